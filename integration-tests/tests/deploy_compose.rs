//! `deploy/compose.yaml` and the configs it mounts from `deploy/compose/`, read: every
//! service `runplane serve` accepts runs on 7070 and knows every endpoint, every
//! container's environment (with deploy/.env as `compose/make-env` writes it) loads as a
//! valid runplane config, each secret is only where it is needed, agents run only on the
//! node agent, and the databases, Redis and the telemetry pipeline are wired.
//! `scripts/compose-smoke` brings the stack up for real.

mod deploy_common;

use std::collections::{BTreeMap, BTreeSet};

use serde_norway::Value;

use deploy_common::{
    PORT, assert_no_local_sandboxes_with_replicas, assert_valid_config, deploy, load_config, read,
    scalar, serve_names, str_of, strings, yaml,
};

/// The compose variables without a default, as deploy/.env has them: the output of
/// `deploy/compose/make-env`, which the README tells operators to run (fresh secrets).
fn compose_variables() -> &'static BTreeMap<String, String> {
    static VARIABLES: std::sync::OnceLock<BTreeMap<String, String>> = std::sync::OnceLock::new();
    VARIABLES.get_or_init(|| {
        let out = std::process::Command::new(deploy().join("compose/make-env"))
            .output()
            .expect("running deploy/compose/make-env (needs bash, openssl, sha256sum)");
        assert!(out.status.success(), "make-env: {out:?}");
        String::from_utf8(out.stdout)
            .expect("make-env prints text")
            .lines()
            .filter(|line| !line.starts_with('#'))
            .filter_map(|line| line.split_once('='))
            .map(|(name, value)| (name.to_owned(), value.to_owned()))
            .collect()
    })
}

fn compose() -> Value {
    yaml(&deploy().join("compose.yaml"))
}

fn compose_services(compose: &Value) -> &serde_norway::Mapping {
    compose["services"]
        .as_mapping()
        .expect("compose.yaml has services")
}

/// `${NAME}`, `${NAME:-default}`, `${NAME-default}`, `${NAME:?error}` and `${NAME?error}`
/// replaced as compose would: the default, or the variable from deploy/.env (as
/// make-env writes it). Returns the names without a default too.
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
                let value = compose_variables().get(name).unwrap_or_else(|| {
                    panic!("compose variable {name} has no default and deploy/compose/make-env does not write it")
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

/// The user of `scheme://user[:password]@host...`.
fn url_user(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let userinfo = rest.split_once('@').map_or("", |(u, _)| u);
    userinfo.split(':').next().unwrap_or_default().to_owned()
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

/// The compose services whose command is `runplane node`: where agents run.
fn node_agents(services: &serde_norway::Mapping) -> Vec<(String, &Value)> {
    services
        .iter()
        .filter(|(_, s)| strings(&s["command"]).first().map(String::as_str) == Some("node"))
        .map(|(name, s)| (str_of(name, "a service name").to_owned(), s))
        .collect()
}

fn networks(service: &Value) -> Vec<String> {
    strings(&service["networks"])
}

/// `ROLE` of a service: RUN_STORE for run-store, ...
fn role(name: &str) -> String {
    name.replace('-', "_").to_uppercase()
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
            let var = format!("RUNPLANE_{}__ENDPOINT", role(&other));
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
        // podman-compose starts what a service depends on first, whatever the condition;
        // a service up before its database retries (restart: unless-stopped).
        let depends = strings(&service["depends_on"]);
        for dependency in ["postgres", "redis"] {
            assert!(
                depends.iter().any(|d| d == dependency),
                "{name} should start after {dependency}"
            );
        }
        assert_eq!(
            service["restart"].as_str(),
            Some("unless-stopped"),
            "{name}"
        );
        assert_valid_config(&format!("compose service {name}"), &env);
    }

    let make_env = compose_variables();
    for name in &without_default {
        assert!(
            make_env.contains_key(name),
            "compose needs ${{{name}}}: deploy/compose/make-env should write it"
        );
    }
}

/// Each service holds its own service token and the others' digests; none holds another
/// service's token, the shared one or the operator token; the node holds none at all.
#[test]
fn each_service_holds_only_its_own_token_and_the_node_only_its_credential() {
    let compose = compose();
    let services = compose_services(&compose);
    let text = read(&deploy().join("compose.yaml"));
    for line in text.lines().map(str::trim_start) {
        assert!(
            !line.starts_with("RUNPLANE_AUTH__OPERATOR_TOKEN:")
                && !line.starts_with("RUNPLANE_AUTH__SERVICE_TOKEN:"),
            "compose.yaml hands a container the operator token or the shared service token: {line}"
        );
    }
    for name in serve_names() {
        let env = compose_environment(&services[name.as_str()], &mut BTreeSet::new());
        let own = format!("RUNPLANE_AUTH__SERVICE_TOKENS__{}", role(&name));
        assert!(env.contains_key(&own), "{name} needs its own token {own}");
        for other in serve_names() {
            let digest = format!("RUNPLANE_AUTH__SERVICE_TOKEN_SHA256__{}", role(&other));
            let token = format!("RUNPLANE_AUTH__SERVICE_TOKENS__{}", role(&other));
            if other == name {
                assert!(
                    !env.contains_key(&digest),
                    "{name}: {digest} and its own token"
                );
            } else {
                assert!(
                    env.contains_key(&digest),
                    "{name} admits {other} by {digest}"
                );
                assert!(!env.contains_key(&token), "{name} holds {other}'s token");
            }
        }
        assert!(
            env.contains_key("RUNPLANE_AUTH__OPERATOR_TOKEN_SHA256"),
            "{name}"
        );
    }
    let nodes = node_agents(services);
    assert!(!nodes.is_empty(), "compose runs no node agent");
    for (name, node) in nodes {
        let env = compose_environment(node, &mut BTreeSet::new());
        for (var, value) in &env {
            assert!(
                !var.starts_with("RUNPLANE_AUTH__")
                    && !var.ends_with("__DATABASE_URL")
                    && !var.ends_with("__REDIS_URL")
                    && !var.contains("SIGNING_KEY")
                    && !var.contains("PASSWORD")
                    && !var.contains("TOKEN"),
                "node agent {name} holds a control-plane secret: {var}"
            );
            for secret in compose_variables().values() {
                assert!(
                    !value.contains(secret.as_str()),
                    "node agent {name}'s {var} holds a secret of deploy/.env"
                );
            }
        }
        // Its credential is a secret file of its own; it mounts nothing of deploy/.
        let secrets = strings(&node["secrets"]);
        assert_eq!(secrets, [format!("{name}-token")], "{name}'s secrets");
        assert_eq!(
            strings(&node["command"]),
            [
                "node",
                "--token-file",
                &format!("/run/secrets/{name}-token")
            ]
        );
        for volume in strings(&node["volumes"]) {
            assert!(
                !volume.starts_with('.') && !volume.contains(".env"),
                "node agent {name} mounts {volume}"
            );
        }
        assert_valid_config(&format!("node agent {name}"), &env);
    }
}

/// Agents run only on node agents, each in a container of its own: no reconciler runs
/// local sandboxes, nothing sets isolation `none`, the node uses the container driver.
#[test]
fn agents_run_only_on_node_agents_in_containers() {
    let compose = compose();
    let services = compose_services(&compose);
    let text = read(&deploy().join("compose.yaml"));
    assert!(
        !text.contains("ISOLATION") && !text.contains("LOCAL_SANDBOXES_BESIDE_SECRETS"),
        "compose.yaml names an isolation or keeps agents beside secrets"
    );
    let reconciler = compose_environment(&services["sandbox-reconciler"], &mut BTreeSet::new());
    let config = load_config(&reconciler).expect("a valid config");
    assert!(
        !config.sandbox_reconciler.local_sandboxes,
        "the reconciler holds secrets: it must not run agents (LOCAL_SANDBOXES=false)"
    );
    let replicas = services["sandbox-reconciler"]["deploy"]["replicas"]
        .as_u64()
        .unwrap_or(1);
    assert_no_local_sandboxes_with_replicas("compose", replicas, &reconciler);
    for (name, node) in node_agents(services) {
        let env = compose_environment(node, &mut BTreeSet::new());
        let config = load_config(&env).expect("a valid node config");
        assert_eq!(
            config.sandbox_reconciler.driver,
            runplane_config::DriverKind::Container,
            "{name} contains its agents in containers"
        );
        assert!(
            env.contains_key("RUNPLANE_SANDBOX_RECONCILER__CONTAINER__IMAGE"),
            "{name} names its agents' image"
        );
        // The engine's socket is the node's alone.
        assert!(
            strings(&node["volumes"])
                .iter()
                .any(|v| v.ends_with(":/run/runplane-engine.sock")),
            "{name} gets the engine socket"
        );
    }
    for (name, service) in services {
        let name = str_of(name, "a service name");
        if node_agents(services).iter().all(|(n, _)| n != name) {
            assert!(
                !strings(&service["volumes"])
                    .iter()
                    .any(|v| v.contains("engine.sock") || v.contains("docker.sock")),
                "{name} gets the engine socket"
            );
        }
    }
}

/// The databases sit on an internal network with the services alone; a node agent is
/// never on it, and reaches only the services.
#[test]
fn databases_are_on_an_internal_network_no_node_joins() {
    let compose = compose();
    let services = compose_services(&compose);
    let data = &compose["networks"]["data"];
    assert_eq!(data["internal"].as_bool(), Some(true), "`data` is internal");
    for database in ["postgres", "redis"] {
        assert_eq!(networks(&services[database]), ["data"], "{database}");
        assert!(
            services[database]["ports"].is_null(),
            "{database} publishes a port"
        );
    }
    for (name, node) in node_agents(services) {
        assert!(
            !networks(node).iter().any(|n| n == "data"),
            "node agent {name} is on the databases' network"
        );
        for network in networks(node) {
            for (other, service) in services {
                let other = str_of(other, "a service name");
                if networks(service).contains(&network) && other != name {
                    assert!(
                        serve_names().iter().any(|s| s == other),
                        "node agent {name} shares network {network} with {other}"
                    );
                }
            }
        }
    }
}
#[test]
fn compose_databases_redis_and_observability_are_wired() {
    let compose = compose();
    let services = compose_services(&compose);
    let image = |name: &str| str_of(&services[name]["image"], "an image").to_owned();
    assert!(image("postgres").contains("runplane-postgres:"));
    assert!(image("redis").contains("runplane-redis:"));
    for (name, file) in [
        ("postgres", "images/postgres.Containerfile"),
        ("redis", "images/redis.Containerfile"),
    ] {
        assert_eq!(
            str_of(&services[name]["build"]["dockerfile"], "a Containerfile"),
            file
        );
        assert!(deploy().join(file).exists(), "{file}");
    }
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

    // One server, one role and one database per Postgres-backed service: the init script
    // creates exactly the databases the URLs name, each owned by the role that reaches it.
    let init = read(&deploy().join("compose/postgres-init.sql"));
    let created: BTreeSet<String> = init
        .lines()
        .filter_map(|line| line.trim().strip_prefix("CREATE DATABASE "))
        .map(|rest| rest.trim_end_matches(';').replace(" OWNER ", "@"))
        .collect();
    let mut used = BTreeSet::new();
    let mut unused = BTreeSet::new();
    for name in serve_names() {
        let env = compose_environment(&services[name.as_str()], &mut unused);
        for (var, value) in &env {
            if var.ends_with("__DATABASE_URL") {
                let (host, port, database) = url_parts(value);
                assert_eq!((host.as_str(), port), ("postgres", 5432), "{var}");
                let user = url_user(value);
                assert_ne!(user, "postgres", "{name} connects as the superuser");
                used.insert(format!("{database}@{user}"));
            }
            if var == "RUNPLANE_STREAM_RECOVERY__REDIS_URL" {
                let (host, port, _) = url_parts(value);
                assert_eq!((host.as_str(), port), ("redis", 6379), "{var}");
                assert_eq!(
                    value
                        .split_once("://")
                        .and_then(|(_, r)| r.split_once('@'))
                        .map(|(a, _)| a),
                    Some(format!(":{}", compose_variables()["REDIS_PASSWORD"]).as_str()),
                    "stream recovery authenticates to Redis"
                );
            }
        }
    }
    assert_eq!(created, used, "postgres-init.sql vs the database URLs");
    let redis = compose_environment(&services["redis"], &mut unused);
    assert!(
        redis.contains_key("REDIS_PASSWORD"),
        "Redis requires a password"
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
