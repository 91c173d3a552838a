//! A cancel is part of the run's story: the run store's `run.cancel` span lands in the
//! trace the run was created in (its stored traceparent), and the cancellation is
//! counted in `runplane.runs.finished{state=cancelled}`. `runplane dev` exports to an
//! OTLP receiver inside this test.

use std::time::Duration;

use runplane_integration_tests::otlp::start_receiver;
use runplane_integration_tests::{channel, start_dev_with_env};
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_testkit::authed;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_joins_the_runs_trace_and_is_counted() {
    let (otlp, receiver) = start_receiver().await;
    let dir = tempfile::tempdir().unwrap();
    let dev = start_dev_with_env(
        dir.path(),
        &[
            ("RUNPLANE_SANDBOX_RECONCILER__DISPATCH", "false"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.as_str()),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
            ("OTEL_METRIC_EXPORT_INTERVAL", "300"),
        ],
    )
    .await;
    let token = std::fs::read_to_string(dir.path().join("operator-token"))
        .unwrap()
        .trim()
        .to_owned();
    let mut op = RunServiceClient::new(channel(&dev.endpoint()).await);
    let run = op
        .create_run(authed(
            runstore_pb::CreateRunRequest {
                client_request_id: "cancel-trace-run-0001".into(),
                org_id: "acme".into(),
                target: Some(runstore_pb::create_run_request::Target::CredentialId(
                    "local".into(),
                )),
                command: "true".into(),
                ..Default::default()
            },
            &token,
        ))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    let trace_id = run
        .traceparent
        .split('-')
        .nth(1)
        .expect("the run's trace")
        .to_owned();
    op.cancel_run(authed(
        runstore_pb::CancelRunRequest {
            run_id: run.id.clone(),
            reason: "traced cancel".into(),
            idempotency_key: "cancel-trace-key-0001".into(),
        },
        &token,
    ))
    .await
    .unwrap();

    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let cancel_in_trace = receiver
            .spans
            .lock()
            .unwrap()
            .iter()
            .any(|r| r.span.name == "run.cancel" && hex(&r.span.trace_id) == trace_id);
        let counted = receiver
            .sums
            .lock()
            .unwrap()
            .iter()
            .any(|(_, metric, attrs, value)| {
                metric == "runplane.runs.finished"
                    && attrs.iter().any(|(k, v)| k == "state" && v == "cancelled")
                    && *value >= 1.0
            });
        if cancel_in_trace && counted {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "run.cancel in trace {trace_id}: {cancel_in_trace}; counted: {counted}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
