//! The NetworkPolicies of the production overlay, evaluated as an enforcing CNI would:
//! who may open a connection to whom, over the pods the manifests run and stand-ins for
//! what they reach outside (DNS, the collector, Postgres, Redis, operators' tools,
//! session clients, a host on the internet).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use serde_norway::Value;

use super::deploy_common::{read, repo, str_of, strings};
use super::manifests::{k8s, labels};
use super::render::{Workload, kustomize, namespace_of, namespaces, workloads};

/// One end of a connection: a pod (namespace and labels) or an address outside.
#[derive(Debug, Clone)]
pub struct Peer {
    pub name: String,
    pub namespace: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub ip: IpAddr,
}

/// A destination port and its protocol.
pub type Port = (u16, &'static str);

pub struct Cluster {
    pub resources: Vec<Value>,
    pub policies: Vec<Value>,
    pub namespaces: BTreeMap<String, BTreeMap<String, String>>,
    pub workloads: Vec<Workload>,
}

impl Cluster {
    pub fn production() -> Cluster {
        let resources = kustomize(&k8s().join("overlays/production"));
        let mut namespaces = namespaces(&resources);
        for ns in ["kube-system", "databases", "observability", "ops"] {
            namespaces.entry(ns.into()).or_insert_with(|| {
                BTreeMap::from([("kubernetes.io/metadata.name".into(), ns.into())])
            });
        }
        Cluster {
            policies: resources
                .iter()
                .filter(|r| r["kind"].as_str() == Some("NetworkPolicy"))
                .cloned()
                .collect(),
            workloads: workloads(&resources),
            namespaces,
            resources,
        }
    }

    /// Whether `from` may open a connection to `to` on `port`: `from`'s egress and
    /// `to`'s ingress both allow it.
    pub fn allows(&self, from: &Peer, to: &Peer, port: Port) -> bool {
        self.direction_allows(from, to, port, "Egress")
            && self.direction_allows(to, from, port, "Ingress")
    }

    /// Policies of `subject`'s namespace that select it for `direction`: none means
    /// everything is allowed that way; otherwise some rule must match `other`.
    fn direction_allows(&self, subject: &Peer, other: &Peer, port: Port, direction: &str) -> bool {
        let Some(namespace) = &subject.namespace else {
            return true; // outside the cluster: no policy of ours
        };
        let selecting: Vec<&Value> = self
            .policies
            .iter()
            .filter(|p| &namespace_of(p) == namespace)
            .filter(|p| policy_types(p).contains(direction))
            .filter(|p| selector_matches(&p["spec"]["podSelector"], &subject.labels))
            .collect();
        if selecting.is_empty() {
            return true;
        }
        let (rules_key, peers_key) = match direction {
            "Egress" => ("egress", "to"),
            _ => ("ingress", "from"),
        };
        selecting.iter().any(|policy| {
            policy["spec"][rules_key]
                .as_sequence()
                .into_iter()
                .flatten()
                .any(|rule| {
                    let ports_ok = rule["ports"]
                        .as_sequence()
                        .is_none_or(|ports| ports.iter().any(|p| port_matches(p, port)));
                    let peers_ok = rule[peers_key].as_sequence().is_none_or(|peers| {
                        peers
                            .iter()
                            .any(|peer| self.peer_matches(peer, namespace, other))
                    });
                    ports_ok && peers_ok
                })
        })
    }

    fn peer_matches(&self, peer: &Value, policy_namespace: &str, other: &Peer) -> bool {
        if !peer["ipBlock"].is_null() {
            return ip_block_matches(&peer["ipBlock"], other.ip);
        }
        let Some(other_namespace) = &other.namespace else {
            return false; // pod and namespace selectors select pods only
        };
        let namespace_ok = match peer.get("namespaceSelector") {
            None => other_namespace == policy_namespace,
            Some(selector) => selector_matches(
                selector,
                self.namespaces
                    .get(other_namespace)
                    .unwrap_or(&BTreeMap::new()),
            ),
        };
        let pod_ok = peer
            .get("podSelector")
            .is_none_or(|selector| selector_matches(selector, &other.labels));
        namespace_ok && pod_ok
    }

    /// The pods the manifests run, one peer per workload.
    pub fn pods(&self) -> Vec<Peer> {
        self.workloads
            .iter()
            .enumerate()
            .map(|(i, w)| Peer {
                name: w.name.clone(),
                namespace: Some(w.namespace.clone()),
                labels: w.labels(),
                ip: format!("10.244.1.{}", i + 10).parse().expect("an address"),
            })
            .collect()
    }
}

/// What the manifests' pods reach outside themselves, as stand-ins with the labels the
/// policies document, and where each listens.
pub fn stand_ins() -> Vec<(Peer, Vec<Port>)> {
    let pod = |name: &str, namespace: &str, labels: &[(&str, &str)], ip: &str| Peer {
        name: name.into(),
        namespace: Some(namespace.into()),
        labels: labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        ip: ip.parse().expect("an address"),
    };
    vec![
        (
            pod(
                "dns",
                "kube-system",
                &[("k8s-app", "kube-dns")],
                "10.244.0.2",
            ),
            vec![(53, "UDP"), (53, "TCP")],
        ),
        (
            pod(
                "collector",
                "observability",
                &[("app.kubernetes.io/name", "opentelemetry-collector")],
                "10.244.2.2",
            ),
            vec![(4317, "TCP")],
        ),
        (
            pod(
                "postgres",
                "databases",
                &[("runplane.dev/datastore", "postgres")],
                "10.244.3.2",
            ),
            vec![(5432, "TCP")],
        ),
        (
            pod(
                "redis",
                "databases",
                &[("runplane.dev/datastore", "redis")],
                "10.244.3.3",
            ),
            vec![(6379, "TCP")],
        ),
        (
            pod(
                "operator-client",
                "ops",
                &[("runplane.dev/operator-client", "true")],
                "10.244.4.2",
            ),
            vec![],
        ),
        (
            pod(
                "session-client",
                "ops",
                &[("runplane.dev/session-client", "true")],
                "10.244.4.3",
            ),
            vec![],
        ),
        (
            Peer {
                name: "internet".into(),
                namespace: None,
                labels: BTreeMap::new(),
                ip: "203.0.113.10".parse().expect("an address"),
            },
            vec![(443, "TCP"), (80, "TCP")],
        ),
    ]
}

pub fn policy_types(policy: &Value) -> BTreeSet<String> {
    let declared = strings(&policy["spec"]["policyTypes"]);
    if !declared.is_empty() {
        return declared.into_iter().collect();
    }
    let mut types = BTreeSet::from(["Ingress".to_owned()]);
    if !policy["spec"]["egress"].is_null() {
        types.insert("Egress".into());
    }
    types
}

/// A LabelSelector against `labels`: matchLabels and matchExpressions all hold (an
/// empty selector selects everything).
pub fn selector_matches(selector: &Value, labels_of: &BTreeMap<String, String>) -> bool {
    let wanted = labels(&selector["matchLabels"]);
    if !wanted.iter().all(|(k, v)| labels_of.get(k) == Some(v)) {
        return false;
    }
    selector["matchExpressions"]
        .as_sequence()
        .into_iter()
        .flatten()
        .all(|expression| {
            let key = str_of(&expression["key"], "a matchExpressions key");
            let values = strings(&expression["values"]);
            let value = labels_of.get(key);
            match str_of(&expression["operator"], "an operator") {
                "In" => value.is_some_and(|v| values.contains(v)),
                "NotIn" => value.is_none_or(|v| !values.contains(v)),
                "Exists" => value.is_some(),
                "DoesNotExist" => value.is_none(),
                other => panic!("unknown selector operator {other}"),
            }
        })
}

fn port_matches(rule_port: &Value, (port, protocol): Port) -> bool {
    let rule_protocol = rule_port["protocol"].as_str().unwrap_or("TCP");
    let number = rule_port["port"].as_u64().unwrap_or_else(|| {
        panic!("a policy port should be a number here (a named port hides what it opens)")
    });
    let end = rule_port["endPort"].as_u64().unwrap_or(number);
    rule_protocol == protocol && (number..=end).contains(&u64::from(port))
}

pub fn ip_block_matches(block: &Value, ip: IpAddr) -> bool {
    in_cidr(str_of(&block["cidr"], "an ipBlock cidr"), ip)
        && !strings(&block["except"]).iter().any(|c| in_cidr(c, ip))
}

pub fn in_cidr(cidr: &str, ip: IpAddr) -> bool {
    let (net, bits) = cidr.split_once('/').expect("a CIDR");
    let bits: u32 = bits.parse().expect("a prefix length");
    match (net.parse::<IpAddr>().expect("a CIDR address"), ip) {
        (IpAddr::V4(net), IpAddr::V4(ip)) => {
            let mask = u32::MAX.checked_shl(32 - bits).unwrap_or(0);
            u32::from(net) & mask == u32::from(ip) & mask
        }
        (IpAddr::V6(net), IpAddr::V6(ip)) => {
            let mask = u128::MAX.checked_shl(128 - bits).unwrap_or(0);
            u128::from(net) & mask == u128::from(ip) & mask
        }
        _ => false,
    }
}

/// The gRPC clients a crate's source builds, as the services they call: what the code
/// says each program dials.
pub fn services_called_by(crate_dirs: &[&str]) -> BTreeSet<String> {
    const CLIENTS: [(&str, &str); 6] = [
        ("run_service_client::", "run-store"),
        ("runner_service_client::", "run-store"),
        ("credential_health_service_client::", "credential-health"),
        ("stream_recovery_service_client::", "stream-recovery"),
        ("node_service_client::", "sandbox-reconciler"),
        ("sandbox_service_client::", "sandbox-reconciler"),
    ];
    let mut called = BTreeSet::new();
    for dir in crate_dirs {
        let mut pending = vec![repo().join(dir).join("src")];
        while let Some(dir) = pending.pop() {
            for entry in
                std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            {
                let path = entry.expect("a directory entry").path();
                if path.is_dir() {
                    pending.push(path);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    let text = read(&path);
                    for (client, service) in CLIENTS {
                        if text.contains(client) {
                            called.insert(service.to_owned());
                        }
                    }
                }
            }
        }
    }
    called
}
