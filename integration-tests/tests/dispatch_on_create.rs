//! A new run is dispatched when it is created, not at the reconciler's next round: on the
//! split topology (each service its own `runplane serve`, on Postgres and Redis) with the
//! round set to a minute, a run of `true` still ends within seconds. The reconciler holds a
//! WaitForRuns long poll on the run store, which answers when a run is created.

use std::time::Duration;

use runplane_integration_tests::split::{Split, TOKEN};
use runplane_integration_tests::{channel, wait_for};
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_testkit::authed;

/// Far below the one-minute round: only a dispatch on creation ends the runs this soon.
const WITHIN: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_are_dispatched_on_creation_not_at_the_next_round() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("runplane.toml");
    std::fs::write(
        &config,
        r#"
[[credential_health.profiles]]
name = "default"
credential_id = "local"
capacity = 8
error_pattern = "API Error:"
exhausted_pattern = "quota exceeded"
"#,
    )
    .unwrap();
    let split = Split::start(
        Some(&config),
        &dir.path().join("sandboxes"),
        &[("RUNPLANE_SANDBOX_RECONCILER__TICK_INTERVAL_MS", "60000")],
    )
    .await;
    let mut runs = RunServiceClient::new(channel(&split.url("run-store")).await);
    // Two runs, one after the other: the second comes after the first dispatch, on the
    // next long poll.
    for i in 0..2 {
        let run = runs
            .create_run(authed(
                runstore_pb::CreateRunRequest {
                    client_request_id: format!("dispatch-on-create-{i}"),
                    org_id: "acme".into(),
                    target: Some(runstore_pb::create_run_request::Target::Profile(
                        "default".into(),
                    )),
                    command: "true".into(),
                    ..Default::default()
                },
                TOKEN,
            ))
            .await
            .unwrap()
            .into_inner()
            .run
            .unwrap();
        let mut last = runstore_pb::RunState::Queued;
        wait_for(
            &format!("run {i} to end though the round is a minute away"),
            WITHIN,
            async || {
                last = runs
                    .get_run(authed(
                        runstore_pb::GetRunRequest {
                            run_id: run.id.clone(),
                        },
                        TOKEN,
                    ))
                    .await
                    .unwrap()
                    .into_inner()
                    .run
                    .unwrap()
                    .state();
                last.is_terminal()
            },
        )
        .await;
        assert_eq!(last, runstore_pb::RunState::Succeeded, "run {i}");
    }
}
