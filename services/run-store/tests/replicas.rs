//! Two run-store replicas on one Postgres database, each on its own socket: a watcher or
//! a long poll on one is woken by a change made through the other (LISTEN/NOTIFY), not
//! by its 30 s re-check.

mod common;

use std::time::Duration;

use common::{Backend, Harness, line};
use runplane_proto::runstore::v1 as runstore_pb;
use tokio_stream::StreamExt;

/// Well under the 30 s re-check: only a wake-up from the other replica arrives this soon.
const WITHIN: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_on_one_replica_sees_an_append_made_on_another() {
    let a = Harness::start(Backend::postgres().await).await;
    let b = a.replica().await;
    let (run_id, key) = a.running_run("replicas-watch").await;
    let mut watch = b
        .operator()
        .await
        .watch_run(runstore_pb::WatchRunRequest {
            run_id: run_id.clone(),
            after_sequence: 0,
            states_only: false,
            heartbeat_interval: Some(prost_types::Duration {
                seconds: 60,
                nanos: 0,
            }),
        })
        .await
        .unwrap()
        .into_inner();
    // The first item is the run's snapshot; then the watcher waits.
    let first = watch.next().await.unwrap().unwrap();
    assert!(matches!(
        first.update,
        Some(runstore_pb::watch_run_response::Update::Run(_))
    ));
    let mut runner = a.runner(&key).await;
    for (i, text) in ["one", "two", "three"].into_iter().enumerate() {
        runner
            .append_events(runstore_pb::AppendEventsRequest {
                run_id: run_id.clone(),
                batch_key: format!("replicas-batch-{i:04}"),
                events: vec![line(text)],
            })
            .await
            .unwrap();
        let item = tokio::time::timeout(WITHIN, watch.next())
            .await
            .unwrap_or_else(|_| {
                panic!("event {text} not seen on the other replica within {WITHIN:?}")
            })
            .unwrap()
            .unwrap();
        match item.update {
            Some(runstore_pb::watch_run_response::Update::Event(e)) => assert_eq!(e.text, text),
            other => panic!("expected event {text}, got {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_poll_on_one_replica_wakes_for_a_message_enqueued_on_another() {
    let a = Harness::start(Backend::postgres().await).await;
    let b = a.replica().await;
    let (run_id, key) = a.running_run("replicas-poll").await;
    let mut runner = b.runner(&key).await;
    let poller = {
        let run_id = run_id.clone();
        tokio::spawn(async move {
            runner
                .poll_steering(runstore_pb::PollSteeringRequest {
                    run_id,
                    acks: vec![],
                    wait: Some(prost_types::Duration {
                        seconds: 25,
                        nanos: 0,
                    }),
                    max_messages: 0,
                })
                .await
                .unwrap()
                .into_inner()
        })
    };
    // Let the poll reach its wait before the steer.
    tokio::time::sleep(Duration::from_millis(500)).await;
    a.operator()
        .await
        .steer(runstore_pb::SteerRequest {
            run_id: run_id.clone(),
            text: "from the other replica".into(),
            idempotency_key: "replicas-steer-0001".into(),
        })
        .await
        .unwrap();
    let answer = tokio::time::timeout(WITHIN, poller)
        .await
        .expect("the long poll woke within 10 s")
        .unwrap();
    assert_eq!(answer.messages.len(), 1, "{answer:?}");
}
