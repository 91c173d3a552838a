//! The stream recovery coordinator: stream leases, per-run restart budgets and replay
//! buffers, in Redis (or in process for `runplane dev`).
//!
//! docs/architecture.md "Stream recovery coordinator" is the contract:
//! only a run's first controller acquires its lease directly; every later one comes
//! through a recovery claim that spends the run's restart budget (immediate first, then
//! growing waits, five at most within five minutes), is handed to the runner as a
//! `resume_stream` steering message, and after five ends the run with exactly one abort.
//!
//! [`config`] is what it takes from the configuration, [`domain::policy`] its numbers and
//! formulas, [`store`] the Redis and in-memory stores behind one trait, [`grpc`] the
//! service and [`error`] its errors.

pub mod config;
pub mod domain;
pub mod error;
pub mod grpc;
pub mod store;

use std::sync::Arc;
use std::time::Duration;

use runplane_clock::SharedClock;
use runplane_grpc::ServiceSet;
use runplane_proto::recovery::v1::stream_recovery_service_server::StreamRecoveryServiceServer;
use runplane_proto::runstore::v1 as runstore_pb;

pub use error::RecoveryError;

/// The orphan sweep. A sweep cut short loses nothing (the next start begins a new pass),
/// so it is aborted at shutdown; a panicked batch is retried from a fresh pass.
const SWEEP_TASK: runplane_grpc::Task = runplane_grpc::Task {
    name: "stream-recovery.sweep",
    on_cancel: runplane_grpc::OnCancel::Abort,
    on_panic: runplane_grpc::OnPanic::Restart,
};

/// The coordinator, ready to be registered on a server.
#[derive(Debug, Clone)]
pub struct StreamRecovery {
    state: Arc<grpc::CoordinatorState>,
    sweep_every: Duration,
    /// Background work; [`StreamRecovery::register`] hands it to the server's shutdown.
    tasks: runplane_grpc::Tasks,
}

impl StreamRecovery {
    /// Over Redis (`[stream_recovery].redis_url`, keys under `key_prefix`).
    pub async fn open(
        config: &runplane_config::Config,
        clock: SharedClock,
    ) -> Result<Self, RecoveryError> {
        let store = store::redis::RedisStore::open(&config.stream_recovery)
            .await
            .map_err(|e| config::unreachable(config, e.to_string()))?;
        Self::with_store(Arc::new(store), config, clock)
    }

    /// Over the in-process store (`runplane dev`).
    pub fn embedded(
        config: &runplane_config::Config,
        clock: SharedClock,
    ) -> Result<Self, RecoveryError> {
        let store = store::memory::MemoryStore::with_clock(clock.clone());
        Self::with_store(Arc::new(store), config, clock)
    }

    pub fn with_store(
        store: Arc<dyn store::RecoveryStore>,
        config: &runplane_config::Config,
        clock: SharedClock,
    ) -> Result<Self, RecoveryError> {
        // Its own service token when it has one, else the shared one.
        let token = config
            .auth
            .calling_token(runplane_config::ServiceRole::StreamRecovery);
        let run_store = runplane_grpc::client::service_client(
            &config.run_store.endpoint,
            token,
            runstore_pb::run_service_client::RunServiceClient::with_interceptor,
        )
        .map_err(|e| RecoveryError::Endpoint(e.to_string()))?;
        Ok(Self {
            state: Arc::new(grpc::CoordinatorState {
                store,
                clock,
                run_store,
                limits: domain::policy::BufferLimits {
                    org_buffer_bytes: config.stream_recovery.max_org_buffered_bytes,
                    ..domain::policy::BufferLimits::default()
                },
                tokens: runplane_grpc::auth::Tokens::from_config(&config.auth),
            }),
            sweep_every: domain::policy::SWEEP_EVERY,
            tasks: runplane_grpc::Tasks::new(),
        })
    }

    /// With other replay-buffer bounds (tests use small ones). Call before `register`.
    pub fn with_limits(mut self, limits: domain::policy::BufferLimits) -> Self {
        Arc::get_mut(&mut self.state)
            .expect("limits are set before the coordinator is shared")
            .limits = limits;
        self
    }

    /// How often the orphan sweep runs a batch (`domain::policy::SWEEP_EVERY` unless set).
    pub fn with_sweep_every(mut self, every: Duration) -> Self {
        self.sweep_every = every;
        self
    }

    /// Adds the coordinator's gRPC service to `services`; its background work stops when
    /// the server begins shutting down.
    pub fn register(&self, services: &mut ServiceSet) {
        services
            .authenticate(self.state.tokens.clone())
            .add(StreamRecoveryServiceServer::new(grpc::StreamRecoveryApi {
                state: self.state.clone(),
            }))
            .background(&self.tasks);
    }

    /// Starts the orphan sweep in the background. Call inside a tokio runtime.
    pub fn start(&self) {
        let (state, every) = (self.state.clone(), self.sweep_every);
        self.tasks.spawn(SWEEP_TASK, move |_| {
            grpc::sweep_forever(state.clone(), every, domain::policy::SWEEP_BATCH)
        });
    }
}
