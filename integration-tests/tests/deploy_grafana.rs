//! The Grafana provisioning under `deploy/compose/grafana/`, checked without Docker: the
//! dashboard queries only metrics the services export, and only the provisioned data
//! sources.

mod deploy_common;

use std::collections::BTreeSet;

use deploy_common::{deploy, read, yaml};

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
