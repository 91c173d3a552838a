//! `deploy/compose.yaml` and the collector and Prometheus configs it mounts from
//! `deploy/compose/`, checked without Docker: every service `runplane serve` accepts runs
//! on 7070 and knows every endpoint, every container's environment loads as a valid
//! runplane config, and the databases, Redis and the telemetry pipeline are wired.

mod deploy_common;

use std::collections::{BTreeMap, BTreeSet};

use serde_norway::Value;

use deploy_common::{
    PORT, assert_no_local_sandboxes_with_replicas, assert_valid_config, deploy, load_config, read,
    scalar, serve_names, str_of, strings, yaml,
};

/// Stand-ins for the compose variables of deploy/.env that have no default.
const COMPOSE_VARIABLES: [(&str, &str); 3] = [
    (
        "RUNPLANE_OPERATOR_TOKEN_SHA256",
        // SHA-256 of "test-operator-token-test-operator-token-0123".
        "a385cd2b1238e40c4629021cedd8afdac0361a5f6fbc683ce955c8fce9088072",
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

/// No container holds the operator token: they get its SHA-256 alone; the CLI keeps the
/// token in deploy/.env.
#[test]
fn no_container_gets_the_operator_token_itself() {
    let text = read(&deploy().join("compose.yaml"));
    for line in text.lines() {
        assert!(
            !line
                .trim_start()
                .starts_with("RUNPLANE_AUTH__OPERATOR_TOKEN:"),
            "compose.yaml hands a container the operator token: {line}"
        );
    }
    assert!(text.contains("RUNPLANE_AUTH__OPERATOR_TOKEN_SHA256:"));
}
