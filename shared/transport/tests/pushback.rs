//! The retrying transport against a server that refuses calls: pushback, rate limiting
//! (`RESOURCE_EXHAUSTED`), the retry throttle, and a real server shedding load.

use std::sync::atomic::Ordering;
use std::time::Duration;

use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::runner_service_client::RunnerServiceClient;
use runplane_proto::runstore::v1::runner_service_server::RunnerServiceServer;
use runplane_testkit::authed;
use runplane_transport::{Jitter, RetryConfig, RetryLayer};
use tonic::Code;

mod common;
use common::*;

/// What the calls present; these servers authenticate no one.
const TOKEN: &str = "test-token";

#[tokio::test]
async fn pushback_is_honoured_when_large_and_floored_at_the_backoff_when_zero() {
    let config = RetryConfig {
        jitter: Jitter::Equal,
        ..fast()
    };
    let (l, addr) = listener().await;
    let script = Script::new([
        Answer::Status(Code::Unavailable, Some(700)),
        Answer::Status(Code::Unavailable, Some(0)),
    ]);
    let _server = Server::start(l, script.clone(), 0).await;
    let layer = RetryLayer::new(config.clone());
    append(&mut client(&addr, &layer)).await.unwrap();
    let delays = layer.stats().delays.lock().unwrap().clone();
    assert_eq!(delays.len(), 2);
    assert_eq!(
        delays[0],
        Duration::from_millis(700),
        "a large pushback wins"
    );
    // Zero pushback: the backoff of the second retry, at least half its ceiling.
    assert!(delays[1] >= config.base, "{:?}", delays[1]);
    assert!(delays[1] <= config.base * 2, "{:?}", delays[1]);
}

#[tokio::test]
async fn resource_exhausted_has_its_own_counter_outside_the_budget() {
    let config = RetryConfig {
        ordinary_budget: Duration::from_millis(50),
        rate_limit_retries: 4,
        ..fast()
    };
    let (l, addr) = listener().await;
    let script = Script::new((0..4).map(|_| Answer::Status(Code::ResourceExhausted, Some(40))));
    let _server = Server::start(l, script.clone(), 0).await;
    let layer = RetryLayer::new(config.clone());
    append(&mut client(&addr, &layer))
        .await
        .expect("rate limiting outlasts the outage budget");
    assert_eq!(script.calls(), 5);
    assert_eq!(layer.stats().rate_limited.load(Ordering::SeqCst), 4);

    // Without pushback the count bounds it.
    let (l, addr) = listener().await;
    let always = Script::new((0..100).map(|_| Answer::Status(Code::ResourceExhausted, None)));
    let _server = Server::start(l, always.clone(), 0).await;
    let err = append(&mut client(&addr, &RetryLayer::new(config)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted);
    assert_eq!(always.calls(), 5, "bounded: the first call and 4 retries");
}

/// A server pacing its clients with pushback is waited out for as long as the rate-limit
/// window lasts, however many refusals that takes (a count gave up mid-storm), and no
/// longer.
#[tokio::test]
async fn paced_refusals_are_bounded_by_the_window_not_a_count() {
    let config = RetryConfig {
        rate_limit_retries: 4,
        ..fast()
    };
    let (l, addr) = listener().await;
    let paced = Script::new((0..15).map(|_| Answer::Status(Code::ResourceExhausted, Some(2))));
    let _server = Server::start(l, paced.clone(), 0).await;
    append(&mut client(&addr, &RetryLayer::new(config.clone())))
        .await
        .expect("fifteen paced refusals, then the call goes through");
    assert_eq!(paced.calls(), 16);

    let (l, addr) = listener().await;
    let always = Script::new((0..1000).map(|_| Answer::Status(Code::ResourceExhausted, Some(20))));
    let _server = Server::start(l, always.clone(), 0).await;
    let windowed = RetryConfig {
        rate_limit_window: Some(Duration::from_millis(200)),
        ..config
    };
    let err = append(&mut client(&addr, &RetryLayer::new(windowed)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted);
    assert!(
        (5..1000).contains(&always.calls()),
        "paced past the count, stopped by the window: {} calls",
        always.calls()
    );
}

#[tokio::test]
async fn a_drained_throttle_suppresses_retries() {
    let (l, addr) = listener().await;
    let script = Script::new((0..100).map(|_| Answer::Status(Code::Unavailable, None)));
    let _server = Server::start(l, script.clone(), 0).await;
    let layer = RetryLayer::new(fast());
    let err = append(&mut client(&addr, &layer)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    let stats = layer.stats();
    assert_eq!(stats.throttled.load(Ordering::SeqCst), 1);
    // 10 tokens, drained at half: the fifth failure of a live server stops retrying,
    // well inside the 5 s budget that would otherwise keep it going.
    assert_eq!(script.calls(), 5);
    assert_eq!(stats.gave_up.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn retry_info_is_honoured() {
    let (l, addr) = listener().await;
    let script = Script::new([Answer::RetryInfo(
        Code::Unavailable,
        Duration::from_millis(600),
    )]);
    let _server = Server::start(l, script.clone(), 0).await;
    let layer = RetryLayer::new(fast());
    append(&mut client(&addr, &layer)).await.unwrap();
    assert_eq!(script.calls(), 2);
    let delays = layer.stats().delays.lock().unwrap().clone();
    assert_eq!(
        delays,
        vec![Duration::from_millis(600)],
        "the RetryInfo delay wins"
    );
}

#[tokio::test]
async fn a_malformed_pushback_stops_retries() {
    for value in ["-1", "soon"] {
        let (l, addr) = listener().await;
        let script = Script::new([Answer::RawPushback(Code::Unavailable, value)]);
        let _server = Server::start(l, script.clone(), 0).await;
        let layer = RetryLayer::new(fast());
        let err = append(&mut client(&addr, &layer)).await.unwrap_err();
        assert_eq!(err.code(), Code::Unavailable);
        assert_eq!(script.calls(), 1, "pushback {value:?}: not retried");
    }
}

#[tokio::test]
async fn a_rate_limited_sleep_is_capped() {
    let config = RetryConfig {
        rate_limit_max_sleep: Duration::from_millis(150),
        ..fast()
    };
    let (l, addr) = listener().await;
    let script = Script::new([Answer::Status(Code::ResourceExhausted, Some(60_000))]);
    let _server = Server::start(l, script.clone(), 0).await;
    let layer = RetryLayer::new(config);
    append(&mut client(&addr, &layer)).await.unwrap();
    let delays = layer.stats().delays.lock().unwrap().clone();
    assert_eq!(
        delays,
        vec![Duration::from_millis(150)],
        "not the minute asked for"
    );
}

/// A shedding server paces a `RESOURCE_EXHAUSTED` retry: the delay is its pushback plus at
/// most half of it again, however often it was refused, not the exponential backoff (which
/// would stretch a fleet's tail); a zero pushback proves nothing and gets the backoff.
#[tokio::test]
async fn a_rate_limited_retry_waits_out_its_pushback_not_the_backoff() {
    let config = RetryConfig {
        base: Duration::from_millis(200),
        cap: Duration::from_millis(200),
        jitter: Jitter::Equal,
        ..fast()
    };
    let (l, addr) = listener().await;
    let script = Script::new([
        Answer::Status(Code::ResourceExhausted, Some(20)),
        Answer::Status(Code::ResourceExhausted, Some(20)),
        Answer::Status(Code::ResourceExhausted, Some(20)),
        Answer::Status(Code::ResourceExhausted, Some(0)),
    ]);
    let _server = Server::start(l, script.clone(), 0).await;
    let layer = RetryLayer::new(config);
    append(&mut client(&addr, &layer)).await.unwrap();
    let delays = layer.stats().delays.lock().unwrap().clone();
    assert_eq!(delays.len(), 4, "{delays:?}");
    for d in &delays[..3] {
        assert!(
            (Duration::from_millis(20)..=Duration::from_millis(30)).contains(d),
            "paced by the pushback: {delays:?}"
        );
    }
    assert!(
        (Duration::from_millis(100)..=Duration::from_millis(200)).contains(&delays[3]),
        "zero pushback: the backoff: {delays:?}"
    );
}

/// A call over the limit waits its turn for up to `overload_queue`, then is shed: a slot
/// that frees within the window serves it (no refusal), one that does not, refuses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_over_the_limit_waits_for_a_slot_within_the_queue_window() {
    async fn serve_one_slot(queue: Duration) -> (String, Script) {
        let (l, addr) = listener().await;
        let script = Script::new([Answer::Stall(Duration::from_millis(300))]);
        let mut services = runplane_grpc::ServiceSet::new();
        services.add(RunnerServiceServer::new(script.clone()));
        let mut limits = runplane_grpc::ServerLimits::default();
        limits
            .max_concurrent_requests_by_service
            .insert("runplane.runstore.v1.RunnerService".to_owned(), 1);
        limits.overload_queue = queue;
        services.limits(limits);
        tokio::spawn(runplane_grpc::serve(
            l,
            services,
            std::future::pending(),
            Duration::from_secs(1),
        ));
        (addr, script)
    }
    async fn second_call_while_the_first_holds_the_slot(
        addr: &str,
        script: &Script,
    ) -> Result<(), Code> {
        let channel = runplane_grpc::client::endpoint(&format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut first = RunnerServiceClient::new(channel.clone());
        let holding = tokio::spawn(async move {
            first
                .append_events(authed(runstore_pb::AppendEventsRequest::default(), TOKEN))
                .await
        });
        // The first call is in the handler (holding the slot) before the second is sent.
        while script.calls() == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let second = RunnerServiceClient::new(channel)
            .append_events(authed(runstore_pb::AppendEventsRequest::default(), TOKEN))
            .await;
        holding.await.unwrap().unwrap();
        second.map(|_| ()).map_err(|s| s.code())
    }

    let (addr, script) = serve_one_slot(Duration::from_secs(5)).await;
    assert_eq!(
        second_call_while_the_first_holds_the_slot(&addr, &script).await,
        Ok(()),
        "served in turn once the slot freed"
    );
    let (addr, script) = serve_one_slot(Duration::from_millis(20)).await;
    assert_eq!(
        second_call_while_the_first_holds_the_slot(&addr, &script).await,
        Err(Code::ResourceExhausted),
        "shed once the window passed"
    );
}

/// A server over its concurrency limit sheds with pushback, and the transport waits it
/// out: the shed call completes once the slot frees, outside the outage budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shedding_server_paces_calls_with_pushback_and_they_complete() {
    let (l, addr) = listener().await;
    // The first call holds the service's only slot for a while.
    let script = Script::new([Answer::Stall(Duration::from_millis(400))]);
    let mut services = runplane_grpc::ServiceSet::new();
    services.add(RunnerServiceServer::new(script.clone()));
    let mut limits = runplane_grpc::ServerLimits::default();
    limits
        .max_concurrent_requests_by_service
        .insert("runplane.runstore.v1.RunnerService".to_owned(), 1);
    limits.overload_pushback = Duration::from_millis(100);
    services.limits(limits);
    tokio::spawn(runplane_grpc::serve(
        l,
        services,
        std::future::pending(),
        Duration::from_secs(1),
    ));

    let layer = RetryLayer::new(fast());
    let mut holder = client(&addr, &layer);
    let holding = tokio::spawn(async move {
        holder
            .append_events(authed(runstore_pb::AppendEventsRequest::default(), TOKEN))
            .await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;

    // Without the transport: the refusal itself, with both forms of pushback.
    let channel = runplane_grpc::client::endpoint(&format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let refused = RunnerServiceClient::new(channel)
        .append_events(authed(runstore_pb::AppendEventsRequest::default(), TOKEN))
        .await
        .expect_err("shed while the slot is held");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert_eq!(
        refused
            .metadata()
            .get("grpc-retry-pushback-ms")
            .and_then(|v| v.to_str().ok()),
        Some("100")
    );
    {
        use tonic_types::StatusExt;
        let details = refused.get_error_details();
        assert_eq!(
            details.retry_info().and_then(|r| r.retry_delay),
            Some(Duration::from_millis(100))
        );
        assert_eq!(
            details.error_info().map(|i| i.reason.as_str()),
            Some("RATE_LIMITED")
        );
    }

    // Through the transport: paced by the pushback, then served.
    let shed_layer = RetryLayer::new(fast());
    client(&addr, &shed_layer)
        .append_events(authed(runstore_pb::AppendEventsRequest::default(), TOKEN))
        .await
        .expect("served once the slot frees");
    assert!(shed_layer.stats().rate_limited.load(Ordering::SeqCst) >= 1);
    assert_eq!(shed_layer.stats().gave_up.load(Ordering::SeqCst), 0);
    holding.await.unwrap().expect("the holder completes");
}
