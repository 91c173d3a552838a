//! One run, one trace: the four services as separate `runplane serve` processes export
//! spans over OTLP to a receiver inside this test; one `runplane run` must come back as a
//! single trace tree whose spans come from at least three services, each span's parent
//! in the same trace, and no run key or token in any attribute (the real key is read from
//! the runner's memory while it runs, and searched for). Metrics take the same path:
//! the run store's run counters arrive at the receiver too.

use std::collections::{BTreeSet, HashMap};
use std::process::Stdio;
use std::time::Duration;

use runplane_integration_tests::otlp::{Received, attribute, attributes, start_receiver, text};
use runplane_integration_tests::sandboxes::run_key_in_memory;
use runplane_integration_tests::{runplane_bin, start_serve};
use runplane_testkit::{TestDatabase, TestRedis, free_local_addr};
use tokio::io::{AsyncBufReadExt, BufReader};

const TOKEN: &str = "traces-operator-token-0123456789abcdef01234";
const RECEIPT_KEY: &str = "0101010101010101010101010101010101010101010101010101010101010101";

/// The run key of `run_id`'s runner, read from its memory while it runs (it is in no
/// environment: the driver hands it down a pipe).
async fn runner_key(run_id: &str) -> String {
    let wanted = format!("RUNPLANE_RUN_ID={run_id}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(entries) = std::fs::read_dir("/proc") {
            for entry in entries.flatten() {
                let Ok(environ) = std::fs::read(entry.path().join("environ")) else {
                    continue;
                };
                let runner = environ.split(|b| *b == 0).any(|v| v == wanted.as_bytes());
                if let Some(key) = runner
                    .then(|| entry.file_name().to_str()?.parse().ok())
                    .flatten()
                    .and_then(run_key_in_memory)
                {
                    return key;
                }
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no runner process of {run_id} found"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_runplane_run_is_one_trace_across_the_services_with_no_secret_in_it() {
    let (otlp, receiver) = start_receiver().await;
    let (run_db, reconciler_db, health_db) = (
        TestDatabase::new().await,
        TestDatabase::new().await,
        TestDatabase::new().await,
    );
    let redis = TestRedis::new().await;
    let state = tempfile::tempdir().unwrap();
    let addrs: HashMap<&str, String> = [
        "run-store",
        "sandbox-reconciler",
        "stream-recovery",
        "credential-health",
    ]
    .into_iter()
    .map(|s| (s, free_local_addr().to_string()))
    .collect();
    let url = |s: &str| format!("http://{}", addrs[s]);
    let common: Vec<(String, String)> = vec![
        ("RUNPLANE_AUTH__OPERATOR_TOKEN".into(), TOKEN.into()),
        (
            "RUNPLANE_RUN_STORE__DATABASE_URL".into(),
            run_db.url().into(),
        ),
        (
            "RUNPLANE_RUN_STORE__RECEIPT_SIGNING_KEY".into(),
            RECEIPT_KEY.into(),
        ),
        ("RUNPLANE_RUN_STORE__ENDPOINT".into(), url("run-store")),
        (
            "RUNPLANE_SANDBOX_RECONCILER__DATABASE_URL".into(),
            reconciler_db.url().into(),
        ),
        (
            "RUNPLANE_SANDBOX_RECONCILER__ENDPOINT".into(),
            url("sandbox-reconciler"),
        ),
        (
            "RUNPLANE_SANDBOX_RECONCILER__STATE_DIR".into(),
            state.path().display().to_string(),
        ),
        (
            "RUNPLANE_SANDBOX_RECONCILER__TICK_INTERVAL_MS".into(),
            "200".into(),
        ),
        (
            "RUNPLANE_STREAM_RECOVERY__REDIS_URL".into(),
            redis.url().into(),
        ),
        (
            "RUNPLANE_STREAM_RECOVERY__KEY_PREFIX".into(),
            redis.prefix().into(),
        ),
        (
            "RUNPLANE_STREAM_RECOVERY__ENDPOINT".into(),
            url("stream-recovery"),
        ),
        (
            "RUNPLANE_CREDENTIAL_HEALTH__DATABASE_URL".into(),
            health_db.url().into(),
        ),
        (
            "RUNPLANE_CREDENTIAL_HEALTH__ENDPOINT".into(),
            url("credential-health"),
        ),
        ("OTEL_EXPORTER_OTLP_ENDPOINT".into(), otlp.clone()),
        ("OTEL_BSP_SCHEDULE_DELAY".into(), "100".into()),
        ("OTEL_METRIC_EXPORT_INTERVAL".into(), "300".into()),
    ];
    let mut processes = Vec::new();
    for (service, addr) in &addrs {
        let mut env: Vec<(&str, &str)> = common
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        env.push(("RUNPLANE_SERVER__LISTEN", addr.as_str()));
        processes.push(start_serve(&[service], &env).await);
    }

    let token_file = state.path().join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let mut cli = tokio::process::Command::new(runplane_bin())
        .args([
            "run",
            "--endpoint",
            &url("run-store"),
            "--lead",
            "trace-lead",
        ])
        .arg("--token-file")
        .arg(&token_file)
        .args(["--", "sh", "-c", "echo hello; sleep 2; echo bye"])
        .env_remove("RUNPLANE_CONFIG")
        .env_remove("RUNPLANE_TOKEN")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(cli.stderr.take().unwrap()).lines();
    let mut run_id = String::new();
    while let Ok(Some(line)) = tokio::time::timeout(Duration::from_secs(30), stderr.next_line())
        .await
        .unwrap()
    {
        if let Some(rest) = line.strip_prefix("runplane: run ") {
            run_id = rest.trim_end_matches(" created").to_owned();
            break;
        }
    }
    assert!(!run_id.is_empty(), "runplane run printed its run id");
    let key = runner_key(&run_id).await;
    let status = tokio::time::timeout(Duration::from_secs(60), cli.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "the run succeeded");

    // Spans arrive in batches; wait until the runner's verdict is in.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let spans = loop {
        let spans = receiver.spans.lock().unwrap().clone();
        let done = spans
            .iter()
            .any(|r| r.span.name.ends_with("RunnerService/SubmitResult"))
            && spans.iter().any(|r| r.span.name == "runner.run");
        // Each process flushes its own batches: a span can arrive before its parent from
        // another process. Wait until every parent that was named has arrived too.
        let run_trace = spans
            .iter()
            .find(|r| r.span.name == "runplane.runstore.v1.RunService/CreateRun")
            .map(|r| r.span.trace_id.clone());
        let ids: BTreeSet<&[u8]> = spans.iter().map(|r| r.span.span_id.as_slice()).collect();
        let parents_in = spans
            .iter()
            .filter(|r| Some(&r.span.trace_id) == run_trace.as_ref())
            .all(|r| {
                r.span.parent_span_id.is_empty() || ids.contains(r.span.parent_span_id.as_slice())
            });
        if (done && parents_in) || tokio::time::Instant::now() > deadline {
            break spans;
        }
        drop(spans);
        tokio::time::sleep(Duration::from_millis(200)).await;
    };

    let create = spans
        .iter()
        .find(|r| {
            r.span.name == "runplane.runstore.v1.RunService/CreateRun"
                || (r.span.name == "create_run" && attribute(&r.span, "credential_id") == "local")
        })
        .unwrap_or_else(|| panic!("no CreateRun span among {} spans", spans.len()));
    let trace_id = create.span.trace_id.clone();
    let trace: Vec<&Received> = spans
        .iter()
        .filter(|r| r.span.trace_id == trace_id)
        .collect();
    let names: BTreeSet<&str> = trace.iter().map(|r| r.span.name.as_str()).collect();
    let services: BTreeSet<&str> = trace.iter().map(|r| r.service.as_str()).collect();
    for expected in [
        "runplane.runstore.v1.RunService/CreateRun",
        "runplane.credentials.v1.CredentialHealthService/CheckAdmission",
        "sandbox.launch",
        "runplane.runstore.v1.RunService/IssueRunKey",
        "runner.run",
        "runplane.runstore.v1.RunnerService/Hello",
        "runplane.runstore.v1.RunnerService/AppendEvents",
        "runplane.runstore.v1.RunnerService/PollSteering",
        "runplane.runstore.v1.RunnerService/SubmitResult",
    ] {
        assert!(
            names.contains(expected),
            "{expected} missing from the run's trace: {names:?}"
        );
    }
    assert!(services.len() >= 3, "spans from {services:?}");
    // The runner streams its output to the coordinator it was told of, not to the run
    // store's address.
    assert!(
        trace.iter().any(|r| r.span.name
            == "runplane.recovery.v1.StreamRecoveryService/AcquireLease"
            && r.service == "runplane-stream-recovery"),
        "no lease taken at the stream recovery coordinator"
    );
    for service in [
        "runplane-run-store",
        "runplane-credential-health",
        "runplane-sandbox-reconciler",
        "runplane-stream-recovery",
        "runplane-runner",
    ] {
        assert!(
            services.contains(service),
            "{service} missing: {services:?}"
        );
    }

    // One tree: one root, every other span's parent in the same trace.
    let ids: BTreeSet<&[u8]> = trace.iter().map(|r| r.span.span_id.as_slice()).collect();
    let roots: Vec<&str> = trace
        .iter()
        .filter(|r| r.span.parent_span_id.is_empty())
        .map(|r| r.span.name.as_str())
        .collect();
    assert_eq!(roots.len(), 1, "roots: {roots:?}");
    for r in &trace {
        if !r.span.parent_span_id.is_empty() {
            assert!(
                ids.contains(r.span.parent_span_id.as_slice()),
                "{} ({}) has a parent outside the trace",
                r.span.name,
                r.service
            );
        }
    }
    // Ids that make a span findable are on the spans.
    let launch = trace
        .iter()
        .find(|r| r.span.name == "sandbox.launch")
        .unwrap();
    assert_eq!(attribute(&launch.span, "run_id"), run_id);
    assert!(!attribute(&launch.span, "sandbox_id").is_empty());
    assert_eq!(attribute(&launch.span, "node_id"), "local");

    // Background rounds (the reconciler's dispatch poll and tick) are not traces of
    // their own: they would bury runs' traces under one root per tick.
    for noisy in ["reconcile.tick", "runplane.runstore.v1.RunService/ListRuns"] {
        assert!(
            !spans.iter().any(|r| r.span.name == noisy),
            "{noisy} was exported"
        );
    }

    // No secret anywhere in what was exported, in any trace.
    for r in &spans {
        for kv in attributes(&r.span) {
            let value = text(kv.value.as_ref());
            assert!(
                !value.contains(&key) && !value.contains(TOKEN),
                "a secret in {}.{} of {}",
                r.span.name,
                kv.key,
                r.service
            );
        }
        assert!(!r.span.name.contains(&key));
    }

    // Metrics go the same way: the run store counted the run's creation and its end.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let sums = receiver.sums.lock().unwrap().clone();
        let seen = |name: &str, attr: Option<(&str, &str)>| {
            sums.iter().any(|(service, metric, attrs, value)| {
                service == "runplane-run-store"
                    && metric == name
                    && *value >= 1.0
                    && attr.is_none_or(|(k, v)| attrs.iter().any(|(ak, av)| ak == k && av == v))
            })
        };
        if seen("runplane.runs.created", None)
            && seen("runplane.runs.finished", Some(("state", "succeeded")))
            && seen("runplane.events.appended", None)
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "run metrics not exported: {:?}",
            sums.iter()
                .map(|(s, m, a, v)| format!("{s} {m} {a:?} {v}"))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(processes);
}
