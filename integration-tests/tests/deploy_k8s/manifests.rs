//! Reading `deploy/k8s/` as Kubernetes would, for the checks in `deploy_k8s.rs`: the
//! resources and kustomizations, patches applied, a container's environment expanded,
//! and the restricted Pod Security Standard.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_norway::Value;

use super::deploy_common::{
    deploy, kebab_case, read, repo, scalar, str_of, strings, yaml, yaml_documents,
};

/// The gRPC health name each `runplane serve` service reports (the server also reports
/// "" for the whole process).
pub const HEALTH_SERVICES: [(&str, &str); 4] = [
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

/// The node agent template (deploy/k8s/node): each node of an overlay is a Deployment
/// made from it, `runplane-node-<id>`.
pub const NODE_AGENTS: &str = "runplane-node";

/// The namespaces: the control plane's and the node agents'.
pub const CONTROL_PLANE_NAMESPACE: &str = "runplane";
pub const NODES_NAMESPACE: &str = "runplane-nodes";

/// Kinds that run pods: each in the base must be one this file checks.
pub const WORKLOAD_KINDS: [&str; 7] = [
    "Deployment",
    "DaemonSet",
    "StatefulSet",
    "ReplicaSet",
    "Job",
    "CronJob",
    "Pod",
];

/// Stand-ins for the downward API fields (`fieldRef`) the manifests read.
pub const POD_NAME: &str = "runplane-0123456789-abcde";
pub const NODE_NAME: &str = "ip-10-0-1-23.eu-west-1.compute.internal";
pub const POD_IP: &str = "10.244.1.17";

/// A stand-in for key `key` of the Secret `secret`, one that passes validation: digests
/// are 64 hex digits, tokens at least 32 characters, every value distinct.
pub fn secret_stand_in(secret: &str, key: &str) -> String {
    let seed: String = format!("{secret}/{key}")
        .bytes()
        .map(|b| format!("{b:02x}"))
        .collect();
    if key.ends_with("sha256") || key == "receipt-signing-key" {
        // Distinct within 64 digits: the names differ early enough.
        let tail: String = seed.chars().rev().collect();
        return tail.repeat(2)[..64].to_owned();
    }
    match key {
        "postgres-password" => format!("stand-in-password-{}", &seed[..16]),
        "redis-url" => "redis://:stand-in-redis-password@redis.databases.svc:6379".to_owned(),
        _ => format!("stand-in-{secret}-{key}-0123456789abcdef"),
    }
}

/// Every `.yaml`/`.yml` file under `dir`, sorted.
pub fn yaml_files(dir: &Path) -> Vec<PathBuf> {
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

/// The subcommands of `runplane`: the variants of the binary's `Command`, in kebab case.
pub fn subcommands() -> BTreeSet<String> {
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

pub fn health_service_of(serve_name: &str) -> &'static str {
    HEALTH_SERVICES
        .iter()
        .find(|(name, _)| *name == serve_name)
        .map(|(_, health)| *health)
        .unwrap_or_else(|| {
            panic!("`runplane serve {serve_name}` has no gRPC health name in HEALTH_SERVICES")
        })
}

pub fn k8s() -> PathBuf {
    deploy().join("k8s")
}

/// Every resource of the YAML files under `dir` except kustomizations and patches.
pub fn resources(dir: &Path) -> Vec<Value> {
    yaml_files(dir)
        .iter()
        .filter(|p| p.file_name().and_then(|n| n.to_str()) != Some("kustomization.yaml"))
        .flat_map(|p| yaml_documents(p))
        .collect()
}

pub fn find<'a>(resources: &'a [Value], kind: &str, name: &str) -> &'a Value {
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

pub fn labels(value: &Value) -> BTreeMap<String, String> {
    value
        .as_mapping()
        .map(|m| {
            m.iter()
                .map(|(k, v)| (str_of(k, "a label").to_owned(), scalar(v)))
                .collect()
        })
        .unwrap_or_default()
}

pub fn selects(selector: &BTreeMap<String, String>, pod: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| pod.get(k) == Some(v))
}

pub fn secret_value(secret_ref: &Value) -> String {
    secret_stand_in(
        str_of(&secret_ref["name"], "a secretKeyRef name"),
        str_of(&secret_ref["key"], "a secret key"),
    )
}

/// `$(NAME)` references expanded against the variables defined before, as the kubelet
/// does; an unresolved one would stay literal, which is a mistake here.
pub fn expand(value: &str, env: &BTreeMap<String, String>) -> String {
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

/// What the downward API gives a container of a pod labelled `pod_labels` for
/// `fieldRef` `path` (a stand-in, or the label).
pub fn field_value(path: &str, pod_labels: &BTreeMap<String, String>) -> String {
    if let Some(label) = path
        .strip_prefix("metadata.labels['")
        .and_then(|rest| rest.strip_suffix("']"))
    {
        return pod_labels
            .get(label)
            .unwrap_or_else(|| panic!("fieldRef {path}: the pod has no label {label}"))
            .clone();
    }
    match path {
        "metadata.name" => POD_NAME,
        "metadata.namespace" => "runplane",
        "spec.nodeName" => NODE_NAME,
        "status.podIP" => POD_IP,
        other => panic!("fieldRef {other} has no stand-in here (a typo, or add one)"),
    }
    .to_owned()
}

/// The environment `container` of the pod template `pod` gets with `config_maps` (name
/// to data) applied.
pub fn container_environment(
    pod: &Value,
    container: &Value,
    config_maps: &BTreeMap<String, BTreeMap<String, String>>,
) -> BTreeMap<String, String> {
    let pod_labels = labels(&pod["metadata"]["labels"]);
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
            field_value(
                str_of(&field["fieldPath"], "a fieldRef fieldPath"),
                &pod_labels,
            )
        } else {
            panic!("env {name} has neither value nor a known valueFrom")
        };
        env.insert(name, value);
    }
    env
}

pub fn config_map_data(resource: &Value) -> BTreeMap<String, String> {
    resource["data"]
        .as_mapping()
        .map(|m| {
            m.iter()
                .map(|(k, v)| (str_of(k, "a ConfigMap key").to_owned(), scalar(v)))
                .collect()
        })
        .unwrap_or_default()
}

pub fn base_config_maps(base: &[Value]) -> BTreeMap<String, BTreeMap<String, String>> {
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

pub fn kustomization(dir: &Path) -> Value {
    yaml(&dir.join("kustomization.yaml"))
}

/// The inline JSON6902 patches of a kustomization that target `kind`.
pub fn json_patches(kustomization: &Value, kind: &str) -> Vec<Value> {
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
pub fn json_patches_for(kustomization: &Value, kind: &str, name: &str) -> Vec<Value> {
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
pub fn overlay_config_maps(
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
pub fn assert_restricted(origin: &str, pod: &Value) {
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
    for volume in pod["volumes"].as_sequence().into_iter().flatten() {
        for key in volume.as_mapping().expect("a volume").keys() {
            let key = str_of(key, "a volume field");
            assert!(
                key == "name" || crate::render::RESTRICTED_VOLUMES.contains(&key),
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

pub fn patched_value(operations: &[Value], path: &str) -> Option<Value> {
    operations
        .iter()
        .rev()
        .find(|op| op["path"].as_str() == Some(path) && op["op"].as_str() != Some("remove"))
        .map(|op| op["value"].clone())
}
