//! The world the reconciler suites run in: the reconciler over real Postgres or SQLite,
//! a real run store on a real socket (its FailRun calls counted, its ListRuns holdable),
//! node credentials as an operator writes them, and a manual clock. Probes come from a
//! fake driver, so each suite reproduces its interleavings deterministically.

// Each test binary uses only some of these.
#![allow(dead_code)]

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use runplane_clock::{Clock, ManualClock};
use runplane_grpc::ServiceSet;
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::reconciler::v1::node_service_client::NodeServiceClient;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_proto::runstore::v1::runner_service_client::RunnerServiceClient;
use runplane_run_store::RunStore;
use runplane_sandbox::Probe;
use runplane_sandbox_reconciler::SandboxReconciler;
use runplane_sandbox_reconciler::drivers::FakeDriver;
use runplane_sandbox_reconciler::reconcile::{
    ReconcileSettings, Reconciler, RunStoreClient, RunnerEndpoints, dispatch,
};
use runplane_sandbox_reconciler::store::Store;
use runplane_sandbox_reconciler::store::entities::{route_identity, sandbox};
use runplane_testkit::Backend;
pub use runplane_testkit::authed;
use tonic::body::Body;
use tonic::server::NamedService;
use tower_service::Service;

pub const TOKEN: &str = "reconciler-test-service-token-0123456789ab";
pub const GRACE: Duration = Duration::from_secs(90);

/// Something a test runs while a ListRuns call is in flight at the run store.
pub type ListRunsHook = Box<dyn FnOnce() -> futures::future::BoxFuture<'static, ()> + Send>;

/// Counts FailRun calls reaching the run store, and runs a test's hook (once) while the
/// next ListRuns is in flight.
#[derive(Clone)]
struct CountFailRun<S> {
    inner: S,
    calls: Arc<AtomicUsize>,
    on_list_runs: Arc<std::sync::Mutex<Option<ListRunsHook>>>,
    /// When set, every ListRuns waits at this barrier before it is answered (replicas
    /// held at the same point of a round).
    list_runs_barrier: Arc<std::sync::Mutex<Option<Arc<tokio::sync::Barrier>>>>,
}

impl<S: NamedService> NamedService for CountFailRun<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for CountFailRun<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = Infallible;
    type Future = futures::future::BoxFuture<'static, Result<S::Response, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        if request.uri().path().ends_with("/FailRun") {
            self.calls.fetch_add(1, Ordering::SeqCst);
        }
        let (hook, barrier) = if request.uri().path().ends_with("/ListRuns") {
            (
                self.on_list_runs.lock().unwrap().take(),
                self.list_runs_barrier.lock().unwrap().clone(),
            )
        } else {
            (None, None)
        };
        let answer = self.inner.call(request);
        Box::pin(async move {
            if let Some(hook) = hook {
                hook().await;
            }
            if let Some(barrier) = barrier {
                barrier.wait().await;
            }
            answer.await
        })
    }
}

pub struct World {
    pub clock: ManualClock,
    pub store: Store,
    pub reconciler_endpoint: String,
    pub run_store_endpoint: String,
    pub fail_run_calls: Arc<AtomicUsize>,
    pub on_list_runs: Arc<std::sync::Mutex<Option<ListRunsHook>>>,
    pub list_runs_barrier: Arc<std::sync::Mutex<Option<Arc<tokio::sync::Barrier>>>>,
    pub _dbs: (Backend, Backend),
}

/// Node `id`'s own credential (its row is written by [`World::start`]): NodeService takes
/// nothing else.
pub fn node_token(id: &str) -> String {
    format!("rpnode_reconcile-test-credential-of-{id}")
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
    /// The reconciler over `reconciler_db`, with a run store on a database of the same
    /// kind.
    pub async fn start(reconciler_db: Backend) -> Self {
        let run_db = match reconciler_db {
            Backend::Sqlite(_) => Backend::sqlite().await,
            _ => Backend::postgres().await,
        };
        // Not about admission: runs are created on the credential they name.
        let mut config = runplane_testkit::config::run_store_signing_with(
            TOKEN,
            &run_db.url(),
            &runplane_run_store::domain::receipt::ReceiptSigner::generate().seed_hex(),
        );
        config.sandbox_reconciler.database_url = reconciler_db.url();

        let run_store = RunStore::open(&config, runplane_clock::SystemClock::shared())
            .await
            .unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        let (runner, run) = run_store.services();
        let mut services = ServiceSet::new();
        let on_list_runs = Arc::new(std::sync::Mutex::new(None));
        let list_runs_barrier = Arc::new(std::sync::Mutex::new(None));
        services
            .authenticate(runplane_grpc::auth::Tokens::from_config(&config.auth))
            .add(runner)
            .add(CountFailRun {
                inner: run,
                calls: calls.clone(),
                on_list_runs: on_list_runs.clone(),
                list_runs_barrier: list_runs_barrier.clone(),
            });
        let run_store_endpoint = serve(services).await;
        config.run_store.endpoint = run_store_endpoint.clone();

        let clock = ManualClock::new(chrono::DateTime::from_timestamp(1_800_000_000, 0).unwrap());
        let reconciler = SandboxReconciler::open(&config, Arc::new(clock.clone()))
            .await
            .unwrap();
        // The nodes of these tests, each with its own credential, as an operator makes them.
        let db = sea_orm::Database::connect(reconciler_db.url().as_str())
            .await
            .unwrap();
        for node in ["node-a", "node-b"] {
            use runplane_sandbox_reconciler::store::entities::node_credential;
            use sea_orm::EntityTrait;
            node_credential::Entity::insert(node_credential::ActiveModel::from(
                node_credential::Model {
                    id: format!("credential-of-{node}"),
                    node_id: node.to_owned(),
                    token_sha256:
                        runplane_sandbox_reconciler::store::node_credentials::token_sha256(
                            &node_token(node),
                        ),
                    created_at_us: 0,
                    max_capacity: 0,
                    revoked_at_us: None,
                },
            ))
            .exec_without_returning(&db)
            .await
            .unwrap();
        }
        let mut services = ServiceSet::new();
        reconciler.register(&mut services);
        let reconciler_endpoint = serve(services).await;
        Self {
            store: reconciler.store().clone(),
            clock,
            reconciler_endpoint,
            run_store_endpoint,
            fail_run_calls: calls,
            on_list_runs,
            list_runs_barrier,
            _dbs: (run_db, reconciler_db),
        }
    }

    /// Another reconciler replica's store: the same database through a pool of its own.
    pub async fn replica_store(&self) -> Store {
        Store::new(
            runplane_db::connect(&self._dbs.1.url()).await.unwrap(),
            Arc::new(self.clock.clone()),
        )
    }

    /// A queued run of org acme, created by request `name`.
    pub async fn queued_run(&self, name: &str) -> runstore_pb::Run {
        self.run_store()
            .await
            .create_run(authed(
                runstore_pb::CreateRunRequest {
                    client_request_id: format!("{name}-request-00000001"),
                    org_id: "acme".into(),
                    target: Some(runstore_pb::create_run_request::Target::CredentialId(
                        "c".into(),
                    )),
                    command: "agent".into(),
                    ..Default::default()
                },
                TOKEN,
            ))
            .await
            .unwrap()
            .into_inner()
            .run
            .unwrap()
    }

    /// One dispatch by the reconciler on `store` (this world's, or a replica's), with
    /// sandboxes placed on node agents only.
    pub async fn dispatch_once(&self, store: &Store) {
        let endpoints = RunnerEndpoints {
            run_store: self.run_store_endpoint.clone(),
            stream_recovery: self.run_store_endpoint.clone(),
        };
        dispatch(
            store,
            &FakeDriver::always(Probe::Alive),
            &self.outbox_client().await,
            None,
            &endpoints,
            Duration::ZERO,
            false,
            &Default::default(),
        )
        .await
        .unwrap();
    }

    pub async fn run_store(&self) -> RunServiceClient<tonic::transport::Channel> {
        RunServiceClient::connect(self.run_store_endpoint.clone())
            .await
            .unwrap()
    }

    pub fn reconciler(&self, driver: FakeDriver) -> Reconciler {
        Reconciler::new(
            self.store.clone(),
            Arc::new(driver),
            ReconcileSettings {
                loss_grace: GRACE,
                ..ReconcileSettings::default()
            },
        )
    }

    pub async fn outbox_client(&self) -> RunStoreClient {
        RunServiceClient::with_interceptor(
            runplane_grpc::client::connect(&self.run_store_endpoint)
                .await
                .unwrap(),
            runplane_grpc::client::Bearer::new(TOKEN),
        )
    }

    /// A running run (a runner said Hello with generation 1's key) and its sandbox row.
    pub async fn running_sandbox(&self, name: &str) -> (sandbox::Model, String) {
        let mut op = self.run_store().await;
        let run = self.queued_run(name).await;
        let sandbox_id = uuid::Uuid::new_v4().to_string();
        let key = op
            .issue_run_key(authed(
                runstore_pb::IssueRunKeyRequest {
                    run_id: run.id.clone(),
                    sandbox_id: sandbox_id.clone(),
                    sandbox_generation: 1,
                    idempotency_key: format!("{sandbox_id}:1"),
                    ..Default::default()
                },
                TOKEN,
            ))
            .await
            .unwrap()
            .into_inner()
            .run_key;
        let mut runner = RunnerServiceClient::connect(self.run_store_endpoint.clone())
            .await
            .unwrap();
        runner
            .hello(authed(
                runstore_pb::HelloRequest {
                    run_id: run.id.clone(),
                    nonce: "reconciler-test-nonce-1".into(),
                    runner_version: String::new(),
                },
                &key,
            ))
            .await
            .unwrap();
        let row = self
            .store
            .insert_sandbox(self.row(&sandbox_id, &run.id, "direct", "started", Some("node-a")))
            .await
            .unwrap();
        (row, key)
    }

    pub fn row(
        &self,
        id: &str,
        run_id: &str,
        substrate: &str,
        status: &str,
        node: Option<&str>,
    ) -> sandbox::Model {
        let now = self.clock.now().timestamp_micros();
        sandbox::Model {
            id: id.to_owned(),
            run_id: run_id.to_owned(),
            org_id: "acme".into(),
            client_request_id: format!("create-{id}"),
            substrate: substrate.into(),
            status: status.parse().expect("a sandbox status"),
            active_node_id: node.map(str::to_owned),
            execution_generation: 1,
            loss_observed_at_us: None,
            idle_timeout_ms: 600_000,
            exit_code: None,
            driver_handle: String::new(),
            observation_seq: 0,
            observed_status: String::new(),
            created_at_us: now,
            updated_at_us: now,
            paused: 0,
            attempt: 1,
            traceparent: String::new(),
            network: String::new(),
            limits: String::new(),
            image: String::new(),
        }
    }

    pub async fn run_state(&self, run_id: &str) -> runstore_pb::Run {
        self.run_store()
            .await
            .get_run(authed(
                runstore_pb::GetRunRequest {
                    run_id: run_id.into(),
                },
                TOKEN,
            ))
            .await
            .unwrap()
            .into_inner()
            .run
            .unwrap()
    }

    /// Asserts `run_id`'s first attempt ended, once, for `reason`, and its second is due
    /// (the run is STARTING on attempt 2, without a sandbox): what a loss or a known exit
    /// does to a run whose retry policy has attempts left. Returns attempt 1's record.
    pub async fn first_attempt_ended(&self, run_id: &str, reason: &str) -> runstore_pb::Attempt {
        let run = self.run_state(run_id).await;
        assert_eq!(
            (run.state(), run.attempt, run.sandbox_id.as_str()),
            (runstore_pb::RunState::Starting, 2, ""),
            "{run:?}"
        );
        assert_eq!(run.attempts.len(), 1, "{run:?}");
        let first = run.attempts[0].clone();
        assert_eq!((first.number, first.end_reason.as_str()), (1, reason));
        first
    }

    /// The runner of `run_id` submits a succeeded verdict with its key.
    pub async fn submit_success(&self, run_id: &str, key: &str) {
        RunnerServiceClient::connect(self.run_store_endpoint.clone())
            .await
            .unwrap()
            .submit_result(authed(
                runstore_pb::SubmitResultRequest {
                    run_id: run_id.into(),
                    verdict: Some(runstore_pb::Verdict {
                        outcome: runstore_pb::VerdictOutcome::Succeeded as i32,
                        reason: "exit_zero".into(),
                        exit_code: Some(0),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                key,
            ))
            .await
            .unwrap();
    }

    pub async fn key_works(
        &self,
        run_id: &str,
        key: &str,
        batch: &str,
    ) -> Result<(), tonic::Status> {
        RunnerServiceClient::connect(self.run_store_endpoint.clone())
            .await
            .unwrap()
            .append_events(authed(
                runstore_pb::AppendEventsRequest {
                    run_id: run_id.into(),
                    batch_key: batch.into(),
                    events: vec![runstore_pb::EventInput {
                        kind: runstore_pb::EventKind::Stdout as i32,
                        text: "still here".into(),
                        ..Default::default()
                    }],
                },
                key,
            ))
            .await
            .map(|_| ())
    }

    /// A direct sandbox of `run_id` that `node` ran and idle-suspended: unplaced, its route
    /// identity naming `node` at generation 1.
    pub async fn suspended_on(&self, node: &str, run_id: &str) -> sandbox::Model {
        let row = self
            .store
            .insert_sandbox(self.row(
                &uuid::Uuid::new_v4().to_string(),
                run_id,
                "direct",
                "suspended",
                None,
            ))
            .await
            .unwrap();
        self.store
            .set_route_identity(route_identity::Model {
                sandbox_id: row.id.clone(),
                current_node_id: node.into(),
                execution_generation: 1,
            })
            .await
            .unwrap();
        row
    }

    /// Stamps a first loss observation now, as an earlier tick would have.
    pub async fn stamp(&self, row: &sandbox::Model) -> sandbox::Model {
        let now = self.clock.now().timestamp_micros();
        assert!(self.store.stamp_loss(&row.id, 1, None, now).await.unwrap());
        self.store.sandbox(&row.id).await.unwrap()
    }
}

// NodeService as a node agent calls it, with its own credential.

pub async fn nodes(w: &World) -> NodeServiceClient<tonic::transport::Channel> {
    NodeServiceClient::connect(w.reconciler_endpoint.clone())
        .await
        .unwrap()
}

pub async fn register(w: &World, id: &str, boot: &str) -> u64 {
    nodes(w)
        .await
        .register_node(authed(
            reconciler_pb::RegisterNodeRequest {
                node_id: id.into(),
                boot_id: format!("{boot}-boot-id-0000000"),
                endpoint: format!("{id}.local:7443"),
                capacity: 4,
                labels: Default::default(),
                agent_version: "test".into(),
            },
            &node_token(id),
        ))
        .await
        .unwrap()
        .into_inner()
        .epoch
}

pub fn publish(
    node: &str,
    epoch: u64,
    row: &sandbox::Model,
    seq: u64,
    status: reconciler_pb::SandboxStatus,
    placed: bool,
) -> tonic::Request<reconciler_pb::PublishSandboxStateRequest> {
    authed(
        reconciler_pb::PublishSandboxStateRequest {
            node_id: node.into(),
            epoch,
            sandbox_id: row.id.clone(),
            execution_generation: 1,
            observation_seq: seq,
            status: status as i32,
            placed,
            exit_code: None,
            observed_at: None,
            waiting_for_input: None,
        },
        &node_token(node),
    )
}
