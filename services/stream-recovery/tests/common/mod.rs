//! What the coordinator's tests share: a World of real gRPC, real Redis (or the
//! in-process store) and a real run store on Postgres, with a manual clock for the gaps
//! and a run store that can fail or stall on cue; and the macro that runs a scenario on
//! every backend.

// Each test file uses its own part of this.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use runplane_clock::ManualClock;
use runplane_config::{Config, Secret};
use runplane_grpc::ServiceSet;
use runplane_grpc::client::Bearer;
use runplane_proto::recovery::v1 as recovery_pb;
use runplane_proto::recovery::v1::stream_recovery_service_client::StreamRecoveryServiceClient;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_proto::runstore::v1::runner_service_client::RunnerServiceClient;
use runplane_run_store::RunStore;
use runplane_stream_recovery::StreamRecovery;
use runplane_stream_recovery::domain::policy::SWEEP_EVERY;
use runplane_stream_recovery::store::redis::RedisStore;
use runplane_testkit::{TestDatabase, TestRedis};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

/// A number no other call in this process got, for client keys.
pub fn unique() -> u32 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    NEXT.fetch_add(1, Ordering::SeqCst)
}

pub const TOKEN: &str = "recovery-test-service-token-0123456789ab";

pub type Coordinator = StreamRecoveryServiceClient<InterceptedService<Channel, Bearer>>;

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

pub struct World {
    pub clock: ManualClock,
    pub fail_enqueue: Arc<AtomicBool>,
    pub get_runs: Arc<AtomicUsize>,
    pub get_run_gate: Arc<tokio::sync::Mutex<()>>,
    pub backend: Backend,
    pub config: Config,
    pub run_store: RunStore,
    pub run_store_endpoint: String,
    pub coordinator_endpoint: String,
    pub _db: TestDatabase,
    pub _redis: TestRedis,
}

/// Where the coordinator keeps its state.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Backend {
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
    pub async fn new(dead_run_store: bool) -> Self {
        Self::on(dead_run_store, Backend::Redis).await
    }

    pub async fn on(dead_run_store: bool, backend: Backend) -> Self {
        Self::sweeping(dead_run_store, backend, SWEEP_EVERY).await
    }

    /// With the coordinator's own sweep running every `sweep_every`.
    pub async fn sweeping(dead_run_store: bool, backend: Backend, sweep_every: Duration) -> Self {
        Self::build(dead_run_store, backend, sweep_every, |_| {}).await
    }

    /// With the configuration as `configure` leaves it.
    pub async fn configured(backend: Backend, configure: fn(&mut Config)) -> Self {
        Self::build(false, backend, SWEEP_EVERY, configure).await
    }

    async fn build(
        dead_run_store: bool,
        backend: Backend,
        sweep_every: Duration,
        configure: fn(&mut Config),
    ) -> Self {
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
        configure(&mut config);
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
        coordinator.start();
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
    pub async fn replica(&self) -> Option<String> {
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
        coordinator.start();
        Some(serve(services).await)
    }

    pub async fn channel(endpoint: &str) -> Channel {
        tonic::transport::Endpoint::from_shared(endpoint.to_owned())
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    pub async fn operator(&self) -> Coordinator {
        StreamRecoveryServiceClient::with_interceptor(
            Self::channel(&self.coordinator_endpoint).await,
            Bearer::new(TOKEN),
        )
    }

    pub async fn runner(&self, key: &str) -> Coordinator {
        StreamRecoveryServiceClient::with_interceptor(
            Self::channel(&self.coordinator_endpoint).await,
            Bearer::new(key),
        )
    }

    /// A running run and its key.
    pub async fn running_run(&self) -> (String, String) {
        self.running_run_of("acme").await
    }

    /// A running run of `org`, and its run key.
    pub async fn running_run_of(&self, org: &str) -> (String, String) {
        let run_id = self.queued_run_of(org).await;
        let key = self.start(&run_id).await;
        (run_id, key)
    }

    /// A run that waits in the queue: no sandbox, no runner.
    pub async fn queued_run(&self) -> String {
        self.queued_run_of("acme").await
    }

    /// A queued run of `org`.
    pub async fn queued_run_of(&self, org: &str) -> String {
        let mut op = RunServiceClient::with_interceptor(
            Self::channel(&self.run_store_endpoint).await,
            Bearer::new(TOKEN),
        );
        op.create_run(runstore_pb::CreateRunRequest {
            client_request_id: format!("recovery-test-request-{}", unique()),
            org_id: org.into(),
            target: Some(runstore_pb::create_run_request::Target::CredentialId(
                "c".into(),
            )),
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
    pub async fn start(&self, run_id: &str) -> String {
        let mut op = RunServiceClient::with_interceptor(
            Self::channel(&self.run_store_endpoint).await,
            Bearer::new(TOKEN),
        );
        let key = op
            .issue_run_key(runstore_pb::IssueRunKeyRequest {
                run_id: run_id.to_owned(),
                sandbox_id: "sbx".into(),
                sandbox_generation: 1,
                idempotency_key: format!("recovery-test-key-{:04}", unique()),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .run_key;
        RunnerServiceClient::with_interceptor(
            Self::channel(&self.run_store_endpoint).await,
            Bearer::new(key.clone()),
        )
        .hello(runstore_pb::HelloRequest {
            run_id: run_id.to_owned(),
            nonce: "recovery-runner-nonce-1".into(),
            runner_version: String::new(),
        })
        .await
        .unwrap();
        key
    }

    /// The runner acquires the stream lease as the run's first controller.
    pub async fn acquire(&self, run_id: &str, key: &str) -> String {
        self.runner(key)
            .await
            .acquire_lease(recovery_pb::AcquireLeaseRequest {
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
    pub async fn messages(
        &self,
        run_id: &str,
        kind: runstore_pb::SteeringKind,
    ) -> Vec<runstore_pb::SteeringMessage> {
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

    pub async fn run_state(&self, run_id: &str) -> runstore_pb::Run {
        RunServiceClient::with_interceptor(
            Self::channel(&self.run_store_endpoint).await,
            Bearer::new(TOKEN),
        )
        .get_run(runstore_pb::GetRunRequest {
            run_id: run_id.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap()
    }

    pub async fn budget(&self, run_id: &str) -> recovery_pb::GetRecoveryBudgetResponse {
        self.operator()
            .await
            .get_recovery_budget(recovery_pb::GetRecoveryBudgetRequest {
                run_id: run_id.into(),
            })
            .await
            .unwrap()
            .into_inner()
    }
}

pub fn frames(range: std::ops::RangeInclusive<u64>) -> Vec<recovery_pb::FrameInput> {
    range
        .map(|s| recovery_pb::FrameInput {
            sequence: s,
            data: format!("frame {s}").into_bytes(),
        })
        .collect()
}

pub fn plan(run_id: &str) -> recovery_pb::PlanRecoveryRequest {
    recovery_pb::PlanRecoveryRequest {
        run_id: run_id.into(),
        reason: "tail".into(),
    }
}

/// Each scenario on one Redis, on the local 3-master Redis Cluster and in memory: one
/// test per backend, named `<scenario's test>` on each.
macro_rules! on_every_backend {
    ($($scenario:ident: $redis:ident, $cluster:ident, $memory:ident;)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $redis() {
                $scenario($crate::common::Backend::Redis).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $cluster() {
                $scenario($crate::common::Backend::Cluster).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $memory() {
                $scenario($crate::common::Backend::Memory).await;
            }
        )*
    };
}

pub(crate) use on_every_backend;
