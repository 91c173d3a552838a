//! A steer applied just before the agent exits is acknowledged before the verdict.
//!
//! The runner library ([`runplane_runner::run`]) runs a real agent (`sh`, which reads one
//! line and exits) against a real run store, reached through a forwarding RunnerService
//! that refuses every steering long poll carrying acknowledgements: the poll the loop
//! sends right after it applied the steer never lands, as when the agent exits before
//! that poll reaches the store (or the poll fails and the loop is in its backoff). The
//! agent exits on the steer; the runner stops its loop and must still acknowledge the
//! steer, or the message stays pending for ever on the ended run.

mod common;

use std::time::Duration;

use common::TOKEN;
use runplane_config::Secret;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_proto::runstore::v1::runner_service_client::RunnerServiceClient;
use runplane_proto::runstore::v1::runner_service_server::{RunnerService, RunnerServiceServer};
use runplane_run_store::RunStore;
use runplane_runner::RunnerEnv;
use runplane_testkit::authed;
use runplane_testkit::run_store::serve_on_own_runtime;
use runplane_transport::RetryConfig;
use tonic::{Request, Response, Status};

/// Forwards the runner's calls to the run store, with their metadata (the run key), and
/// refuses the steering loop's long polls that carry acknowledgements.
struct AcksHeldBack {
    upstream: RunnerServiceClient<tonic::transport::Channel>,
    refused: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

fn forwarded<T>(request: Request<T>) -> Request<T> {
    let (metadata, _, message) = request.into_parts();
    let mut forwarded = Request::new(message);
    *forwarded.metadata_mut() = metadata;
    forwarded
}

#[tonic::async_trait]
impl RunnerService for AcksHeldBack {
    async fn hello(
        &self,
        request: Request<runstore_pb::HelloRequest>,
    ) -> Result<Response<runstore_pb::HelloResponse>, Status> {
        self.upstream.clone().hello(forwarded(request)).await
    }

    async fn append_events(
        &self,
        request: Request<runstore_pb::AppendEventsRequest>,
    ) -> Result<Response<runstore_pb::AppendEventsResponse>, Status> {
        self.upstream
            .clone()
            .append_events(forwarded(request))
            .await
    }

    async fn poll_steering(
        &self,
        request: Request<runstore_pb::PollSteeringRequest>,
    ) -> Result<Response<runstore_pb::PollSteeringResponse>, Status> {
        let poll = request.get_ref();
        if !poll.acks.is_empty() && poll.wait.is_some() {
            self.refused
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            return Err(Status::unavailable("held back by the test"));
        }
        self.upstream
            .clone()
            .poll_steering(forwarded(request))
            .await
    }

    async fn submit_result(
        &self,
        request: Request<runstore_pb::SubmitResultRequest>,
    ) -> Result<Response<runstore_pb::SubmitResultResponse>, Status> {
        self.upstream
            .clone()
            .submit_result(forwarded(request))
            .await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steer_applied_as_the_agent_exits_is_acknowledged_before_the_verdict() {
    let sqlite = runplane_testkit::TestSqlite::new();
    let config = runplane_testkit::config::run_store(TOKEN, &sqlite.url());
    let addr = runplane_testkit::free_local_addr().to_string();
    let endpoint = format!("http://{addr}");
    let server = serve_on_own_runtime(&config, addr.clone());
    let upstream = common::connected(&endpoint).await;

    let proxy_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy_endpoint = format!("http://{}", proxy_listener.local_addr().unwrap());
    let refused = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let proxy = AcksHeldBack {
        upstream: RunnerServiceClient::new(upstream.clone()),
        refused: refused.clone(),
    };
    let _proxy = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RunnerServiceServer::new(proxy))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(
                proxy_listener,
            )),
    );

    let mut op = RunServiceClient::new(upstream);
    let (run, key) = common::run_with_key(
        &mut op,
        "acks-at-exit-request-1",
        "sh",
        vec!["-c".into(), "read line; echo \"got $line\"".into()],
        "acks-at-exit-key-00001",
    )
    .await;
    // Queued before the runner starts: its first poll serves it.
    op.steer(authed(
        runstore_pb::SteerRequest {
            run_id: run.id.clone(),
            text: "hello".into(),
            idempotency_key: "acks-at-exit-steer-001".into(),
        },
        TOKEN,
    ))
    .await
    .unwrap();

    let outcome = tokio::time::timeout(
        Duration::from_secs(60),
        runplane_runner::run(
            RunnerEnv {
                endpoint: proxy_endpoint.clone(),
                recovery_endpoint: proxy_endpoint,
                run_id: run.id.clone(),
                run_key: Secret::new(key),
            },
            RetryConfig {
                ordinary_budget: Duration::from_secs(2),
                ..RetryConfig::default()
            },
            runplane_clock::SystemClock::shared(),
        ),
    )
    .await
    .expect("the runner ends within 60 s")
    .unwrap();
    assert!(outcome.recorded, "{outcome:?}");
    // Either the loop's next poll was held back, or the agent exited before the loop
    // sent it: in both cases only the runner's own send at exit acknowledges the steer.
    let _held_back = refused.load(std::sync::atomic::Ordering::SeqCst);

    let store = RunStore::open(&config, runplane_clock::SystemClock::shared())
        .await
        .unwrap();
    let stdout: Vec<String> = store
        .store()
        .events_after(&run.id, 0, 100)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == runstore_pb::EventKind::Stdout as i32)
        .map(|e| e.text)
        .collect();
    assert_eq!(stdout, ["got hello"]);
    assert!(
        store
            .store()
            .pending_messages(&run.id, 100)
            .await
            .unwrap()
            .is_empty(),
        "the steer the agent took is acknowledged"
    );
    server.shutdown_background();
}
