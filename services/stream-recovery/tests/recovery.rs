//! Stream recovery over real gRPC, real Redis and a real run store on Postgres, with a
//! manual clock for the gaps: takeovers are bounded, handed to the runner as
//! resume_stream, and end the run with exactly one abort.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use runplane_clock::{Clock, ManualClock};
use runplane_config::{Config, Secret};
use runplane_grpc::client::Bearer;
use runplane_grpc::{ErrorReason, ServiceSet, error_info};
use runplane_proto::recovery::v1 as pb;
use runplane_proto::recovery::v1::stream_recovery_service_client::StreamRecoveryServiceClient;
use runplane_proto::runstore::v1 as rs;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_proto::runstore::v1::runner_service_client::RunnerServiceClient;
use runplane_run_store::RunStore;
use runplane_stream_recovery::StreamRecovery;
use runplane_stream_recovery::domain::policy::SWEEP_EVERY;
use runplane_stream_recovery::store::redis::RedisStore;
use runplane_testkit::{TestDatabase, TestRedis};
use tonic::Code;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

/// A number no other call in this process got, for client keys.
fn unique() -> u32 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    NEXT.fetch_add(1, Ordering::SeqCst)
}

const TOKEN: &str = "recovery-test-service-token-0123456789ab";

type Coordinator = StreamRecoveryServiceClient<InterceptedService<Channel, Bearer>>;

/// The run store's RunService, with EnqueueControl failing while `fail_enqueue` is set
/// (the run store unreachable just for the hand-off after a claim), its GetRun calls
/// counted (what polling the run store would cost), and each GetRun answered only once
/// it can take `get_run_gate` (a slow run store, held up for as long as a test needs).
#[derive(Clone)]
struct FaultyRunService<S> {
    inner: S,
    fail_enqueue: Arc<AtomicBool>,
    get_runs: Arc<AtomicUsize>,
    get_run_gate: Arc<tokio::sync::Mutex<()>>,
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for FaultyRunService<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> tower_service::Service<http::Request<tonic::body::Body>> for FaultyRunService<S>
where
    S: tower_service::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        >,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        if request.uri().path().ends_with("/EnqueueControl")
            && self.fail_enqueue.load(Ordering::SeqCst)
        {
            return Box::pin(async { Ok(tonic::Status::unavailable("injected").into_http()) });
        }
        if request.uri().path().ends_with("/GetRun") {
            self.get_runs.fetch_add(1, Ordering::SeqCst);
            let gate = self.get_run_gate.clone();
            let answer = self.inner.call(request);
            return Box::pin(async move {
                drop(gate.lock().await);
                answer.await
            });
        }
        Box::pin(self.inner.call(request))
    }
}

struct World {
    clock: ManualClock,
    fail_enqueue: Arc<AtomicBool>,
    get_runs: Arc<AtomicUsize>,
    get_run_gate: Arc<tokio::sync::Mutex<()>>,
    backend: Backend,
    config: Config,
    run_store: RunStore,
    run_store_endpoint: String,
    coordinator_endpoint: String,
    _db: TestDatabase,
    _redis: TestRedis,
}

/// Where the coordinator keeps its state.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Backend {
    Redis,
    /// The local 3-master Redis Cluster.
    Cluster,
    Memory,
}

async fn serve(services: ServiceSet) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(runplane_grpc::serve(
        listener,
        services,
        std::future::pending(),
        Duration::from_secs(1),
    ));
    endpoint
}

impl World {
    /// `dead_run_store`: the coordinator is pointed at a run store that is not there.
    async fn new(dead_run_store: bool) -> Self {
        Self::on(dead_run_store, Backend::Redis).await
    }

    async fn on(dead_run_store: bool, backend: Backend) -> Self {
        Self::sweeping(dead_run_store, backend, SWEEP_EVERY).await
    }

    /// With the coordinator's own sweep running every `sweep_every`.
    async fn sweeping(dead_run_store: bool, backend: Backend, sweep_every: Duration) -> Self {
        let db = TestDatabase::new().await;
        let redis = match backend {
            Backend::Cluster => TestRedis::cluster().await,
            Backend::Redis | Backend::Memory => TestRedis::new().await,
        };
        let mut config = Config::default();
        config.auth.operator_token = Secret::new(TOKEN);
        config.auth.service_token = Secret::new(runplane_testkit::SERVICE_TOKEN);
        config.run_store.database_url = db.url().to_owned();
        config.run_store.receipt_signing_key =
            Secret::new(runplane_run_store::domain::receipt::ReceiptSigner::generate().seed_hex());
        // Not about admission: runs are created on the credential they name.
        config.run_store.admission = false;
        let run_store = RunStore::open(&config, runplane_clock::SystemClock::shared())
            .await
            .unwrap();
        let fail_enqueue = Arc::new(AtomicBool::new(false));
        let get_runs = Arc::new(AtomicUsize::new(0));
        let get_run_gate = Arc::default();
        let (runner_service, run_service) = run_store.services();
        let mut services = ServiceSet::new();
        services
            .authenticate(runplane_grpc::auth::Tokens::from_config(&config.auth))
            .add(runner_service)
            .add(FaultyRunService {
                inner: run_service,
                fail_enqueue: fail_enqueue.clone(),
                get_runs: get_runs.clone(),
                get_run_gate: Arc::clone(&get_run_gate),
            });
        let run_store_endpoint = serve(services).await;

        config.run_store.endpoint = if dead_run_store {
            format!("http://{}", runplane_testkit::free_local_addr())
        } else {
            run_store_endpoint.clone()
        };
        let clock = ManualClock::new(chrono::DateTime::from_timestamp(1_800_000_000, 0).unwrap());
        let coordinator = match backend {
            Backend::Redis | Backend::Cluster => {
                let store = RedisStore::connect(redis.url(), redis.prefix())
                    .await
                    .unwrap();
                StreamRecovery::with_store(Arc::new(store), &config, Arc::new(clock.clone()))
                    .unwrap()
            }
            Backend::Memory => StreamRecovery::embedded(&config, Arc::new(clock.clone())).unwrap(),
        }
        .with_sweep_every(sweep_every);
        let mut services = ServiceSet::new();
        coordinator.register(&mut services);
        let coordinator_endpoint = serve(services).await;
        Self {
            clock,
            fail_enqueue,
            get_runs,
            get_run_gate,
            backend,
            config,
            run_store,
            run_store_endpoint,
            coordinator_endpoint,
            _db: db,
            _redis: redis,
        }
    }

    /// A second coordinator on the same Redis (a replica); None in memory, which is one
    /// process's.
    async fn replica(&self) -> Option<String> {
        if self.backend == Backend::Memory {
            return None;
        }
        let store = RedisStore::connect(self._redis.url(), self._redis.prefix())
            .await
            .unwrap();
        let coordinator =
            StreamRecovery::with_store(Arc::new(store), &self.config, Arc::new(self.clock.clone()))
                .unwrap();
        let mut services = ServiceSet::new();
        coordinator.register(&mut services);
        Some(serve(services).await)
    }

    async fn channel(endpoint: &str) -> Channel {
        tonic::transport::Endpoint::from_shared(endpoint.to_owned())
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    async fn operator(&self) -> Coordinator {
        StreamRecoveryServiceClient::with_interceptor(
            Self::channel(&self.coordinator_endpoint).await,
            Bearer::new(TOKEN),
        )
    }

    async fn runner(&self, key: &str) -> Coordinator {
        StreamRecoveryServiceClient::with_interceptor(
            Self::channel(&self.coordinator_endpoint).await,
            Bearer::new(key),
        )
    }

    /// A running run and its key.
    async fn running_run(&self) -> (String, String) {
        let run_id = self.queued_run().await;
        let key = self.start(&run_id).await;
        (run_id, key)
    }

    /// A run that waits in the queue: no sandbox, no runner.
    async fn queued_run(&self) -> String {
        let mut op = RunServiceClient::with_interceptor(
            Self::channel(&self.run_store_endpoint).await,
            Bearer::new(TOKEN),
        );
        op.create_run(rs::CreateRunRequest {
            client_request_id: format!("recovery-test-request-{}", unique()),
            org_id: "acme".into(),
            target: Some(rs::create_run_request::Target::CredentialId("c".into())),
            command: "agent".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap()
        .id
    }

    /// Issues the run's key and says Hello as its runner: the run is running, and its
    /// runner has not acquired the stream lease yet.
    async fn start(&self, run_id: &str) -> String {
        let mut op = RunServiceClient::with_interceptor(
            Self::channel(&self.run_store_endpoint).await,
            Bearer::new(TOKEN),
        );
        let key = op
            .issue_run_key(rs::IssueRunKeyRequest {
                run_id: run_id.to_owned(),
                sandbox_id: "sbx".into(),
                sandbox_generation: 1,
                idempotency_key: format!("recovery-test-key-{:04}", unique()),
            })
            .await
            .unwrap()
            .into_inner()
            .run_key;
        RunnerServiceClient::with_interceptor(
            Self::channel(&self.run_store_endpoint).await,
            Bearer::new(key.clone()),
        )
        .hello(rs::HelloRequest {
            run_id: run_id.to_owned(),
            nonce: "recovery-runner-nonce-1".into(),
            runner_version: String::new(),
        })
        .await
        .unwrap();
        key
    }

    /// The runner acquires the stream lease as the run's first controller.
    async fn acquire(&self, run_id: &str, key: &str) -> String {
        self.runner(key)
            .await
            .acquire_lease(pb::AcquireLeaseRequest {
                run_id: run_id.to_owned(),
                controller_id: "runner-first-controller".into(),
                ttl: None,
            })
            .await
            .unwrap()
            .into_inner()
            .controller_token
    }

    /// The run's steering messages of `kind` (acknowledged or not).
    async fn messages(&self, run_id: &str, kind: rs::SteeringKind) -> Vec<rs::SteeringMessage> {
        self.run_store
            .store()
            .pending_messages(run_id, 100)
            .await
            .unwrap()
            .iter()
            .map(runplane_run_store::convert::message)
            .filter(|m| m.kind() == kind)
            .collect()
    }

    async fn run_state(&self, run_id: &str) -> rs::Run {
        RunServiceClient::with_interceptor(
            Self::channel(&self.run_store_endpoint).await,
            Bearer::new(TOKEN),
        )
        .get_run(rs::GetRunRequest {
            run_id: run_id.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap()
    }

    async fn budget(&self, run_id: &str) -> pb::GetRecoveryBudgetResponse {
        self.operator()
            .await
            .get_recovery_budget(pb::GetRecoveryBudgetRequest {
                run_id: run_id.into(),
            })
            .await
            .unwrap()
            .into_inner()
    }
}

fn frames(range: std::ops::RangeInclusive<u64>) -> Vec<pb::FrameInput> {
    range
        .map(|s| pb::FrameInput {
            sequence: s,
            data: format!("frame {s}").into_bytes(),
        })
        .collect()
}

fn plan(run_id: &str) -> pb::PlanRecoveryRequest {
    pb::PlanRecoveryRequest {
        run_id: run_id.into(),
        reason: "tail".into(),
    }
}

/// How each controller fails.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Failure {
    /// It dies (a thrown error, a killed process): its lease lapses.
    LeaseLapses,
    /// Its append keeps failing and it hands off: it releases its lease at once.
    HandsOff,
}

/// Controllers keep failing. `tails` planners ask at once at every step, as several tabs
/// or pods tailing one run would.
async fn exhausts_after_five_takeovers_with_one_abort(tails: usize, failure: Failure) {
    let w = World::new(false).await;
    let (run_id, key) = w.running_run().await;
    let mut runner = w.runner(&key).await;
    let first = runner
        .acquire_lease(pb::AcquireLeaseRequest {
            run_id: run_id.clone(),
            controller_id: "runner-first-controller".into(),
            ttl: None,
        })
        .await
        .unwrap()
        .into_inner();
    runner
        .append_frames(pb::AppendFramesRequest {
            run_id: run_id.clone(),
            controller_token: first.controller_token.clone(),
            frames: frames(1..=3),
            resync: false,
        })
        .await
        .unwrap();

    let mut waits = Vec::new();
    let mut current = first.controller_token.clone();
    for attempt in 1..=5u32 {
        match failure {
            // The controller died: its lease lapses, and any backoff runs out.
            Failure::LeaseLapses => w.clock.advance(Duration::from_secs(61)),
            // The controller gives up: it releases, and the planners wait out the backoff.
            Failure::HandsOff => {
                let released = runner
                    .release_lease(pb::ReleaseLeaseRequest {
                        run_id: run_id.clone(),
                        controller_token: current.clone(),
                    })
                    .await
                    .unwrap()
                    .into_inner();
                assert!(released.released);
                let budget = w.budget(&run_id).await.budget.unwrap();
                let now = w.clock.now().timestamp_millis();
                let wait_ms = budget
                    .not_before
                    .map(|t| t.seconds * 1000 + i64::from(t.nanos / 1_000_000) - now + 1)
                    .unwrap_or(0)
                    .max(0);
                w.clock.advance(Duration::from_millis(wait_ms as u64));
            }
        }
        let calls: Vec<_> = (0..tails)
            .map(|_| {
                let run_id = run_id.clone();
                let w = &w;
                async move { w.operator().await.plan_recovery(plan(&run_id)).await }
            })
            .collect();
        let answers = futures::future::join_all(calls).await;
        let claimed: Vec<_> = answers
            .iter()
            .filter_map(|a| a.as_ref().ok())
            .filter(|a| a.get_ref().decision() == pb::RecoveryDecision::Claimed)
            .collect();
        assert_eq!(
            claimed.len(),
            1,
            "attempt {attempt}: one claim among {tails} planners"
        );
        let budget = w.budget(&run_id).await.budget.unwrap();
        assert_eq!(budget.attempts, attempt);
        waits.push(budget.not_before.unwrap().seconds - budget.claimed_at.unwrap().seconds);
        let resumes = w.messages(&run_id, rs::SteeringKind::ResumeStream).await;
        if let Some(rs::steering_message::Payload::ResumeStream(p)) =
            &resumes.last().unwrap().payload
        {
            current = p.controller_token.clone();
        }
    }
    assert!(
        waits.windows(2).all(|p| p[1] >= p[0]),
        "the waits grow: {waits:?}"
    );
    assert!(waits.last() > waits.first(), "the waits grow: {waits:?}");

    let resumes = w.messages(&run_id, rs::SteeringKind::ResumeStream).await;
    assert_eq!(resumes.len(), 5, "exactly five resume_stream messages");
    for (i, m) in resumes.iter().enumerate() {
        let Some(rs::steering_message::Payload::ResumeStream(p)) = &m.payload else {
            panic!("not a resume_stream payload");
        };
        assert_eq!((p.attempt, p.next_sequence), (i as u32 + 1, 4));
    }

    w.clock.advance(Duration::from_secs(61));
    let err = w
        .operator()
        .await
        .plan_recovery(plan(&run_id))
        .await
        .unwrap_err();
    assert_eq!(
        error_info(&err).unwrap().reason,
        ErrorReason::RecoveryExhausted.as_str_name()
    );
    let run = w.run_state(&run_id).await;
    assert_eq!(run.state(), rs::RunState::Failed);
    assert_eq!(run.failure_reason, "stream_recovery_exhausted");

    // Later tails find the run terminal; nothing more reaches the runner.
    for _ in 0..3 {
        w.clock.advance(Duration::from_secs(61));
        let later = w
            .operator()
            .await
            .plan_recovery(plan(&run_id))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(later.decision(), pb::RecoveryDecision::RunTerminal);
    }
    assert_eq!(
        w.messages(&run_id, rs::SteeringKind::Abort).await.len(),
        1,
        "exactly one abort"
    );
    assert_eq!(
        w.messages(&run_id, rs::SteeringKind::ResumeStream)
            .await
            .len(),
        5
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_controllers_keep_dying_ends_after_five_takeovers_with_one_tail() {
    exhausts_after_five_takeovers_with_one_abort(1, Failure::LeaseLapses).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_controllers_keep_dying_ends_after_five_takeovers_with_three_tails() {
    exhausts_after_five_takeovers_with_one_abort(3, Failure::LeaseLapses).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_appends_keep_failing_ends_after_five_hand_offs_with_one_tail() {
    exhausts_after_five_takeovers_with_one_abort(1, Failure::HandsOff).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_appends_keep_failing_ends_after_five_hand_offs_with_three_tails() {
    exhausts_after_five_takeovers_with_one_abort(3, Failure::HandsOff).await;
}

/// A lease TTL of a far-off number of seconds is refused like any TTL out of range; it
/// must not overflow the conversion to milliseconds (a panic in a checked build, a
/// wrapped value that passes the range check in a release one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_ttl_past_its_range_is_refused_not_overflowed() {
    let w = World::new(false).await;
    let (run_id, key) = w.running_run().await;
    let mut runner = w.runner(&key).await;
    for seconds in [i64::MAX, i64::MAX / 1000 + 1, -1] {
        let refused = runner
            .acquire_lease(pb::AcquireLeaseRequest {
                run_id: run_id.clone(),
                controller_id: "runner-ttl-check".into(),
                ttl: Some(prost_types::Duration { seconds, nanos: 0 }),
            })
            .await
            .expect_err("an out-of-range ttl was accepted");
        assert_eq!(
            refused.code(),
            tonic::Code::InvalidArgument,
            "{seconds}: {refused:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frame_sequences_past_their_bound_are_refused_not_overflowed() {
    let w = World::new(false).await;
    let (run_id, key) = w.running_run().await;
    let mut runner = w.runner(&key).await;
    let token = runner
        .acquire_lease(pb::AcquireLeaseRequest {
            run_id: run_id.clone(),
            controller_id: "runner-overflow-check".into(),
            ttl: None,
        })
        .await
        .unwrap()
        .into_inner()
        .controller_token;
    for sequences in [vec![u64::MAX, 0], vec![u64::MAX], vec![(1 << 53) + 1]] {
        let refused = runner
            .append_frames(pb::AppendFramesRequest {
                run_id: run_id.clone(),
                controller_token: token.clone(),
                frames: sequences
                    .iter()
                    .map(|&sequence| pb::FrameInput {
                        sequence,
                        data: b"x".to_vec(),
                    })
                    .collect(),
                resync: false,
            })
            .await
            .unwrap_err();
        assert_eq!(
            refused.code(),
            tonic::Code::InvalidArgument,
            "{sequences:?}: {refused:?}"
        );
    }
    // Nothing was appended: the stream still starts at 1.
    let appended = runner
        .append_frames(pb::AppendFramesRequest {
            run_id: run_id.clone(),
            controller_token: token,
            frames: frames(1..=1),
            resync: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(appended.next_sequence, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_takeover_is_immediate_and_completes_what_the_old_controller_could_not() {
    let w = World::new(false).await;
    let (run_id, key) = w.running_run().await;
    let mut runner = w.runner(&key).await;
    let old = runner
        .acquire_lease(pb::AcquireLeaseRequest {
            run_id: run_id.clone(),
            controller_id: "runner-first-controller".into(),
            ttl: None,
        })
        .await
        .unwrap()
        .into_inner()
        .controller_token;
    runner
        .append_frames(pb::AppendFramesRequest {
            run_id: run_id.clone(),
            controller_token: old.clone(),
            frames: frames(1..=2),
            resync: false,
        })
        .await
        .unwrap();
    // The old controller's next append never lands; its lease lapses.
    w.clock.advance(Duration::from_secs(31));
    let claim = w
        .operator()
        .await
        .plan_recovery(plan(&run_id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        claim.decision(),
        pb::RecoveryDecision::Claimed,
        "immediate: no backoff before the first"
    );
    assert_eq!(claim.next_sequence, 3);

    let fenced = runner
        .append_frames(pb::AppendFramesRequest {
            run_id: run_id.clone(),
            controller_token: old,
            frames: frames(3..=3),
            resync: false,
        })
        .await
        .unwrap_err();
    assert_eq!(
        error_info(&fenced).unwrap().reason,
        ErrorReason::LeaseFenced.as_str_name()
    );

    let resume = w.messages(&run_id, rs::SteeringKind::ResumeStream).await;
    let Some(rs::steering_message::Payload::ResumeStream(p)) = &resume[0].payload else {
        panic!("a resume_stream message");
    };
    let appended = runner
        .append_frames(pb::AppendFramesRequest {
            run_id: run_id.clone(),
            controller_token: p.controller_token.clone(),
            frames: frames(3..=4),
            resync: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        appended.next_sequence, 5,
        "the next controller completed the stream"
    );

    // The new controller fails too and hands off at once (releases its lease): the next
    // takeover waits out the backoff instead of following straight away.
    let released = runner
        .release_lease(pb::ReleaseLeaseRequest {
            run_id: run_id.clone(),
            controller_token: p.controller_token.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(released.released);
    let wait = w.operator().await.plan_recovery(plan(&run_id)).await;
    match wait {
        Err(e) => assert_eq!(
            error_info(&e).unwrap().reason,
            ErrorReason::RecoveryNotBefore.as_str_name()
        ),
        Ok(a) => panic!("claimed again inside the backoff: {:?}", a.into_inner()),
    }
    assert_eq!(w.budget(&run_id).await.budget.unwrap().attempts, 1);
    w.clock.advance(Duration::from_secs(2));
    let second = w
        .operator()
        .await
        .plan_recovery(plan(&run_id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(second.decision(), pb::RecoveryDecision::Claimed);
    assert_eq!(second.budget.unwrap().attempts, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_that_fails_before_it_starts_spends_nothing() {
    let w = World::new(true).await;
    let err = w
        .operator()
        .await
        .plan_recovery(plan("01a22b9d-7bd7-76e7-a072-4dd6efe3ec58"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    assert_eq!(
        error_info(&err).unwrap().reason,
        ErrorReason::UpstreamUnavailable.as_str_name()
    );
    let budget = w.budget("01a22b9d-7bd7-76e7-a072-4dd6efe3ec58").await;
    assert_eq!(budget.budget.unwrap().attempts, 0);
    assert_eq!(budget.lease.unwrap().state(), pb::LeaseState::Free);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_run_is_never_taken_over() {
    let w = World::new(false).await;
    let (run_id, key) = w.running_run().await;
    let mut runner = w.runner(&key).await;
    let token = runner
        .acquire_lease(pb::AcquireLeaseRequest {
            run_id: run_id.clone(),
            controller_id: "parked-controller-0001".into(),
            ttl: None,
        })
        .await
        .unwrap()
        .into_inner()
        .controller_token;
    for _ in 0..10 {
        w.clock.advance(Duration::from_secs(20));
        runner
            .renew_lease(pb::RenewLeaseRequest {
                run_id: run_id.clone(),
                controller_token: token.clone(),
                ttl: None,
            })
            .await
            .unwrap();
        let answer = w
            .operator()
            .await
            .plan_recovery(plan(&run_id))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(answer.decision(), pb::RecoveryDecision::LeaseHeld);
    }
    assert!(
        w.messages(&run_id, rs::SteeringKind::ResumeStream)
            .await
            .is_empty()
    );
    assert_eq!(w.budget(&run_id).await.budget.unwrap().attempts, 0);
    let _ = w.clock.now();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_controller_must_come_through_a_claim_and_keys_are_checked() {
    let w = World::new(false).await;
    let (run_id, key) = w.running_run().await;
    let mut runner = w.runner(&key).await;
    runner
        .acquire_lease(pb::AcquireLeaseRequest {
            run_id: run_id.clone(),
            controller_id: "runner-first-controller".into(),
            ttl: None,
        })
        .await
        .unwrap();
    let held = runner
        .acquire_lease(pb::AcquireLeaseRequest {
            run_id: run_id.clone(),
            controller_id: "a-second-controller-01".into(),
            ttl: None,
        })
        .await
        .unwrap_err();
    assert_eq!(
        error_info(&held).unwrap().reason,
        ErrorReason::LeaseHeld.as_str_name()
    );
    w.clock.advance(Duration::from_secs(31));
    let takeover = runner
        .acquire_lease(pb::AcquireLeaseRequest {
            run_id: run_id.clone(),
            controller_id: "a-second-controller-01".into(),
            ttl: None,
        })
        .await
        .unwrap_err();
    assert_eq!(
        error_info(&takeover).unwrap().reason,
        ErrorReason::LeaseTakeoverRequired.as_str_name()
    );

    let mut stranger = w.runner("rk_not-a-key-anyone-was-given").await;
    let refused = stranger
        .acquire_lease(pb::AcquireLeaseRequest {
            run_id,
            controller_id: "stranger-controller-01".into(),
            ttl: None,
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_window_starts_a_fresh_budget() {
    let w = World::new(false).await;
    let (run_id, key) = w.running_run().await;
    w.acquire(&run_id, &key).await;
    for attempt in 1..=2 {
        w.clock.advance(Duration::from_secs(61));
        let claim = w
            .operator()
            .await
            .plan_recovery(plan(&run_id))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(claim.budget.unwrap().attempts, attempt);
    }
    w.clock.advance(Duration::from_secs(5 * 60 + 1));
    let fresh = w
        .operator()
        .await
        .plan_recovery(plan(&run_id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(fresh.decision(), pb::RecoveryDecision::Claimed);
    assert_eq!(
        fresh.budget.unwrap().attempts,
        1,
        "a takeover after 5 quiet minutes starts over"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_settles_runs_nobody_can_own_and_leaves_parked_ones() {
    let w = World::new(false).await;
    let (run_id, key) = w.running_run().await;
    w.acquire(&run_id, &key).await;
    // Spend the budget without a successor ever starting.
    for _ in 0..5 {
        w.clock.advance(Duration::from_secs(61));
        w.operator()
            .await
            .plan_recovery(plan(&run_id))
            .await
            .unwrap();
    }
    w.clock.advance(Duration::from_secs(61));
    // An unknown run with state left behind, and a parked one.
    let mut stranger = w.runner(&key).await;
    let _ = stranger
        .get_recovery_budget(pb::GetRecoveryBudgetRequest {
            run_id: run_id.clone(),
        })
        .await;

    let mut op = w.operator().await;
    let dry = op
        .sweep_orphans(pb::SweepOrphansRequest {
            cursor: String::new(),
            limit: 10,
            dry_run: true,
        })
        .await
        .unwrap()
        .into_inner();
    let action = |r: &pb::SweepOrphansResponse| {
        r.results
            .iter()
            .find(|x| x.run_id == run_id)
            .map(|x| x.action())
            .unwrap()
    };
    assert_eq!(action(&dry), pb::OrphanAction::RunEnded);
    assert_eq!(
        w.run_state(&run_id).await.state(),
        rs::RunState::Running,
        "a dry run changes nothing"
    );

    let swept = op
        .sweep_orphans(pb::SweepOrphansRequest {
            cursor: String::new(),
            limit: 10,
            dry_run: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(action(&swept), pb::OrphanAction::RunEnded);
    assert_eq!(
        w.run_state(&run_id).await.failure_reason,
        "stream_recovery_exhausted"
    );
    assert_eq!(w.messages(&run_id, rs::SteeringKind::Abort).await.len(), 1);
    // The run is terminal now: the next pass deletes its keys.
    let next = op
        .sweep_orphans(pb::SweepOrphansRequest {
            cursor: String::new(),
            limit: 10,
            dry_run: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(action(&next), pb::OrphanAction::KeysDeleted);
}

/// A following tail, read in the background; `next` waits for its next item.
struct Follower {
    items: tokio::sync::mpsc::UnboundedReceiver<pb::tail_response::Item>,
}

impl Follower {
    async fn open(w: &World, run_id: &str) -> Self {
        let mut stream = w
            .operator()
            .await
            .tail(pb::TailRequest {
                run_id: run_id.to_owned(),
                from_sequence: 0,
                follow: true,
                heartbeat_interval: None,
            })
            .await
            .unwrap()
            .into_inner();
        let (tx, items) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok(Some(item)) = stream.message().await {
                // Heartbeats say only that the tail is alive; these tests read what it says.
                if let Some(item) = item.item
                    && !matches!(item, pb::tail_response::Item::Heartbeat(_))
                    && tx.send(item).is_err()
                {
                    return;
                }
            }
        });
        Self { items }
    }

    async fn next(&mut self) -> pb::tail_response::Item {
        self.within(Duration::from_secs(10)).await
    }

    async fn within(&mut self, bound: Duration) -> pb::tail_response::Item {
        tokio::time::timeout(bound, self.items.recv())
            .await
            .unwrap_or_else(|_| panic!("the tail sent nothing within {bound:?}"))
            .expect("the tail is open")
    }

    fn decision(item: &pb::tail_response::Item) -> Option<pb::RecoveryDecision> {
        match item {
            pb::tail_response::Item::Recovery(r) => Some(r.decision()),
            _ => None,
        }
    }
}

async fn a_queued_run_is_never_taken_over_and_later_runs_normally(backend: Backend) {
    let w = World::on(false, backend).await;
    let run_id = w.queued_run().await;
    let mut tail = Follower::open(&w, &run_id).await;
    assert!(matches!(
        tail.next().await,
        pb::tail_response::Item::CaughtUp(_)
    ));
    // The tail plans as soon as it caught up, and says there is no controller to replace.
    assert_eq!(
        Follower::decision(&tail.next().await),
        Some(pb::RecoveryDecision::NoControllerYet)
    );
    // Three simulated minutes of watchers planning every few seconds, as in the field.
    for _ in 0..45 {
        w.clock.advance(Duration::from_secs(4));
        let answer = w
            .operator()
            .await
            .plan_recovery(plan(&run_id))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(answer.decision(), pb::RecoveryDecision::NoControllerYet);
    }
    let spent = w.budget(&run_id).await;
    assert_eq!(spent.budget.unwrap().attempts, 0, "nothing was spent");
    assert_eq!(spent.lease.unwrap().state(), pb::LeaseState::Free);
    assert_eq!(w.run_state(&run_id).await.state(), rs::RunState::Queued);
    assert!(
        w.messages(&run_id, rs::SteeringKind::ResumeStream)
            .await
            .is_empty()
    );

    // The run starts; until its runner acquires, a plan still finds no controller.
    let key = w.start(&run_id).await;
    w.clock.advance(Duration::from_secs(61));
    let before_acquire = w
        .operator()
        .await
        .plan_recovery(plan(&run_id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        before_acquire.decision(),
        pb::RecoveryDecision::NoControllerYet
    );
    // Its runner is the first controller: it acquires directly and streams.
    let token = w.acquire(&run_id, &key).await;
    w.runner(&key)
        .await
        .append_frames(pb::AppendFramesRequest {
            run_id: run_id.clone(),
            controller_token: token,
            frames: frames(1..=3),
            resync: false,
        })
        .await
        .unwrap();
    let mut seen = Vec::new();
    while seen.len() < 3 {
        match tail.next().await {
            pb::tail_response::Item::Frame(f) => seen.push(f.sequence),
            pb::tail_response::Item::Recovery(r) => {
                assert_eq!(
                    r.decision(),
                    pb::RecoveryDecision::NoControllerYet,
                    "the tail never claims"
                )
            }
            other => panic!("unexpected tail item {other:?}"),
        }
    }
    assert_eq!(seen, [1, 2, 3], "the same tail keeps serving frames");
    let held = w
        .operator()
        .await
        .plan_recovery(plan(&run_id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(held.decision(), pb::RecoveryDecision::LeaseHeld);
    assert_eq!(w.budget(&run_id).await.budget.unwrap().attempts, 0);
    assert!(
        w.messages(&run_id, rs::SteeringKind::ResumeStream)
            .await
            .is_empty()
    );
}

async fn a_failed_hand_off_after_a_claim_changes_nothing(backend: Backend) {
    let w = World::on(false, backend).await;
    let (run_id, key) = w.running_run().await;
    let old = w.acquire(&run_id, &key).await;
    // One takeover already spent, so "unchanged" has a budget to compare with.
    w.clock.advance(Duration::from_secs(31));
    let first = w
        .operator()
        .await
        .plan_recovery(plan(&run_id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.decision(), pb::RecoveryDecision::Claimed);
    w.clock.advance(Duration::from_secs(61));
    let before = w.budget(&run_id).await;

    w.fail_enqueue.store(true, Ordering::SeqCst);
    let err = w
        .operator()
        .await
        .plan_recovery(plan(&run_id))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    let after = w.budget(&run_id).await;
    assert_eq!(after.budget, before.budget, "the budget is unchanged");
    assert_eq!(after.lease, before.lease, "the lease is as it was (lapsed)");
    assert_eq!(
        w.messages(&run_id, rs::SteeringKind::ResumeStream)
            .await
            .len(),
        1
    );

    // The run store answers again: the next plan claims attempt 2, not 3.
    w.fail_enqueue.store(false, Ordering::SeqCst);
    let second = w
        .operator()
        .await
        .plan_recovery(plan(&run_id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(second.decision(), pb::RecoveryDecision::Claimed);
    assert_eq!(second.budget.unwrap().attempts, 2);
    let _ = old;
}

/// Spends a running run's whole budget: five takeovers, each controller dying at once.
/// Leaves the fifth claim's lease held.
async fn spend_budget(w: &World, run_id: &str) {
    for attempt in 1..=5 {
        w.clock.advance(Duration::from_secs(61));
        let claim = w
            .operator()
            .await
            .plan_recovery(plan(run_id))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(claim.budget.unwrap().attempts, attempt);
    }
}

async fn wait_for(what: &str, mut done: impl AsyncFnMut() -> bool) {
    for _ in 0..200 {
        if done().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what} never happened");
}

async fn the_scheduled_sweep_ends_spent_runs_and_respects_the_reset(backend: Backend) {
    let w = World::sweeping(false, backend, Duration::from_millis(100)).await;
    // A run whose budget was spent more than 5 minutes ago: a claim would start afresh.
    let (quiet, key) = w.running_run().await;
    w.acquire(&quiet, &key).await;
    spend_budget(&w, &quiet).await;
    // One jump, while the fifth claim's lease is still held, past the reset window.
    w.clock.advance(Duration::from_secs(5 * 60 + 1));
    // A run whose budget is spent now.
    let (spent, key) = w.running_run().await;
    w.acquire(&spent, &key).await;
    spend_budget(&w, &spent).await;
    w.clock.advance(Duration::from_secs(61));

    // Nobody calls SweepOrphans: the coordinator's own sweep ends the spent run...
    wait_for("the sweep ending the spent run", async || {
        w.run_state(&spent).await.state() == rs::RunState::Failed
    })
    .await;
    assert_eq!(
        w.run_state(&spent).await.failure_reason,
        "stream_recovery_exhausted"
    );
    assert_eq!(w.messages(&spent, rs::SteeringKind::Abort).await.len(), 1);
    // ...and, the run being terminal, a later round deletes its state.
    wait_for("the sweep deleting the ended run's keys", async || {
        w.budget(&spent).await.budget.unwrap().attempts == 0
    })
    .await;

    // The quiet run was left alone, and its next takeover starts a fresh budget.
    left_alone_and_claimed_afresh(&w, &quiet).await;
}

/// `run_id` is still running with no abort sent, and its next takeover is claimed as the
/// first of a fresh budget.
async fn left_alone_and_claimed_afresh(w: &World, run_id: &str) {
    assert_eq!(w.run_state(run_id).await.state(), rs::RunState::Running);
    assert!(w.messages(run_id, rs::SteeringKind::Abort).await.is_empty());
    let fresh = w
        .operator()
        .await
        .plan_recovery(plan(run_id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(fresh.decision(), pb::RecoveryDecision::Claimed);
    assert_eq!(fresh.budget.unwrap().attempts, 1);
}

/// A sweep held up reading the run judges the budget at the run store's answer, not at
/// the time it asked: a spent budget whose window lapsed meanwhile starts afresh on the
/// next claim, so the run is left alone.
async fn a_sweep_held_up_by_the_run_store_judges_the_budget_when_it_answers(backend: Backend) {
    let w = World::on(false, backend).await;
    let (run_id, key) = w.running_run().await;
    w.acquire(&run_id, &key).await;
    spend_budget(&w, &run_id).await;

    // The run store is slow: the sweep asks about the run while the fifth claim's lease
    // is held, and hears back after the window (and the lease) lapsed.
    let held = w.get_run_gate.lock().await;
    let asked = w.get_runs.load(Ordering::SeqCst);
    let mut op = w.operator().await;
    let sweep = tokio::spawn(async move {
        op.sweep_orphans(pb::SweepOrphansRequest {
            cursor: String::new(),
            limit: 10,
            dry_run: false,
        })
        .await
        .unwrap()
        .into_inner()
    });
    wait_for("the sweep asking the run store", async || {
        w.get_runs.load(Ordering::SeqCst) > asked
    })
    .await;
    w.clock.advance(Duration::from_secs(5 * 60 + 1));
    drop(held);
    let swept = sweep.await.unwrap();

    let action = swept.results.iter().find(|r| r.run_id == run_id).unwrap();
    assert_eq!(action.action(), pb::OrphanAction::Skipped);
    left_alone_and_claimed_afresh(&w, &run_id).await;
}

async fn a_parked_run_sleeps_through_any_number_of_leases(backend: Backend) {
    let w = World::on(false, backend).await;
    let (run_id, key) = w.running_run().await;
    let token = w.acquire(&run_id, &key).await;
    let mut runner = w.runner(&key).await;
    let append = |range| pb::AppendFramesRequest {
        run_id: run_id.clone(),
        controller_token: token.clone(),
        frames: frames(range),
        resync: false,
    };
    runner.append_frames(append(1..=3)).await.unwrap();
    let mut tail = Follower::open(&w, &run_id).await;

    // The node agent parks the stream, then suspends the sandbox: the runner renews
    // nothing from here on.
    let parked = w
        .operator()
        .await
        .park_stream(pb::ParkStreamRequest {
            run_id: run_id.clone(),
            sandbox_id: "sbx".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(parked.parked);
    // Six leases' worth of suspension, tailed and planned all along.
    for _ in 0..6 {
        w.clock.advance(Duration::from_secs(31));
        let answer = w
            .operator()
            .await
            .plan_recovery(plan(&run_id))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(answer.decision(), pb::RecoveryDecision::LeaseHeld);
        // Room for the following tail to plan too.
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let swept = w
        .operator()
        .await
        .sweep_orphans(pb::SweepOrphansRequest {
            cursor: String::new(),
            limit: 10,
            dry_run: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        swept
            .results
            .iter()
            .all(|r| r.action() == pb::OrphanAction::Skipped),
        "the sweep leaves a parked run alone"
    );
    let state = w.budget(&run_id).await;
    assert_eq!(state.lease.unwrap().state(), pb::LeaseState::Parked);
    assert_eq!(state.budget.unwrap().attempts, 0);
    assert!(
        w.messages(&run_id, rs::SteeringKind::ResumeStream)
            .await
            .is_empty()
    );

    // The restore hands the lease back; the same runner goes on with the same token.
    let unparked = w
        .operator()
        .await
        .unpark_stream(pb::UnparkStreamRequest {
            run_id: run_id.clone(),
            ttl: None,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(unparked.unparked);
    runner.append_frames(append(4..=6)).await.unwrap();
    let mut seen = Vec::new();
    while seen.len() < 6 {
        match tail.next().await {
            pb::tail_response::Item::Frame(f) => seen.push(f.sequence),
            pb::tail_response::Item::CaughtUp(_) => {}
            other => panic!("a parked run's tail got {other:?}"),
        }
    }
    assert_eq!(seen, [1, 2, 3, 4, 5, 6], "every frame once, no replay_gap");
    assert_eq!(
        w.budget(&run_id).await.lease.unwrap().state(),
        pb::LeaseState::Held
    );
}

async fn bad_run_ids_are_refused_and_leave_no_state(backend: Backend) {
    let w = World::on(false, backend).await;
    let unknown = "01a22b9d-7bd7-76e7-a072-4dd6efe3ec58";
    for (run_id, code) in [
        (unknown, Code::NotFound),
        ("not-a-run", Code::InvalidArgument),
        (
            "01A22B9D-7BD7-76E7-A072-4DD6EFE3EC58",
            Code::InvalidArgument,
        ),
    ] {
        let mut op = w.operator().await;
        let plan = op.plan_recovery(plan(run_id)).await.unwrap_err();
        assert_eq!(plan.code(), code, "plan of {run_id}: {plan:?}");
        let tail = op
            .tail(pb::TailRequest {
                run_id: run_id.into(),
                from_sequence: 0,
                follow: true,
                heartbeat_interval: None,
            })
            .await;
        let tail = match tail {
            Err(status) => status,
            Ok(stream) => stream.into_inner().message().await.unwrap_err(),
        };
        assert_eq!(tail.code(), code, "tail of {run_id}: {tail:?}");
        // A budget read of an unknown run answers an empty budget; a malformed id is
        // refused. Neither writes anything.
        let budget = op
            .get_recovery_budget(pb::GetRecoveryBudgetRequest {
                run_id: run_id.into(),
            })
            .await;
        if code == Code::InvalidArgument {
            assert_eq!(budget.unwrap_err().code(), code);
        } else {
            assert_eq!(budget.unwrap().into_inner().budget.unwrap().attempts, 0);
        }
    }
    let swept = w
        .operator()
        .await
        .sweep_orphans(pb::SweepOrphansRequest {
            cursor: String::new(),
            limit: 10,
            dry_run: true,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(swept.results.is_empty(), "no state: {:?}", swept.results);
    if backend != Backend::Memory {
        let keys = w._redis.keys().await;
        assert!(keys.is_empty(), "no keys: {keys:?}");
    }
}

/// Each scenario on one Redis, on the local 3-master Redis Cluster and in memory: one
/// test per backend, named `<scenario's test>` on each.
/// A following tail waits on the coordinator's store: it does not poll the run store
/// while nothing happens, and a frame appended through another coordinator replica
/// reaches it at once (not at its 30 s re-check).
async fn a_tail_is_woken_by_frames_and_does_not_poll(backend: Backend) {
    let w = World::on(false, backend).await;
    let (run_id, key) = w.running_run().await;
    let token = w.acquire(&run_id, &key).await;
    let mut tail = Follower::open(&w, &run_id).await;
    assert!(matches!(
        tail.next().await,
        pb::tail_response::Item::CaughtUp(_)
    ));
    let appender = match w.replica().await {
        Some(replica) => StreamRecoveryServiceClient::with_interceptor(
            World::channel(&replica).await,
            Bearer::new(key.clone()),
        ),
        None => w.runner(&key).await,
    };
    let append = |range| {
        let (mut appender, run_id, token) = (appender.clone(), run_id.clone(), token.clone());
        async move {
            appender
                .append_frames(pb::AppendFramesRequest {
                    run_id,
                    controller_token: token,
                    frames: frames(range),
                    resync: false,
                })
                .await
                .unwrap();
        }
    };
    // Well under every timer of the tail (heartbeat 5 s, the lease's lapse, re-check
    // 30 s): only a wake-up from the store delivers a frame this soon.
    let woken = Duration::from_secs(2);
    append(1..=2).await;
    for sequence in 1..=2 {
        match tail.within(woken).await {
            pb::tail_response::Item::Frame(f) => assert_eq!(f.sequence, sequence),
            other => panic!("expected frame {sequence}, got {other:?}"),
        }
    }
    // Idle for a while: the tail follows the run's state through one WatchRun.
    let reads = w.get_runs.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(3)).await;
    append(3..=3).await;
    match tail.within(woken).await {
        pb::tail_response::Item::Frame(f) => assert_eq!(f.sequence, 3),
        other => panic!("expected frame 3, got {other:?}"),
    }
    assert_eq!(
        w.get_runs.load(Ordering::SeqCst) - reads,
        0,
        "an idle tail read the run from the run store"
    );
}

macro_rules! on_every_backend {
    ($($scenario:ident: $redis:ident, $cluster:ident, $memory:ident;)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $redis() {
                $scenario(Backend::Redis).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $cluster() {
                $scenario(Backend::Cluster).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $memory() {
                $scenario(Backend::Memory).await;
            }
        )*
    };
}

on_every_backend! {
    a_tail_is_woken_by_frames_and_does_not_poll: a_tail_waits_on_redis_not_the_run_store, a_tail_waits_on_the_cluster_not_the_run_store, a_tail_waits_in_memory_not_on_the_run_store;
    a_queued_run_is_never_taken_over_and_later_runs_normally: tails_and_plans_of_a_queued_run_spend_nothing_on_redis, tails_and_plans_of_a_queued_run_spend_nothing_on_a_cluster, tails_and_plans_of_a_queued_run_spend_nothing_in_memory;
    a_failed_hand_off_after_a_claim_changes_nothing: a_failed_enqueue_after_a_claim_leaves_the_budget_unchanged_on_redis, a_failed_enqueue_after_a_claim_leaves_the_budget_unchanged_on_a_cluster, a_failed_enqueue_after_a_claim_leaves_the_budget_unchanged_in_memory;
    the_scheduled_sweep_ends_spent_runs_and_respects_the_reset: the_sweep_runs_by_itself_and_respects_the_reset_on_redis, the_sweep_runs_by_itself_and_respects_the_reset_on_a_cluster, the_sweep_runs_by_itself_and_respects_the_reset_in_memory;
    a_sweep_held_up_by_the_run_store_judges_the_budget_when_it_answers: a_slow_run_store_does_not_make_the_sweep_end_a_reset_run_on_redis, a_slow_run_store_does_not_make_the_sweep_end_a_reset_run_on_a_cluster, a_slow_run_store_does_not_make_the_sweep_end_a_reset_run_in_memory;
    a_parked_run_sleeps_through_any_number_of_leases: a_suspended_run_tailed_past_five_leases_is_never_taken_over_on_redis, a_suspended_run_tailed_past_five_leases_is_never_taken_over_on_a_cluster, a_suspended_run_tailed_past_five_leases_is_never_taken_over_in_memory;
    bad_run_ids_are_refused_and_leave_no_state: unknown_and_malformed_runs_are_refused_with_no_keys_on_redis, unknown_and_malformed_runs_are_refused_with_no_keys_on_a_cluster, unknown_and_malformed_runs_are_refused_with_no_state_in_memory;
}
