//! `deploy/k8s/`, checked without a cluster: the base (the four services, the
//! namespaces and NetworkPolicies), the node agent template and the production overlay,
//! read as files and as `kubectl kustomize` builds them. The probed gRPC health names
//! are services of the proto descriptor set, and every container's environment loads as
//! a valid runplane config (so a misspelt `RUNPLANE_<SECTION>__<FIELD>` fails here, not
//! in a crash loop); the check of that config loading is here too, on the Secrets'
//! stand-ins. What contains agents is in `deploy_k8s/isolation.rs` (Secrets, tokens,
//! Pod Security) and `deploy_k8s/network.rs` (NetworkPolicies).

mod deploy_common;
#[path = "deploy_k8s/isolation.rs"]
mod isolation;
#[path = "deploy_k8s/manifests.rs"]
mod manifests;
#[path = "deploy_k8s/network.rs"]
mod network;
#[path = "deploy_k8s/policies.rs"]
mod policies;
#[path = "deploy_k8s/render.rs"]
mod render;

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

        let env = container_environment(pod, container, &config_maps);
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
                Some(&format!(
                    "http://{other}.{CONTROL_PLANE_NAMESPACE}.svc:{PORT}"
                )),
                "Deployment {name} needs {var}, the Service {other} by its full name (the \
                 runners on node agents, in another namespace, get it from the reconciler)"
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

    // As kustomize builds it: the node agents, which run the sandboxes, get production
    // resources of their own, and every container's environment (the ConfigMaps with
    // the overlay's patch merged) is a valid config.
    let built = render::kustomize(&overlay_dir);
    let template = render::workloads(&resources(&k8s().join("node")));
    let template_resources = &template[0].containers()[0]["resources"];
    let config_maps = base_config_maps(&built);
    let mut nodes = 0;
    for workload in render::workloads(&built) {
        let container = workload.containers()[0];
        if workload.runs_agents() {
            nodes += 1;
            assert!(
                !container["resources"]["limits"]["memory"].is_null()
                    && container["resources"] != *template_resources,
                "{}: production resources for the node agents",
                workload.origin()
            );
        }
        let env = container_environment(&workload.pod, container, &config_maps);
        assert_valid_config(&format!("k8s production {}", workload.origin()), &env);
    }
    assert!(nodes >= 2, "production runs {nodes} node agents");
}

#[test]
fn k8s_base_runs_only_the_services_all_restricted() {
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
            kind == "Deployment" && services.iter().any(|s| s == name),
            "deploy/k8s/base runs {kind} {name}, which is not a service's Deployment: give it \
             checks here"
        );
        assert_eq!(
            resource["metadata"]["namespace"].as_str(),
            Some(CONTROL_PLANE_NAMESPACE),
            "{kind} {name}"
        );
        workloads.insert((kind, name));
        assert_restricted(
            &format!("{kind} {name}"),
            &resource["spec"]["template"]["spec"],
        );
    }
    assert_eq!(
        workloads.len(),
        services.len(),
        "one Deployment per service: {workloads:?}"
    );
}

#[test]
fn k8s_node_agents_run_runplane_node_each_under_its_own_id() {
    let built = render::kustomize(&k8s().join("overlays/production"));
    let config_maps = base_config_maps(&built);
    let nodes: Vec<render::Workload> = render::workloads(&built)
        .into_iter()
        .filter(|w| w.runs_agents())
        .collect();
    assert!(!nodes.is_empty(), "production runs no node agent");
    let mut ids = BTreeSet::new();
    for node in &nodes {
        let origin = node.origin();
        assert!(
            selects(&labels(&node.pod["metadata"]["labels"]), &node.labels()),
            "{origin}: its pods carry its labels"
        );
        // No Service of a runplane service selects the agents.
        for name in serve_names() {
            let service = find(&built, "Service", &name);
            assert!(
                !selects(&labels(&service["spec"]["selector"]), &node.labels()),
                "Service {name} selects {origin}"
            );
        }
        let containers = node.containers();
        assert_eq!(containers.len(), 1, "{origin}: one container");
        let container = containers[0];
        let command: Vec<String> = strings(&container["command"])
            .into_iter()
            .chain(strings(&container["args"]))
            .filter(|arg| arg != "runplane")
            .collect();
        assert_eq!(
            command,
            ["node", "--token-file=/etc/runplane/node-credential/token"],
            "{origin} runs `runplane node` with its node's own credential, from a file"
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
                "{origin}: {probe} can only exec, `runplane node` serves no health service"
            );
        }
        for (section, key) in [
            ("requests", "cpu"),
            ("requests", "memory"),
            ("limits", "memory"),
        ] {
            assert!(
                !container["resources"][section][key].is_null(),
                "{origin} needs resources.{section}.{key}"
            );
        }

        let env = container_environment(&node.pod, container, &config_maps);
        assert_valid_config(&origin, &env);
        let config = load_config(&env).expect("a valid config");
        assert!(
            ids.insert(config.node.id.clone()),
            "two node agents register as {}",
            config.node.id
        );
        assert_eq!(
            node.name,
            format!("{NODE_AGENTS}-{}", config.node.id),
            "{origin}: named after its node id"
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
            format!("http://sandbox-reconciler.{CONTROL_PLANE_NAMESPACE}.svc:{PORT}"),
            "the agents dial the reconciler's Service in the control plane's namespace"
        );
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
        let volume = node.spec()["volumes"]
            .as_sequence()
            .into_iter()
            .flatten()
            .find(|v| v["name"].as_str() == Some(volume_name))
            .unwrap_or_else(|| panic!("volumeMount {volume_name} names no volume"));
        assert!(
            !volume["emptyDir"].is_null(),
            "the node's state directory is on an emptyDir"
        );
    }
}

#[test]
fn k8s_reconciler_runs_no_local_sandboxes_when_it_can_have_several_replicas() {
    let name = "sandbox-reconciler";
    let base = resources(&k8s().join("base"));
    let deployment = find(&base, "Deployment", name);
    let hpa = find(&base, "HorizontalPodAutoscaler", name);
    let pod = &deployment["spec"]["template"];
    let container = &pod["spec"]["containers"][0];
    let base_replicas = deployment["spec"]["replicas"].as_u64().unwrap_or(1);
    let base_hpa_max = hpa["spec"]["maxReplicas"].as_u64().expect("maxReplicas");
    let base_env = container_environment(pod, container, &base_config_maps(&base));
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
        pod,
        container,
        &overlay_config_maps(&overlay_dir, &overlay, &base),
    );
    assert_no_local_sandboxes_with_replicas("k8s production", replicas.max(hpa_max), &env);

    // With local sandboxes off, a queued run waits for a node agent: there must be some.
    let config = load_config(&env).expect("a valid config");
    if !config.sandbox_reconciler.local_sandboxes {
        let built = render::kustomize(&overlay_dir);
        assert!(
            render::workloads(&built).iter().any(|w| w.runs_agents()),
            "production runs no node agent, and the reconciler no local sandbox"
        );
    }
}

// --- runplane config ----------------------------------------------------------------

#[test]
fn the_config_check_catches_a_misspelt_field_and_a_bad_value() {
    let mut env: BTreeMap<String, String> = [
        ("RUNPLANE_SERVER__LISTEN", "0.0.0.0:7070".to_owned()),
        (
            "RUNPLANE_AUTH__OPERATOR_TOKEN_SHA256",
            secret_stand_in("runplane-token-digests", "operator-token-sha256"),
        ),
        (
            "RUNPLANE_AUTH__SERVICE_TOKENS__RUN_STORE",
            secret_stand_in("runplane-run-store", "service-token"),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
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
