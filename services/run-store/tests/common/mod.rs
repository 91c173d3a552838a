//! A run store on a real socket over a real database, with a switch that lets the
//! handler commit and then cuts the response mid-body, as a dying proxy or a restart
//! between commit and reply would.

#![allow(dead_code)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use runplane_config::{Config, Secret};
use runplane_grpc::{ErrorReason, ServiceSet, error_info};
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_proto::runstore::v1::runner_service_client::RunnerServiceClient;
use runplane_run_store::RunStore;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tower_service::Service;

pub const SERVICE_TOKEN: &str = "service-token-0123456789abcdef0123456789";
pub const ACME_TOKEN: &str = "acme-operator-token-0123456789abcdef01234";

pub use runplane_testkit::Backend;

/// Paths whose next responses are cut after the handler ran, with how many to cut.
type Cuts = Arc<Mutex<HashMap<String, usize>>>;

pub struct Harness {
    pub endpoint: String,
    pub store: RunStore,
    cuts: Cuts,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    served: Option<
        tokio::task::JoinHandle<Result<runplane_grpc::Stopped, runplane_grpc::server::ServeError>>,
    >,
    /// What the store signs receipts with, for tests that write through the store itself.
    pub signer: runplane_run_store::domain::receipt::ReceiptSigner,
    configure: fn(&mut Config),
    clock: Option<runplane_clock::ManualClock>,
    _backend: Backend,
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

pub use runplane_grpc::client::Bearer;

pub type RunClient = RunServiceClient<InterceptedService<Channel, Bearer>>;
pub type RunnerClient = RunnerServiceClient<InterceptedService<Channel, Bearer>>;

impl Harness {
    /// A second replica on this one's database, configured as this one is, on its clock.
    pub async fn replica(&self) -> Self {
        Self::start_on(
            Backend::Shared(self._backend.url()),
            self.configure,
            self.clock.clone(),
        )
        .await
    }

    /// [`Self::start_with`] on a clock that moves only by [`Self::advance`].
    pub async fn start_manual(backend: Backend, configure: fn(&mut Config)) -> Self {
        use runplane_clock::Clock;
        let clock = runplane_clock::ManualClock::new(runplane_clock::SystemClock::new().now());
        Self::start_on(backend, configure, Some(clock)).await
    }

    /// Moves the manual clock (and its replicas') forward.
    pub fn advance(&self, by: Duration) {
        self.clock
            .as_ref()
            .expect("a harness started with start_manual")
            .advance(by);
    }

    pub async fn start(backend: Backend) -> Self {
        Self::start_with(backend, |_| {}).await
    }

    /// A run store whose configuration `configure` changes after the harness's own.
    pub async fn start_with(backend: Backend, configure: fn(&mut Config)) -> Self {
        Self::start_on(backend, configure, None).await
    }

    /// [`Self::start_with`] on `clock`; `None`: the system clock.
    async fn start_on(
        backend: Backend,
        configure: fn(&mut Config),
        clock: Option<runplane_clock::ManualClock>,
    ) -> Self {
        let mut config = Config::default();
        config.auth.operator_token = Secret::new(SERVICE_TOKEN);
        config.auth.service_token = Secret::new(runplane_testkit::SERVICE_TOKEN);
        config
            .auth
            .org_tokens
            .insert("acme".into(), Secret::new(ACME_TOKEN));
        config.run_store.database_url = backend.url();
        let signer = runplane_run_store::domain::receipt::ReceiptSigner::generate();
        config.run_store.receipt_signing_key = Secret::new(signer.seed_hex());
        // The run store's own behaviour; admission and failure reports go through
        // credential health in services/credential-health/tests.
        config.run_store.admission = false;
        config.run_store.max_batch_events = 100;
        configure(&mut config);
        let shared: runplane_clock::SharedClock = match &clock {
            Some(manual) => std::sync::Arc::new(manual.clone()),
            None => runplane_clock::SystemClock::shared(),
        };
        let store = RunStore::open(&config, shared)
            .await
            .expect("run store opens");
        let cuts: Cuts = Arc::default();
        let (runner, run) = store.services();
        let mut services = ServiceSet::new();
        services
            .authenticate(runplane_grpc::auth::Tokens::from_config(&config.auth))
            .add(CutAfterCommit {
                inner: runner,
                cuts: cuts.clone(),
            })
            .add(CutAfterCommit {
                inner: run,
                cuts: cuts.clone(),
            });
        let closing = store.clone();
        services.on_shutdown(move || closing.begin_shutdown());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(runplane_grpc::serve(
            listener,
            services,
            async {
                let _ = stopped.await;
            },
            Duration::from_secs(1),
        ));
        Self {
            endpoint,
            store,
            cuts,
            stop: Some(stop),
            served: Some(served),
            signer,
            configure,
            clock,
            _backend: backend,
        }
    }

    /// Shuts the server down (as SIGTERM would) and waits until `serve` returned: once
    /// in-flight calls finished, or when the 1 s grace ran out.
    pub async fn shut_down(&mut self) -> runplane_grpc::Stopped {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let served = self.served.take().expect("not shut down yet");
        served.await.unwrap().unwrap()
    }

    /// The next `n` responses of `method` (e.g. "AppendEvents") are cut after the handler
    /// committed.
    pub fn cut_next(&self, method: &str, n: usize) {
        self.cuts.lock().unwrap().insert(method.to_owned(), n);
    }

    async fn channel(&self) -> Channel {
        tonic::transport::Endpoint::from_shared(self.endpoint.clone())
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    pub async fn operator(&self) -> RunClient {
        self.operator_with(SERVICE_TOKEN).await
    }

    pub async fn operator_with(&self, token: &str) -> RunClient {
        RunServiceClient::with_interceptor(self.channel().await, Bearer::new(token))
    }

    pub async fn runner(&self, key: &str) -> RunnerClient {
        RunnerServiceClient::with_interceptor(self.channel().await, Bearer::new(key))
    }

    /// A queued run in org `acme`.
    pub async fn create_run(&self, request_id: &str) -> runstore_pb::Run {
        self.operator()
            .await
            .create_run(create_request(request_id))
            .await
            .expect("create run")
            .into_inner()
            .run
            .unwrap()
    }

    pub async fn issue_key(&self, run_id: &str, generation: u64) -> String {
        self.issue_key_for(run_id, "sbx-test", generation).await
    }

    /// The key of `sandbox_id`'s execution `generation`.
    pub async fn issue_key_for(&self, run_id: &str, sandbox_id: &str, generation: u64) -> String {
        self.operator()
            .await
            .issue_run_key(runstore_pb::IssueRunKeyRequest {
                run_id: run_id.into(),
                sandbox_id: sandbox_id.into(),
                sandbox_generation: generation,
                idempotency_key: format!("{sandbox_id}:{generation}:issue-key"),
                ..Default::default()
            })
            .await
            .expect("issue key")
            .into_inner()
            .run_key
    }

    /// A run that a runner has said Hello on; returns the run id and the key.
    pub async fn running_run(&self, request_id: &str) -> (String, String) {
        let run = self.create_run(request_id).await;
        let key = self.issue_key(&run.id, 1).await;
        self.runner(&key)
            .await
            .hello(runstore_pb::HelloRequest {
                run_id: run.id.clone(),
                nonce: "runner-nonce-0000000001".into(),
                runner_version: "test".into(),
            })
            .await
            .expect("hello");
        (run.id, key)
    }

    pub async fn get_run(&self, run_id: &str) -> runstore_pb::Run {
        self.operator()
            .await
            .get_run(runstore_pb::GetRunRequest {
                run_id: run_id.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .run
            .unwrap()
    }
}

pub fn create_request(request_id: &str) -> runstore_pb::CreateRunRequest {
    runstore_pb::CreateRunRequest {
        client_request_id: format!("{request_id:0>16}"),
        org_id: "acme".into(),
        lead_id: "lead-1".into(),
        target: Some(runstore_pb::create_run_request::Target::CredentialId(
            "cred-a".into(),
        )),
        command: "agent".into(),
        args: vec!["--task".into(), "fix".into()],
        labels: Default::default(),
        max_duration: None,
        priority: None,
    }
}

pub fn line(text: &str) -> runstore_pb::EventInput {
    runstore_pb::EventInput {
        kind: runstore_pb::EventKind::Stdout as i32,
        text: text.into(),
        ..Default::default()
    }
}

pub fn check(name: &str) -> runstore_pb::EventInput {
    runstore_pb::EventInput {
        kind: runstore_pb::EventKind::Custom as i32,
        check: true,
        name: name.into(),
        ..Default::default()
    }
}

pub fn succeeded() -> runstore_pb::Verdict {
    runstore_pb::Verdict {
        outcome: runstore_pb::VerdictOutcome::Succeeded as i32,
        reason: "exit_zero".into(),
        exit_code: Some(0),
        ..Default::default()
    }
}

pub fn failed(code: i32) -> runstore_pb::Verdict {
    runstore_pb::Verdict {
        outcome: runstore_pb::VerdictOutcome::Failed as i32,
        reason: "exit_nonzero".into(),
        exit_code: Some(code),
        ..Default::default()
    }
}

/// The stable reason of a status.
pub fn reason(status: &tonic::Status) -> String {
    error_info(status).map(|i| i.reason).unwrap_or_default()
}

pub fn assert_reason(status: &tonic::Status, code: tonic::Code, expected: ErrorReason) {
    assert_eq!(status.code(), code, "{status:?}");
    assert_eq!(reason(status), expected.as_str_name(), "{status:?}");
}

/// Wraps a tonic service; when told to, lets the handler run to completion and then
/// replaces the response body with one that fails at once, so the client sees the
/// stream reset after the server committed.
#[derive(Clone)]
pub struct CutAfterCommit<S> {
    inner: S,
    cuts: Cuts,
}

impl<S: NamedService> NamedService for CutAfterCommit<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for CutAfterCommit<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let method = request
            .uri()
            .path()
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_owned();
        let cut = {
            let mut cuts = self.cuts.lock().unwrap();
            match cuts.get_mut(&method) {
                Some(n) if *n > 0 => {
                    *n -= 1;
                    true
                }
                _ => false,
            }
        };
        let future = self.inner.call(request);
        Box::pin(async move {
            let response = future.await?;
            if !cut {
                return Ok(response);
            }
            // Drain the real body so the handler's work is complete, then fail instead.
            let (parts, body) = response.into_parts();
            let _ = http_body_util_collect(body).await;
            Ok(http::Response::from_parts(parts, Body::new(FailingBody)))
        })
    }
}

async fn http_body_util_collect(mut body: Body) -> Vec<Bytes> {
    use http_body::Body as _;
    let mut chunks = Vec::new();
    let mut body = Pin::new(&mut body);
    while let Some(frame) = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
        if let Ok(frame) = frame
            && let Ok(data) = frame.into_data()
        {
            chunks.push(data);
        }
    }
    chunks
}

struct FailingBody;

impl http_body::Body for FailingBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>> {
        Poll::Ready(Some(Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "response cut after commit",
        ))))
    }
}

/// `events` are the run's 1..n without gaps or duplicates, and each extends the hash
/// chain from the run's genesis.
pub fn assert_chain_from_genesis(
    run_id: &str,
    events: &[runplane_run_store::store::entities::event::Model],
) {
    use runplane_run_store::domain::chain::{self, ChainedEvent};
    let mut head = chain::genesis(run_id);
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e.sequence, i as i64 + 1, "no gaps, no duplicates");
        head = chain::extend(
            &head,
            &ChainedEvent {
                sequence: e.sequence as u64,
                kind: e.kind,
                check: e.is_check,
                name: &e.name,
                text: &e.text,
                data: &e.data,
                observed_at_us: e.observed_at_us,
            },
        );
        assert_eq!(head, e.digest, "event {} extends the chain", e.sequence);
    }
}

/// A CancelRun request.
pub fn cancel(run_id: &str, reason: &str, key: &str) -> runstore_pb::CancelRunRequest {
    runstore_pb::CancelRunRequest {
        run_id: run_id.into(),
        reason: reason.into(),
        idempotency_key: key.into(),
    }
}
/// AppendEvents with `events` under `batch_key`.
pub async fn append(
    runner: &mut RunnerClient,
    run_id: &str,
    batch_key: &str,
    events: Vec<runstore_pb::EventInput>,
) -> Result<runstore_pb::AppendEventsResponse, tonic::Status> {
    runner
        .append_events(runstore_pb::AppendEventsRequest {
            run_id: run_id.into(),
            batch_key: batch_key.into(),
            events,
        })
        .await
        .map(|r| r.into_inner())
}
/// A PollSteering that answers at once, acknowledging `acks`.
pub async fn poll(
    runner: &mut RunnerClient,
    run_id: &str,
    acks: Vec<runstore_pb::SteeringAck>,
) -> Result<runstore_pb::PollSteeringResponse, tonic::Status> {
    runner
        .poll_steering(runstore_pb::PollSteeringRequest {
            run_id: run_id.into(),
            acks,
            wait: None,
            max_messages: 0,
        })
        .await
        .map(|r| r.into_inner())
}
/// An acknowledgement that message `id` was applied.
pub fn applied(id: &str) -> runstore_pb::SteeringAck {
    runstore_pb::SteeringAck {
        message_id: id.into(),
        outcome: runstore_pb::AckOutcome::Applied as i32,
        attempts: 1,
        error: String::new(),
    }
}
/// SubmitResult with `verdict` and no final batch.
pub async fn submit(
    runner: &mut RunnerClient,
    run_id: &str,
    verdict: runstore_pb::Verdict,
) -> Result<runstore_pb::SubmitResultResponse, tonic::Status> {
    runner
        .submit_result(runstore_pb::SubmitResultRequest {
            run_id: run_id.into(),
            verdict: Some(verdict),
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner())
}
/// The run's receipt body, verified against the store's public key.
pub async fn receipt(h: &Harness, run_id: &str) -> runstore_pb::ReceiptBody {
    let receipt = h
        .operator()
        .await
        .get_receipt(runstore_pb::GetReceiptRequest {
            run_id: run_id.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .receipt
        .unwrap();
    runplane_run_store::domain::receipt::verify(&receipt, &h.store.receipt_public_key())
        .expect("receipt verifies")
}
