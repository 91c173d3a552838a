//! What the `deploy_*` tests share. Together they check `deploy/` without Docker or a
//! cluster: the compose file, the collector and Prometheus (`deploy_compose`), the
//! Kubernetes base (the four services and the node agents' DaemonSet) and production
//! overlay (`deploy_k8s`), the Grafana provisioning (`deploy_grafana`), and the Dockerfile
//! (`deploy_image`).
//!
//! The checks tie the manifests to the code they deploy: the services are the ones
//! `runplane serve` accepts (its `ServiceName` enum), the probed gRPC health names are
//! services of the proto descriptor set, every container's environment loads as a valid
//! runplane config (so a misspelt `RUNPLANE_<SECTION>__<FIELD>` fails here, not in a
//! crash loop), and the dashboard queries only metrics the services export.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use runplane_config::{Config, ServiceRole};
use serde_norway::Value;

/// The port every runplane container listens on.
#[allow(dead_code)]
pub const PORT: u64 = 7070;

// --- reading ------------------------------------------------------------------------

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("integration-tests lives in the workspace")
        .to_path_buf()
}

pub fn deploy() -> PathBuf {
    repo().join("deploy")
}

pub fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The YAML documents of a file (split at `---` lines), with merge keys
/// (`<<: *anchor`) applied as compose applies them.
pub fn yaml_documents(path: &Path) -> Vec<Value> {
    let text = read(path);
    let mut documents = vec![String::new()];
    for line in text.lines() {
        if line.trim_end() == "---" {
            documents.push(String::new());
        } else {
            let current = documents.last_mut().expect("one document at least");
            current.push_str(line);
            current.push('\n');
        }
    }
    documents
        .iter()
        .map(|document| {
            let mut value: Value = serde_norway::from_str(document)
                .unwrap_or_else(|e| panic!("{} is not valid YAML: {e}", path.display()));
            value
                .apply_merge()
                .unwrap_or_else(|e| panic!("{}: bad merge key: {e}", path.display()));
            value
        })
        .filter(|value| !value.is_null())
        .collect()
}

#[allow(dead_code)]
pub fn yaml(path: &Path) -> Value {
    let mut documents = yaml_documents(path);
    assert_eq!(
        documents.len(),
        1,
        "{} should hold one YAML document",
        path.display()
    );
    documents.remove(0)
}

#[allow(dead_code)]
pub fn str_of<'a>(value: &'a Value, what: &str) -> &'a str {
    value
        .as_str()
        .unwrap_or_else(|| panic!("{what} should be a string, is {value:?}"))
}

#[allow(dead_code)]
pub fn strings(value: &Value) -> Vec<String> {
    value
        .as_sequence()
        .map(|items| {
            items
                .iter()
                .map(|item| str_of(item, "a list item").to_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// A YAML scalar as the string a container sees in its environment.
#[allow(dead_code)]
pub fn scalar(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        other => panic!("an environment value should be a scalar, is {other:?}"),
    }
}

/// What `runplane serve` accepts: the variants of the binary's `ServiceName`, which clap
/// spells in kebab case; `All` names no single service.
#[allow(dead_code)]
pub fn serve_names() -> Vec<String> {
    let serve = read(&repo().join("services/runplane/src/serve.rs"));
    let body = serve
        .split("pub enum ServiceName {")
        .nth(1)
        .and_then(|rest| rest.split('}').next())
        .expect("services/runplane/src/serve.rs defines `pub enum ServiceName { ... }`");
    let names: Vec<String> = body
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with("//") && !line.starts_with('#'))
        .map(|line| line.trim_end_matches(','))
        .filter(|variant| *variant != "All")
        .map(kebab_case)
        .collect();
    assert!(
        names.iter().any(|n| n == "run-store"),
        "ServiceName parsed as {names:?}"
    );
    names
}

pub fn kebab_case(ident: &str) -> String {
    let mut out = String::new();
    for (i, c) in ident.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('-');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

// --- runplane config ----------------------------------------------------------------

/// The config `runplane serve` (or `runplane node`) starts with given `env` (a
/// container's whole environment), or why there is none: loaded the way the binary
/// loads it, from `RUNPLANE_*` variables alone, inside a figment Jail (so this process's
/// own environment stays out).
// Jail's closure must return figment's own (large) error type.
#[allow(clippy::result_large_err)]
pub fn load_config(env: &BTreeMap<String, String>) -> Result<Config, String> {
    let mut loaded = None;
    let outcome = figment::Jail::try_with(|jail| {
        jail.clear_env();
        for (name, value) in env {
            jail.set_env(name, value);
        }
        // `runplane serve` needs the operator token (or its digest) and a token to call
        // the others with: the role's own (the role whose token the environment holds)
        // or the shared one. A node agent (RUNPLANE_NODE__ID) holds neither, its own
        // credential comes from a file.
        let node_agent = env.contains_key("RUNPLANE_NODE__ID");
        loaded = Some(Config::load(None).and_then(|config| {
            if !node_agent {
                config.require_operator_token()?;
                let role = ServiceRole::ALL
                    .into_iter()
                    .find(|role| !config.auth.service_tokens.get(*role).is_empty())
                    .unwrap_or(ServiceRole::RunStore);
                config.require_calling_token(role)?;
            }
            Ok(config)
        }));
        Ok(())
    });
    outcome.map_err(|e| e.to_string())?;
    loaded.expect("the jail ran").map_err(|e| e.to_string())
}

/// Why `env` is not a config runplane starts with, if it is not.
pub fn config_error(env: &BTreeMap<String, String>) -> Option<String> {
    load_config(env).err()
}

#[allow(dead_code)]
pub fn assert_valid_config(origin: &str, env: &BTreeMap<String, String>) {
    let config_vars: Vec<&String> = env
        .keys()
        .filter(|k| k.starts_with("RUNPLANE_") && k.contains("__"))
        .collect();
    assert!(
        !config_vars.is_empty(),
        "{origin}: no RUNPLANE_ variables at all"
    );
    if let Some(error) = config_error(env) {
        panic!(
            "{origin}: its environment is not a valid runplane config: {error}\n{config_vars:?}"
        );
    }
}

/// A reconciler that may run more than one replica (`max_replicas`) has local sandboxes
/// off in `env`.
#[allow(dead_code)]
pub fn assert_no_local_sandboxes_with_replicas(
    origin: &str,
    max_replicas: u64,
    env: &BTreeMap<String, String>,
) {
    let config = load_config(env).unwrap_or_else(|e| panic!("{origin}: {e}"));
    assert!(
        max_replicas <= 1 || !config.sandbox_reconciler.local_sandboxes,
        "{origin}: up to {max_replicas} reconciler replicas with local sandboxes on; set \
         RUNPLANE_SANDBOX_RECONCILER__LOCAL_SANDBOXES=false (other replicas can neither probe \
         nor signal one replica's local sandboxes)"
    );
}
