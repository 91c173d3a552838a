//! `deploy/`, checked without Docker or a cluster: the compose file, the Kubernetes base
//! (the four services and the node agents' DaemonSet) and production overlay, the
//! collector, Prometheus and Grafana provisioning, and the Dockerfile.
//!
//! The checks tie the manifests to the code they deploy: the services are the ones
//! `runplane serve` accepts (its `ServiceName` enum), the probed gRPC health names are
//! services of the proto descriptor set, every container's environment loads as a valid
//! runplane config (so a misspelt `RUNPLANE_<SECTION>__<FIELD>` fails here, not in a
//! crash loop), and the dashboard queries only metrics the services export.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use prost_reflect::DescriptorPool;
use runplane_config::Config;
use serde_norway::Value;

/// The gRPC health name each `runplane serve` service reports (the server also reports
/// "" for the whole process).
const HEALTH_SERVICES: [(&str, &str); 4] = [
    ("run-store", "runplane.runstore.v1.RunService"),
    (
        "sandbox-reconciler",
        "runplane.reconciler.v1.SandboxService",
    ),
    (
        "stream-recovery",
        "runplane.recovery.v1.StreamRecoveryService",
    ),
    (
        "credential-health",
        "runplane.credentials.v1.CredentialHealthService",
    ),
];

/// The port every runplane container listens on.
const PORT: u64 = 7070;

/// The DaemonSet of node agents (`runplane node`), where sandboxes run on Kubernetes.
const NODE_AGENTS: &str = "runplane-node";

/// Kinds that run pods: each in the base must be one this file checks.
const WORKLOAD_KINDS: [&str; 7] = [
    "Deployment",
    "DaemonSet",
    "StatefulSet",
    "ReplicaSet",
    "Job",
    "CronJob",
    "Pod",
];

/// Stand-ins for the downward API fields (`fieldRef`) the manifests read.
const POD_NAME: &str = "runplane-0123456789-abcde";
const NODE_NAME: &str = "ip-10-0-1-23.eu-west-1.compute.internal";
const POD_IP: &str = "10.244.1.17";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Instrument {
    Counter,
    /// Recorded in seconds.
    Histogram,
}

/// What the services export on meter "runplane": name, instrument and attributes.
const METRICS: [(&str, Instrument, &[&str]); 14] = [
    ("runplane.runs.created", Instrument::Counter, &[]),
    ("runplane.runs.finished", Instrument::Counter, &["state"]),
    ("runplane.events.appended", Instrument::Counter, &[]),
    ("runplane.steering.acks", Instrument::Counter, &["outcome"]),
    (
        "runplane.transport.retries",
        Instrument::Counter,
        &["method", "classification"],
    ),
    (
        "runplane.transport.outage_budget_spent",
        Instrument::Histogram,
        &["method"],
    ),
    (
        "runplane.reconcile.tick.duration",
        Instrument::Histogram,
        &[],
    ),
    ("runplane.reconcile.loss_stamps", Instrument::Counter, &[]),
    ("runplane.recovery.claims", Instrument::Counter, &["result"]),
    ("runplane.recovery.exhaustions", Instrument::Counter, &[]),
    (
        "runplane.recovery.sweep.settled",
        Instrument::Counter,
        &["action"],
    ),
    ("runplane.credentials.incidents", Instrument::Counter, &[]),
    ("runplane.credentials.quarantines", Instrument::Counter, &[]),
    (
        "runplane.admission.refusals",
        Instrument::Counter,
        &["reason"],
    ),
];

/// Labels every series carries besides the metric's own attributes: the exporter's
/// `job`/`instance` (service.name, service.instance.id) and the histogram bucket bound.
const SERIES_LABELS: [&str; 3] = ["job", "instance", "le"];

/// The keys of the Secret `runplane-secrets`, with stand-in values that pass validation.
const SECRET_KEYS: [(&str, &str); 4] = [
    (
        "operator-token",
        "test-operator-token-test-operator-token-0123",
    ),
    (
        "service-token",
        "test-service-token-test-service-token-012345",
    ),
    (
        "receipt-signing-key",
        "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0",
    ),
    ("postgres-password", "test-password"),
];

/// Stand-ins for the compose variables of deploy/.env that have no default.
const COMPOSE_VARIABLES: [(&str, &str); 3] = [
    (
        "RUNPLANE_OPERATOR_TOKEN",
        "test-operator-token-test-operator-token-0123",
    ),
    (
        "RUNPLANE_SERVICE_TOKEN",
        "test-service-token-test-service-token-012345",
    ),
    (
        "RUNPLANE_RECEIPT_SIGNING_KEY",
        "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0",
    ),
];

// --- reading ------------------------------------------------------------------------

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("integration-tests lives in the workspace")
        .to_path_buf()
}

fn deploy() -> PathBuf {
    repo().join("deploy")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The YAML documents of a file (split at `---` lines), with merge keys
/// (`<<: *anchor`) applied as compose applies them.
fn yaml_documents(path: &Path) -> Vec<Value> {
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

fn yaml(path: &Path) -> Value {
    let mut documents = yaml_documents(path);
    assert_eq!(
        documents.len(),
        1,
        "{} should hold one YAML document",
        path.display()
    );
    documents.remove(0)
}

/// Every `.yaml`/`.yml` file under `dir`, sorted.
fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                pending.push(path);
            } else if matches!(
                path.extension().and_then(|e| e.to_str()),
                Some("yaml" | "yml")
            ) {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

fn str_of<'a>(value: &'a Value, what: &str) -> &'a str {
    value
        .as_str()
        .unwrap_or_else(|| panic!("{what} should be a string, is {value:?}"))
}

fn strings(value: &Value) -> Vec<String> {
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
fn scalar(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        other => panic!("an environment value should be a scalar, is {other:?}"),
    }
}

/// What `runplane serve` accepts: the variants of the binary's `ServiceName`, which clap
/// spells in kebab case; `All` names no single service.
fn serve_names() -> Vec<String> {
    let cli = read(&repo().join("services/runplane/src/cli.rs"));
    let body = cli
        .split("pub enum ServiceName {")
        .nth(1)
        .and_then(|rest| rest.split('}').next())
        .expect("services/runplane/src/cli.rs defines `pub enum ServiceName { ... }`");
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

/// The subcommands of `runplane`: the variants of the binary's `Command`, in kebab case.
fn subcommands() -> BTreeSet<String> {
    let cli = read(&repo().join("services/runplane/src/cli.rs"));
    let body = cli
        .split("pub enum Command {")
        .nth(1)
        .and_then(|rest| rest.split("\n}").next())
        .expect("services/runplane/src/cli.rs defines `pub enum Command { ... }`");
    let names: BTreeSet<String> = body
        .lines()
        .filter_map(|line| line.strip_prefix("    "))
        .filter(|line| line.starts_with(|c: char| c.is_ascii_uppercase()))
        .map(|line| {
            let variant: String = line
                .chars()
                .take_while(char::is_ascii_alphanumeric)
                .collect();
            kebab_case(&variant)
        })
        .collect();
    assert!(names.contains("serve"), "Command parsed as {names:?}");
    names
}

fn kebab_case(ident: &str) -> String {
    let mut out = String::new();
    for (i, c) in ident.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('-');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

fn health_service_of(serve_name: &str) -> &'static str {
    HEALTH_SERVICES
        .iter()
        .find(|(name, _)| *name == serve_name)
        .map(|(_, health)| *health)
        .unwrap_or_else(|| {
            panic!("`runplane serve {serve_name}` has no gRPC health name in HEALTH_SERVICES")
        })
}

// --- runplane config ----------------------------------------------------------------

/// The config `runplane serve` (or `runplane node`) starts with given `env` (a
/// container's whole environment), or why there is none: loaded the way the binary
/// loads it, from `RUNPLANE_*` variables alone, inside a figment Jail (so this process's
/// own environment stays out).
// Jail's closure must return figment's own (large) error type.
#[allow(clippy::result_large_err)]
fn load_config(env: &BTreeMap<String, String>) -> Result<Config, String> {
    let mut loaded = None;
    let outcome = figment::Jail::try_with(|jail| {
        jail.clear_env();
        for (name, value) in env {
            jail.set_env(name, value);
        }
        // `runplane serve` needs both tokens; a node agent (RUNPLANE_NODE__ID) holds
        // neither, its own credential comes from a file.
        let node_agent = env.contains_key("RUNPLANE_NODE__ID");
        loaded = Some(Config::load(None).and_then(|config| {
            if !node_agent {
                config.require_operator_token()?;
                config.require_service_token()?;
            }
            Ok(config)
        }));
        Ok(())
    });
    outcome.map_err(|e| e.to_string())?;
    loaded.expect("the jail ran").map_err(|e| e.to_string())
}

/// Why `env` is not a config runplane starts with, if it is not.
fn config_error(env: &BTreeMap<String, String>) -> Option<String> {
    load_config(env).err()
}

fn assert_valid_config(origin: &str, env: &BTreeMap<String, String>) {
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

#[test]
fn the_config_check_catches_a_misspelt_field_and_a_bad_value() {
    let mut env: BTreeMap<String, String> = [
        ("RUNPLANE_SERVER__LISTEN", "0.0.0.0:7070"),
        ("RUNPLANE_AUTH__OPERATOR_TOKEN", SECRET_KEYS[0].1),
        ("RUNPLANE_AUTH__SERVICE_TOKEN", SECRET_KEYS[1].1),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    assert_eq!(config_error(&env), None);

    env.insert(
        "RUNPLANE_RUN_STORE__DATABSE_URL".into(),
        "postgres://x".into(),
    );
    let error = config_error(&env).expect("an unknown field is refused");
    assert!(error.contains("databse_url"), "{error}");
    env.remove("RUNPLANE_RUN_STORE__DATABSE_URL");

    env.insert(
        "RUNPLANE_RUN_STORE__RECEIPT_SIGNING_KEY".into(),
        "CHANGE-ME".into(),
    );
    let error = config_error(&env).expect("a placeholder key is refused");
    assert!(error.contains("run_store.receipt_signing_key"), "{error}");
}

// --- compose ------------------------------------------------------------------------

fn compose() -> Value {
    yaml(&deploy().join("compose.yaml"))
}

fn compose_services(compose: &Value) -> &serde_norway::Mapping {
    compose["services"]
        .as_mapping()
        .expect("compose.yaml has services")
}

/// `${NAME}`, `${NAME:-default}`, `${NAME-default}`, `${NAME:?error}` and `${NAME?error}`
/// replaced as compose would: the default, or the variable from deploy/.env (a
/// stand-in here). Returns the names without a default too.
fn interpolate(text: &str, without_default: &mut BTreeSet<String>) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let end = rest[start..]
            .find('}')
            .map(|i| start + i)
            .unwrap_or_else(|| panic!("unclosed ${{ in {text:?}"));
        let inner = &rest[start + 2..end];
        let split = inner.find([':', '-', '?']).unwrap_or(inner.len());
        let (name, modifier) = inner.split_at(split);
        let default = modifier
            .strip_prefix(":-")
            .or_else(|| modifier.strip_prefix('-'));
        match default {
            Some(default) => out.push_str(default),
            None => {
                without_default.insert(name.to_owned());
                let value = COMPOSE_VARIABLES
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| *v)
                    .unwrap_or_else(|| {
                        panic!("compose variable {name} has no default and no stand-in in COMPOSE_VARIABLES")
                    });
                out.push_str(value);
            }
        }
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

fn compose_environment(
    service: &Value,
    without_default: &mut BTreeSet<String>,
) -> BTreeMap<String, String> {
    let environment = &service["environment"];
    let mut env = BTreeMap::new();
    if let Some(mapping) = environment.as_mapping() {
        for (name, value) in mapping {
            let name = str_of(name, "an environment name").to_owned();
            env.insert(name, interpolate(&scalar(value), without_default));
        }
    } else if let Some(list) = environment.as_sequence() {
        for item in list {
            let (name, value) = str_of(item, "an environment entry")
                .split_once('=')
                .expect("NAME=value");
            env.insert(name.to_owned(), interpolate(value, without_default));
        }
    }
    env
}

/// `scheme://[user[:password]@]host:port[/path]` -> (host, port, path).
fn url_parts(url: &str) -> (String, u64, String) {
    let rest = url
        .split_once("://")
        .unwrap_or_else(|| panic!("{url} is not a URL"))
        .1;
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
    let (host, port) = host_port
        .rsplit_once(':')
        .unwrap_or_else(|| panic!("{url} names no port"));
    let port = port
        .parse()
        .unwrap_or_else(|_| panic!("{url}: bad port {port}"));
    (host.to_owned(), port, path.to_owned())
}

#[test]
fn compose_runs_every_service_runplane_serve_accepts_on_7070_with_all_endpoints() {
    let compose = compose();
    let services = compose_services(&compose);
    let mut service_names = BTreeSet::new();
    let mut without_default = BTreeSet::new();

    for name in serve_names() {
        let service = services
            .get(name.as_str())
            .unwrap_or_else(|| panic!("compose.yaml has no service {name}"));
        assert_eq!(
            strings(&service["command"]),
            ["serve", name.as_str()],
            "compose service {name} should run `serve {name}`"
        );
        let env = compose_environment(service, &mut without_default);
        assert_eq!(
            env.get("RUNPLANE_SERVER__LISTEN").map(String::as_str),
            Some("0.0.0.0:7070"),
            "{name} listens on 0.0.0.0:7070 inside its container"
        );
        // The services call each other: every container knows every endpoint, each the
        // compose service of that name on 7070.
        for other in serve_names() {
            let var = format!(
                "RUNPLANE_{}__ENDPOINT",
                other.replace('-', "_").to_uppercase()
            );
            assert_eq!(
                env.get(&var),
                Some(&format!("http://{other}:{PORT}")),
                "compose service {name} needs {var}"
            );
        }
        let (collector, port, _) = url_parts(
            env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                .unwrap_or_else(|| panic!("{name} exports no telemetry")),
        );
        assert!(
            services.contains_key(collector.as_str()) && port == 4317,
            "{name}: OTEL_EXPORTER_OTLP_ENDPOINT should be a compose service on 4317"
        );
        let service_name = env
            .get("OTEL_SERVICE_NAME")
            .unwrap_or_else(|| panic!("{name} has no OTEL_SERVICE_NAME"));
        assert!(
            service_names.insert(service_name.clone()),
            "OTEL_SERVICE_NAME {service_name} is used twice"
        );
        for dependency in ["postgres", "redis"] {
            assert_eq!(
                service["depends_on"][dependency]["condition"].as_str(),
                Some("service_healthy"),
                "{name} should wait for a healthy {dependency}"
            );
            assert!(
                !services[dependency]["healthcheck"]["test"].is_null(),
                "{dependency} needs a healthcheck for service_healthy"
            );
        }
        assert_valid_config(&format!("compose service {name}"), &env);
    }

    let env_example = read(&deploy().join(".env.example"));
    for name in &without_default {
        assert!(
            env_example
                .lines()
                .any(|l| l.starts_with(&format!("{name}="))),
            "compose needs ${{{name}}}: deploy/.env.example should show it"
        );
    }
}

#[test]
fn compose_databases_redis_and_observability_are_wired() {
    let compose = compose();
    let services = compose_services(&compose);
    let image = |name: &str| str_of(&services[name]["image"], "an image").to_owned();
    assert!(image("postgres").starts_with("postgres:16"));
    assert!(image("redis").starts_with("redis:7"));
    assert!(image("otel-collector").starts_with("otel/opentelemetry-collector-contrib:"));
    assert!(image("tempo").starts_with("grafana/tempo:"));
    assert!(image("prometheus").starts_with("prom/prometheus:"));
    assert!(image("grafana").starts_with("grafana/grafana:"));

    // Every bind mount exists.
    for (name, service) in services {
        for volume in strings(&service["volumes"]) {
            if let Some(source) = volume.split(':').next().filter(|s| s.starts_with('.')) {
                assert!(
                    deploy().join(source).exists(),
                    "compose service {name:?} mounts {source}, which does not exist under deploy/"
                );
            }
        }
    }

    // One server, one database per Postgres-backed service: the init script creates
    // exactly the databases the URLs name, on the compose postgres service.
    let init = read(&deploy().join("compose/postgres-init.sql"));
    let created: BTreeSet<String> = init
        .lines()
        .filter_map(|line| line.trim().strip_prefix("CREATE DATABASE "))
        .map(|rest| rest.trim_end_matches(';').trim().to_owned())
        .collect();
    let mut used = BTreeSet::new();
    let mut unused = BTreeSet::new();
    for name in serve_names() {
        let env = compose_environment(&services[name.as_str()], &mut unused);
        for (var, value) in &env {
            if var.ends_with("__DATABASE_URL") {
                let (host, port, database) = url_parts(value);
                assert_eq!((host.as_str(), port), ("postgres", 5432), "{var}");
                used.insert(database);
            }
            if var == "RUNPLANE_STREAM_RECOVERY__REDIS_URL" {
                let (host, port, _) = url_parts(value);
                assert_eq!((host.as_str(), port), ("redis", 6379), "{var}");
            }
        }
    }
    assert_eq!(created, used, "postgres-init.sql vs the database URLs");
    assert!(
        strings(&services["postgres"]["volumes"])
            .iter()
            .any(|v| v.contains("postgres-init.sql:/docker-entrypoint-initdb.d/")),
        "the init script is mounted into /docker-entrypoint-initdb.d"
    );

    // Collector: OTLP/gRPC in; traces to Tempo, metrics to its prometheus exporter,
    // which Prometheus scrapes.
    let collector = yaml(&deploy().join("compose/otel-collector.yaml"));
    let (_, port, _) = url_parts(&format!(
        "grpc://{}",
        str_of(
            &collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"],
            "the OTLP gRPC endpoint"
        )
    ));
    assert_eq!(port, 4317);
    let pipelines = &collector["service"]["pipelines"];
    let trace_exporters = strings(&pipelines["traces"]["exporters"]);
    assert!(
        trace_exporters.iter().any(|exporter| {
            exporter.starts_with("otlp")
                && url_parts(&format!(
                    "grpc://{}",
                    str_of(
                        &collector["exporters"][exporter.as_str()]["endpoint"],
                        "endpoint"
                    )
                ))
                .0 == "tempo"
        }),
        "traces go to Tempo: {trace_exporters:?}"
    );
    assert!(strings(&pipelines["metrics"]["exporters"]).contains(&"prometheus".to_owned()));
    for pipeline in ["traces", "metrics"] {
        for exporter in strings(&pipelines[pipeline]["exporters"]) {
            assert!(
                !collector["exporters"][exporter.as_str()].is_null(),
                "pipeline {pipeline} uses undefined exporter {exporter}"
            );
        }
    }
    let (_, exporter_port, _) = url_parts(&format!(
        "http://{}",
        str_of(
            &collector["exporters"]["prometheus"]["endpoint"],
            "the prometheus exporter endpoint"
        )
    ));
    let prometheus = yaml(&deploy().join("compose/prometheus.yaml"));
    let targets: Vec<String> = prometheus["scrape_configs"]
        .as_sequence()
        .expect("scrape_configs")
        .iter()
        .flat_map(|job| {
            job["static_configs"]
                .as_sequence()
                .cloned()
                .unwrap_or_default()
        })
        .flat_map(|config| strings(&config["targets"]))
        .collect();
    assert!(
        targets.contains(&format!("otel-collector:{exporter_port}")),
        "Prometheus scrapes the collector's exporter on {exporter_port}: {targets:?}"
    );
}

// --- Grafana ------------------------------------------------------------------------

fn prometheus_name(metric: &str, instrument: Instrument) -> Vec<String> {
    let base = metric.replace('.', "_");
    match instrument {
        Instrument::Counter => vec![format!("{base}_total")],
        // The exporter appends the unit (`_seconds`) unless told not to.
        Instrument::Histogram => [format!("{base}_seconds"), base]
            .iter()
            .flat_map(|b| ["_bucket", "_sum", "_count"].map(|s| format!("{b}{s}")))
            .collect(),
    }
}

/// The `runplane_*` metric names in a PromQL expression; `(_seconds)?` in a name regex
/// counts as the suffix.
fn metric_names(expr: &str) -> Vec<String> {
    let expr = expr.replace("(_seconds)?", "_seconds");
    let mut names = Vec::new();
    let mut rest = expr.as_str();
    while let Some(start) = rest.find("runplane_") {
        let name: String = rest[start..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
            .collect();
        rest = &rest[start + name.len()..];
        names.push(name);
    }
    names
}

/// Labels an expression groups or formats by: `by (...)`, `without (...)`, `{{label}}`.
fn grouping_labels(expr: &str, legend: &str) -> BTreeSet<String> {
    let mut labels = BTreeSet::new();
    for keyword in ["by (", "by(", "without (", "without("] {
        for part in expr.split(keyword).skip(1) {
            let inside = part.split(')').next().unwrap_or_default();
            labels.extend(
                inside
                    .split(',')
                    .map(|l| l.trim().to_owned())
                    .filter(|l| !l.is_empty()),
            );
        }
    }
    for part in legend.split("{{").skip(1) {
        labels.insert(
            part.split("}}")
                .next()
                .unwrap_or_default()
                .trim()
                .to_owned(),
        );
    }
    labels
}

fn collect_targets<'a>(value: &'a serde_json::Value, out: &mut Vec<&'a serde_json::Value>) {
    match value {
        serde_json::Value::Object(object) => {
            if object.contains_key("expr") {
                out.push(value);
            }
            object.values().for_each(|v| collect_targets(v, out));
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| collect_targets(v, out)),
        _ => {}
    }
}

fn collect_datasource_uids(value: &serde_json::Value, out: &mut BTreeSet<String>) {
    match value {
        serde_json::Value::Object(object) => {
            if let Some(uid) = object
                .get("datasource")
                .and_then(|d| d.get("uid"))
                .and_then(|u| u.as_str())
            {
                out.insert(uid.to_owned());
            }
            object
                .values()
                .for_each(|v| collect_datasource_uids(v, out));
        }
        serde_json::Value::Array(items) => {
            items.iter().for_each(|v| collect_datasource_uids(v, out))
        }
        _ => {}
    }
}

#[test]
fn the_grafana_dashboard_queries_only_metrics_the_services_export() {
    let path = deploy().join("compose/grafana/dashboards/runplane.json");
    let dashboard: serde_json::Value = serde_json::from_str(&read(&path))
        .unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
    let mut targets = Vec::new();
    collect_targets(&dashboard, &mut targets);
    assert!(!targets.is_empty(), "the dashboard has no queries");

    let mut queried = BTreeSet::new();
    for target in targets {
        let expr = target["expr"].as_str().expect("expr is a string");
        let legend = target["legendFormat"].as_str().unwrap_or_default();
        let names = metric_names(expr);
        assert!(!names.is_empty(), "{expr:?} queries no runplane metric");
        let mut attributes: BTreeSet<&str> = SERIES_LABELS.into_iter().collect();
        for name in &names {
            let (metric, _, metric_attributes) = METRICS
                .iter()
                .find(|(metric, instrument, _)| prometheus_name(metric, *instrument).contains(name))
                .unwrap_or_else(|| {
                    panic!("{expr:?} queries {name}, which no runplane service exports")
                });
            queried.insert(*metric);
            attributes.extend(metric_attributes.iter());
        }
        for label in grouping_labels(expr, legend) {
            assert!(
                attributes.contains(label.as_str()),
                "{expr:?} groups by {label}, an attribute {names:?} do not have"
            );
        }
    }
    let exported: BTreeSet<&str> = METRICS.iter().map(|(metric, _, _)| *metric).collect();
    let missing: Vec<_> = exported.difference(&queried).collect();
    assert!(missing.is_empty(), "no panel shows {missing:?}");

    // The data sources the dashboard names are provisioned, and Tempo links to
    // Prometheus.
    let datasources =
        yaml(&deploy().join("compose/grafana/provisioning/datasources/datasources.yaml"));
    let datasources = datasources["datasources"]
        .as_sequence()
        .expect("datasources");
    let uid_of = |kind: &str| {
        datasources
            .iter()
            .find(|d| d["type"].as_str() == Some(kind))
            .and_then(|d| d["uid"].as_str())
            .unwrap_or_else(|| panic!("no {kind} data source with a uid"))
            .to_owned()
    };
    let prometheus = uid_of("prometheus");
    let tempo = datasources
        .iter()
        .find(|d| d["type"].as_str() == Some("tempo"))
        .expect("a Tempo data source");
    assert_eq!(
        tempo["jsonData"]["serviceMap"]["datasourceUid"].as_str(),
        Some(prometheus.as_str())
    );
    assert_eq!(
        tempo["jsonData"]["tracesToMetrics"]["datasourceUid"].as_str(),
        Some(prometheus.as_str())
    );
    let tempo_uid = uid_of("tempo");
    let exemplar_links: Vec<&str> = datasources
        .iter()
        .find(|d| d["type"].as_str() == Some("prometheus"))
        .and_then(|d| d["jsonData"]["exemplarTraceIdDestinations"].as_sequence())
        .into_iter()
        .flatten()
        .filter_map(|link| link["datasourceUid"].as_str())
        .collect();
    assert_eq!(
        exemplar_links,
        [tempo_uid.as_str()],
        "exemplars open traces in Tempo"
    );
    let mut used = BTreeSet::new();
    collect_datasource_uids(&dashboard, &mut used);
    assert_eq!(
        used,
        BTreeSet::from([prometheus]),
        "the dashboard's data sources"
    );
}

// --- Kubernetes ---------------------------------------------------------------------

fn k8s() -> PathBuf {
    deploy().join("k8s")
}

/// Every resource of the YAML files under `dir` except kustomizations and patches.
fn resources(dir: &Path) -> Vec<Value> {
    yaml_files(dir)
        .iter()
        .filter(|p| p.file_name().and_then(|n| n.to_str()) != Some("kustomization.yaml"))
        .flat_map(|p| yaml_documents(p))
        .collect()
}

fn find<'a>(resources: &'a [Value], kind: &str, name: &str) -> &'a Value {
    let found: Vec<&Value> = resources
        .iter()
        .filter(|r| {
            r["kind"].as_str() == Some(kind) && r["metadata"]["name"].as_str() == Some(name)
        })
        .collect();
    assert_eq!(
        found.len(),
        1,
        "deploy/k8s/base should have one {kind} {name}"
    );
    found[0]
}

fn labels(value: &Value) -> BTreeMap<String, String> {
    value
        .as_mapping()
        .map(|m| {
            m.iter()
                .map(|(k, v)| (str_of(k, "a label").to_owned(), scalar(v)))
                .collect()
        })
        .unwrap_or_default()
}

fn selects(selector: &BTreeMap<String, String>, pod: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| pod.get(k) == Some(v))
}

fn secret_value(secret_ref: &Value) -> String {
    assert_eq!(
        secret_ref["name"].as_str(),
        Some("runplane-secrets"),
        "secrets come from the Secret runplane-secrets"
    );
    let key = str_of(&secret_ref["key"], "a secret key");
    SECRET_KEYS
        .iter()
        .find(|(k, _)| *k == key)
        .map(|(_, v)| (*v).to_owned())
        .unwrap_or_else(|| {
            panic!("runplane-secrets has no key {key} (documented: {SECRET_KEYS:?})")
        })
}

/// `$(NAME)` references expanded against the variables defined before, as the kubelet
/// does; an unresolved one would stay literal, which is a mistake here.
fn expand(value: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = value;
    while let Some(start) = rest.find("$(") {
        out.push_str(&rest[..start]);
        let end = start + rest[start..].find(')').expect("closed $(");
        let name = &rest[start + 2..end];
        out.push_str(
            env.get(name)
                .unwrap_or_else(|| panic!("$({name}) in {value:?} is defined nowhere before it")),
        );
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

/// What the downward API gives a container for `fieldRef` `path` (a stand-in).
fn field_value(path: &str) -> String {
    match path {
        "metadata.name" => POD_NAME,
        "metadata.namespace" => "runplane",
        "spec.nodeName" => NODE_NAME,
        "status.podIP" => POD_IP,
        other => panic!("fieldRef {other} has no stand-in here (a typo, or add one)"),
    }
    .to_owned()
}

/// The environment a workload's runplane container gets with `config_maps` (name to
/// data) applied.
fn container_environment(
    container: &Value,
    config_maps: &BTreeMap<String, BTreeMap<String, String>>,
) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    for source in container["envFrom"].as_sequence().into_iter().flatten() {
        let name = str_of(&source["configMapRef"]["name"], "an envFrom configMapRef");
        let data = config_maps.get(name).unwrap_or_else(|| {
            panic!("envFrom names ConfigMap {name}, which is not in deploy/k8s")
        });
        env.extend(data.clone());
    }
    for entry in container["env"].as_sequence().into_iter().flatten() {
        let name = str_of(&entry["name"], "an env name").to_owned();
        let value = if let Some(value) = entry.get("value") {
            expand(&scalar(value), &env)
        } else if let Some(secret) = entry["valueFrom"].get("secretKeyRef") {
            secret_value(secret)
        } else if let Some(key_ref) = entry["valueFrom"].get("configMapKeyRef") {
            let map = str_of(&key_ref["name"], "a configMapKeyRef name");
            let key = str_of(&key_ref["key"], "a configMapKeyRef key");
            config_maps
                .get(map)
                .and_then(|data| data.get(key))
                .cloned()
                .unwrap_or_else(|| {
                    panic!("env {name} reads key {key} of ConfigMap {map}, which has no such key")
                })
        } else if let Some(field) = entry["valueFrom"].get("fieldRef") {
            field_value(str_of(&field["fieldPath"], "a fieldRef fieldPath"))
        } else {
            panic!("env {name} has neither value nor a known valueFrom")
        };
        env.insert(name, value);
    }
    env
}

fn config_map_data(resource: &Value) -> BTreeMap<String, String> {
    resource["data"]
        .as_mapping()
        .map(|m| {
            m.iter()
                .map(|(k, v)| (str_of(k, "a ConfigMap key").to_owned(), scalar(v)))
                .collect()
        })
        .unwrap_or_default()
}

fn base_config_maps(base: &[Value]) -> BTreeMap<String, BTreeMap<String, String>> {
    base.iter()
        .filter(|r| r["kind"].as_str() == Some("ConfigMap"))
        .map(|r| {
            (
                str_of(&r["metadata"]["name"], "a name").to_owned(),
                config_map_data(r),
            )
        })
        .collect()
}

fn kustomization(dir: &Path) -> Value {
    yaml(&dir.join("kustomization.yaml"))
}

/// The inline JSON6902 patches of a kustomization that target `kind`.
fn json_patches(kustomization: &Value, kind: &str) -> Vec<Value> {
    kustomization["patches"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter(|p| p["target"]["kind"].as_str() == Some(kind))
        .filter_map(|p| p["patch"].as_str())
        .flat_map(|text| {
            serde_norway::from_str::<Vec<Value>>(text)
                .unwrap_or_else(|e| panic!("a {kind} patch is not a JSON6902 list: {e}"))
        })
        .collect()
}

/// The inline JSON6902 patches of a kustomization that reach the `kind` named `name`:
/// those whose target names it and those that name no resource.
fn json_patches_for(kustomization: &Value, kind: &str, name: &str) -> Vec<Value> {
    kustomization["patches"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter(|p| p["target"]["kind"].as_str() == Some(kind))
        .filter(|p| p["target"]["name"].as_str().is_none_or(|n| n == name))
        .filter_map(|p| p["patch"].as_str())
        .flat_map(|text| {
            serde_norway::from_str::<Vec<Value>>(text)
                .unwrap_or_else(|e| panic!("a {kind} patch is not a JSON6902 list: {e}"))
        })
        .collect()
}

/// The base's ConfigMaps with the overlay's ConfigMap patches merged over them.
fn overlay_config_maps(
    overlay_dir: &Path,
    overlay: &Value,
    base: &[Value],
) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut config_maps = base_config_maps(base);
    let patch_files = overlay["patches"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter_map(|p| p["path"].as_str());
    for patch in patch_files {
        for document in yaml_documents(&overlay_dir.join(patch)) {
            if document["kind"].as_str() == Some("ConfigMap") {
                let name = str_of(&document["metadata"]["name"], "a name");
                config_maps
                    .get_mut(name)
                    .unwrap_or_else(|| {
                        panic!("the overlay patches ConfigMap {name}, which the base lacks")
                    })
                    .extend(config_map_data(&document));
            }
        }
    }
    config_maps
}

/// The pod spec passes the restricted Pod Security Standard the production namespace
/// enforces (and keeps the root filesystem read-only).
fn assert_restricted(origin: &str, pod: &Value) {
    let pod_security = &pod["securityContext"];
    assert_eq!(
        pod_security["runAsNonRoot"].as_bool(),
        Some(true),
        "{origin}: runAsNonRoot"
    );
    assert_ne!(
        pod_security["runAsUser"].as_u64(),
        Some(0),
        "{origin}: runAsUser"
    );
    for host in ["hostNetwork", "hostPID", "hostIPC"] {
        assert_ne!(pod[host].as_bool(), Some(true), "{origin}: {host}");
    }
    const ALLOWED_VOLUMES: [&str; 8] = [
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    ];
    for volume in pod["volumes"].as_sequence().into_iter().flatten() {
        for key in volume.as_mapping().expect("a volume").keys() {
            let key = str_of(key, "a volume field");
            assert!(
                key == "name" || ALLOWED_VOLUMES.contains(&key),
                "{origin}: a {key} volume breaks the restricted Pod Security Standard"
            );
        }
    }
    let containers = pod["containers"]
        .as_sequence()
        .into_iter()
        .chain(pod["initContainers"].as_sequence())
        .flatten();
    for container in containers {
        let security = &container["securityContext"];
        let seccomp = security["seccompProfile"]["type"]
            .as_str()
            .or(pod_security["seccompProfile"]["type"].as_str());
        assert_eq!(seccomp, Some("RuntimeDefault"), "{origin}: seccomp");
        assert_eq!(
            security["allowPrivilegeEscalation"].as_bool(),
            Some(false),
            "{origin}: allowPrivilegeEscalation"
        );
        assert_ne!(
            security["privileged"].as_bool(),
            Some(true),
            "{origin}: privileged"
        );
        assert_ne!(
            security["runAsUser"].as_u64(),
            Some(0),
            "{origin}: runAsUser"
        );
        assert_eq!(
            security["readOnlyRootFilesystem"].as_bool(),
            Some(true),
            "{origin}: readOnlyRootFilesystem"
        );
        assert!(
            strings(&security["capabilities"]["drop"]).contains(&"ALL".to_owned()),
            "{origin}: drops all capabilities"
        );
        assert!(
            strings(&security["capabilities"]["add"])
                .iter()
                .all(|c| c == "NET_BIND_SERVICE"),
            "{origin}: adds a capability"
        );
        for port in container["ports"].as_sequence().into_iter().flatten() {
            assert!(port["hostPort"].is_null(), "{origin}: a hostPort");
        }
    }
}

fn patched_value(operations: &[Value], path: &str) -> Option<Value> {
    operations
        .iter()
        .rev()
        .find(|op| op["path"].as_str() == Some(path) && op["op"].as_str() != Some("remove"))
        .map(|op| op["value"].clone())
}

#[test]
fn k8s_base_has_a_deployment_service_pdb_and_hpa_per_service_with_grpc_health_probes() {
    let pool = DescriptorPool::decode(runplane_proto::FILE_DESCRIPTOR_SET)
        .expect("the proto descriptor set decodes");
    let base = resources(&k8s().join("base"));
    let config_maps = base_config_maps(&base);

    for name in serve_names() {
        let deployment = find(&base, "Deployment", &name);
        let pod = &deployment["spec"]["template"];
        let pod_labels = labels(&pod["metadata"]["labels"]);
        assert!(
            selects(
                &labels(&deployment["spec"]["selector"]["matchLabels"]),
                &pod_labels
            ),
            "Deployment {name}'s selector matches its pods"
        );
        let containers = pod["spec"]["containers"].as_sequence().expect("containers");
        assert_eq!(containers.len(), 1, "Deployment {name}: one container");
        let container = &containers[0];
        let command: Vec<String> = strings(&container["command"])
            .into_iter()
            .chain(strings(&container["args"]))
            .filter(|arg| arg != "runplane")
            .collect();
        assert_eq!(
            command,
            ["serve", name.as_str()],
            "Deployment {name} runs `serve {name}`"
        );
        assert!(
            container["ports"]
                .as_sequence()
                .into_iter()
                .flatten()
                .any(|p| p["containerPort"].as_u64() == Some(PORT)),
            "Deployment {name} exposes {PORT}"
        );

        // Native gRPC probes on grpc.health.v1, naming the real service.
        let expected = health_service_of(&name);
        assert!(
            pool.get_service_by_name(expected).is_some(),
            "{expected} is not a service of the proto descriptor set"
        );
        for probe in ["readinessProbe", "livenessProbe", "startupProbe"] {
            let grpc = &container[probe]["grpc"];
            if probe == "startupProbe" && container[probe].is_null() {
                continue;
            }
            assert_eq!(
                grpc["port"].as_u64(),
                Some(PORT),
                "Deployment {name}: {probe} is a gRPC probe on {PORT}"
            );
            let service = str_of(&grpc["service"], "the probed gRPC service");
            assert!(
                pool.get_service_by_name(service).is_some(),
                "Deployment {name}: {probe} probes {service}, which is not a runplane gRPC service"
            );
            assert_eq!(service, expected, "Deployment {name}: {probe}");
        }

        let resources = &container["resources"];
        for (section, key) in [
            ("requests", "cpu"),
            ("requests", "memory"),
            ("limits", "memory"),
        ] {
            assert!(
                !resources[section][key].is_null(),
                "Deployment {name} needs resources.{section}.{key}"
            );
        }
        assert_eq!(
            pod["spec"]["securityContext"]["runAsNonRoot"].as_bool(),
            Some(true),
            "{name}"
        );
        assert_eq!(
            container["securityContext"]["allowPrivilegeEscalation"].as_bool(),
            Some(false),
            "{name}"
        );

        let env = container_environment(container, &config_maps);
        assert_eq!(
            env.get("RUNPLANE_SERVER__LISTEN").map(String::as_str),
            Some("0.0.0.0:7070"),
            "Deployment {name} listens on 0.0.0.0:7070"
        );
        for other in serve_names() {
            let var = format!(
                "RUNPLANE_{}__ENDPOINT",
                other.replace('-', "_").to_uppercase()
            );
            assert_eq!(
                env.get(&var),
                Some(&format!("http://{other}:{PORT}")),
                "Deployment {name} needs {var}, the Service {other}"
            );
        }
        assert!(env.contains_key("OTEL_SERVICE_NAME"), "Deployment {name}");
        assert!(
            env.contains_key("OTEL_EXPORTER_OTLP_ENDPOINT"),
            "Deployment {name}"
        );
        assert_valid_config(&format!("k8s base Deployment {name}"), &env);

        let service = find(&base, "Service", &name);
        assert!(
            selects(&labels(&service["spec"]["selector"]), &pod_labels),
            "Service {name} selects Deployment {name}'s pods"
        );
        assert!(
            service["spec"]["ports"]
                .as_sequence()
                .into_iter()
                .flatten()
                .any(|p| {
                    p["port"].as_u64() == Some(PORT)
                        && (p["targetPort"].as_u64() == Some(PORT)
                            || p["targetPort"].as_str() == Some("grpc"))
                }),
            "Service {name} exposes {PORT}"
        );

        let pdb = find(&base, "PodDisruptionBudget", &name);
        assert!(
            selects(
                &labels(&pdb["spec"]["selector"]["matchLabels"]),
                &pod_labels
            ),
            "PDB {name}"
        );
        let hpa = find(&base, "HorizontalPodAutoscaler", &name);
        assert_eq!(
            hpa["spec"]["scaleTargetRef"]["kind"].as_str(),
            Some("Deployment")
        );
        assert_eq!(
            hpa["spec"]["scaleTargetRef"]["name"].as_str(),
            Some(name.as_str())
        );
    }
}

#[test]
fn kustomizations_reference_existing_files_and_every_base_manifest() {
    let mut seen = 0;
    for path in yaml_files(&k8s()) {
        if path.file_name().and_then(|n| n.to_str()) != Some("kustomization.yaml") {
            continue;
        }
        seen += 1;
        let dir = path.parent().expect("a directory");
        let kustomization = yaml(&path);
        let entries: Vec<String> = strings(&kustomization["resources"])
            .into_iter()
            .chain(
                kustomization["patches"]
                    .as_sequence()
                    .into_iter()
                    .flatten()
                    .filter_map(|p| p["path"].as_str().map(str::to_owned)),
            )
            .collect();
        for entry in entries {
            let target = dir.join(&entry);
            assert!(
                target.is_file() || target.join("kustomization.yaml").is_file(),
                "{} references {entry}, which is neither a file nor a kustomization",
                path.display()
            );
        }
    }
    assert!(seen >= 2, "deploy/k8s has a base and an overlay");

    // Nothing in the base is left out of it.
    let base = k8s().join("base");
    let listed: BTreeSet<String> = strings(&kustomization(&base)["resources"])
        .into_iter()
        .collect();
    for file in yaml_files(&base) {
        let name = file
            .file_name()
            .and_then(|n| n.to_str())
            .expect("a file name")
            .to_owned();
        assert!(
            name == "kustomization.yaml" || listed.contains(&name),
            "deploy/k8s/base/{name} is not in its kustomization's resources"
        );
    }
}

#[test]
fn the_production_overlay_runs_two_replicas_of_everything_with_a_pinned_image() {
    let overlay_dir = k8s().join("overlays/production");
    let overlay = kustomization(&overlay_dir);
    assert!(
        strings(&overlay["resources"])
            .iter()
            .any(|r| r == "../../base"),
        "the overlay builds on the base"
    );

    let replicas: BTreeMap<String, u64> = overlay["replicas"]
        .as_sequence()
        .expect("the overlay sets replicas")
        .iter()
        .map(|r| {
            (
                str_of(&r["name"], "a name").to_owned(),
                r["count"].as_u64().expect("a count"),
            )
        })
        .collect();
    for name in serve_names() {
        let count = replicas.get(&name).copied().unwrap_or(0);
        assert!(
            count >= 2,
            "the production overlay runs {count} replicas of {name}, not at least 2"
        );
    }

    let hpa = json_patches(&overlay, "HorizontalPodAutoscaler");
    let min = patched_value(&hpa, "/spec/minReplicas")
        .and_then(|v| v.as_u64())
        .expect("HPA minReplicas");
    let max = patched_value(&hpa, "/spec/maxReplicas")
        .and_then(|v| v.as_u64())
        .expect("HPA maxReplicas");
    assert!(min >= 2 && min <= max, "HPA {min}..{max}");
    assert!(
        replicas.values().all(|count| *count == min),
        "Deployment replicas equal the HPA minimum, so an apply never scales below it"
    );
    let pdb = json_patches(&overlay, "PodDisruptionBudget");
    assert_eq!(
        patched_value(&pdb, "/spec/minAvailable").and_then(|v| v.as_u64()),
        Some(1)
    );
    assert!(
        pdb.iter().any(|op| op["op"].as_str() == Some("remove")
            && op["path"].as_str() == Some("/spec/maxUnavailable")),
        "a PDB may not set both minAvailable and maxUnavailable"
    );
    assert!(
        !json_patches(&overlay, "Deployment").is_empty(),
        "production resources"
    );

    let image = overlay["images"]
        .as_sequence()
        .and_then(|images| {
            images
                .iter()
                .find(|i| i["name"].as_str() == Some("runplane"))
        })
        .expect("the overlay sets the runplane image");
    let tag = image["newTag"].as_str().unwrap_or_default();
    let digest = image["digest"].as_str().unwrap_or_default();
    assert!(
        digest.starts_with("sha256:") || (!tag.is_empty() && !["latest", "dev"].contains(&tag)),
        "the production image is pinned (tag {tag:?}, digest {digest:?})"
    );

    // The node agents run the sandboxes: they get production resources of their own.
    assert!(
        patched_value(
            &json_patches_for(&overlay, "DaemonSet", NODE_AGENTS),
            "/spec/template/spec/containers/0/resources"
        )
        .is_some_and(|r| !r["limits"]["memory"].is_null()),
        "production resources for the node agents"
    );

    // The overlay's ConfigMap patch, merged over the base's, still makes a valid config
    // for every Deployment and for the node agents.
    let base = resources(&k8s().join("base"));
    let config_maps = overlay_config_maps(&overlay_dir, &overlay, &base);
    let workloads = serve_names()
        .into_iter()
        .map(|name| ("Deployment", name))
        .chain([("DaemonSet", NODE_AGENTS.to_owned())]);
    for (kind, name) in workloads {
        let workload = find(&base, kind, &name);
        let container = &workload["spec"]["template"]["spec"]["containers"][0];
        let env = container_environment(container, &config_maps);
        assert_valid_config(&format!("k8s production {kind} {name}"), &env);
    }
}

#[test]
fn k8s_base_runs_only_the_services_and_the_node_agents_all_restricted() {
    let base = resources(&k8s().join("base"));
    let services = serve_names();
    let mut workloads = BTreeSet::new();
    for resource in &base {
        let kind = resource["kind"].as_str().unwrap_or_default();
        if !WORKLOAD_KINDS.contains(&kind) {
            continue;
        }
        let name = str_of(&resource["metadata"]["name"], "a name");
        assert!(
            (kind == "Deployment" && services.iter().any(|s| s == name))
                || (kind == "DaemonSet" && name == NODE_AGENTS),
            "deploy/k8s/base runs {kind} {name}, which is neither a service's Deployment nor \
             the node agents' DaemonSet: give it checks here"
        );
        workloads.insert((kind, name));
        assert_restricted(
            &format!("{kind} {name}"),
            &resource["spec"]["template"]["spec"],
        );
    }
    assert_eq!(
        workloads.len(),
        services.len() + 1,
        "one Deployment per service and the node agents: {workloads:?}"
    );
}

#[test]
fn k8s_node_agents_run_runplane_node_on_every_node() {
    let base = resources(&k8s().join("base"));
    let config_maps = base_config_maps(&base);
    let daemonset = find(&base, "DaemonSet", NODE_AGENTS);
    let pod = &daemonset["spec"]["template"];
    assert!(
        selects(
            &labels(&daemonset["spec"]["selector"]["matchLabels"]),
            &labels(&pod["metadata"]["labels"])
        ),
        "DaemonSet {NODE_AGENTS}'s selector matches its pods"
    );
    // No Service of a runplane service selects the agents.
    for name in serve_names() {
        let service = find(&base, "Service", &name);
        assert!(
            !selects(
                &labels(&service["spec"]["selector"]),
                &labels(&pod["metadata"]["labels"])
            ),
            "Service {name} selects the node agents"
        );
    }
    assert_eq!(
        pod["spec"]["automountServiceAccountToken"].as_bool(),
        Some(false),
        "sandboxes share the agent's pod: no Kubernetes API token"
    );
    let containers = pod["spec"]["containers"].as_sequence().expect("containers");
    assert_eq!(
        containers.len(),
        1,
        "DaemonSet {NODE_AGENTS}: one container"
    );
    let container = &containers[0];
    let command: Vec<String> = strings(&container["command"])
        .into_iter()
        .chain(strings(&container["args"]))
        .filter(|arg| arg != "runplane")
        .collect();
    assert_eq!(
        command,
        [
            "node",
            "--token-file=/etc/runplane/node-tokens/$(NODE_NAME)"
        ],
        "DaemonSet {NODE_AGENTS} runs `runplane node` with its node's own credential"
    );
    assert!(
        subcommands().contains("node"),
        "`runplane node` is a subcommand of the binary"
    );
    // `runplane node` serves sessions but no health service, and a probe that failed
    // would restart it and end its sandboxes.
    for probe in ["readinessProbe", "livenessProbe", "startupProbe"] {
        assert!(
            container[probe].is_null() || !container[probe]["exec"].is_null(),
            "DaemonSet {NODE_AGENTS}: {probe} can only exec, `runplane node` serves no port"
        );
    }
    for (section, key) in [
        ("requests", "cpu"),
        ("requests", "memory"),
        ("limits", "memory"),
    ] {
        assert!(
            !container["resources"][section][key].is_null(),
            "DaemonSet {NODE_AGENTS} needs resources.{section}.{key}"
        );
    }

    // Sandboxes inherit the agent's environment: of the secrets, it carries only the
    // operator token it registers with.
    assert!(
        container["envFrom"]
            .as_sequence()
            .into_iter()
            .flatten()
            .all(|source| source["secretRef"].is_null()),
        "DaemonSet {NODE_AGENTS}: no envFrom of a Secret"
    );
    let secret_keys: BTreeSet<&str> = container["env"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter_map(|entry| entry["valueFrom"]["secretKeyRef"]["key"].as_str())
        .collect();
    assert_eq!(
        secret_keys,
        BTreeSet::new(),
        "DaemonSet {NODE_AGENTS}: no secret in the environment its sandboxes would inherit"
    );

    let env = container_environment(container, &config_maps);
    assert_valid_config(&format!("k8s base DaemonSet {NODE_AGENTS}"), &env);
    let config = load_config(&env).expect("a valid config");
    assert_eq!(
        config.node.id, NODE_NAME,
        "RUNPLANE_NODE__ID is the Kubernetes node's name (spec.nodeName): stable across restarts"
    );
    let (host, port) = config.node.endpoint.rsplit_once(':').unwrap_or_else(|| {
        panic!(
            "RUNPLANE_NODE__ENDPOINT {:?} is not host:port",
            config.node.endpoint
        )
    });
    assert_eq!(
        host, POD_IP,
        "RUNPLANE_NODE__ENDPOINT is the pod's IP (status.podIP)"
    );
    assert!(
        port.parse::<u16>().is_ok_and(|p| p > 0),
        "RUNPLANE_NODE__ENDPOINT: bad port {port}"
    );
    assert!(
        (1..=10_000).contains(&config.node.capacity),
        "RUNPLANE_NODE__CAPACITY {} is outside what the reconciler accepts",
        config.node.capacity
    );
    assert_eq!(
        config.sandbox_reconciler.endpoint,
        format!("http://sandbox-reconciler:{PORT}"),
        "the agents dial the reconciler's Service"
    );
    assert!(env.contains_key("OTEL_EXPORTER_OTLP_ENDPOINT"));
    assert_eq!(
        env.get("OTEL_SERVICE_NAME").map(String::as_str),
        Some("runplane-node")
    );

    // The state directory is on a volume: the root filesystem is read-only.
    let state_dir = Path::new(&config.node.state_dir);
    assert!(
        state_dir.is_absolute(),
        "RUNPLANE_NODE__STATE_DIR {state_dir:?}"
    );
    let mount = container["volumeMounts"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter(|m| state_dir.starts_with(str_of(&m["mountPath"], "a mountPath")))
        .max_by_key(|m| str_of(&m["mountPath"], "a mountPath").len())
        .unwrap_or_else(|| panic!("RUNPLANE_NODE__STATE_DIR {state_dir:?} is on no volume"));
    let volume_name = str_of(&mount["name"], "a volumeMount name");
    let volume = pod["spec"]["volumes"]
        .as_sequence()
        .into_iter()
        .flatten()
        .find(|v| v["name"].as_str() == Some(volume_name))
        .unwrap_or_else(|| panic!("volumeMount {volume_name} names no volume"));
    assert!(
        !volume["emptyDir"].is_null() || !volume["hostPath"].is_null(),
        "the node's state directory is on an emptyDir or a hostPath"
    );
}

/// A reconciler that may run more than one replica (`max_replicas`) has local sandboxes
/// off in `env`.
fn assert_no_local_sandboxes_with_replicas(
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

#[test]
fn k8s_reconciler_runs_no_local_sandboxes_when_it_can_have_several_replicas() {
    let name = "sandbox-reconciler";
    let base = resources(&k8s().join("base"));
    let deployment = find(&base, "Deployment", name);
    let hpa = find(&base, "HorizontalPodAutoscaler", name);
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let base_replicas = deployment["spec"]["replicas"].as_u64().unwrap_or(1);
    let base_hpa_max = hpa["spec"]["maxReplicas"].as_u64().expect("maxReplicas");
    let base_env = container_environment(container, &base_config_maps(&base));
    assert_no_local_sandboxes_with_replicas("k8s base", base_replicas.max(base_hpa_max), &base_env);

    let overlay_dir = k8s().join("overlays/production");
    let overlay = kustomization(&overlay_dir);
    let replicas = overlay["replicas"]
        .as_sequence()
        .into_iter()
        .flatten()
        .find(|r| r["name"].as_str() == Some(name))
        .and_then(|r| r["count"].as_u64())
        .unwrap_or(base_replicas);
    let hpa_max = patched_value(
        &json_patches_for(&overlay, "HorizontalPodAutoscaler", name),
        "/spec/maxReplicas",
    )
    .and_then(|v| v.as_u64())
    .unwrap_or(base_hpa_max);
    assert!(
        replicas >= 2,
        "production runs several reconciler replicas ({replicas})"
    );
    let env = container_environment(
        container,
        &overlay_config_maps(&overlay_dir, &overlay, &base),
    );
    assert_no_local_sandboxes_with_replicas("k8s production", replicas.max(hpa_max), &env);

    // With local sandboxes off, a queued run waits for a node agent: there must be some.
    for env in [&base_env, &env] {
        let config = load_config(env).expect("a valid config");
        if !config.sandbox_reconciler.local_sandboxes {
            find(&base, "DaemonSet", NODE_AGENTS);
        }
    }
}

#[test]
fn compose_runs_one_reconciler_with_local_sandboxes() {
    let compose = compose();
    let services = compose_services(&compose);
    let reconciler = &services["sandbox-reconciler"];
    let env = compose_environment(reconciler, &mut BTreeSet::new());
    let config = load_config(&env).expect("a valid config");
    let agents = services
        .values()
        .any(|s| strings(&s["command"]).first().map(String::as_str) == Some("node"));
    assert!(
        agents || config.sandbox_reconciler.local_sandboxes,
        "compose runs no node agent: with local sandboxes off, runs would wait forever"
    );
    let replicas = reconciler["deploy"]["replicas"].as_u64().unwrap_or(1);
    assert_no_local_sandboxes_with_replicas("compose", replicas, &env);
}

// --- image and docs -----------------------------------------------------------------

#[test]
fn the_dockerfile_builds_the_binary_locked_and_runs_it_unprivileged_on_7070() {
    let dockerfile = read(&deploy().join("Dockerfile"));
    assert!(dockerfile.contains("cargo build --release -p runplane --locked"));
    assert!(
        dockerfile.contains("--mount=type=cache"),
        "cargo cache mounts"
    );
    assert!(dockerfile.contains("ENTRYPOINT [\"runplane\"]"));
    assert!(
        dockerfile
            .lines()
            .any(|l| l.trim() == format!("EXPOSE {PORT}"))
    );
    let user = dockerfile
        .lines()
        .filter_map(|l| l.trim().strip_prefix("USER "))
        .next_back()
        .expect("the image sets a USER");
    assert!(
        !user.starts_with("root") && !user.starts_with("0"),
        "USER {user}"
    );

    let ignored: BTreeSet<&str> = [".git", "target", ".runplane"].into();
    let dockerignore = read(&repo().join(".dockerignore"));
    for entry in ignored {
        assert!(
            dockerignore
                .lines()
                .any(|l| l.trim().trim_end_matches('/') == entry),
            ".dockerignore should exclude {entry}"
        );
    }
}

#[test]
fn the_deploy_readme_points_at_the_example_config() {
    let readme = read(&deploy().join("README.md"));
    assert!(readme.contains("runplane.example.toml"));
    assert!(deploy().join("runplane.example.toml").is_file());
}
