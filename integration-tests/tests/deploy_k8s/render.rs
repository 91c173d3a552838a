//! `deploy/k8s/` as the API server would receive it: each kustomization built by
//! `kubectl kustomize` (kustomize inside kubectl), then its workloads, their pods'
//! Secrets, and the Pod Security Standards' checks.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use serde_norway::Value;

use super::deploy_common::{str_of, strings};
use super::manifests::{WORKLOAD_KINDS, labels};

/// `kubectl kustomize <dir>`: what `kubectl apply -k <dir>` would send.
pub fn kustomize(dir: &Path) -> Vec<Value> {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "running `kubectl kustomize {}`: {e}; these tests need kubectl (it carries \
                 kustomize): install it from your distribution or the Kubernetes packages",
                dir.display()
            )
        });
    assert!(
        out.status.success(),
        "`kubectl kustomize {}` failed: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("kustomize prints UTF-8");
    // kustomize separates documents with `---` lines alone.
    text.split("\n---\n")
        .map(|document| {
            serde_norway::from_str::<Value>(document)
                .unwrap_or_else(|e| panic!("kustomize printed invalid YAML: {e}"))
        })
        .filter(|value| !value.is_null())
        .collect()
}

/// A resource that runs pods, with its pod template.
#[derive(Debug, Clone)]
pub struct Workload {
    pub kind: String,
    pub name: String,
    pub namespace: String,
    /// The pod template (`metadata` and `spec`).
    pub pod: Value,
    pub replicas: u64,
}

impl Workload {
    pub fn origin(&self) -> String {
        format!("{} {}/{}", self.kind, self.namespace, self.name)
    }

    pub fn spec(&self) -> &Value {
        &self.pod["spec"]
    }

    pub fn labels(&self) -> BTreeMap<String, String> {
        labels(&self.pod["metadata"]["labels"])
    }

    /// Every container: init, regular and ephemeral.
    pub fn containers(&self) -> Vec<&Value> {
        ["initContainers", "containers", "ephemeralContainers"]
            .iter()
            .filter_map(|key| self.spec()[*key].as_sequence())
            .flatten()
            .collect()
    }

    /// Whether a container runs `runplane node`: the pods where agents run.
    pub fn runs_agents(&self) -> bool {
        self.containers().iter().any(|c| {
            strings(&c["command"])
                .into_iter()
                .chain(strings(&c["args"]))
                .find(|arg| arg != "runplane" && !arg.ends_with("/runplane"))
                .is_some_and(|sub| sub == "node" || sub == "dev")
        })
    }

    /// The `runplane serve` service this workload runs, if it runs one.
    pub fn served(&self) -> Option<String> {
        let container = self.containers().into_iter().next()?;
        let args: Vec<String> = strings(&container["command"])
            .into_iter()
            .chain(strings(&container["args"]))
            .filter(|arg| arg != "runplane")
            .collect();
        (args.first().map(String::as_str) == Some("serve"))
            .then(|| args.get(1).cloned())
            .flatten()
    }

    /// Every Secret its pods can read: secret and projected volumes, envFrom and
    /// secretKeyRef of any container.
    pub fn secrets(&self) -> BTreeSet<String> {
        let mut found = BTreeSet::new();
        for volume in self.spec()["volumes"].as_sequence().into_iter().flatten() {
            if let Some(name) = volume["secret"]["secretName"].as_str() {
                found.insert(name.to_owned());
            }
            for source in volume["projected"]["sources"]
                .as_sequence()
                .into_iter()
                .flatten()
            {
                if let Some(name) = source["secret"]["name"].as_str() {
                    found.insert(name.to_owned());
                }
            }
        }
        for container in self.containers() {
            for source in container["envFrom"].as_sequence().into_iter().flatten() {
                if let Some(name) = source["secretRef"]["name"].as_str() {
                    found.insert(name.to_owned());
                }
            }
            for entry in container["env"].as_sequence().into_iter().flatten() {
                if let Some(name) = entry["valueFrom"]["secretKeyRef"]["name"].as_str() {
                    found.insert(name.to_owned());
                }
            }
        }
        found
    }
}

/// The workloads of built resources; a resource without a namespace lands in `default`.
pub fn workloads(resources: &[Value]) -> Vec<Workload> {
    resources
        .iter()
        .filter(|r| WORKLOAD_KINDS.contains(&r["kind"].as_str().unwrap_or_default()))
        .map(|r| {
            let kind = str_of(&r["kind"], "a kind").to_owned();
            let pod = match kind.as_str() {
                "Pod" => r.clone(),
                "CronJob" => r["spec"]["jobTemplate"]["spec"]["template"].clone(),
                _ => r["spec"]["template"].clone(),
            };
            Workload {
                name: str_of(&r["metadata"]["name"], "a name").to_owned(),
                namespace: namespace_of(r),
                replicas: r["spec"]["replicas"].as_u64().unwrap_or(1),
                kind,
                pod,
            }
        })
        .collect()
}

pub fn namespace_of(resource: &Value) -> String {
    resource["metadata"]["namespace"]
        .as_str()
        .unwrap_or("default")
        .to_owned()
}

/// The Namespaces of built resources, name to labels (with the label the API server
/// adds to every namespace, `kubernetes.io/metadata.name`).
pub fn namespaces(resources: &[Value]) -> BTreeMap<String, BTreeMap<String, String>> {
    resources
        .iter()
        .filter(|r| r["kind"].as_str() == Some("Namespace"))
        .map(|r| {
            let name = str_of(&r["metadata"]["name"], "a name").to_owned();
            let mut labels = labels(&r["metadata"]["labels"]);
            labels.insert("kubernetes.io/metadata.name".into(), name.clone());
            (name, labels)
        })
        .collect()
}

/// The volume types the restricted Pod Security Standard admits.
pub const RESTRICTED_VOLUMES: [&str; 8] = [
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
];

/// The Pod Security Standards' levels, least permissive first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Restricted,
    Baseline,
    Privileged,
}

impl Level {
    pub fn parse(label: &str) -> Level {
        match label {
            "restricted" => Level::Restricted,
            "baseline" => Level::Baseline,
            "privileged" => Level::Privileged,
            other => panic!("{other:?} is not a Pod Security level"),
        }
    }
}

/// The least permissive Pod Security level that admits `pod` (a pod template), by the
/// checks of the Pod Security Standards (kubernetes.io/docs/concepts/security/
/// pod-security-standards) that these manifests can trip, and why it is not stricter.
pub fn level_needed(pod: &Value) -> (Level, Vec<String>) {
    let spec = &pod["spec"];
    let pod_sc = &spec["securityContext"];
    let mut baseline = Vec::new();
    let mut restricted = Vec::new();
    for host in ["hostNetwork", "hostPID", "hostIPC"] {
        if spec[host].as_bool() == Some(true) {
            baseline.push(host.to_owned());
        }
    }
    const BASELINE_CAPS: [&str; 13] = [
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    ];
    for volume in spec["volumes"].as_sequence().into_iter().flatten() {
        for key in volume.as_mapping().expect("a volume").keys() {
            let key = str_of(key, "a volume field");
            if key == "hostPath" {
                baseline.push("a hostPath volume".into());
            } else if key != "name" && !RESTRICTED_VOLUMES.contains(&key) {
                restricted.push(format!("a {key} volume"));
            }
        }
    }
    let unconfined = |sc: &Value| {
        sc["seccompProfile"]["type"].as_str() == Some("Unconfined")
            || sc["appArmorProfile"]["type"].as_str() == Some("Unconfined")
    };
    if unconfined(pod_sc) {
        baseline.push("an Unconfined seccomp or AppArmor profile".into());
    }
    let containers = ["initContainers", "containers", "ephemeralContainers"]
        .iter()
        .filter_map(|key| spec[*key].as_sequence())
        .flatten();
    for container in containers {
        let sc = &container["securityContext"];
        if sc["privileged"].as_bool() == Some(true) {
            baseline.push("a privileged container".into());
        }
        for cap in strings(&sc["capabilities"]["add"]) {
            if !BASELINE_CAPS.contains(&cap.as_str()) {
                baseline.push(format!("capability {cap}"));
            } else if cap != "NET_BIND_SERVICE" {
                restricted.push(format!("capability {cap}"));
            }
        }
        if sc["procMount"].as_str().is_some_and(|m| m != "Default") {
            baseline.push("an unmasked /proc".into());
        }
        if unconfined(sc) {
            baseline.push("an Unconfined seccomp or AppArmor profile".into());
        }
        for port in container["ports"].as_sequence().into_iter().flatten() {
            if port["hostPort"].as_u64().is_some_and(|p| p != 0) {
                baseline.push("a hostPort".into());
            }
        }
        if sc["allowPrivilegeEscalation"].as_bool() != Some(false) {
            restricted.push("privilege escalation allowed".into());
        }
        let non_root = sc["runAsNonRoot"]
            .as_bool()
            .or(pod_sc["runAsNonRoot"].as_bool());
        let uid = sc["runAsUser"].as_u64().or(pod_sc["runAsUser"].as_u64());
        if non_root != Some(true) || uid == Some(0) {
            restricted.push("may run as root".into());
        }
        let seccomp = sc["seccompProfile"]["type"]
            .as_str()
            .or(pod_sc["seccompProfile"]["type"].as_str());
        if !matches!(seccomp, Some("RuntimeDefault" | "Localhost")) {
            restricted.push("no RuntimeDefault seccomp profile".into());
        }
        if !strings(&sc["capabilities"]["drop"]).contains(&"ALL".to_owned()) {
            restricted.push("does not drop ALL capabilities".into());
        }
    }
    if !baseline.is_empty() {
        (Level::Privileged, baseline)
    } else if !restricted.is_empty() {
        (Level::Baseline, restricted)
    } else {
        (Level::Restricted, Vec::new())
    }
}
