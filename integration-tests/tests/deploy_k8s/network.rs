//! The production overlay's NetworkPolicies: everything denied by default, and allowed
//! exactly the connections the code makes (its gRPC clients, its database and Redis
//! URLs), DNS and telemetry, operators' tools, sessions, and the agents' internet.

use std::collections::{BTreeMap, BTreeSet};

use super::deploy_common::{load_config, str_of};
use super::manifests::*;
use super::policies::*;

fn is_default_deny(policy: &serde_norway::Value) -> bool {
    let spec = &policy["spec"];
    spec["podSelector"]
        .as_mapping()
        .is_none_or(|m| m.is_empty())
        && policy_types(policy) == BTreeSet::from(["Egress".into(), "Ingress".into()])
        && spec["ingress"].as_sequence().is_none_or(|r| r.is_empty())
        && spec["egress"].as_sequence().is_none_or(|r| r.is_empty())
}

#[test]
fn every_namespace_denies_by_default_and_every_pod_and_datastore_is_selected() {
    let cluster = Cluster::production();
    for namespace in [CONTROL_PLANE_NAMESPACE, NODES_NAMESPACE] {
        assert!(
            cluster
                .policies
                .iter()
                .any(|p| p["metadata"]["namespace"].as_str() == Some(namespace)
                    && is_default_deny(p)),
            "namespace {namespace} has no default-deny NetworkPolicy (ingress and egress)"
        );
    }
    let datastores: Vec<Peer> = stand_ins()
        .into_iter()
        .map(|(peer, _)| peer)
        .filter(|p| p.labels.contains_key("runplane.dev/datastore"))
        .collect();
    for pod in cluster.pods().iter().chain(&datastores) {
        let namespace = pod.namespace.as_deref().expect("a pod");
        let selecting: Vec<&str> = cluster
            .policies
            .iter()
            .filter(|p| p["metadata"]["namespace"].as_str() == Some(namespace))
            .filter(|p| selector_matches(&p["spec"]["podSelector"], &pod.labels))
            .filter(|p| policy_types(p).contains("Ingress"))
            .map(|p| str_of(&p["metadata"]["name"], "a name"))
            .collect();
        assert!(
            !selecting.is_empty(),
            "{namespace}/{}: no NetworkPolicy governs its ingress",
            pod.name
        );
    }
}

/// Every connection the policies allow among the pods and the stand-ins, as
/// `from -> to:port/protocol`.
fn allowed(cluster: &Cluster) -> BTreeSet<String> {
    let pods = cluster.pods();
    let services = |peer: &Peer| -> Vec<Port> {
        // The manifests' pods listen on their containers' ports.
        cluster
            .workloads
            .iter()
            .find(|w| w.name == peer.name)
            .map(|w| {
                w.containers()
                    .iter()
                    .flat_map(|c| c["ports"].as_sequence().cloned().unwrap_or_default())
                    .filter_map(|p| p["containerPort"].as_u64())
                    .map(|p| (u16::try_from(p).expect("a port"), "TCP"))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut targets: Vec<(Peer, Vec<Port>)> =
        pods.iter().map(|p| (p.clone(), services(p))).collect();
    targets.extend(stand_ins());
    let sources: Vec<Peer> = pods
        .iter()
        .cloned()
        .chain(stand_ins().into_iter().map(|(p, _)| p))
        .collect();
    let mut out = BTreeSet::new();
    let ours = |peer: &Peer| pods.iter().any(|p| p.name == peer.name);
    for from in &sources {
        for (to, ports) in &targets {
            // Between two stand-ins nothing of ours decides.
            if from.name == to.name || !(ours(from) || ours(to)) {
                continue;
            }
            for port in ports {
                if cluster.allows(from, to, *port) {
                    out.insert(format!(
                        "{} -> {}:{}/{}",
                        from.name, to.name, port.0, port.1
                    ));
                }
            }
        }
    }
    out
}

#[test]
fn network_policies_allow_exactly_the_connections_the_code_makes() {
    let cluster = Cluster::production();
    let config_maps = base_config_maps(&cluster.resources);
    let mut expected = BTreeSet::new();
    let mut edge = |from: &str, to: &str, port: u16, protocol: &str| {
        expected.insert(format!("{from} -> {to}:{port}/{protocol}"));
    };
    for workload in &cluster.workloads {
        let from = workload.name.as_str();
        edge(from, "dns", 53, "UDP");
        edge(from, "dns", 53, "TCP");
        edge(from, "collector", 4317, "TCP");
        let called = match workload.served() {
            Some(service) => services_called_by(&[&format!("services/{service}")]),
            // A node agent's own calls and its runners'.
            None => services_called_by(&["services/node-agent", "services/runner"]),
        };
        for service in called {
            edge(from, &service, 7070, "TCP");
        }
        // Postgres and Redis where its configuration points at them.
        let env = container_environment(&workload.pod, workload.containers()[0], &config_maps);
        load_config(&env).unwrap_or_else(|e| panic!("{}: {e}", workload.origin()));
        if env.keys().any(|k| k.ends_with("__DATABASE_URL")) {
            edge(from, "postgres", 5432, "TCP");
        }
        if env.contains_key("RUNPLANE_STREAM_RECOVERY__REDIS_URL") {
            edge(from, "redis", 6379, "TCP");
        }
        if workload.runs_agents() {
            // The agents' own outbound traffic.
            edge(from, "internet", 443, "TCP");
            edge(from, "internet", 80, "TCP");
            edge("session-client", from, 7443, "TCP");
        } else {
            edge("operator-client", from, 7070, "TCP");
        }
    }
    let actual = allowed(&cluster);
    let extra: Vec<&String> = actual.difference(&expected).collect();
    let missing: Vec<&String> = expected.difference(&actual).collect();
    assert!(
        extra.is_empty() && missing.is_empty(),
        "NetworkPolicies allow what no code needs: {extra:#?}\nand refuse what code needs: {missing:#?}"
    );
}

#[test]
fn node_agents_never_reach_postgres_or_redis_wherever_they_are() {
    let cluster = Cluster::production();
    let nodes: Vec<Peer> = cluster
        .pods()
        .into_iter()
        .filter(|p| {
            p.labels
                .get("app.kubernetes.io/component")
                .map(String::as_str)
                == Some("node")
        })
        .collect();
    assert!(!nodes.is_empty(), "no node agent runs");
    // A datastore inside the cluster, on the operator's network, or at a public address.
    let addresses = [
        "10.244.3.2",
        "172.20.0.5",
        "192.168.10.4",
        "203.0.113.20",
        "fd00::5",
    ];
    let datastores = BTreeMap::from([("postgres", 5432), ("redis", 6379)]);
    for node in &nodes {
        for (kind, port) in &datastores {
            for address in addresses {
                for namespace in [Some("databases".to_owned()), None] {
                    let target = Peer {
                        name: (*kind).into(),
                        namespace: namespace.clone(),
                        labels: BTreeMap::from([(
                            "runplane.dev/datastore".to_owned(),
                            (*kind).to_owned(),
                        )]),
                        ip: address.parse().expect("an address"),
                    };
                    assert!(
                        !cluster.allows(node, &target, (*port, "TCP")),
                        "node agent {} reaches {kind} on {port} at {address} ({namespace:?})",
                        node.name
                    );
                }
            }
        }
    }
}
