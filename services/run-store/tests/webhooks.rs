//! Lifecycle webhooks as the run store owes them, on Postgres and on SQLite: each event
//! is written in the transaction of the run's change, once per endpoint whose filters
//! take it, and once however often the change is replayed. (Delivery itself is tested
//! end to end in integration-tests/tests/webhooks.rs.)

#[macro_use]
mod common;

use common::*;
use runplane_proto::runstore::v1 as runstore_pb;

runplane_testkit::on_both_backends!(
    Owing::start =>
    a_backend_error_is_owed_after_the_failure_to_the_endpoints_that_take_it,
    a_replayed_verdict_owes_its_event_once,
    a_wait_for_input_is_owed_once_per_wait,
);

/// Two endpoints on a closed port (deliveries are retried, never made): one takes every
/// event of every org, the other only backend errors of another org.
fn two_endpoints(config: &mut runplane_config::Config) {
    let entry = |url: &str, events: &[&str], orgs: &[&str]| runplane_config::WebhookConfig {
        url: url.into(),
        secret: runplane_config::Secret::new("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"),
        events: events.iter().map(|e| e.to_string()).collect(),
        orgs: orgs.iter().map(|o| o.to_string()).collect(),
        allow_private_targets: true,
        ca_file: String::new(),
    };
    config.run_store.webhooks = vec![
        entry("http://127.0.0.1:1/all", &[], &[]),
        entry(
            "http://127.0.0.1:1/other",
            &["run.backend_error"],
            &["other-org"],
        ),
    ];
}

/// A run store owing webhooks to [`two_endpoints`].
struct Owing;

impl Owing {
    async fn start(backend: Backend) -> Harness {
        Harness::start_with(backend, two_endpoints).await
    }
}

/// (endpoint, event) of every delivery owed for `run_id`, oldest first.
async fn owed(h: &Harness, run_id: &str) -> Vec<(String, String)> {
    h.store
        .store()
        .webhook_deliveries(run_id)
        .await
        .unwrap()
        .into_iter()
        .map(|d| (d.endpoint_id, d.event_type))
        .collect()
}

async fn a_backend_error_is_owed_after_the_failure_to_the_endpoints_that_take_it(h: Harness) {
    let all = runplane_run_store::domain::webhook::endpoint_id("http://127.0.0.1:1/all");
    let (run_id, _) = h.running_run("owed-backend").await;
    let mark = runstore_pb::MarkBackendErrorRequest {
        run_id: run_id.clone(),
        idempotency_key: "owed-backend-turn-01".into(),
        kind: runstore_pb::BackendErrorKind::Error as i32,
        reason: "upstream 529 overloaded".into(),
        credential_id: "cred-a".into(),
        incident_id: "inc-1".into(),
        turn_id: "turn-1".into(),
    };
    let mut op = h.operator().await;
    op.mark_backend_error(mark.clone()).await.unwrap();
    let expected = [
        (all.clone(), "run.started".to_owned()),
        (all.clone(), "run.failed".to_owned()),
        (all.clone(), "run.backend_error".to_owned()),
    ];
    assert_eq!(
        owed(&h, &run_id).await,
        expected,
        "the other org's endpoint takes none"
    );
    // A replay owes nothing more.
    op.mark_backend_error(mark).await.unwrap();
    assert_eq!(owed(&h, &run_id).await, expected);
    let rows = h.store.store().webhook_deliveries(&run_id).await.unwrap();
    let body: serde_json::Value = serde_json::from_str(&rows[2].body).unwrap();
    assert_eq!(body["type"], "run.backend_error");
    assert_eq!(body["data"]["state"], "backend_error");
    assert_eq!(body["data"]["org_id"], "acme");
    assert_eq!(body["data"]["verdict"]["reason"], "backend_error");
}

async fn a_replayed_verdict_owes_its_event_once(h: Harness) {
    let (run_id, key) = h.running_run("owed-replay").await;
    let mut runner = h.runner(&key).await;
    submit(&mut runner, &run_id, succeeded()).await.unwrap();
    submit(&mut runner, &run_id, succeeded()).await.unwrap();
    let events: Vec<String> = owed(&h, &run_id)
        .await
        .into_iter()
        .map(|(_, e)| e)
        .collect();
    assert_eq!(events, ["run.started", "run.succeeded"]);
}

async fn a_wait_for_input_is_owed_once_per_wait(h: Harness) {
    let (run_id, _) = h.running_run("owed-waiting").await;
    let mut svc = h.operator_with(runplane_testkit::SERVICE_TOKEN).await;
    let report = |seq: u64, waiting: bool| runstore_pb::ReportWaitingForInputRequest {
        run_id: run_id.clone(),
        execution_generation: 1,
        observation_seq: seq,
        waiting,
    };
    // Waiting, seen again, replayed: one wait. Working, then waiting again: a second.
    for (seq, waiting) in [(1, true), (2, true), (2, true), (3, false), (4, true)] {
        svc.report_waiting_for_input(report(seq, waiting))
            .await
            .unwrap();
    }
    let events: Vec<String> = owed(&h, &run_id)
        .await
        .into_iter()
        .map(|(_, e)| e)
        .collect();
    assert_eq!(
        events,
        [
            "run.started",
            "run.waiting_for_input",
            "run.waiting_for_input"
        ]
    );
}
