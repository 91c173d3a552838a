//! Two `runplane serve run-store` processes on one Postgres, as two replicas behind a
//! balancer are: a watcher on one sees an event appended through the other at once,
//! woken by the other replica's notification, not by the 30 s re-check.

use std::time::Duration;

use runplane_integration_tests::{channel, start_serve};
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_proto::runstore::v1::runner_service_client::RunnerServiceClient;
use runplane_testkit::TestDatabase;
use runplane_testkit::authed;

const TOKEN: &str = "watch-replicas-operator-token-0123456789ab";
const RECEIPT_KEY: &str = "0303030303030303030303030303030303030303030303030303030303030303";
/// Well under the re-check (30 s): only a wake-up from the other process is this quick.
const WITHIN: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_on_one_serve_process_sees_an_append_made_through_another() {
    let db = TestDatabase::new().await;
    let env = [
        ("RUNPLANE_SERVER__LISTEN", "127.0.0.1:0"),
        ("RUNPLANE_AUTH__OPERATOR_TOKEN", TOKEN),
        ("RUNPLANE_RUN_STORE__DATABASE_URL", db.url()),
        ("RUNPLANE_RUN_STORE__RECEIPT_SIGNING_KEY", RECEIPT_KEY),
        ("RUNPLANE_RUN_STORE__ADMISSION", "false"),
    ];
    let a = start_serve(&["run-store"], &env).await;
    let b = start_serve(&["run-store"], &env).await;
    let (to_a, to_b) = (channel(&a.endpoint()).await, channel(&b.endpoint()).await);

    let mut operator = RunServiceClient::new(to_a.clone());
    let run_id = operator
        .create_run(authed(
            runstore_pb::CreateRunRequest {
                client_request_id: "watch-replicas-run-0001".into(),
                org_id: "org".into(),
                lead_id: "lead".into(),
                target: Some(runstore_pb::create_run_request::Target::CredentialId(
                    "c".into(),
                )),
                command: "agent".into(),
                ..Default::default()
            },
            TOKEN,
        ))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap()
        .id;
    let key = operator
        .issue_run_key(authed(
            runstore_pb::IssueRunKeyRequest {
                run_id: run_id.clone(),
                sandbox_id: "sbx".into(),
                sandbox_generation: 1,
                idempotency_key: format!("key-{run_id}"),
                ..Default::default()
            },
            TOKEN,
        ))
        .await
        .unwrap()
        .into_inner()
        .run_key;

    let mut watch = RunServiceClient::new(to_b)
        .watch_run(authed(
            runstore_pb::WatchRunRequest {
                run_id: run_id.clone(),
                heartbeat_interval: Some(prost_types::Duration {
                    seconds: 60,
                    nanos: 0,
                }),
                ..Default::default()
            },
            TOKEN,
        ))
        .await
        .unwrap()
        .into_inner();
    // The snapshot first; after it the watcher on B is waiting.
    let first = watch.message().await.unwrap().unwrap();
    assert!(matches!(
        first.update,
        Some(runstore_pb::watch_run_response::Update::Run(_))
    ));

    RunnerServiceClient::new(to_a)
        .append_events(authed(
            runstore_pb::AppendEventsRequest {
                run_id: run_id.clone(),
                batch_key: "watch-replicas-batch-1".into(),
                events: vec![runstore_pb::EventInput {
                    kind: runstore_pb::EventKind::Stdout as i32,
                    text: "hello from replica a".into(),
                    ..Default::default()
                }],
            },
            &key,
        ))
        .await
        .unwrap();
    let seen = tokio::time::timeout(WITHIN, async {
        loop {
            let item = watch
                .message()
                .await
                .unwrap()
                .expect("the watch stays open");
            if let Some(runstore_pb::watch_run_response::Update::Event(e)) = item.update {
                return e;
            }
        }
    })
    .await
    .unwrap_or_else(|_| {
        panic!("the watcher on replica B did not see A's append within {WITHIN:?}")
    });
    assert_eq!(seen.sequence, 1);
    assert_eq!(seen.text, "hello from replica a");
}
