//! The retrying transport against servers that stall: attempt deadlines, long polls, and
//! failing over from a replica that accepts connections and never answers.

use std::sync::atomic::Ordering;
use std::time::Duration;

use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::runner_service_client::RunnerServiceClient;
use runplane_transport::{RetryConfig, RetryLayer};
use tonic::Code;

mod common;
use common::*;

/// Accepts TCP connections and never says a word: a wedged replica, or a balancer in
/// front of one. The sockets are kept open, never read.
async fn silent() -> (String, tokio::task::JoinHandle<()>) {
    let (l, addr) = listener().await;
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = l.accept().await {
            held.push(socket);
        }
    });
    (addr, task)
}

fn deadlines() -> RetryConfig {
    RetryConfig {
        attempt_timeout: Duration::from_millis(800),
        handshake_timeout: Duration::from_millis(300),
        long_poll_margin: Duration::from_millis(300),
        ..fast()
    }
}

#[tokio::test]
async fn a_server_that_accepts_and_never_answers_fails_over_to_the_next_address() {
    let (silent_addr, _silent) = silent().await;
    let (l, good_addr) = listener().await;
    let script = Script::default();
    let _server = Server::start(l, script.clone(), 0).await;
    // Hello unsafe: a connection that never heard the server proves nothing was sent.
    let layer = RetryLayer::with_table(deadlines(), UNSAFE_HELLO);
    let channel = runplane_transport::connect_lazy(
        &format!("http://{silent_addr},http://{good_addr}"),
        &layer,
    )
    .unwrap();
    let upstream = channel.upstream().clone();
    let started = tokio::time::Instant::now();
    RunnerServiceClient::new(channel)
        .hello(runstore_pb::HelloRequest::default())
        .await
        .expect("the call moved on to the second address");
    assert!(
        started.elapsed() < fast().ordinary_budget,
        "within its budget: {:?}",
        started.elapsed()
    );
    assert_eq!(script.calls(), 1);
    assert_eq!(upstream.replacements(), 1);
    assert_eq!(layer.stats().proven_not_sent.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_long_poll_outlives_the_ordinary_deadline() {
    let (l, addr) = listener().await;
    let script = Script::default();
    let _server = Server::start(l, script.clone(), 0).await;
    let layer = RetryLayer::new(deadlines());
    let mut c = client(&addr, &layer);
    // Twice the ordinary attempt deadline: a long poll's is its wait plus the margin.
    c.poll_steering(runstore_pb::PollSteeringRequest {
        wait: Some(prost_types::Duration {
            seconds: 2,
            nanos: 0,
        }),
        ..Default::default()
    })
    .await
    .expect("the long poll survives");
    assert_eq!(
        script.calls(),
        1,
        "one attempt, not cut at the ordinary deadline"
    );
    assert_eq!(layer.stats().retries(), 0);
}

#[tokio::test]
async fn an_attempt_past_its_deadline_is_retried_on_a_new_connection() {
    let (l, addr) = listener().await;
    let script = Script::new([Answer::Stall(Duration::from_secs(30))]);
    let _server = Server::start(l, script.clone(), 0).await;
    let layer = RetryLayer::new(deadlines());
    let channel = runplane_transport::connect_lazy(&format!("http://{addr}"), &layer).unwrap();
    let upstream = channel.upstream().clone();
    let mut c = RunnerServiceClient::new(channel);
    append(&mut c)
        .await
        .expect("the replay after the deadline succeeds");
    assert_eq!(script.calls(), 2);
    assert_eq!(
        upstream.replacements(),
        1,
        "the stalled connection was replaced"
    );
    assert_eq!(layer.stats().maybe_processed.load(Ordering::SeqCst), 1);

    // Unsafe: past its deadline on a server that spoke, it may have been processed.
    let script = Script::new([Answer::Stall(Duration::from_secs(30))]);
    let (l, addr) = listener().await;
    let _server = Server::start(l, script.clone(), 0).await;
    let layer = RetryLayer::with_table(deadlines(), UNSAFE_HELLO);
    let err = client(&addr, &layer)
        .hello(runstore_pb::HelloRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err}");
    assert_eq!(script.calls(), 1, "not replayed");
}
