//! `deploy/k8s/`, checked without a cluster: the base (the four services and the node
//! agents' DaemonSet) and the production overlay. The probed gRPC health names are
//! services of the proto descriptor set, and every container's environment loads as a
//! valid runplane config (so a misspelt `RUNPLANE_<SECTION>__<FIELD>` fails here, not in
//! a crash loop); the check of that config loading is here too, on the Secret's
//! stand-ins.

mod deploy_common;
#[path = "deploy_k8s/manifests.rs"]
mod manifests;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use prost_reflect::DescriptorPool;

use deploy_common::{
    PORT, assert_no_local_sandboxes_with_replicas, assert_valid_config, config_error, load_config,
    serve_names, str_of, strings, yaml,
};

use manifests::*;

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

// --- runplane config ----------------------------------------------------------------

#[test]
fn the_config_check_catches_a_misspelt_field_and_a_bad_value() {
    let mut env: BTreeMap<String, String> = [
        ("RUNPLANE_SERVER__LISTEN", "0.0.0.0:7070"),
        ("RUNPLANE_AUTH__OPERATOR_TOKEN_SHA256", SECRET_KEYS[0].1),
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

/// No pod holds the operator token: the services get its SHA-256 alone
/// (`auth.operator_token_sha256`), from the Secret's `operator-token-sha256`.
#[test]
fn no_manifest_gives_a_pod_the_operator_token_itself() {
    for path in yaml_files(&k8s()) {
        let text = deploy_common::read(&path);
        for line in text.lines() {
            let line = line.trim();
            assert_ne!(
                line,
                "- name: RUNPLANE_AUTH__OPERATOR_TOKEN",
                "{} hands a pod the operator token",
                path.display()
            );
            assert_ne!(line, "key: operator-token", "{}", path.display());
        }
    }
}
