//! Loss grace and placement against real Postgres, a real run store on a real socket,
//! and a fake driver whose probes reproduce the interleavings deterministically.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use runplane_clock::{Clock, ManualClock};
use runplane_config::{Config, Secret};
use runplane_grpc::{ErrorReason, ServiceSet, error_info};
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::reconciler::v1::sandbox_service_client::SandboxServiceClient;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_proto::runstore::v1::runner_service_client::RunnerServiceClient;
use runplane_run_store::RunStore;
use runplane_sandbox::Probe;
use runplane_sandbox::route_token;
use runplane_sandbox_reconciler::SandboxReconciler;
use runplane_sandbox_reconciler::drivers::FakeDriver;
use runplane_sandbox_reconciler::reconcile::{
    ReconcileSettings, Reconciler, RunStoreClient, RunnerEndpoints, deliver_outbox, dispatch,
};
use runplane_sandbox_reconciler::store::Store;
use runplane_sandbox_reconciler::store::entities::{node, route_identity, sandbox};
use runplane_testkit::Backend;
use tonic::Code;
use tonic::body::Body;
use tonic::server::NamedService;
use tower_service::Service;

const TOKEN: &str = "reconciler-test-service-token-0123456789ab";
const GRACE: Duration = Duration::from_secs(90);

/// Something a test runs while a ListRuns call is in flight at the run store.
type ListRunsHook = Box<dyn FnOnce() -> futures::future::BoxFuture<'static, ()> + Send>;

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

struct World {
    clock: ManualClock,
    store: Store,
    reconciler_endpoint: String,
    run_store_endpoint: String,
    fail_run_calls: Arc<AtomicUsize>,
    on_list_runs: Arc<std::sync::Mutex<Option<ListRunsHook>>>,
    list_runs_barrier: Arc<std::sync::Mutex<Option<Arc<tokio::sync::Barrier>>>>,
    _dbs: (Backend, Backend),
}

/// Node `id`'s own credential (its row is written by [`World::start`]): NodeService takes
/// nothing else.
fn node_token(id: &str) -> String {
    format!("rpnode_reconcile-test-credential-of-{id}")
}

fn authed<T>(message: T, token: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    r
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
    async fn start(reconciler_db: Backend) -> Self {
        let run_db = match reconciler_db {
            Backend::Sqlite(_) => Backend::sqlite().await,
            _ => Backend::postgres().await,
        };
        let mut config = Config::default();
        config.auth.operator_token = Secret::new(TOKEN);
        config.auth.service_token = Secret::new(runplane_testkit::SERVICE_TOKEN);
        config.run_store.database_url = run_db.url();
        config.run_store.receipt_signing_key =
            Secret::new(runplane_run_store::domain::receipt::ReceiptSigner::generate().seed_hex());
        // Not about admission: runs are created on the credential they name.
        config.run_store.admission = false;
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
    async fn replica_store(&self) -> Store {
        Store::new(
            runplane_db::connect(&self._dbs.1.url()).await.unwrap(),
            Arc::new(self.clock.clone()),
        )
    }

    /// A queued run of org acme, created by request `name`.
    async fn queued_run(&self, name: &str) -> runstore_pb::Run {
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
    async fn dispatch_once(&self, store: &Store) {
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

    async fn run_store(&self) -> RunServiceClient<tonic::transport::Channel> {
        RunServiceClient::connect(self.run_store_endpoint.clone())
            .await
            .unwrap()
    }

    fn reconciler(&self, driver: FakeDriver) -> Reconciler {
        Reconciler::new(
            self.store.clone(),
            Arc::new(driver),
            ReconcileSettings {
                loss_grace: GRACE,
                ..ReconcileSettings::default()
            },
        )
    }

    async fn outbox_client(&self) -> RunStoreClient {
        RunServiceClient::with_interceptor(
            runplane_grpc::client::connect(&self.run_store_endpoint)
                .await
                .unwrap(),
            runplane_grpc::client::Bearer::new(TOKEN),
        )
    }

    /// A running run (a runner said Hello with generation 1's key) and its sandbox row.
    async fn running_sandbox(&self, name: &str) -> (sandbox::Model, String) {
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

    fn row(
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
            traceparent: String::new(),
            network: String::new(),
        }
    }

    async fn run_state(&self, run_id: &str) -> runstore_pb::Run {
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

    async fn key_works(&self, run_id: &str, key: &str, batch: &str) -> Result<(), tonic::Status> {
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
    async fn suspended_on(&self, node: &str, run_id: &str) -> sandbox::Model {
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
    async fn stamp(&self, row: &sandbox::Model) -> sandbox::Model {
        let now = self.clock.now().timestamp_micros();
        assert!(self.store.stamp_loss(&row.id, 1, None, now).await.unwrap());
        self.store.sandbox(&row.id).await.unwrap()
    }
}

runplane_testkit::on_both_backends!(
    workers 4,
    World::start =>
    one_loss_observation_only_stamps_and_the_run_fails_after_the_grace,
    a_stamp_cleared_while_the_probe_is_in_flight_keeps_the_run_alive,
    a_stale_clear_cannot_delete_a_stamp_written_after_it_was_read,
    grace_expiry_seen_by_three_concurrent_ticks_fails_the_run_once,
    a_reattach_wakes_an_unplaced_sandbox_whatever_its_direct_route_names,
);

async fn one_loss_observation_only_stamps_and_the_run_fails_after_the_grace(w: World) {
    let (row, key) = w.running_sandbox("grace").await;
    let lost = w.reconciler(FakeDriver::always(Probe::Exited(Some(137))));

    let first = lost.tick().await.unwrap();
    assert_eq!(first.stamped, 1);
    assert!(
        w.store
            .sandbox(&row.id)
            .await
            .unwrap()
            .loss_observed_at_us
            .is_some()
    );
    w.clock.advance(GRACE - Duration::from_secs(1));
    assert_eq!(
        lost.tick().await.unwrap().confirmed,
        0,
        "still within the grace"
    );
    assert!(w.store.outbox().await.unwrap().is_empty());
    w.key_works(&row.run_id, &key, "batch-within-grace-1")
        .await
        .unwrap();

    w.clock.advance(Duration::from_secs(1));
    assert_eq!(lost.tick().await.unwrap().confirmed, 1);
    let sandbox = w.store.sandbox(&row.id).await.unwrap();
    assert_eq!(
        (sandbox.status.as_str(), sandbox.exit_code),
        ("exited", Some(137))
    );
    assert_eq!(
        deliver_outbox(&w.store, &w.outbox_client().await, 10)
            .await
            .unwrap(),
        1
    );
    let run = w.run_state(&row.run_id).await;
    assert_eq!(run.state(), runstore_pb::RunState::Failed);
    assert_eq!(run.failure_reason, "sandbox_lost");
    // A sandbox seen alive again before the grace ends clears the stamp instead.
    let (row2, _) = w.running_sandbox("grace-recovers").await;
    lost.observe(row2.clone()).await.unwrap();
    let alive = w.reconciler(FakeDriver::always(Probe::Alive));
    assert_eq!(alive.tick().await.unwrap().cleared, 1);
    assert!(
        w.store
            .sandbox(&row2.id)
            .await
            .unwrap()
            .loss_observed_at_us
            .is_none()
    );
}

async fn a_stamp_cleared_while_the_probe_is_in_flight_keeps_the_run_alive(w: World) {
    let (row, key) = w.running_sandbox("cleared-mid-probe").await;
    let stamped = w.stamp(&row).await;
    w.clock.advance(GRACE + Duration::from_secs(30));

    // Tick B saw the sandbox alive and clears the stamp while tick A's probe is in flight;
    // A's probe then reports the sandbox lost, from before B's observation.
    let b = w.reconciler(FakeDriver::always(Probe::Alive));
    let store = w.store.clone();
    let a = w.reconciler(FakeDriver::new(move |row| {
        let b = b.clone();
        let store = store.clone();
        Box::pin(async move {
            let fresh = store.sandbox(&row.id).await.unwrap();
            assert_eq!(b.observe(fresh).await.unwrap().cleared, 1);
            Probe::Lost
        })
    }));
    let report = a.observe(stamped).await.unwrap();
    assert_eq!((report.confirmed, report.lost_races), (0, 1));

    let now = w.store.sandbox(&row.id).await.unwrap();
    assert_eq!(now.status, "started");
    assert!(now.loss_observed_at_us.is_none());
    assert!(
        w.store.outbox().await.unwrap().is_empty(),
        "no FailRun was queued"
    );
    assert_eq!(
        w.run_state(&row.run_id).await.state(),
        runstore_pb::RunState::Running
    );
    w.key_works(&row.run_id, &key, "batch-after-the-race-1")
        .await
        .expect("the key still works");
}

async fn a_stale_clear_cannot_delete_a_stamp_written_after_it_was_read(w: World) {
    let (row, _) = w.running_sandbox("stale-clear").await;
    let stamped = w.stamp(&row).await;

    // While tick A (which read the old stamp) probes, B clears it and C stamps a new loss.
    let b = w.reconciler(FakeDriver::always(Probe::Alive));
    let c = w.reconciler(FakeDriver::always(Probe::Lost));
    let store = w.store.clone();
    let clock = w.clock.clone();
    let a = w.reconciler(FakeDriver::new(move |row| {
        let (b, c, store, clock) = (b.clone(), c.clone(), store.clone(), clock.clone());
        Box::pin(async move {
            b.observe(store.sandbox(&row.id).await.unwrap())
                .await
                .unwrap();
            clock.advance(Duration::from_secs(5));
            c.observe(store.sandbox(&row.id).await.unwrap())
                .await
                .unwrap();
            Probe::Alive
        })
    }));
    let report = a.observe(stamped.clone()).await.unwrap();
    assert_eq!((report.cleared, report.lost_races), (0, 1));
    let now = w.store.sandbox(&row.id).await.unwrap();
    let newer = stamped.loss_observed_at_us.unwrap() + 5_000_000;
    assert_eq!(
        now.loss_observed_at_us,
        Some(newer),
        "C's stamp survives A's stale clear"
    );
}

async fn grace_expiry_seen_by_three_concurrent_ticks_fails_the_run_once(w: World) {
    let (row, key) = w.running_sandbox("three-ticks").await;
    let stamped = w.stamp(&row).await;
    w.clock.advance(GRACE + Duration::from_secs(1));

    // All three read the row, then all three probes answer at once.
    let barrier = Arc::new(tokio::sync::Barrier::new(3));
    let driver = FakeDriver::new(move |_| {
        let barrier = barrier.clone();
        Box::pin(async move {
            barrier.wait().await;
            Probe::Lost
        })
    });
    let ticks: Vec<_> = (0..3).map(|_| w.reconciler(driver.clone())).collect();
    let (r1, r2, r3) = tokio::join!(
        ticks[0].observe(stamped.clone()),
        ticks[1].observe(stamped.clone()),
        ticks[2].observe(stamped.clone()),
    );
    let confirmed: u64 = [r1, r2, r3].into_iter().map(|r| r.unwrap().confirmed).sum();
    assert_eq!(confirmed, 1, "exactly one tick wins the compare-and-set");
    assert_eq!(w.store.outbox().await.unwrap().len(), 1);

    let client = w.outbox_client().await;
    assert_eq!(deliver_outbox(&w.store, &client, 10).await.unwrap(), 1);
    assert_eq!(deliver_outbox(&w.store, &client, 10).await.unwrap(), 0);
    assert_eq!(
        w.fail_run_calls.load(Ordering::SeqCst),
        1,
        "FailRun called once"
    );
    assert_eq!(
        w.run_state(&row.run_id).await.state(),
        runstore_pb::RunState::Failed
    );
    let err = w
        .key_works(&row.run_id, &key, "batch-after-failure-1")
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
}

async fn a_reattach_wakes_an_unplaced_sandbox_whatever_its_direct_route_names(w: World) {
    let now = w.clock.now().timestamp_micros();
    w.store
        .upsert_node(node::Model {
            id: "node-a".into(),
            endpoint: "127.0.0.1:7443".into(),
            capacity: 8,
            last_heartbeat_us: now,
            boot_id: "boot-a".into(),
            epoch: 1,
            used: 0,
            registered_at_us: now,
        })
        .await
        .unwrap();
    let kubernetes = w
        .store
        .insert_sandbox(w.row(
            &uuid::Uuid::new_v4().to_string(),
            "run-k",
            "kubernetes",
            "suspended",
            None,
        ))
        .await
        .unwrap();
    let placed = w
        .store
        .insert_sandbox(w.row(
            &uuid::Uuid::new_v4().to_string(),
            "run-p",
            "direct",
            "started",
            Some("node-a"),
        ))
        .await
        .unwrap();
    let idle = w
        .store
        .insert_sandbox(w.row(
            &uuid::Uuid::new_v4().to_string(),
            "run-i",
            "direct",
            "started",
            Some("node-a"),
        ))
        .await
        .unwrap();
    for row in [&placed, &idle] {
        w.store
            .set_route_identity(route_identity::Model {
                sandbox_id: row.id.clone(),
                current_node_id: "node-a".into(),
                execution_generation: 1,
            })
            .await
            .unwrap();
    }
    // node-a suspends `idle` for idleness and publishes it unplaced; its route identity
    // still names node-a.
    assert!(
        w.store
            .publish(&idle.id, 1, "suspended", None)
            .await
            .unwrap()
    );

    let mut api = SandboxServiceClient::connect(w.reconciler_endpoint.clone())
        .await
        .unwrap();
    let resolve = |id: &str| {
        authed(
            reconciler_pb::ResolveRouteRequest {
                sandbox_id: id.into(),
                session_id: "session-1".into(),
            },
            TOKEN,
        )
    };

    for unplaced in [&kubernetes, &idle] {
        let err = api.resolve_route(resolve(&unplaced.id)).await.unwrap_err();
        assert_eq!(
            err.code(),
            Code::FailedPrecondition,
            "{}",
            unplaced.substrate
        );
        let info = error_info(&err).unwrap();
        assert_eq!(info.reason, ErrorReason::NotPlaced.as_str_name());
        let wake = w
            .store
            .open_wake(&unplaced.id)
            .await
            .unwrap()
            .expect("a wake is queued");
        assert_eq!(info.metadata["wake_id"], wake.id);
        // Asking again reuses the one pending wake.
        let again = api.resolve_route(resolve(&unplaced.id)).await.unwrap_err();
        assert_eq!(error_info(&again).unwrap().metadata["wake_id"], wake.id);
        let shown = api
            .get_sandbox(authed(
                reconciler_pb::GetSandboxRequest {
                    sandbox_id: unplaced.id.clone(),
                },
                TOKEN,
            ))
            .await
            .unwrap()
            .into_inner()
            .sandbox
            .unwrap();
        assert!(
            shown.route_identity.is_none(),
            "placement reads share the rule"
        );
        assert_eq!(shown.pending_wake.unwrap().id, wake.id);
    }

    let route = api
        .resolve_route(resolve(&placed.id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (route.node_id.as_str(), route.endpoint.as_str()),
        ("node-a", "127.0.0.1:7443")
    );
    let node_a_key = route_token::node_key(
        &route_token::default_key(runplane_testkit::SERVICE_TOKEN),
        "node-a",
    );
    let claims = route_token::verify(&node_a_key, &route.route_token, w.clock.now().timestamp())
        .expect("a valid route token");
    assert_eq!(
        (claims.sandbox_id, claims.node_id),
        (placed.id.clone(), "node-a".to_owned())
    );
    assert!(
        w.store.open_wake(&placed.id).await.unwrap().is_none(),
        "no wake for a placed row"
    );
}

mod node_protocol {
    use super::*;
    use runplane_proto::reconciler::v1::node_service_client::NodeServiceClient;

    runplane_testkit::on_both_backends!(
        World::start =>
        without_local_sandboxes_a_queued_run_waits_for_a_node_agent,
        a_new_boot_fences_the_old_epoch,
        a_node_publishes_only_for_rows_it_owns_and_never_an_older_observation,
        a_restore_writes_placement_and_route_identity_and_settles_the_wake,
        numbers_past_their_columns_and_oversized_strings_are_refused_before_any_write,
        an_oversized_page_is_refused_by_both_lists,
        create_is_keyed_and_destroy_ends_the_sandbox,
        a_far_off_idle_timeout_does_not_overflow_create,
    );

    pub(super) async fn nodes(w: &World) -> NodeServiceClient<tonic::transport::Channel> {
        NodeServiceClient::connect(w.reconciler_endpoint.clone())
            .await
            .unwrap()
    }

    pub(super) async fn register(w: &World, id: &str, boot: &str) -> u64 {
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

    pub(super) fn publish(
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
            },
            &node_token(node),
        )
    }

    async fn without_local_sandboxes_a_queued_run_waits_for_a_node_agent(w: World) {
        // Several reconciler replicas: none may run a sandbox in its own process tree,
        // where the others could not probe or signal it.
        let run = w.queued_run("waits-for-a-node").await;
        w.dispatch_once(&w.store).await;
        assert!(
            w.store.live_sandbox_of(&run.id).await.unwrap().is_none(),
            "no sandbox without a node agent"
        );
        assert_eq!(
            w.run_state(&run.id).await.state(),
            runstore_pb::RunState::Queued
        );

        register(&w, "node-a", "a").await;
        w.dispatch_once(&w.store).await;
        let row = w
            .store
            .live_sandbox_of(&run.id)
            .await
            .unwrap()
            .expect("placed");
        assert_eq!(row.active_node_id.as_deref(), Some("node-a"));
    }

    async fn a_new_boot_fences_the_old_epoch(w: World) {
        let first = register(&w, "node-a", "one").await;
        assert_eq!(
            register(&w, "node-a", "one").await,
            first,
            "the same boot keeps its epoch"
        );
        let second = register(&w, "node-a", "two").await;
        assert_eq!(second, first + 1);
        let err = nodes(&w)
            .await
            .heartbeat(authed(
                reconciler_pb::HeartbeatRequest {
                    node_id: "node-a".into(),
                    epoch: first,
                    used: 0,
                },
                &node_token("node-a"),
            ))
            .await
            .unwrap_err();
        assert_eq!(
            error_info(&err).unwrap().reason,
            ErrorReason::NodeEpochStale.as_str_name()
        );
    }

    async fn a_node_publishes_only_for_rows_it_owns_and_never_an_older_observation(w: World) {
        let a = register(&w, "node-a", "a").await;
        let b = register(&w, "node-b", "b").await;
        let row = w
            .store
            .insert_sandbox(w.row(
                &uuid::Uuid::new_v4().to_string(),
                "run-o",
                "direct",
                "started",
                Some("node-a"),
            ))
            .await
            .unwrap();
        w.store
            .set_route_identity(route_identity::Model {
                sandbox_id: row.id.clone(),
                current_node_id: "node-a".into(),
                execution_generation: 1,
            })
            .await
            .unwrap();
        let mut client = nodes(&w).await;

        let err = client
            .publish_sandbox_state(publish(
                "node-b",
                b,
                &row,
                10,
                reconciler_pb::SandboxStatus::Exited,
                true,
            ))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied);
        assert_eq!(
            error_info(&err).unwrap().reason,
            ErrorReason::NodeNotOwner.as_str_name()
        );

        // node-a suspends for idleness and gives up the placement; its route identity stays.
        let answer = client
            .publish_sandbox_state(publish(
                "node-a",
                a,
                &row,
                10,
                reconciler_pb::SandboxStatus::Suspended,
                false,
            ))
            .await
            .unwrap()
            .into_inner();
        assert!(answer.applied);
        let now = w.store.sandbox(&row.id).await.unwrap();
        assert_eq!(
            (now.status.as_str(), now.active_node_id),
            ("suspended", None)
        );
        // Still node-a's to publish for (its route identity, same generation); not node-b's.
        let older = client
            .publish_sandbox_state(publish(
                "node-a",
                a,
                &row,
                9,
                reconciler_pb::SandboxStatus::Started,
                true,
            ))
            .await
            .unwrap()
            .into_inner();
        assert!(!older.applied, "an older observation changes nothing");
        assert!(
            client
                .publish_sandbox_state(publish(
                    "node-b",
                    b,
                    &row,
                    11,
                    reconciler_pb::SandboxStatus::Started,
                    true
                ))
                .await
                .is_err()
        );

        // An exit is an observation: the row stays live until the loss grace decides.
        client
            .publish_sandbox_state(publish(
                "node-a",
                a,
                &row,
                12,
                reconciler_pb::SandboxStatus::Started,
                true,
            ))
            .await
            .unwrap();
        client
            .publish_sandbox_state(publish(
                "node-a",
                a,
                &row,
                13,
                reconciler_pb::SandboxStatus::Exited,
                true,
            ))
            .await
            .unwrap();
        let now = w.store.sandbox(&row.id).await.unwrap();
        assert_eq!(
            (now.status.as_str(), now.observed_status.as_str()),
            ("started", "exited")
        );
    }

    async fn a_restore_writes_placement_and_route_identity_and_settles_the_wake(w: World) {
        let b = register(&w, "node-b", "b").await;
        let row = w.suspended_on("node-b", "run-w").await;
        let wake = w.store.queue_wake(&row.id, "test").await.unwrap();
        assert_eq!(w.store.assign_wakes(0).await.unwrap(), 1);
        let mut client = nodes(&w).await;
        let assigned = client
            .list_assigned_sandboxes(authed(
                reconciler_pb::ListAssignedSandboxesRequest {
                    node_id: "node-b".into(),
                    epoch: b,
                    known_revision: 0,
                    wait: None,
                },
                &node_token("node-b"),
            ))
            .await
            .unwrap()
            .into_inner();
        let restore = assigned
            .assignments
            .iter()
            .find(|a| a.intent() == reconciler_pb::AssignmentIntent::Restore)
            .expect("a restore assignment");
        assert_eq!(
            (restore.wake_id.as_str(), restore.wake_attempt),
            (wake.id.as_str(), 1)
        );

        let restored = client
            .report_restored(authed(
                reconciler_pb::ReportRestoredRequest {
                    node_id: "node-b".into(),
                    epoch: b,
                    wake_id: wake.id.clone(),
                    sandbox_id: row.id.clone(),
                    execution_generation: 1,
                    wake_attempt: 1,
                },
                &node_token("node-b"),
            ))
            .await
            .unwrap()
            .into_inner()
            .sandbox
            .unwrap();
        assert_eq!(restored.active_node_id, "node-b");
        assert_eq!(restored.route_identity.unwrap().current_node_id, "node-b");
        assert!(
            w.store.open_wake(&row.id).await.unwrap().is_none(),
            "the wake is settled"
        );
        // The same report again finds the wake settled.
        let again = client
            .report_restored(authed(
                reconciler_pb::ReportRestoredRequest {
                    node_id: "node-b".into(),
                    epoch: b,
                    wake_id: wake.id.clone(),
                    sandbox_id: row.id.clone(),
                    execution_generation: 1,
                    wake_attempt: 1,
                },
                &node_token("node-b"),
            ))
            .await
            .unwrap_err();
        assert_eq!(
            error_info(&again).unwrap().reason,
            ErrorReason::WakeSettled.as_str_name()
        );
    }

    async fn numbers_past_their_columns_and_oversized_strings_are_refused_before_any_write(
        w: World,
    ) {
        use runplane_sandbox_reconciler::store::entities::wake;
        use sea_orm::EntityTrait;
        let b = register(&w, "node-b", "b").await;
        let row = w.suspended_on("node-b", "run-bounds").await;
        let queued = w.store.queue_wake(&row.id, "test").await.unwrap();
        assert_eq!(w.store.assign_wakes(0).await.unwrap(), 1);
        let wake_of = || async {
            wake::Entity::find_by_id(queued.id.clone())
                .one(w.store.database())
                .await
                .unwrap()
                .unwrap()
        };
        let assigned = wake_of().await;
        let mut client = nodes(&w).await;
        let failed = |epoch: u64, attempt: u32, error: String| {
            authed(
                reconciler_pb::ReportWakeFailedRequest {
                    node_id: "node-b".into(),
                    epoch,
                    wake_id: queued.id.clone(),
                    wake_attempt: attempt,
                    error,
                },
                &node_token("node-b"),
            )
        };
        let field = |e: &tonic::Status| {
            assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
            error_info(e).unwrap().metadata["field"].clone()
        };
        // 2 bytes a character: 513 bytes over the bound, ending inside a character at 512.
        let long = format!("x{}", "é".repeat(256));
        let e = client
            .report_wake_failed(failed(b, 1, long.clone()))
            .await
            .unwrap_err();
        assert_eq!(field(&e), "error");
        let e = client
            .report_wake_failed(failed(u64::MAX, 1, "boom".into()))
            .await
            .unwrap_err();
        assert_eq!(field(&e), "epoch");
        let e = client
            .report_wake_failed(failed(b, u32::MAX, "boom".into()))
            .await
            .unwrap_err();
        assert_eq!(field(&e), "wake_attempt");
        assert_eq!(wake_of().await, assigned, "nothing written");

        let e = client
            .publish_sandbox_state(authed(
                reconciler_pb::PublishSandboxStateRequest {
                    node_id: "node-b".into(),
                    epoch: b,
                    sandbox_id: row.id.clone(),
                    execution_generation: u64::MAX,
                    observation_seq: 1,
                    status: reconciler_pb::SandboxStatus::Started as i32,
                    placed: true,
                    exit_code: None,
                    observed_at: None,
                },
                &node_token("node-b"),
            ))
            .await
            .unwrap_err();
        assert_eq!(field(&e), "execution_generation");

        // Inside the service the store still bounds the error, at a character boundary.
        let stored = w
            .store
            .report_wake_failed("node-b", &queued.id, 1, &long)
            .await
            .unwrap();
        let kept = stored.last_error;
        assert!(kept.len() <= 512 && long.starts_with(&kept), "{kept}");

        let mut api = SandboxServiceClient::connect(w.reconciler_endpoint.clone())
            .await
            .unwrap();
        let e = api
            .destroy_sandbox(authed(
                reconciler_pb::DestroySandboxRequest {
                    sandbox_id: row.id.clone(),
                    reason: "r".repeat(257),
                },
                TOKEN,
            ))
            .await
            .unwrap_err();
        assert_eq!(field(&e), "reason");
        assert_ne!(
            w.store.sandbox(&row.id).await.unwrap().status,
            runplane_sandbox_reconciler::store::DELETED,
            "an oversized reason destroys nothing"
        );
    }

    async fn an_oversized_page_is_refused_by_both_lists(w: World) {
        let mut api = SandboxServiceClient::connect(w.reconciler_endpoint.clone())
            .await
            .unwrap();
        let sandboxes = api
            .list_sandboxes(authed(
                reconciler_pb::ListSandboxesRequest {
                    page_size: 501,
                    ..Default::default()
                },
                TOKEN,
            ))
            .await
            .unwrap_err();
        let nodes = api
            .list_nodes(authed(
                reconciler_pb::ListNodesRequest {
                    page_size: 501,
                    ..Default::default()
                },
                TOKEN,
            ))
            .await
            .unwrap_err();
        for err in [sandboxes, nodes] {
            assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
            let info = error_info(&err).unwrap();
            assert_eq!(info.reason, ErrorReason::InvalidField.as_str_name());
            assert_eq!(info.metadata["field"], "page_size");
        }
        // The boundary is accepted.
        api.list_nodes(authed(
            reconciler_pb::ListNodesRequest {
                page_size: 500,
                ..Default::default()
            },
            TOKEN,
        ))
        .await
        .unwrap();
    }

    /// CreateSandbox converts `idle_timeout` to milliseconds before anything else; a
    /// far-off number of seconds saturates instead of overflowing (a panic in a checked
    /// build), and the call is answered as any other would be.
    async fn a_far_off_idle_timeout_does_not_overflow_create(w: World) {
        let (existing, _) = w.running_sandbox("far-off-idle").await;
        let mut api = SandboxServiceClient::connect(w.reconciler_endpoint.clone())
            .await
            .unwrap();
        let err = api
            .create_sandbox(authed(
                reconciler_pb::CreateSandboxRequest {
                    client_request_id: "far-off-idle-request".into(),
                    run_id: existing.run_id.clone(),
                    substrate: reconciler_pb::Substrate::Direct as i32,
                    idle_timeout: Some(prost_types::Duration {
                        seconds: i64::MAX,
                        nanos: 999_999_999,
                    }),
                    node_id: String::new(),
                },
                TOKEN,
            ))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");
    }

    async fn create_is_keyed_and_destroy_ends_the_sandbox(w: World) {
        let (existing, _) = w.running_sandbox("create-keyed").await;
        let mut api = SandboxServiceClient::connect(w.reconciler_endpoint.clone())
            .await
            .unwrap();
        let create = |key: &str, substrate: reconciler_pb::Substrate| {
            authed(
                reconciler_pb::CreateSandboxRequest {
                    client_request_id: key.into(),
                    run_id: existing.run_id.clone(),
                    substrate: substrate as i32,
                    idle_timeout: None,
                    node_id: String::new(),
                },
                TOKEN,
            )
        };
        let err = api
            .create_sandbox(create(
                "another-request-0001",
                reconciler_pb::Substrate::Direct,
            ))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::AlreadyExists);
        assert_eq!(
            error_info(&err).unwrap().metadata["sandbox_id"],
            existing.id
        );
        let err = api
            .create_sandbox(create(
                "kubernetes-request-01",
                reconciler_pb::Substrate::Kubernetes,
            ))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);

        let destroyed = api
            .destroy_sandbox(authed(
                reconciler_pb::DestroySandboxRequest {
                    sandbox_id: existing.id.clone(),
                    reason: "test".into(),
                },
                TOKEN,
            ))
            .await
            .unwrap()
            .into_inner()
            .sandbox
            .unwrap();
        assert_eq!(destroyed.status(), reconciler_pb::SandboxStatus::Deleted);
        let err = api
            .resolve_route(authed(
                reconciler_pb::ResolveRouteRequest {
                    sandbox_id: existing.id.clone(),
                    session_id: String::new(),
                },
                TOKEN,
            ))
            .await
            .unwrap_err();
        assert_eq!(
            error_info(&err).unwrap().reason,
            ErrorReason::SandboxEnded.as_str_name()
        );

        // With the old one gone, a new sandbox for the run can be created, once per key.
        let first = api
            .create_sandbox(create(
                "replacement-request-1",
                reconciler_pb::Substrate::Direct,
            ))
            .await
            .unwrap()
            .into_inner()
            .sandbox
            .unwrap();
        let again = api
            .create_sandbox(create(
                "replacement-request-1",
                reconciler_pb::Substrate::Direct,
            ))
            .await
            .unwrap()
            .into_inner()
            .sandbox
            .unwrap();
        assert_eq!(first.id, again.id);
        assert_eq!(first.status(), reconciler_pb::SandboxStatus::Creating);
    }
}

/// Whatever ends a run, its sandboxes go (suspended ones included) and nothing revives
/// them (docs/architecture.md "A run's life and its end").
mod convergence {
    use super::node_protocol::{nodes, register};
    use super::*;
    use runplane_sandbox_reconciler::store::entities::wake;
    use sea_orm::{ActiveModelTrait, EntityTrait, IntoActiveModel};

    runplane_testkit::on_both_backends!(
        World::start =>
        every_sandbox_of_an_ended_run_is_deleted_in_one_round_and_stopped_by_its_owner,
        a_late_wake_or_restore_of_a_destroyed_sandbox_is_refused_and_settles_the_wake,
        a_wake_of_a_sandbox_whose_run_ended_is_refused_and_deletes_it,
        a_restore_that_races_the_sweep_loses_and_its_node_stops_the_sandbox,
    );

    impl World {
        /// Ends `run_id` the way a service does (FailRun with the service token).
        async fn end_run(&self, run_id: &str) {
            self.run_store()
                .await
                .fail_run(authed(
                    runstore_pb::FailRunRequest {
                        run_id: run_id.into(),
                        reason: "test_ended".into(),
                        message: "ended by the test".into(),
                        idempotency_key: format!("end-{run_id}"),
                        ..Default::default()
                    },
                    TOKEN,
                ))
                .await
                .unwrap();
            assert!(self.run_state(run_id).await.state().is_terminal());
        }

        /// A reconciler whose rounds do everything but dispatch.
        fn sweeper(&self, driver: FakeDriver) -> Reconciler {
            Reconciler::new(
                self.store.clone(),
                Arc::new(driver),
                ReconcileSettings {
                    loss_grace: GRACE,
                    dispatch: false,
                    ..ReconcileSettings::default()
                },
            )
        }

        fn endpoints(&self) -> RunnerEndpoints {
            RunnerEndpoints {
                run_store: self.run_store_endpoint.clone(),
                stream_recovery: self.run_store_endpoint.clone(),
            }
        }

        async fn insert(&self, row: sandbox::Model, routed_to: Option<&str>) -> sandbox::Model {
            let row = self.store.insert_sandbox(row).await.unwrap();
            if let Some(node) = routed_to {
                self.store
                    .set_route_identity(route_identity::Model {
                        sandbox_id: row.id.clone(),
                        current_node_id: node.into(),
                        execution_generation: row.execution_generation,
                    })
                    .await
                    .unwrap();
            }
            row
        }

        async fn wake_row(&self, id: &str) -> wake::Model {
            wake::Entity::find_by_id(id.to_owned())
                .one(self.store.database())
                .await
                .unwrap()
                .unwrap()
        }

        async fn status_shown(&self, id: &str) -> reconciler_pb::Sandbox {
            SandboxServiceClient::connect(self.reconciler_endpoint.clone())
                .await
                .unwrap()
                .get_sandbox(authed(
                    reconciler_pb::GetSandboxRequest {
                        sandbox_id: id.into(),
                    },
                    TOKEN,
                ))
                .await
                .unwrap()
                .into_inner()
                .sandbox
                .unwrap()
        }
    }

    fn new_id() -> String {
        uuid::Uuid::new_v4().to_string()
    }

    async fn assigned(w: &World, node: &str, epoch: u64) -> Vec<reconciler_pb::Assignment> {
        nodes(w)
            .await
            .list_assigned_sandboxes(authed(
                reconciler_pb::ListAssignedSandboxesRequest {
                    node_id: node.into(),
                    epoch,
                    known_revision: 0,
                    wait: None,
                },
                &node_token(node),
            ))
            .await
            .unwrap()
            .into_inner()
            .assignments
    }

    fn intents(
        assignments: &[reconciler_pb::Assignment],
        intent: reconciler_pb::AssignmentIntent,
    ) -> Vec<String> {
        let mut ids: Vec<String> = assignments
            .iter()
            .filter(|a| a.intent() == intent)
            .map(|a| a.sandbox_id.clone())
            .collect();
        ids.sort();
        ids
    }

    fn report_restored(
        node: &str,
        epoch: u64,
        wake_id: &str,
        sandbox_id: &str,
    ) -> tonic::Request<reconciler_pb::ReportRestoredRequest> {
        authed(
            reconciler_pb::ReportRestoredRequest {
                node_id: node.into(),
                epoch,
                wake_id: wake_id.into(),
                sandbox_id: sandbox_id.into(),
                execution_generation: 1,
                wake_attempt: 1,
            },
            &node_token(node),
        )
    }

    async fn every_sandbox_of_an_ended_run_is_deleted_in_one_round_and_stopped_by_its_owner(
        w: World,
    ) {
        let a = register(&w, "node-a", "a").await;
        let (started, _) = w.running_sandbox("ended").await;
        w.store
            .set_route_identity(route_identity::Model {
                sandbox_id: started.id.clone(),
                current_node_id: "node-a".into(),
                execution_generation: 1,
            })
            .await
            .unwrap();
        let run = started.run_id.clone();
        let creating = w
            .insert(
                w.row(&new_id(), &run, "direct", "creating", Some("node-a")),
                Some("node-a"),
            )
            .await;
        // Idle-suspended by node-a and published unplaced, with a wake waiting.
        let suspended = w
            .insert(
                w.row(&new_id(), &run, "direct", "suspended", None),
                Some("node-a"),
            )
            .await;
        let wake = w.store.queue_wake(&suspended.id, "reattach").await.unwrap();
        let local = w
            .insert(
                sandbox::Model {
                    driver_handle: "fake:local".into(),
                    ..w.row(&new_id(), &run, "direct", "started", Some("local"))
                },
                None,
            )
            .await;
        // An exit already confirmed, and an exit only observed: neither is deleted yet.
        let exited = w
            .insert(
                w.row(&new_id(), &run, "direct", "exited", Some("local")),
                None,
            )
            .await;
        let observed_exit = w
            .insert(
                sandbox::Model {
                    observed_status: "exited".into(),
                    ..w.row(&new_id(), &run, "direct", "started", Some("node-a"))
                },
                Some("node-a"),
            )
            .await;
        let (survivor, _) = w.running_sandbox("still-running").await;
        w.end_run(&run).await;

        let driver = FakeDriver::always(Probe::Alive);
        let reconciler = w.sweeper(driver.clone());
        reconciler
            .round(&w.outbox_client().await, &w.endpoints())
            .await;

        let ended = [
            &started,
            &creating,
            &suspended,
            &local,
            &exited,
            &observed_exit,
        ];
        let listed = SandboxServiceClient::connect(w.reconciler_endpoint.clone())
            .await
            .unwrap()
            .list_sandboxes(authed(
                reconciler_pb::ListSandboxesRequest {
                    run_id: run.clone(),
                    ..Default::default()
                },
                TOKEN,
            ))
            .await
            .unwrap()
            .into_inner()
            .sandboxes;
        assert_eq!(listed.len(), ended.len());
        for s in &listed {
            assert_eq!(s.status(), reconciler_pb::SandboxStatus::Deleted, "{s:?}");
            assert!(s.pending_wake.is_none());
        }
        assert_eq!(
            w.status_shown(&survivor.id).await.status(),
            reconciler_pb::SandboxStatus::Started,
            "a running run keeps its sandbox"
        );
        // The deletion settled the wake: no node restores what was destroyed.
        let settled = w.wake_row(&wake.id).await;
        assert_eq!(settled.state, "failed");
        assert!(settled.settled_at_us.is_some());

        // Local ones were stopped by the reconciler itself, in the same round.
        let mut stopped = driver.destroyed();
        stopped.sort();
        let mut local_ids = vec![local.id.clone(), exited.id.clone()];
        local_ids.sort();
        assert_eq!(stopped, local_ids);

        // node-a is told to stop its own, the suspended one included, and the survivor
        // keeps running; once it acknowledges, nothing more is owed.
        let list = assigned(&w, "node-a", a).await;
        let mut node_ids = vec![
            started.id.clone(),
            creating.id.clone(),
            suspended.id.clone(),
            observed_exit.id.clone(),
        ];
        node_ids.sort();
        assert_eq!(
            intents(&list, reconciler_pb::AssignmentIntent::Destroy),
            node_ids
        );
        assert_eq!(
            intents(&list, reconciler_pb::AssignmentIntent::Run),
            vec![survivor.id.clone()]
        );
        for id in &node_ids {
            let acked = nodes(&w)
                .await
                .publish_sandbox_state(authed(
                    reconciler_pb::PublishSandboxStateRequest {
                        node_id: "node-a".into(),
                        epoch: a,
                        sandbox_id: id.clone(),
                        execution_generation: 1,
                        observation_seq: 100,
                        status: reconciler_pb::SandboxStatus::Deleted as i32,
                        placed: false,
                        exit_code: None,
                        observed_at: None,
                    },
                    &node_token("node-a"),
                ))
                .await
                .unwrap()
                .into_inner();
            assert!(acked.applied);
            assert_eq!(
                acked.sandbox.unwrap().status(),
                reconciler_pb::SandboxStatus::Deleted
            );
        }
        assert!(
            intents(
                &assigned(&w, "node-a", a).await,
                reconciler_pb::AssignmentIntent::Destroy
            )
            .is_empty()
        );
        // A second round owes nothing again: every stop was acknowledged.
        reconciler
            .round(&w.outbox_client().await, &w.endpoints())
            .await;
        assert_eq!(driver.destroyed().len(), 2);
    }

    async fn a_late_wake_or_restore_of_a_destroyed_sandbox_is_refused_and_settles_the_wake(
        w: World,
    ) {
        let b = register(&w, "node-b", "b").await;
        let (row, _) = w.running_sandbox("late-wake").await;
        // node-b ran it and suspended it: node-b holds it, and its wakes go to node-b.
        w.store
            .set_route_identity(route_identity::Model {
                sandbox_id: row.id.clone(),
                current_node_id: "node-b".into(),
                execution_generation: 1,
            })
            .await
            .unwrap();
        assert!(
            w.store
                .publish(&row.id, 1, "suspended", None)
                .await
                .unwrap()
        );
        let mut api = SandboxServiceClient::connect(w.reconciler_endpoint.clone())
            .await
            .unwrap();
        let request_wake = || {
            authed(
                reconciler_pb::RequestWakeRequest {
                    sandbox_id: row.id.clone(),
                    reason: "reattach".into(),
                },
                TOKEN,
            )
        };
        let wake = api
            .request_wake(request_wake())
            .await
            .unwrap()
            .into_inner()
            .wake
            .expect("a wake for an unplaced sandbox of a running run");
        assert_eq!(w.store.assign_wakes(0).await.unwrap(), 1);

        // Destroyed while node-b restores it.
        let destroyed = api
            .destroy_sandbox(authed(
                reconciler_pb::DestroySandboxRequest {
                    sandbox_id: row.id.clone(),
                    reason: "test".into(),
                },
                TOKEN,
            ))
            .await
            .unwrap()
            .into_inner()
            .sandbox
            .unwrap();
        assert_eq!(destroyed.status(), reconciler_pb::SandboxStatus::Deleted);
        assert_eq!(
            w.wake_row(&wake.id).await.state,
            "failed",
            "settled with it"
        );

        let late = nodes(&w)
            .await
            .report_restored(report_restored("node-b", b, &wake.id, &row.id))
            .await
            .unwrap_err();
        assert_eq!(late.code(), Code::FailedPrecondition);
        assert_eq!(
            error_info(&late).unwrap().reason,
            ErrorReason::SandboxEnded.as_str_name()
        );
        let shown = w.status_shown(&row.id).await;
        assert_eq!(shown.status(), reconciler_pb::SandboxStatus::Deleted);
        assert!(
            shown.active_node_id.is_empty(),
            "not placed by the late restore"
        );

        // A late reattach or wake request queues nothing.
        for err in [
            api.request_wake(request_wake()).await.unwrap_err(),
            api.resolve_route(authed(
                reconciler_pb::ResolveRouteRequest {
                    sandbox_id: row.id.clone(),
                    session_id: "session-1".into(),
                },
                TOKEN,
            ))
            .await
            .unwrap_err(),
        ] {
            assert_eq!(
                error_info(&err).unwrap().reason,
                ErrorReason::SandboxEnded.as_str_name()
            );
        }
        assert!(w.store.open_wake(&row.id).await.unwrap().is_none());

        // A wake that got in anyway (queued as the deletion committed) is settled, not
        // assigned.
        let stray = wake::Model {
            id: new_id(),
            sandbox_id: row.id.clone(),
            state: "pending".into(),
            node_id: None,
            attempts: 0,
            last_error: String::new(),
            reason: "stray".into(),
            requested_at_us: w.clock.now().timestamp_micros(),
            settled_at_us: None,
            not_before_us: None,
        };
        stray
            .clone()
            .into_active_model()
            .insert(w.store.database())
            .await
            .unwrap();
        assert_eq!(w.store.assign_wakes(0).await.unwrap(), 0);
        assert_eq!(w.wake_row(&stray.id).await.state, "failed");

        // And one assigned before the row was deleted behind its back: the restore itself
        // refuses an ended row and settles the wake.
        let (other, _) = w.running_sandbox("restore-after-delete").await;
        w.store
            .set_route_identity(route_identity::Model {
                sandbox_id: other.id.clone(),
                current_node_id: "node-b".into(),
                execution_generation: 1,
            })
            .await
            .unwrap();
        assert!(
            w.store
                .publish(&other.id, 1, "suspended", None)
                .await
                .unwrap()
        );
        let wake = w.store.queue_wake(&other.id, "reattach").await.unwrap();
        assert_eq!(w.store.assign_wakes(0).await.unwrap(), 1);
        let mut deleted = other.clone().into_active_model();
        deleted.status = sea_orm::Set(sandbox::SandboxStatus::Deleted);
        deleted.update(w.store.database()).await.unwrap();
        let late = nodes(&w)
            .await
            .report_restored(report_restored("node-b", b, &wake.id, &other.id))
            .await
            .unwrap_err();
        assert_eq!(
            error_info(&late).unwrap().reason,
            ErrorReason::SandboxEnded.as_str_name()
        );
        assert_eq!(w.wake_row(&wake.id).await.state, "failed");
        assert_eq!(
            w.status_shown(&other.id).await.status(),
            reconciler_pb::SandboxStatus::Deleted,
            "never revived"
        );
    }

    async fn a_wake_of_a_sandbox_whose_run_ended_is_refused_and_deletes_it(w: World) {
        let (row, _) = w.running_sandbox("wake-ended-run").await;
        assert!(
            w.store
                .publish(&row.id, 1, "suspended", None)
                .await
                .unwrap()
        );
        w.end_run(&row.run_id).await;
        let err = SandboxServiceClient::connect(w.reconciler_endpoint.clone())
            .await
            .unwrap()
            .request_wake(authed(
                reconciler_pb::RequestWakeRequest {
                    sandbox_id: row.id.clone(),
                    reason: "reattach".into(),
                },
                TOKEN,
            ))
            .await
            .unwrap_err();
        assert_eq!(
            error_info(&err).unwrap().reason,
            ErrorReason::SandboxEnded.as_str_name()
        );
        assert!(w.store.open_wake(&row.id).await.unwrap().is_none());
        assert_eq!(
            w.status_shown(&row.id).await.status(),
            reconciler_pb::SandboxStatus::Deleted
        );
    }

    async fn a_restore_that_races_the_sweep_loses_and_its_node_stops_the_sandbox(w: World) {
        let b = register(&w, "node-b", "b").await;
        let (row, _) = w.running_sandbox("restore-race").await;
        // Suspended by node-b, which holds it.
        w.store
            .set_route_identity(route_identity::Model {
                sandbox_id: row.id.clone(),
                current_node_id: "node-b".into(),
                execution_generation: 1,
            })
            .await
            .unwrap();
        assert!(
            w.store
                .publish(&row.id, 1, "suspended", None)
                .await
                .unwrap()
        );
        let wake = w.store.queue_wake(&row.id, "reattach").await.unwrap();
        assert_eq!(w.store.assign_wakes(0).await.unwrap(), 1);
        w.end_run(&row.run_id).await;

        // The sweep has read the row (suspended, unplaced) and asks the run store; node-b's
        // restore lands while that question is in flight.
        let endpoint = w.reconciler_endpoint.clone();
        let (wake_id, sandbox_id) = (wake.id.clone(), row.id.clone());
        *w.on_list_runs.lock().unwrap() = Some(Box::new(move || {
            Box::pin(async move {
                let restored = NodeServiceClient::connect(endpoint)
                    .await
                    .unwrap()
                    .report_restored(report_restored("node-b", b, &wake_id, &sandbox_id))
                    .await
                    .unwrap()
                    .into_inner()
                    .sandbox
                    .unwrap();
                assert_eq!(restored.active_node_id, "node-b");
            })
        }));
        w.sweeper(FakeDriver::always(Probe::Alive))
            .delete_sandboxes_of_ended_runs(&w.outbox_client().await)
            .await
            .unwrap();
        assert!(w.on_list_runs.lock().unwrap().is_none(), "the hook ran");

        let shown = w.status_shown(&row.id).await;
        assert_eq!(
            shown.status(),
            reconciler_pb::SandboxStatus::Deleted,
            "the deletion wins"
        );
        // The node that restored it is the one told to stop it.
        let list = assigned(&w, "node-b", b).await;
        assert_eq!(
            intents(&list, reconciler_pb::AssignmentIntent::Destroy),
            vec![row.id.clone()]
        );
        assert!(intents(&list, reconciler_pb::AssignmentIntent::Run).is_empty());
    }

    use runplane_proto::reconciler::v1::node_service_client::NodeServiceClient;
}

/// Several hosts: a wake goes to the node holding the sandbox, a node's publication is a
/// compare-and-set on its ownership, a node lost with suspended sandboxes ends their runs
/// through the loss grace, and a failing restore settles instead of looping.
mod many_hosts {
    use super::node_protocol::{nodes, publish, register};
    use super::*;
    use runplane_sandbox_reconciler::drivers::{ProcessDriver, RoutedDriver};
    use runplane_sandbox_reconciler::store::entities::wake;
    use sea_orm::{
        ActiveModelTrait, ConnectionTrait, EntityTrait, IntoActiveModel, TransactionTrait,
    };

    runplane_testkit::on_both_backends!(
        workers 4,
        World::start =>
        a_wake_goes_to_the_node_holding_the_sandbox_and_waits_for_it,
        a_node_lost_with_suspended_sandboxes_ends_their_runs_once_after_the_grace,
        a_failing_restore_backs_off_and_settles_instead_of_looping,
    );

    async fn heartbeat(w: &World, node: &str, epoch: u64, used: u32) {
        nodes(w)
            .await
            .heartbeat(authed(
                reconciler_pb::HeartbeatRequest {
                    node_id: node.into(),
                    epoch,
                    used,
                },
                &node_token(node),
            ))
            .await
            .unwrap();
    }

    async fn restores_listed(w: &World, node: &str, epoch: u64) -> Vec<reconciler_pb::Assignment> {
        nodes(w)
            .await
            .list_assigned_sandboxes(authed(
                reconciler_pb::ListAssignedSandboxesRequest {
                    node_id: node.into(),
                    epoch,
                    known_revision: 0,
                    wait: None,
                },
                &node_token(node),
            ))
            .await
            .unwrap()
            .into_inner()
            .assignments
            .into_iter()
            .filter(|a| a.intent() == reconciler_pb::AssignmentIntent::Restore)
            .collect()
    }

    /// A running run whose sandbox node `node` ran and then suspended for idleness,
    /// published through NodeService as the agent does.
    async fn suspended_run(w: &World, name: &str, node: &str, epoch: u64) -> sandbox::Model {
        let (row, _) = w.running_sandbox(name).await;
        let mut placed = row.into_active_model();
        placed.active_node_id = sea_orm::Set(Some(node.to_owned()));
        let row = placed.update(w.store.database()).await.unwrap();
        w.store
            .set_route_identity(route_identity::Model {
                sandbox_id: row.id.clone(),
                current_node_id: node.into(),
                execution_generation: 1,
            })
            .await
            .unwrap();
        let answer = nodes(w)
            .await
            .publish_sandbox_state(publish(
                node,
                epoch,
                &row,
                10,
                reconciler_pb::SandboxStatus::Suspended,
                false,
            ))
            .await
            .unwrap()
            .into_inner();
        assert!(answer.applied);
        w.store.sandbox(&row.id).await.unwrap()
    }

    /// The reconciler as `runplane serve` builds it: node sandboxes probed through what
    /// their nodes publish and how recently they heartbeat.
    fn routed(w: &World, state: &std::path::Path) -> Reconciler {
        Reconciler::new(
            w.store.clone(),
            Arc::new(RoutedDriver::new(
                ProcessDriver::new(state, "/nonexistent/runplane"),
                w.store.clone(),
            )),
            ReconcileSettings {
                loss_grace: GRACE,
                dispatch: false,
                ..ReconcileSettings::default()
            },
        )
    }

    async fn a_wake_goes_to_the_node_holding_the_sandbox_and_waits_for_it(w: World) {
        let a = register(&w, "node-a", "a").await;
        let b = register(&w, "node-b", "b").await;
        // node-a is busier: the least-used rule would pick node-b.
        heartbeat(&w, "node-a", a, 3).await;
        heartbeat(&w, "node-b", b, 0).await;
        let row = w.suspended_on("node-a", "run-holder").await;
        let wake = w.store.queue_wake(&row.id, "reattach").await.unwrap();

        // node-a silent: the wake waits for it rather than going to node-b.
        w.clock.advance(Duration::from_secs(11));
        heartbeat(&w, "node-b", b, 0).await;
        assert_eq!(
            w.store.assign_wakes(w.store.silent_since()).await.unwrap(),
            0
        );
        assert!(restores_listed(&w, "node-b", b).await.is_empty());

        heartbeat(&w, "node-a", a, 3).await;
        assert_eq!(
            w.store.assign_wakes(w.store.silent_since()).await.unwrap(),
            1
        );
        let on_a = restores_listed(&w, "node-a", a).await;
        assert_eq!(on_a.len(), 1);
        assert_eq!(on_a[0].wake_id, wake.id);
        assert!(restores_listed(&w, "node-b", b).await.is_empty());
    }

    /// Backends of this test's database waiting on a lock.
    async fn lock_waiters(db: &sea_orm::DatabaseConnection) -> i64 {
        let row = db
            .query_one_raw(sea_orm::Statement::from_string(
                db.get_database_backend(),
                "SELECT count(*) AS n FROM pg_stat_activity \
                 WHERE datname = current_database() AND wait_event_type = 'Lock'",
            ))
            .await
            .unwrap()
            .unwrap();
        row.try_get::<i64>("", "n").unwrap()
    }

    async fn until_lock_waiters(db: &sea_orm::DatabaseConnection, n: i64) {
        for _ in 0..500 {
            if lock_waiters(db).await >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{n} backends never waited on a lock");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_publication_racing_a_restore_does_not_overwrite_it() {
        let w = World::start(Backend::postgres().await).await;
        let a = register(&w, "node-a", "a").await;
        let b = register(&w, "node-b", "b").await;
        let row = w.suspended_on("node-a", "run-publication-race").await;
        // A wake handed to node-b (the least-used rule did this; a driver that restores
        // anywhere still may), which restores the sandbox.
        let queued = w.store.queue_wake(&row.id, "reattach").await.unwrap();
        let mut handed = queued.clone().into_active_model();
        handed.state = sea_orm::Set("assigned".into());
        handed.node_id = sea_orm::Set(Some("node-b".into()));
        handed.attempts = sea_orm::Set(1);
        handed.update(w.store.database()).await.unwrap();

        // A second connection holds the wake row, so the restore stops after writing the
        // sandbox row and before it commits.
        let holder = sea_orm::Database::connect(w._dbs.1.url()).await.unwrap();
        let held = holder.begin().await.unwrap();
        held.execute_unprepared(&format!(
            "SELECT id FROM wakes WHERE id = '{}' FOR UPDATE",
            queued.id
        ))
        .await
        .unwrap();
        let restore = {
            let endpoint = w.reconciler_endpoint.clone();
            let (wake_id, sandbox_id) = (queued.id.clone(), row.id.clone());
            tokio::spawn(async move {
                NodeServiceClient::connect(endpoint)
                    .await
                    .unwrap()
                    .report_restored(authed(
                        reconciler_pb::ReportRestoredRequest {
                            node_id: "node-b".into(),
                            epoch: b,
                            wake_id,
                            sandbox_id,
                            execution_generation: 1,
                            wake_attempt: 1,
                        },
                        &node_token("node-b"),
                    ))
                    .await
            })
        };
        until_lock_waiters(w.store.database(), 1).await;
        // node-a's publication (its suspend, sent again) reads the row as it was, still
        // node-a's, and its write waits behind the restore.
        let stale = {
            let endpoint = w.reconciler_endpoint.clone();
            let row = row.clone();
            tokio::spawn(async move {
                NodeServiceClient::connect(endpoint)
                    .await
                    .unwrap()
                    .publish_sandbox_state(publish(
                        "node-a",
                        a,
                        &row,
                        20,
                        reconciler_pb::SandboxStatus::Suspended,
                        false,
                    ))
                    .await
            })
        };
        until_lock_waiters(w.store.database(), 2).await;
        held.commit().await.unwrap();

        let restored = restore.await.unwrap();
        let lost = stale.await.unwrap().unwrap_err();
        assert_eq!(lost.code(), Code::PermissionDenied, "{lost:?}");
        assert_eq!(
            error_info(&lost).unwrap().reason,
            ErrorReason::NodeNotOwner.as_str_name()
        );
        let now = w.store.sandbox(&row.id).await.unwrap();
        assert_eq!(
            (now.status.as_str(), now.active_node_id.as_deref()),
            ("started", Some("node-b")),
            "the restore stands"
        );
        restored.unwrap();
        assert_eq!(
            w.store
                .route_of(&row.id)
                .await
                .unwrap()
                .unwrap()
                .current_node_id,
            "node-b"
        );
    }

    async fn a_node_lost_with_suspended_sandboxes_ends_their_runs_once_after_the_grace(w: World) {
        // No sandbox here is local: the process driver is never asked.
        let state = std::env::temp_dir().join(uuid::Uuid::new_v4().to_string());
        let a = register(&w, "node-a", "a").await;
        let b = register(&w, "node-b", "b").await;
        let on_a = [
            suspended_run(&w, "lost-host-1", "node-a", a).await,
            suspended_run(&w, "lost-host-2", "node-a", a).await,
        ];
        let on_b = suspended_run(&w, "live-host", "node-b", b).await;
        let waiting = w.store.queue_wake(&on_a[0].id, "reattach").await.unwrap();
        let reconciler = routed(&w, &state);

        // Both nodes heartbeat: suspended sandboxes wait for their wakes.
        assert_eq!(reconciler.tick().await.unwrap().stamped, 0);

        // node-a falls silent for good; node-b keeps heartbeating.
        w.clock.advance(Duration::from_secs(11));
        heartbeat(&w, "node-b", b, 0).await;
        let first = reconciler.tick().await.unwrap();
        assert_eq!(first.stamped, 2, "{first:?}");
        assert_eq!(first.confirmed, 0, "one observation fails nothing");
        assert!(
            w.store
                .sandbox(&on_b.id)
                .await
                .unwrap()
                .loss_observed_at_us
                .is_none()
        );

        // Past the grace: overlapping ticks confirm each loss once.
        w.clock.advance(GRACE);
        heartbeat(&w, "node-b", b, 0).await;
        let (one, two) = tokio::join!(reconciler.tick(), reconciler.tick());
        assert_eq!(one.unwrap().confirmed + two.unwrap().confirmed, 2);
        let client = w.outbox_client().await;
        deliver_outbox(&w.store, &client, 100).await.unwrap();
        reconciler.tick().await.unwrap();
        deliver_outbox(&w.store, &client, 100).await.unwrap();
        assert_eq!(
            w.fail_run_calls.load(Ordering::SeqCst),
            2,
            "one FailRun per run"
        );
        for row in &on_a {
            let run = w.run_state(&row.run_id).await;
            assert_eq!(run.state(), runstore_pb::RunState::Failed, "{run:?}");
            assert_eq!(run.verdict.unwrap().reason, "sandbox_lost");
            assert_eq!(w.store.sandbox(&row.id).await.unwrap().status, "lost");
        }
        let settled = wake::Entity::find_by_id(waiting.id.clone())
            .one(w.store.database())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(settled.state, "failed", "nothing restores a lost sandbox");
        assert_eq!(
            w.run_state(&on_b.run_id).await.state(),
            runstore_pb::RunState::Running,
            "a live host's suspended run waits for its wake"
        );
    }

    async fn a_failing_restore_backs_off_and_settles_instead_of_looping(w: World) {
        let a = register(&w, "node-a", "a").await;
        let b = register(&w, "node-b", "b").await;
        let row = w.suspended_on("node-a", "run-failing-restore").await;
        let mut api = SandboxServiceClient::connect(w.reconciler_endpoint.clone())
            .await
            .unwrap();
        let request_wake = || {
            authed(
                reconciler_pb::RequestWakeRequest {
                    sandbox_id: row.id.clone(),
                    reason: "reattach".into(),
                },
                TOKEN,
            )
        };
        // A minute of a client reattaching four times a second, a reconciler round at
        // each, and node-a failing every restore it is handed.
        let step = Duration::from_millis(250);
        let steps = 4 * 60;
        let mut attempts = 0;
        for _ in 0..steps {
            w.clock.advance(step);
            heartbeat(&w, "node-a", a, 0).await;
            heartbeat(&w, "node-b", b, 0).await;
            api.request_wake(request_wake()).await.unwrap();
            w.store.assign_wakes(w.store.silent_since()).await.unwrap();
            assert!(
                restores_listed(&w, "node-b", b).await.is_empty(),
                "only the holder"
            );
            for restore in restores_listed(&w, "node-a", a).await {
                attempts += 1;
                nodes(&w)
                    .await
                    .report_wake_failed(authed(
                        reconciler_pb::ReportWakeFailedRequest {
                            node_id: "node-a".into(),
                            epoch: a,
                            wake_id: restore.wake_id,
                            wake_attempt: restore.wake_attempt,
                            error: "could not signal the sandbox".into(),
                        },
                        &node_token("node-a"),
                    ))
                    .await
                    .unwrap();
            }
        }
        // A wake tries 3 times within 3 s; the next one waits 30 s after it failed.
        let window = Duration::from_millis(250) * steps;
        let bound = 3 * (window.as_secs() / 30 + 1);
        assert!(
            attempts > 0 && attempts <= bound,
            "{attempts} restores in {window:?}"
        );

        // Once node-a says the process is gone, nothing is handed out again.
        nodes(&w)
            .await
            .publish_sandbox_state(publish(
                "node-a",
                a,
                &row,
                30,
                reconciler_pb::SandboxStatus::Lost,
                false,
            ))
            .await
            .unwrap();
        let mut after = 0;
        for _ in 0..steps {
            w.clock.advance(step);
            heartbeat(&w, "node-a", a, 0).await;
            let _ = api.request_wake(request_wake()).await;
            w.store.assign_wakes(w.store.silent_since()).await.unwrap();
            after += restores_listed(&w, "node-a", a).await.len();
        }
        assert_eq!(after, 0, "no restore of a sandbox its holder saw gone");
    }

    use runplane_proto::reconciler::v1::node_service_client::NodeServiceClient;
}

/// Two reconciler replicas, each with its own connection pool on one database, running
/// the same background step at the same moment.
mod two_replicas {
    use super::node_protocol::register;
    use super::*;
    use sea_orm::EntityTrait;

    /// Two reconcilers with always-alive probes, one on the world's store and one on a
    /// replica's, and a run-store client for both.
    async fn replicas(w: &World) -> (Reconciler, Reconciler, RunStoreClient) {
        let driver = || Arc::new(FakeDriver::always(Probe::Alive));
        let a = Reconciler::new(w.store.clone(), driver(), ReconcileSettings::default());
        let b = Reconciler::new(
            w.replica_store().await,
            driver(),
            ReconcileSettings::default(),
        );
        (a, b, w.outbox_client().await)
    }

    /// While `held`, each ListRuns waits until two are in flight: both replicas hold the
    /// same answer before either acts on it.
    fn hold_list_runs(w: &World, held: bool) {
        *w.list_runs_barrier.lock().unwrap() = held.then(|| Arc::new(tokio::sync::Barrier::new(2)));
    }

    /// Both replicas read the nodes' room, then both are held at the same point (their
    /// ListRuns of STARTING runs) until each has claimed, so both place against the same
    /// stale room: the node's lock and count at the insert keep every node within its
    /// capacity (4), and no run gets two sandboxes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn dispatching_at_once_they_place_each_run_once_within_each_nodes_capacity() {
        let w = World::start(Backend::postgres().await).await;
        register(&w, "node-a", "a").await;
        register(&w, "node-b", "b").await;
        let mut runs = Vec::new();
        for i in 0..12 {
            runs.push(w.queued_run(&format!("two-dispatch-{i:02}")).await.id);
        }
        let other = w.replica_store().await;
        hold_list_runs(&w, true);
        tokio::join!(w.dispatch_once(&w.store), w.dispatch_once(&other));
        hold_list_runs(&w, false);

        let rows = sandbox::Entity::find()
            .all(w.store.database())
            .await
            .unwrap();
        let mut per_run = std::collections::HashMap::<&str, usize>::new();
        let mut per_node = std::collections::HashMap::<&str, usize>::new();
        for row in &rows {
            *per_run.entry(row.run_id.as_str()).or_default() += 1;
            *per_node
                .entry(row.active_node_id.as_deref().unwrap_or("unplaced"))
                .or_default() += 1;
        }
        assert!(
            per_run.values().all(|n| *n == 1),
            "a run placed twice: {per_run:?}"
        );
        assert_eq!(per_node.get("node-a"), Some(&4), "{per_node:?}");
        assert_eq!(per_node.get("node-b"), Some(&4), "{per_node:?}");
        assert_eq!(rows.len(), 8);

        // Room frees (two runs end): the next round places runs that waited, still within
        // capacity, and never a run twice.
        let mut op = w.run_store().await;
        for row in rows
            .iter()
            .filter(|r| r.active_node_id.as_deref() == Some("node-a"))
            .take(2)
        {
            op.cancel_run(authed(
                runstore_pb::CancelRunRequest {
                    run_id: row.run_id.clone(),
                    reason: String::new(),
                    idempotency_key: format!("free-{}", row.id),
                },
                TOKEN,
            ))
            .await
            .unwrap();
            w.store.mark_deleted(&row.id, 1).await.unwrap();
        }
        tokio::join!(w.dispatch_once(&w.store), w.dispatch_once(&other));
        let rows = sandbox::Entity::find()
            .all(w.store.database())
            .await
            .unwrap();
        let live: Vec<_> = rows.iter().filter(|r| r.status != "deleted").collect();
        let on_a = live
            .iter()
            .filter(|r| r.active_node_id.as_deref() == Some("node-a"))
            .count();
        assert_eq!(on_a, 4, "node-a filled to its capacity again, not past it");
        let mut runs_placed: Vec<&str> = rows.iter().map(|r| r.run_id.as_str()).collect();
        let placed = runs_placed.len();
        runs_placed.sort();
        runs_placed.dedup();
        assert_eq!(runs_placed.len(), placed, "a run placed twice");
        assert_eq!(placed, 10);
    }

    /// Both replicas sweep the sandboxes of ended runs at once, both holding the same
    /// answer from the run store: each sandbox is deleted by exactly one of them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn sweeping_ended_runs_at_once_they_delete_each_sandbox_once() {
        let w = World::start(Backend::postgres().await).await;
        let mut op = w.run_store().await;
        let mut rows = Vec::new();
        for i in 0..5 {
            let (row, _) = w.running_sandbox(&format!("two-sweeps-{i}")).await;
            op.cancel_run(authed(
                runstore_pb::CancelRunRequest {
                    run_id: row.run_id.clone(),
                    reason: String::new(),
                    idempotency_key: format!("two-sweeps-cancel-{i}"),
                },
                TOKEN,
            ))
            .await
            .unwrap();
            rows.push(row);
        }
        let (a, b, client) = replicas(&w).await;
        hold_list_runs(&w, true);
        let (da, db) = tokio::join!(
            a.delete_sandboxes_of_ended_runs(&client),
            b.delete_sandboxes_of_ended_runs(&client)
        );
        hold_list_runs(&w, false);
        assert_eq!(da.unwrap() + db.unwrap(), 5, "each deleted by one replica");
        for row in &rows {
            assert_eq!(w.store.sandbox(&row.id).await.unwrap().status, "deleted");
        }
    }

    /// Both replicas find the same parked runs with a message waiting at once: each
    /// sandbox gets one wake, queued by one of them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn waking_parked_runs_at_once_they_queue_one_wake_each() {
        use runplane_sandbox_reconciler::store::entities::wake;
        let w = World::start(Backend::postgres().await).await;
        let mut op = w.run_store().await;
        let mut parked = Vec::new();
        for i in 0..4 {
            let (row, _) = w.running_sandbox(&format!("two-wakes-{i}")).await;
            w.store.mark_deleted(&row.id, 1).await.unwrap();
            op.steer(authed(
                runstore_pb::SteerRequest {
                    run_id: row.run_id.clone(),
                    text: "are you there".into(),
                    idempotency_key: format!("two-wakes-steer-{i}"),
                },
                TOKEN,
            ))
            .await
            .unwrap();
            parked.push(w.suspended_on("node-a", &row.run_id).await);
        }
        let (a, b, client) = replicas(&w).await;
        hold_list_runs(&w, true);
        let (qa, qb) = tokio::join!(
            a.wake_sandboxes_with_messages(&client),
            b.wake_sandboxes_with_messages(&client)
        );
        hold_list_runs(&w, false);
        assert_eq!(
            qa.unwrap() + qb.unwrap(),
            4,
            "each wake queued by one replica"
        );
        let wakes = wake::Entity::find().all(w.store.database()).await.unwrap();
        assert_eq!(wakes.len(), 4, "{wakes:?}");
        for row in &parked {
            assert_eq!(wakes.iter().filter(|k| k.sandbox_id == row.id).count(), 1);
        }
        // Asked again, nothing more is queued: the open wakes stand.
        assert_eq!(a.wake_sandboxes_with_messages(&client).await.unwrap(), 0);
    }

    /// Both replicas tick over the same sandboxes past their loss grace at once: every
    /// loss is confirmed by exactly one of them, one FailRun owed for each.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn ticking_at_once_they_confirm_each_loss_once() {
        let w = World::start(Backend::postgres().await).await;
        let mut rows = Vec::new();
        for i in 0..6 {
            let (row, _) = w.running_sandbox(&format!("two-ticks-{i}")).await;
            rows.push(w.stamp(&row).await);
        }
        w.clock.advance(GRACE + Duration::from_secs(1));
        let other = w.replica_store().await;
        let settings = ReconcileSettings {
            loss_grace: GRACE,
            // Small batches, so the replicas' passes interleave row by row.
            batch: 2,
            ..ReconcileSettings::default()
        };
        let a = Reconciler::new(
            w.store.clone(),
            Arc::new(FakeDriver::always(Probe::Lost)),
            settings.clone(),
        );
        let b = Reconciler::new(other, Arc::new(FakeDriver::always(Probe::Lost)), settings);
        let (ra, rb) = tokio::join!(a.tick(), b.tick());
        let (ra, rb) = (ra.unwrap(), rb.unwrap());
        assert_eq!(ra.confirmed + rb.confirmed, 6, "{ra:?} {rb:?}");
        assert_eq!(w.store.outbox().await.unwrap().len(), 6);

        let client = w.outbox_client().await;
        let (da, db) = tokio::join!(
            deliver_outbox(&w.store, &client, 10),
            deliver_outbox(&w.store, &client, 10)
        );
        assert_eq!(da.unwrap() + db.unwrap(), 6);
        assert_eq!(
            w.fail_run_calls.load(Ordering::SeqCst),
            6,
            "FailRun once per loss"
        );
        for row in &rows {
            assert_eq!(
                w.run_state(&row.run_id).await.state(),
                runstore_pb::RunState::Failed
            );
        }
    }
}
