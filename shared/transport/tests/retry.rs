//! The retrying transport against real servers on real sockets: every failure here
//! comes over the wire (a refused connect, a server killed mid-call, a body cut short, a
//! status with pushback), none is a mocked error.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use runplane_proto::runstore::v1 as pb;
use runplane_proto::runstore::v1::runner_service_client::RunnerServiceClient;
use runplane_proto::runstore::v1::runner_service_server::{RunnerService, RunnerServiceServer};
use runplane_proto::{MethodPolicy, OutageBudget, ReplaySafety};
use runplane_transport::{Jitter, RetryConfig, RetryLayer, RunnerChannel};
use tokio::net::TcpListener;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::{Code, Request, Response, Status};
use tower_service::Service;

/// One scripted answer of the test server.
#[derive(Clone)]
enum Answer {
    Ok,
    Status(Code, Option<u64>),
    /// Wait, then answer with the next scripted answer.
    Stall(Duration),
    /// A status whose pushback is a `google.rpc.RetryInfo` detail.
    RetryInfo(Code, Duration),
    /// A status with this exact `grpc-retry-pushback-ms` value.
    RawPushback(Code, &'static str),
}

#[derive(Clone, Default)]
struct Script {
    answers: Arc<Mutex<VecDeque<Answer>>>,
    calls: Arc<AtomicUsize>,
}

impl Script {
    fn new(answers: impl IntoIterator<Item = Answer>) -> Self {
        Self {
            answers: Arc::new(Mutex::new(answers.into_iter().collect())),
            calls: Arc::default(),
        }
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    async fn answer<T: Default>(&self) -> Result<Response<T>, Status> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        loop {
            let next = self
                .answers
                .lock()
                .unwrap()
                .pop_front()
                .unwrap_or(Answer::Ok);
            match next {
                Answer::Ok => return Ok(Response::new(T::default())),
                Answer::Stall(d) => tokio::time::sleep(d).await,
                Answer::RetryInfo(code, delay) => {
                    use tonic_types::{ErrorDetails, StatusExt};
                    return Err(Status::with_error_details(
                        code,
                        "scripted",
                        ErrorDetails::with_retry_info(Some(delay)),
                    ));
                }
                Answer::RawPushback(code, value) => {
                    let mut status = Status::new(code, "scripted");
                    status
                        .metadata_mut()
                        .insert("grpc-retry-pushback-ms", value.parse().unwrap());
                    return Err(status);
                }
                Answer::Status(code, pushback) => {
                    let mut status = Status::new(code, "scripted");
                    if let Some(ms) = pushback {
                        status
                            .metadata_mut()
                            .insert("grpc-retry-pushback-ms", ms.to_string().parse().unwrap());
                    }
                    return Err(status);
                }
            }
        }
    }
}

#[tonic::async_trait]
impl RunnerService for Script {
    async fn hello(
        &self,
        _: Request<pb::HelloRequest>,
    ) -> Result<Response<pb::HelloResponse>, Status> {
        self.answer().await
    }
    async fn append_events(
        &self,
        _: Request<pb::AppendEventsRequest>,
    ) -> Result<Response<pb::AppendEventsResponse>, Status> {
        self.answer().await
    }
    /// Waits the whole wait it is asked for, as a poll with nothing pending does.
    async fn poll_steering(
        &self,
        request: Request<pb::PollSteeringRequest>,
    ) -> Result<Response<pb::PollSteeringResponse>, Status> {
        let wait = request.into_inner().wait.unwrap_or_default();
        tokio::time::sleep(Duration::from_millis(wait.seconds as u64 * 1000)).await;
        self.answer().await
    }
}

/// Cuts the next `n` response bodies after the handler answered.
#[derive(Clone)]
struct Cut<S> {
    inner: S,
    remaining: Arc<AtomicUsize>,
}

impl<S: NamedService> NamedService for Cut<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for Cut<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + Send
        + Clone
        + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<http::Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let cut = self
            .remaining
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        let future = self.inner.call(request);
        Box::pin(async move {
            let response = future.await?;
            if !cut {
                return Ok(response);
            }
            let (parts, _) = response.into_parts();
            Ok(http::Response::from_parts(parts, Body::new(Failing)))
        })
    }
}

struct Failing;

impl http_body::Body for Failing {
    type Data = Bytes;
    type Error = std::io::Error;
    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>> {
        Poll::Ready(Some(Err(std::io::ErrorKind::ConnectionReset.into())))
    }
}

/// A server on a runtime of its own, so killing it closes its listener and every open
/// connection at once, as a killed process would.
struct Server {
    runtime: Option<tokio::runtime::Runtime>,
}

impl Server {
    async fn start(listener: TcpListener, script: Script, cuts: usize) -> Self {
        let service = Cut {
            inner: RunnerServiceServer::new(script),
            remaining: Arc::new(AtomicUsize::new(cuts)),
        };
        let listener = listener.into_std().unwrap();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        runtime.spawn(async move {
            let listener = TcpListener::from_std(listener).unwrap();
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await
                .unwrap();
        });
        Self {
            runtime: Some(runtime),
        }
    }

    fn kill(mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

fn fast() -> RetryConfig {
    RetryConfig {
        base: Duration::from_millis(20),
        cap: Duration::from_millis(100),
        ordinary_budget: Duration::from_secs(5),
        terminal_budget: Duration::from_secs(5),
        ..RetryConfig::default()
    }
}

fn client(addr: &str, layer: &RetryLayer) -> RunnerServiceClient<RunnerChannel> {
    RunnerServiceClient::new(
        runplane_transport::connect_lazy(&format!("http://{addr}"), layer).unwrap(),
    )
}

async fn listener() -> (TcpListener, String) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    (l, addr)
}

async fn append(
    c: &mut RunnerServiceClient<RunnerChannel>,
) -> Result<pb::AppendEventsResponse, Status> {
    c.append_events(pb::AppendEventsRequest::default())
        .await
        .map(Response::into_inner)
}

/// The same runner methods, but Hello classified unsafe: for the unsafe-method cases.
static UNSAFE_HELLO: &[MethodPolicy] = &[
    MethodPolicy {
        path: "/runplane.runstore.v1.RunnerService/AppendEvents",
        replay_safety: ReplaySafety::Keyed,
        key_field: Some("batch_key"),
        outage_budget: OutageBudget::Ordinary,
        justification: "test",
        client_streaming: false,
        server_streaming: false,
        long_poll_wait_field: None,
        callers: runplane_proto::Callers::of(&[runplane_proto::Caller::Runner]),
    },
    MethodPolicy {
        path: "/runplane.runstore.v1.RunnerService/Hello",
        replay_safety: ReplaySafety::Unsafe,
        key_field: None,
        outage_budget: OutageBudget::Ordinary,
        justification: "test",
        client_streaming: false,
        server_streaming: false,
        long_poll_wait_field: None,
        callers: runplane_proto::Callers::of(&[runplane_proto::Caller::Runner]),
    },
];

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
        c.hello(pb::HelloRequest::default())
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
    assert!(c.hello(pb::HelloRequest::default()).await.is_err());
    assert_eq!(script.calls(), 1, "exactly one attempt");
    assert_eq!(layer.stats().gave_up.load(Ordering::SeqCst), 1);

    let script = Script::new([Answer::Status(Code::Unavailable, None)]);
    let (l, addr) = listener().await;
    let _server = Server::start(l, script.clone(), 0).await;
    let err = client(&addr, &layer)
        .hello(pb::HelloRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    assert_eq!(script.calls(), 1);
}

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
        .hello(pb::HelloRequest::default())
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
    c.poll_steering(pb::PollSteeringRequest {
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
        .hello(pb::HelloRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err}");
    assert_eq!(script.calls(), 1, "not replayed");
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
                .append_events(authed_request(pb::AppendEventsRequest::default()))
                .await
        });
        // The first call is in the handler (holding the slot) before the second is sent.
        while script.calls() == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let second = RunnerServiceClient::new(channel)
            .append_events(authed_request(pb::AppendEventsRequest::default()))
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

fn authed_request<T>(message: T) -> Request<T> {
    let mut request = Request::new(message);
    request
        .metadata_mut()
        .insert("authorization", "Bearer test-token".parse().unwrap());
    request
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

    fn authed(request: pb::AppendEventsRequest) -> Request<pb::AppendEventsRequest> {
        let mut request = Request::new(request);
        request
            .metadata_mut()
            .insert("authorization", "Bearer test-token".parse().unwrap());
        request
    }
    let layer = RetryLayer::new(fast());
    let mut holder = client(&addr, &layer);
    let holding = tokio::spawn(async move {
        holder
            .append_events(authed(pb::AppendEventsRequest::default()))
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
        .append_events(authed(pb::AppendEventsRequest::default()))
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
        .append_events(authed(pb::AppendEventsRequest::default()))
        .await
        .expect("served once the slot frees");
    assert!(shed_layer.stats().rate_limited.load(Ordering::SeqCst) >= 1);
    assert_eq!(shed_layer.stats().gave_up.load(Ordering::SeqCst), 0);
    holding.await.unwrap().expect("the holder completes");
}
