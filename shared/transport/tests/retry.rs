//! The retrying transport against real servers on real sockets: every failure here
//! comes over the wire (a refused connect, a server killed mid-call, a body cut short, a
//! status with pushback), none is a mocked error. This file: what is retried, by what the
//! failure proves and the method's replay safety, and the outage budget.

use std::sync::atomic::Ordering;
use std::time::Duration;

use runplane_proto::runstore::v1 as runstore_pb;
use runplane_transport::{RetryConfig, RetryLayer};
use tokio::net::TcpListener;
use tonic::{Code, Response};

mod common;
use common::*;

#[tokio::test]
async fn unavailable_twice_then_success() {
    let (l, addr) = listener().await;
    let script = Script::new([
        Answer::Status(Code::Unavailable, None),
        Answer::Status(Code::Unavailable, None),
    ]);
    let _server = Server::start(l, script.clone(), 0).await;
    let layer = RetryLayer::new(fast());
    append(&mut client(&addr, &layer))
        .await
        .expect("third attempt succeeds");
    assert_eq!(script.calls(), 3);
    assert_eq!(layer.stats().maybe_processed.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn invalid_argument_is_not_retried() {
    let (l, addr) = listener().await;
    let script = Script::new([Answer::Status(Code::InvalidArgument, None)]);
    let _server = Server::start(l, script.clone(), 0).await;
    let layer = RetryLayer::new(fast());
    let err = append(&mut client(&addr, &layer)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(script.calls(), 1);
    assert_eq!(layer.stats().retries(), 0);
}

#[tokio::test]
async fn a_refused_connect_is_retried_until_the_server_listens() {
    let (l, addr) = listener().await;
    drop(l); // nothing listens on the port now
    let layer = RetryLayer::new(fast());
    // Hello is unsafe here: a refused connect proves nothing was sent, so it retries anyway.
    let unsafe_layer = RetryLayer::with_table(fast(), UNSAFE_HELLO);
    let mut c = client(&addr, &unsafe_layer);
    let call = tokio::spawn(async move {
        c.hello(runstore_pb::HelloRequest::default())
            .await
            .map(Response::into_inner)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let script = Script::default();
    let _server = Server::start(TcpListener::bind(&addr).await.unwrap(), script.clone(), 0).await;
    call.await.unwrap().expect("succeeds once the port reopens");
    assert_eq!(script.calls(), 1);
    assert!(unsafe_layer.stats().proven_not_sent.load(Ordering::SeqCst) >= 1);
    drop(layer);
}

#[tokio::test]
async fn a_server_killed_mid_call_and_relistened_on_the_same_port() {
    let (l, addr) = listener().await;
    let first = Script::new([Answer::Stall(Duration::from_secs(30))]);
    let server = Server::start(l, first.clone(), 0).await;
    let layer = RetryLayer::new(fast());
    let mut c = client(&addr, &layer);
    let call = tokio::spawn(async move { append(&mut c).await });
    // Wait until the request reached the handler, then kill the server under it.
    while first.calls() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    server.kill();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let second = Script::default();
    let _server = Server::start(TcpListener::bind(&addr).await.unwrap(), second.clone(), 0).await;
    call.await
        .unwrap()
        .expect("the replay-safe call survives the restart");
    assert_eq!(second.calls(), 1);
    let stats = layer.stats();
    assert!(
        stats.maybe_processed.load(Ordering::SeqCst) >= 1,
        "the kill was ambiguous"
    );
}

#[tokio::test]
async fn a_response_cut_mid_body_is_replayed_for_a_replay_safe_method() {
    let (l, addr) = listener().await;
    let script = Script::default();
    let _server = Server::start(l, script.clone(), 1).await;
    let layer = RetryLayer::new(fast());
    append(&mut client(&addr, &layer))
        .await
        .expect("the replay succeeds");
    assert_eq!(script.calls(), 2);
    assert_eq!(layer.stats().maybe_processed.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn an_ambiguous_failure_is_tried_exactly_once_for_an_unsafe_method() {
    let (l, addr) = listener().await;
    let script = Script::default();
    let _server = Server::start(l, script.clone(), 1).await;
    let layer = RetryLayer::with_table(fast(), UNSAFE_HELLO);
    let mut c = client(&addr, &layer);
    assert!(c.hello(runstore_pb::HelloRequest::default()).await.is_err());
    assert_eq!(script.calls(), 1, "exactly one attempt");
    assert_eq!(layer.stats().gave_up.load(Ordering::SeqCst), 1);

    let script = Script::new([Answer::Status(Code::Unavailable, None)]);
    let (l, addr) = listener().await;
    let _server = Server::start(l, script.clone(), 0).await;
    let err = client(&addr, &layer)
        .hello(runstore_pb::HelloRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    assert_eq!(script.calls(), 1);
}

#[tokio::test]
async fn the_budget_is_spent_then_the_error_surfaces() {
    let config = RetryConfig {
        ordinary_budget: Duration::from_millis(400),
        ..fast()
    };
    let (l, addr) = listener().await;
    let script = Script::new((0..1000).map(|_| Answer::Status(Code::Unavailable, None)));
    let _server = Server::start(l, script.clone(), 0).await;
    let layer = RetryLayer::new(config.clone());
    let err = append(&mut client(&addr, &layer)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    let stats = layer.stats();
    assert_eq!(stats.gave_up.load(Ordering::SeqCst), 1);
    // Retried through the budget (not after the first failure), and stopped by it.
    let delays = stats.delays.lock().unwrap().clone();
    assert!(script.calls() >= 3, "retried {} times", script.calls());
    let slept: Duration = delays.iter().sum();
    assert!(
        slept <= config.ordinary_budget,
        "slept {slept:?} beyond the budget"
    );
}

#[tokio::test]
async fn one_retry_is_granted_even_when_the_first_attempt_outlives_the_budget() {
    let config = RetryConfig {
        ordinary_budget: Duration::from_millis(200),
        ..fast()
    };
    let (l, addr) = listener().await;
    let script = Script::new([
        Answer::Stall(Duration::from_millis(600)),
        Answer::Status(Code::Unavailable, None),
        Answer::Status(Code::Unavailable, None),
    ]);
    let _server = Server::start(l, script.clone(), 0).await;
    let layer = RetryLayer::new(config);
    let err = append(&mut client(&addr, &layer)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    assert_eq!(
        script.calls(),
        2,
        "the stalled attempt, then exactly one granted retry"
    );
}

#[tokio::test]
async fn a_refused_connect_is_retried_on_the_short_schedule() {
    let (l, addr) = listener().await;
    drop(l);
    let config = RetryConfig {
        base: Duration::from_secs(5),
        cap: Duration::from_secs(5),
        ordinary_budget: Duration::from_millis(1500),
        ..fast()
    };
    let layer = RetryLayer::new(config.clone());
    append(&mut client(&addr, &layer)).await.unwrap_err();
    let delays = layer.stats().delays.lock().unwrap().clone();
    assert!(delays.len() >= 2, "{delays:?}");
    assert!(
        delays.iter().all(|d| *d <= config.connect_cap),
        "never the long backoff after a refused connect: {delays:?}"
    );
}
