//! The sandbox reconciler: sandboxes, nodes, loss grace, placement, routes and wakes.
//!
//! docs/architecture.md "Sandbox reconciler" is the contract. The crate holds what it
//! takes from the configuration ([`config`]); the model and its migrations ([`store`]); the decisions apart from persistence ([`domain`]:
//! loss grace, placement, route tokens, wakes); the round ([`reconcile`]: dispatch within
//! node capacity, the sweep of ended runs, wakes of parked runs with messages, the
//! loss-grace tick whose every write is a compare-and-set on what it read, and FailRun
//! through a transactional outbox); the drivers ([`drivers`]: the process driver under
//! bubblewrap, node agents through the routed driver, and a scriptable fake); the node
//! agent ([`agent`]) and its session endpoint ([`session`]); and the gRPC surface
//! ([`grpc`]). Sandboxes run as processes on this host or on node agents; a Kubernetes
//! driver does not exist.

pub mod clients;
pub mod config;
pub mod domain;
pub mod drivers;
pub mod error;
pub mod grpc;
pub mod owed;
pub mod reconcile;
pub mod signals;
pub mod slots;
pub mod store;

use std::sync::Arc;
use std::time::Duration;

use runplane_clock::SharedClock;
use runplane_grpc::ServiceSet;
use runplane_proto::credentials::v1::credential_health_service_client::CredentialHealthServiceClient;
use runplane_proto::reconciler::v1::node_credential_service_server::NodeCredentialServiceServer;
use runplane_proto::reconciler::v1::node_service_server::NodeServiceServer;
use runplane_proto::reconciler::v1::sandbox_service_server::SandboxServiceServer;
use runplane_proto::recovery::v1::stream_recovery_service_client::StreamRecoveryServiceClient;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;

pub use error::ReconcilerError;

/// A started reconciler, ready to be registered on a server.
#[derive(Debug, Clone)]
pub struct SandboxReconciler {
    state: Arc<grpc::ReconcilerState>,
    settings: reconcile::ReconcileSettings,
    run_store_endpoint: String,
    tick_interval: Duration,
    state_dir: std::path::PathBuf,
    /// Credential health, whose fleet view caps dispatch; it runs where admission is on.
    fleet: Option<clients::FleetClient>,
    /// Background work; [`SandboxReconciler::register`] hands it to the server's shutdown.
    tasks: runplane_grpc::Tasks,
    /// The driver of this host's own sandboxes, once given.
    local: Option<drivers::ProcessDriver>,
    /// Held while this process may run local sandboxes (see [`LOCAL_SANDBOXES_ROLE`]): by
    /// the rounds, which launch them.
    local_role: Option<Arc<runplane_db::exclusive::Exclusive>>,
}

/// The advisory lock a reconciler with local sandboxes holds on its database for as long
/// as it runs (`local` in ASCII). A local sandbox lives in one replica's process tree and
/// is probed and stopped there; two such replicas on one database would both launch the
/// sandboxes they read as not started, and each would find the other's lost. A second one
/// is refused at start; several replicas run with `local_sandboxes = false` and node
/// agents.
const LOCAL_SANDBOXES_ROLE: i64 = 0x6c_6f_63_61_6c;

/// How long a reconciler with local sandboxes waits at start for the one before it (just
/// killed or stopping) to let go of [`LOCAL_SANDBOXES_ROLE`].
const LOCAL_SANDBOXES_WAIT: Duration = Duration::from_secs(15);

/// The reconcile round. It finishes the round in hand at shutdown. A panic stops the
/// process: the round owns this host's sandbox processes through the process driver, and
/// a fresh process adopting them from the state directory is the recovery the restart
/// tests prove, where a loop restarted in place would not be.
const ROUNDS_TASK: runplane_grpc::Task = runplane_grpc::Task {
    name: "sandbox-reconciler.rounds",
    on_cancel: runplane_grpc::OnCancel::Finish,
    on_panic: runplane_grpc::OnPanic::Stop,
};

impl SandboxReconciler {
    /// Opens and migrates the reconciler's database (`[sandbox_reconciler].database_url`).
    pub async fn open(
        config: &runplane_config::Config,
        clock: SharedClock,
    ) -> Result<Self, ReconcilerError> {
        let db = runplane_db::connect_and_migrate::<store::Migrator>(
            &config.sandbox_reconciler.database_url,
        )
        .await?;
        let local_role = if config.sandbox_reconciler.local_sandboxes {
            let held =
                runplane_db::exclusive::hold(&db, LOCAL_SANDBOXES_ROLE, LOCAL_SANDBOXES_WAIT)
                    .await
                    .map_err(ReconcilerError::Storage)?;
            Some(Arc::new(
                held.ok_or(ReconcilerError::InvalidField {
                    field: "sandbox_reconciler.local_sandboxes",
                    reason: "another sandbox reconciler with local sandboxes uses this database; \
                         a local sandbox lives in one replica's process tree, so several \
                         replicas need local_sandboxes = false and node agents"
                        .into(),
                })?,
            ))
        } else {
            None
        };
        let token = config
            .auth
            .calling_token(runplane_config::ServiceRole::SandboxReconciler);
        let route_key = config::route_key(config);
        // The other services, each called with the reconciler's own service token (else
        // the shared one).
        let invalid = |field: &'static str| {
            move |e: runplane_grpc::client::ClientError| ReconcilerError::InvalidField {
                field,
                reason: e.to_string(),
            }
        };
        let run_store = runplane_grpc::client::service_client(
            &config.run_store.endpoint,
            token,
            RunServiceClient::with_interceptor,
        )
        .map_err(invalid("run_store.endpoint"))?;
        // Capacity comes from credential health, which exists exactly where the run store
        // asks it for admission (`[run_store] admission`).
        let fleet = if config.run_store.admission {
            Some(
                runplane_grpc::client::service_client(
                    &config.credential_health.endpoint,
                    token,
                    CredentialHealthServiceClient::with_interceptor,
                )
                .map_err(invalid("credential_health.endpoint"))?,
            )
        } else {
            None
        };
        let recovery = runplane_grpc::client::service_client(
            &config.stream_recovery.endpoint,
            token,
            StreamRecoveryServiceClient::with_interceptor,
        )
        .map_err(invalid("stream_recovery.endpoint"))?;
        let tasks = runplane_grpc::Tasks::new();
        let signals = signals::Signals::new(&tasks, &db);
        Ok(Self {
            fleet,
            state: Arc::new(grpc::ReconcilerState {
                signals,
                store: store::Store::new(db, clock),
                run_store,
                recovery,
                run_store_endpoint: config.run_store.endpoint.clone(),
                recovery_endpoint: config.stream_recovery.endpoint.clone(),
                local_state_dir: config.sandbox_reconciler.state_dir.clone().into(),
                tokens: runplane_grpc::auth::Tokens::from_config(&config.auth),
                route_key,
                route_ttl: config::route_ttl(config),
                profiles: crate::domain::placement::ProfileSandboxes::from_config(config),
            }),
            settings: reconcile::ReconcileSettings::from_config(config),
            run_store_endpoint: config.run_store.endpoint.clone(),
            tick_interval: config::tick_interval(config),
            state_dir: config.sandbox_reconciler.state_dir.clone().into(),
            tasks,
            local: None,
            local_role,
        })
    }

    /// Where this reconciler's own sandboxes run when no node agent is ready: the
    /// `runplane` binary their runners start from, and how their agents are contained
    /// ([`runplane_sandbox::Containment::probe`]). Without it, runs wait for a node agent.
    pub fn with_local_sandboxes(
        mut self,
        runplane_binary: std::path::PathBuf,
        containment: runplane_sandbox::Containment,
    ) -> Self {
        self.local = Some(
            drivers::ProcessDriver::new(&self.state_dir, runplane_binary).contained(containment),
        );
        self
    }

    /// Starts dispatch, wake assignment, the reconcile tick and outbox delivery in the
    /// background; they stop at the server's shutdown ([`SandboxReconciler::register`]).
    /// Sandboxes go to registered node agents; with none ready, the reconciler runs them
    /// on its own machine with the process driver, if it was given one
    /// ([`SandboxReconciler::with_local_sandboxes`]).
    pub fn start(&self) {
        let store = self.state.store.clone();
        let mut settings = self.settings.clone();
        let local = match &self.local {
            Some(local) => local.clone(),
            None => {
                if settings.local_sandboxes {
                    tracing::warn!("no local sandbox driver was given; runs wait for a node agent");
                }
                settings.local_sandboxes = false;
                // Starts nothing (local sandboxes are off now), but still probes and stops
                // the sandboxes this host started before, which its state directory holds.
                drivers::ProcessDriver::new(&self.state_dir, "runplane")
            }
        };
        let driver = Arc::new(drivers::RoutedDriver::new(local, store.clone()));
        let this = self.clone();
        let local_role = self.local_role.clone();
        self.tasks.spawn(ROUNDS_TASK, move |cancelled| {
            // The rounds launch local sandboxes, so they hold the role while they run.
            let _held = &local_role;
            let reconciler =
                reconcile::Reconciler::new(store.clone(), driver.clone(), settings.clone())
                    .with_fleet(this.fleet.clone())
                    .with_recovery(Some(this.state.recovery.clone()));
            reconcile::run_loop(
                reconciler,
                this.state.run_store.clone(),
                reconcile::RunnerEndpoints {
                    run_store: this.run_store_endpoint.clone(),
                    stream_recovery: this.state.recovery_endpoint.clone(),
                },
                this.tick_interval,
                this.state.signals.clone(),
                cancelled.cancelled(),
            )
        });
    }

    pub fn store(&self) -> &store::Store {
        &self.state.store
    }

    /// Adds the reconciler's gRPC services to `services`.
    pub fn register(&self, services: &mut ServiceSet) {
        services
            .authenticate(self.state.tokens.clone())
            .add(SandboxServiceServer::new(grpc::SandboxApi {
                state: self.state.clone(),
            }))
            .add(NodeServiceServer::new(grpc::NodeApi {
                state: self.state.clone(),
            }))
            .add(NodeCredentialServiceServer::new(grpc::NodeCredentialApi {
                state: self.state.clone(),
            }))
            .background(&self.tasks);
    }
}
