//! What keeps agents apart from the control plane and from each other, checked on the
//! production overlay as kustomize builds it: where agents run, which Secrets each pod
//! can read, which tokens it holds, and the Pod Security level of each namespace.

use std::collections::{BTreeMap, BTreeSet};

use runplane_config::Isolation;
use serde_norway::Value;

use super::deploy_common::{assert_valid_config, load_config, serve_names};
use super::manifests::*;
use super::render::*;

fn production() -> Vec<Value> {
    kustomize(&k8s().join("overlays/production"))
}

/// The ConfigMaps of built resources, name to data.
pub fn built_config_maps(resources: &[Value]) -> BTreeMap<String, BTreeMap<String, String>> {
    base_config_maps(resources)
}

/// Each container's environment, for every workload of `resources`.
fn environments(resources: &[Value]) -> Vec<(Workload, BTreeMap<String, String>)> {
    let config_maps = built_config_maps(resources);
    workloads(resources)
        .into_iter()
        .flat_map(|w| {
            w.containers()
                .into_iter()
                .map(|c| container_environment(&w.pod, c, &config_maps))
                .collect::<Vec<_>>()
                .into_iter()
                .map(move |env| (w.clone(), env))
        })
        .collect()
}

fn role_of(service: &str) -> String {
    service.replace('-', "_").to_uppercase()
}

#[test]
fn each_agent_pod_mounts_its_own_node_credential_and_no_other_secret() {
    let built = production();
    let all = workloads(&built);
    let (agents, control_plane): (Vec<&Workload>, Vec<&Workload>) =
        all.iter().partition(|w| w.runs_agents());
    assert!(
        !agents.is_empty(),
        "the production overlay runs no node agent"
    );
    let control_plane_secrets: BTreeSet<String> =
        control_plane.iter().flat_map(|w| w.secrets()).collect();
    let config_maps = built_config_maps(&built);
    let mut credentials = BTreeSet::new();
    for agent in agents {
        let origin = agent.origin();
        // A DaemonSet's (or a StatefulSet's) pods share one template, and so one set of
        // Secrets: every node's credential would be in every pod.
        assert_eq!(
            (agent.kind.as_str(), agent.replicas),
            ("Deployment", 1),
            "{origin}: one pod per node credential"
        );
        let env = container_environment(&agent.pod, agent.containers()[0], &config_maps);
        let node_id = env
            .get("RUNPLANE_NODE__ID")
            .unwrap_or_else(|| panic!("{origin} sets no RUNPLANE_NODE__ID"));
        let own = format!("runplane-node-{node_id}");
        assert_eq!(
            agent.secrets(),
            BTreeSet::from([own.clone()]),
            "{origin} (node {node_id}) may read its own credential's Secret {own} and nothing else"
        );
        assert!(
            !control_plane_secrets.contains(&own),
            "{origin}: the control plane reads {own} too"
        );
        assert!(
            credentials.insert(own.clone()),
            "two node agents mount {own}"
        );
        assert_eq!(
            agent.spec()["automountServiceAccountToken"].as_bool(),
            Some(false),
            "{origin}: no Kubernetes API token (a projected Secret of its own)"
        );
    }
}

#[test]
fn nothing_runs_agents_uncontained() {
    // The node template is never applied alone: production builds every node from it.
    let dirs = [k8s().join("base"), k8s().join("overlays/production")];
    for dir in &dirs {
        let built = kustomize(dir);
        for (workload, env) in environments(&built) {
            let origin = format!("{} ({})", workload.origin(), dir.display());
            assert_ne!(
                workload.spec()["shareProcessNamespace"].as_bool(),
                Some(true),
                "{origin}: shareProcessNamespace shows every container's processes to the agents"
            );
            for (name, value) in &env {
                assert!(
                    !(name.ends_with("__ISOLATION") && value.eq_ignore_ascii_case("none")),
                    "{origin}: {name}={value} runs agents uncontained"
                );
            }
            if workload.runs_agents() {
                let config = load_config(&env).unwrap_or_else(|e| panic!("{origin}: {e}"));
                assert_eq!(
                    config.sandbox_reconciler.isolation,
                    Isolation::Bwrap,
                    "{origin}: agents run under bubblewrap"
                );
            }
        }
    }
}

#[test]
fn agents_have_a_namespace_of_their_own_at_the_pod_security_level_they_need() {
    let built = production();
    let namespaces = namespaces(&built);
    let all = workloads(&built);
    let agent_namespaces: BTreeSet<&str> = all
        .iter()
        .filter(|w| w.runs_agents())
        .map(|w| w.namespace.as_str())
        .collect();
    let other_namespaces: BTreeSet<&str> = all
        .iter()
        .filter(|w| !w.runs_agents())
        .map(|w| w.namespace.as_str())
        .collect();
    assert!(!agent_namespaces.is_empty(), "no node agent runs");
    assert!(
        agent_namespaces.is_disjoint(&other_namespaces),
        "agents share a namespace with the control plane: {agent_namespaces:?}"
    );
    assert_eq!(
        agent_namespaces,
        BTreeSet::from([NODES_NAMESPACE]),
        "node agents run in {NODES_NAMESPACE}"
    );

    let mut needed: BTreeMap<&str, (Level, Vec<String>)> = BTreeMap::new();
    for workload in &all {
        let (level, why) = level_needed(&workload.pod);
        let entry = needed
            .entry(workload.namespace.as_str())
            .or_insert((Level::Restricted, Vec::new()));
        if level > entry.0 {
            *entry = (
                level,
                why.iter()
                    .map(|w| format!("{}: {w}", workload.origin()))
                    .collect(),
            );
        }
    }
    for (namespace, (level, why)) in &needed {
        let labels = namespaces
            .get(*namespace)
            .unwrap_or_else(|| panic!("the overlay creates no Namespace {namespace}"));
        let enforced = labels
            .get("pod-security.kubernetes.io/enforce")
            .map(|l| Level::parse(l))
            .unwrap_or_else(|| panic!("namespace {namespace} enforces no Pod Security level"));
        // Admits its pods, and no more than they need.
        assert_eq!(
            enforced, *level,
            "namespace {namespace} enforces {enforced:?}; its pods need {level:?} ({why:?})"
        );
    }
    assert_eq!(
        needed.get(CONTROL_PLANE_NAMESPACE).map(|(l, _)| *l),
        Some(Level::Restricted),
        "the control plane stays restricted"
    );

    // What the node pods ask for is what the process driver needs to contain agents:
    // root (cgroups, the workspace image's mount, network namespaces and a uid per
    // agent are made as root: shared/sandbox/src/process/limits.rs and network.rs), and
    // the devices and mounts only a privileged container has.
    for agent in all.iter().filter(|w| w.runs_agents()) {
        let origin = agent.origin();
        let pod_sc = &agent.spec()["securityContext"];
        for container in agent.containers() {
            let sc = &container["securityContext"];
            assert_eq!(
                sc["runAsUser"].as_u64().or(pod_sc["runAsUser"].as_u64()),
                Some(0),
                "{origin}: the process driver contains agents as root"
            );
            assert_eq!(
                sc["privileged"].as_bool(),
                Some(true),
                "{origin}: privileged"
            );
        }
    }
}

#[test]
fn no_pod_holds_the_operator_token_or_a_token_all_services_share() {
    let built = production();
    let all = workloads(&built);
    let services = serve_names();
    for (workload, env) in environments(&built) {
        let origin = workload.origin();
        for forbidden in [
            "RUNPLANE_AUTH__OPERATOR_TOKEN",
            "RUNPLANE_AUTH__SERVICE_TOKEN",
            "RUNPLANE_TOKEN",
        ] {
            assert!(!env.contains_key(forbidden), "{origin} holds {forbidden}");
        }
        let own_tokens: Vec<&String> = env
            .keys()
            .filter(|k| k.starts_with("RUNPLANE_AUTH__SERVICE_TOKENS__"))
            .collect();
        let digests: BTreeSet<String> = env
            .keys()
            .filter_map(|k| k.strip_prefix("RUNPLANE_AUTH__SERVICE_TOKEN_SHA256__"))
            .map(str::to_owned)
            .collect();
        let Some(service) = workload.served() else {
            assert!(
                !env.keys().any(|k| k.starts_with("RUNPLANE_AUTH__")),
                "{origin} runs no service and holds a service credential"
            );
            continue;
        };
        let role = role_of(&service);
        assert_eq!(
            own_tokens,
            [&format!("RUNPLANE_AUTH__SERVICE_TOKENS__{role}")],
            "{origin} holds its own token and no other service's"
        );
        let others: BTreeSet<String> = services
            .iter()
            .filter(|s| **s != service)
            .map(|s| role_of(s))
            .collect();
        assert_eq!(
            digests, others,
            "{origin} admits the other services by their digests"
        );
        assert!(
            env.contains_key("RUNPLANE_AUTH__OPERATOR_TOKEN_SHA256"),
            "{origin} admits operators by the token's digest"
        );
        assert_valid_config(&origin, &env);

        // Its own token's Secret is read by its pods alone.
        let container = workload.containers()[0];
        let secret = container["env"]
            .as_sequence()
            .into_iter()
            .flatten()
            .find(|e| e["name"].as_str() == Some(&format!("RUNPLANE_AUTH__SERVICE_TOKENS__{role}")))
            .and_then(|e| e["valueFrom"]["secretKeyRef"]["name"].as_str())
            .unwrap_or_else(|| panic!("{origin}: its token comes from no Secret"));
        for other in all.iter().filter(|w| w.name != workload.name) {
            assert!(
                !other.secrets().contains(secret),
                "{} can read {secret}, {origin}'s own token",
                other.origin()
            );
        }
    }
}

#[test]
fn stream_recovery_reaches_redis_with_a_password_from_a_secret_of_its_own() {
    let built = production();
    for (name, data) in built_config_maps(&built) {
        assert!(
            !data.contains_key("RUNPLANE_STREAM_RECOVERY__REDIS_URL"),
            "ConfigMap {name} holds the Redis URL, which carries its password"
        );
    }
    let all = workloads(&built);
    let workload = all
        .iter()
        .find(|w| w.served().as_deref() == Some("stream-recovery"))
        .expect("stream-recovery runs");
    let entry = workload.containers()[0]["env"]
        .as_sequence()
        .into_iter()
        .flatten()
        .find(|e| e["name"].as_str() == Some("RUNPLANE_STREAM_RECOVERY__REDIS_URL"))
        .cloned()
        .expect("stream-recovery sets RUNPLANE_STREAM_RECOVERY__REDIS_URL");
    let secret = entry["valueFrom"]["secretKeyRef"]["name"]
        .as_str()
        .expect("the Redis URL comes from a Secret");
    for other in all.iter().filter(|w| w.name != workload.name) {
        assert!(
            !other.secrets().contains(secret),
            "{} can read {secret}, which holds Redis's password",
            other.origin()
        );
    }
    let env = container_environment(
        &workload.pod,
        workload.containers()[0],
        &built_config_maps(&built),
    );
    let config = load_config(&env).expect("a valid config");
    assert!(
        config.stream_recovery.redis_url.starts_with("redis://:"),
        "the stand-in URL carries a password"
    );
}
