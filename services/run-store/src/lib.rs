//! The run store: runs, run keys, events with signed receipts, steering and results.
//!
//! docs/architecture.md "Run store" is the contract. The gRPC surface is
//! `runplane.runstore.v1.RunnerService` (the runner, authenticated by its run key) and
//! `runplane.runstore.v1.RunService` (operators and services, by token).

pub mod auth;
pub mod changes;
pub mod config;
pub mod convert;
pub mod domain;
pub mod error;
pub mod grpc;
pub mod outbox;
pub mod store;

use std::sync::Arc;

use runplane_clock::SharedClock;
use runplane_grpc::ServiceSet;
use runplane_proto::credentials::v1::credential_health_service_client::CredentialHealthServiceClient;
use runplane_proto::runstore::v1::run_service_server::RunServiceServer;
use runplane_proto::runstore::v1::runner_service_server::RunnerServiceServer;

pub use config::{Limits, RunStoreSettings};

/// Most runs one deadline sweep ends; the rest wait for the next round.
const DEADLINE_SWEEP_BATCH: u64 = 100;
pub use error::RunStoreError;

/// A started run store, ready to be registered on a server.
#[derive(Debug, Clone)]
pub struct RunStore {
    shared: Arc<grpc::Shared>,
}

impl RunStore {
    /// Opens and migrates the run store's database (`[run_store].database_url`).
    pub async fn open(
        config: &runplane_config::Config,
        clock: SharedClock,
    ) -> Result<Self, RunStoreError> {
        let settings = RunStoreSettings::from_config(config)?;
        let db =
            runplane_db::connect_and_migrate::<store::Migrator>(&settings.database_url).await?;
        let credential_health = if config.run_store.admission {
            let channel = runplane_grpc::client::connect_lazy(&config.credential_health.endpoint)
                .map_err(|e| RunStoreError::InvalidField {
                field: "credential_health.endpoint".into(),
                reason: e.to_string(),
            })?;
            Some(CredentialHealthServiceClient::with_interceptor(
                channel,
                runplane_grpc::client::Bearer::new(config.auth.service_token.expose()),
            ))
        } else {
            None
        };
        // On Postgres every replica's changes wake every replica's waiters.
        let changes = if db.get_database_backend() == sea_orm::DbBackend::Postgres {
            changes::Changes::across_replicas(db.get_postgres_connection_pool().clone())
        } else {
            changes::Changes::new()
        };
        let store = store::Store::new(db, clock).with_failure_reports(config.run_store.admission);
        // The watchers' safety net: one query per re-check for every watched run.
        tokio::spawn({
            let (changes, store) = (changes.clone(), store.clone());
            async move {
                changes
                    .recheck(|runs| {
                        let store = store.clone();
                        async move { store.versions(runs).await }
                    })
                    .await;
            }
        });
        Ok(Self {
            shared: Arc::new(grpc::Shared {
                store,
                settings,
                tokens: runplane_grpc::auth::Tokens::from_config(&config.auth),
                changes,
                credential_health,
            }),
        })
    }

    /// The run store's background work until `shutdown`: the deadline sweep every
    /// `[run_store] deadline_sweep_interval_ms`, and (with admission) the outbox of
    /// failed turns owed to credential health. A round that fails is retried by the next.
    pub fn spawn_loop(
        &self,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        let store = self.clone();
        tokio::spawn(async move {
            tokio::pin!(shutdown);
            let mut sweep = tokio::time::interval(store.shared.settings.deadline_sweep_interval);
            let mut deliver = tokio::time::interval(outbox::EVERY);
            sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            deliver.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = &mut shutdown => return,
                    _ = sweep.tick() => {
                        if let Err(e) = store.sweep_deadlines().await {
                            tracing::warn!(error = %e, "deadline sweep failed; next round retries");
                        }
                    }
                    _ = deliver.tick(), if store.shared.credential_health.is_some() => {
                        if let Err(e) = store.deliver_outbox().await {
                            tracing::warn!(error = %e, "outbox delivery failed; next round retries");
                        }
                    }
                }
            }
        })
    }

    /// Ends the runs past their deadline as `deadline_exceeded`: one bounded query for
    /// the due runs, then each is ended under its own lock, so replicas sweeping at the
    /// same time end each run once. Returns how many this call ended.
    pub async fn sweep_deadlines(&self) -> Result<u64, RunStoreError> {
        let s = &self.shared;
        let mut ended = 0;
        for run_id in s.store.past_deadline(DEADLINE_SWEEP_BATCH).await? {
            if let Some(run) = s.store.expire(&run_id, &s.settings.signer).await? {
                s.changes.ended(&run.id, &run.state);
                tracing::info!(run_id = %run.id, "run ended: deadline exceeded");
                ended += 1;
            }
        }
        Ok(ended)
    }

    /// Delivers due outbox rows once (tests drive delivery by hand with this). Each row is
    /// claimed before its call, so replicas delivering at the same time send it once.
    pub async fn deliver_outbox(&self) -> Result<u64, RunStoreError> {
        match &self.shared.credential_health {
            Some(client) => outbox::deliver(self.store(), client, 100).await,
            None => Ok(0),
        }
    }

    pub fn store(&self) -> &store::Store {
        &self.shared.store
    }

    /// The two tonic services, for callers that wrap them (tests cut responses).
    pub fn services(
        &self,
    ) -> (
        RunnerServiceServer<grpc::RunnerApi>,
        RunServiceServer<grpc::RunApi>,
    ) {
        (
            RunnerServiceServer::new(grpc::RunnerApi {
                shared: self.shared.clone(),
            }),
            RunServiceServer::new(grpc::RunApi {
                shared: self.shared.clone(),
            }),
        )
    }

    /// The public key receipts are signed with.
    pub fn receipt_public_key(&self) -> [u8; 32] {
        self.shared.settings.signer.public_key()
    }

    /// Adds the run store's gRPC services to `services`.
    pub fn register(&self, services: &mut ServiceSet) {
        let (runner, run) = self.services();
        let store = self.clone();
        services
            .authenticate(self.shared.tokens.clone())
            .add(runner)
            .add(run)
            .on_shutdown(move || store.begin_shutdown());
    }

    /// Ends long polls and watches now instead of letting them hold the shutdown up:
    /// polls answer with what is pending, watches end so their clients resume elsewhere.
    pub fn begin_shutdown(&self) {
        self.shared.changes.close();
    }
}
