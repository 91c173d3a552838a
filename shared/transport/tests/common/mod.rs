//! A scripted runner service on a real socket, a server that can be killed as a process
//! would be, and the clients and retry settings the transport tests share.

#![allow(dead_code)]

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::runner_service_client::RunnerServiceClient;
use runplane_proto::runstore::v1::runner_service_server::{RunnerService, RunnerServiceServer};
use runplane_proto::{MethodPolicy, OutageBudget, ReplaySafety};
use runplane_transport::{RetryConfig, RetryLayer, RunnerChannel};
use tokio::net::TcpListener;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::{Code, Request, Response, Status};
use tower_service::Service;

/// One scripted answer of the test server.
#[derive(Clone)]
pub enum Answer {
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
pub struct Script {
    answers: Arc<Mutex<VecDeque<Answer>>>,
    calls: Arc<AtomicUsize>,
}

impl Script {
    pub fn new(answers: impl IntoIterator<Item = Answer>) -> Self {
        Self {
            answers: Arc::new(Mutex::new(answers.into_iter().collect())),
            calls: Arc::default(),
        }
    }

    pub fn calls(&self) -> usize {
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
        _: Request<runstore_pb::HelloRequest>,
    ) -> Result<Response<runstore_pb::HelloResponse>, Status> {
        self.answer().await
    }
    async fn append_events(
        &self,
        _: Request<runstore_pb::AppendEventsRequest>,
    ) -> Result<Response<runstore_pb::AppendEventsResponse>, Status> {
        self.answer().await
    }
    /// Waits the whole wait it is asked for, as a poll with nothing pending does.
    async fn poll_steering(
        &self,
        request: Request<runstore_pb::PollSteeringRequest>,
    ) -> Result<Response<runstore_pb::PollSteeringResponse>, Status> {
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
pub struct Server {
    runtime: Option<tokio::runtime::Runtime>,
}

impl Server {
    pub async fn start(listener: TcpListener, script: Script, cuts: usize) -> Self {
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

    pub fn kill(mut self) {
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

pub fn fast() -> RetryConfig {
    RetryConfig {
        base: Duration::from_millis(20),
        cap: Duration::from_millis(100),
        ordinary_budget: Duration::from_secs(5),
        terminal_budget: Duration::from_secs(5),
        ..RetryConfig::default()
    }
}

pub fn client(addr: &str, layer: &RetryLayer) -> RunnerServiceClient<RunnerChannel> {
    RunnerServiceClient::new(
        runplane_transport::connect_lazy(&format!("http://{addr}"), layer).unwrap(),
    )
}

pub async fn listener() -> (TcpListener, String) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    (l, addr)
}

pub async fn append(
    c: &mut RunnerServiceClient<RunnerChannel>,
) -> Result<runstore_pb::AppendEventsResponse, Status> {
    c.append_events(runstore_pb::AppendEventsRequest::default())
        .await
        .map(Response::into_inner)
}

/// The same runner methods, but Hello classified unsafe: for the unsafe-method cases.
pub static UNSAFE_HELLO: &[MethodPolicy] = &[
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
