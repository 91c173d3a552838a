//! The run store: runs, run keys, events with signed receipts, steering and results.
//!
//! docs/architecture.md "Run store" is the contract. The gRPC surface is
//! `runplane.runstore.v1.RunnerService` (the runner, authenticated by its run key) and
//! `runplane.runstore.v1.RunService` (operators and services, by token).

pub mod auth;
pub mod changes;
pub mod clients;
pub mod config;
pub mod convert;
pub mod domain;
pub mod error;
pub mod grpc;
pub mod outbox;
pub mod store;
pub mod webhooks;

use std::sync::Arc;

use runplane_clock::SharedClock;
use runplane_grpc::ServiceSet;
use runplane_proto::credentials::v1::credential_health_service_client::CredentialHealthServiceClient;
use runplane_proto::runstore::v1::run_service_server::RunServiceServer;
use runplane_proto::runstore::v1::runner_service_server::RunnerServiceServer;

pub use config::RunStoreSettings;
pub use domain::limits::Limits;

/// Most runs one deadline sweep ends; the rest wait for the next round.
const DEADLINE_SWEEP_BATCH: u64 = 100;
pub use error::RunStoreError;

/// A started run store, ready to be registered on a server.
#[derive(Debug, Clone)]
pub struct RunStore {
    state: Arc<grpc::ServiceState>,
    /// Background work; [`RunStore::register`] hands it to the server's shutdown.
    tasks: runplane_grpc::Tasks,
}

/// Re-reads every watched run now and then, in case a change's notification was lost;
/// it stops when watches close at shutdown.
const RECHECK_TASK: runplane_grpc::Task = runplane_grpc::Task {
    name: "run-store.recheck",
    on_cancel: runplane_grpc::OnCancel::Abort,
    on_panic: runplane_grpc::OnPanic::Restart,
};

/// The deadline sweep and outbox delivery: rounds, each safe to redo and safe beside
/// another replica's, so a round in hand finishes at shutdown and a panic restarts it.
const ROUNDS_TASK: runplane_grpc::Task = runplane_grpc::Task {
    name: "run-store.rounds",
    on_cancel: runplane_grpc::OnCancel::Finish,
    on_panic: runplane_grpc::OnPanic::Restart,
};

/// Lifecycle webhook delivery: each endpoint's loop, safe to stop mid-attempt (a claimed
/// delivery is due again when its claim lapses) and restarted on a panic.
const WEBHOOKS_TASK: runplane_grpc::Task = runplane_grpc::Task {
    name: "run-store.webhooks",
    on_cancel: runplane_grpc::OnCancel::Abort,
    on_panic: runplane_grpc::OnPanic::Restart,
};

impl RunStore {
    /// Opens and migrates the run store's database (`[run_store].database_url`).
    pub async fn open(
        config: &runplane_config::Config,
        clock: SharedClock,
    ) -> Result<Self, RunStoreError> {
        let settings = RunStoreSettings::from_config(config)?;
        let webhooks = webhooks::Webhooks::from_config(
            &config.run_store.webhooks,
            &config.run_store.webhook_delivery,
        )?;
        let db =
            runplane_db::connect_and_migrate::<store::Migrator>(&settings.database_url).await?;
        let credential_health = if config.run_store.admission {
            Some(
                runplane_grpc::client::service_client(
                    &config.credential_health.endpoint,
                    // Its own token when it has one: only CALLER_RUN_STORE's methods.
                    config
                        .auth
                        .calling_token(runplane_config::ServiceRole::RunStore),
                    CredentialHealthServiceClient::with_interceptor,
                )
                .map_err(|e| RunStoreError::InvalidField {
                    field: "credential_health.endpoint".into(),
                    reason: e.to_string(),
                })?,
            )
        } else {
            None
        };
        let tasks = runplane_grpc::Tasks::new();
        // On Postgres every replica's changes wake every replica's waiters.
        let changes = if db.get_database_backend() == sea_orm::DbBackend::Postgres {
            changes::Changes::across_replicas(&tasks, db.get_postgres_connection_pool().clone())
        } else {
            changes::Changes::new()
        };
        let store = store::Store::new(db, clock)
            .with_failure_reports(config.run_store.admission)
            .with_event_quota(store::EventQuota::from_config(&config.run_store))
            .with_webhooks(webhooks.routes())
            .with_retries(domain::retry::RetryRules::from_profiles(
                &config.credential_health.profiles,
            ))
            .with_tasks(tasks.clone());
        // The watchers' safety net: one query per re-check for every watched run.
        tasks.spawn(RECHECK_TASK, {
            let (changes, store) = (changes.clone(), store.clone());
            move |_| {
                let (changes, store) = (changes.clone(), store.clone());
                async move {
                    changes
                        .recheck(|runs| {
                            let store = store.clone();
                            async move { store.versions(runs).await }
                        })
                        .await;
                }
            }
        });
        Ok(Self {
            tasks,
            state: Arc::new(grpc::ServiceState {
                store,
                settings,
                tokens: runplane_grpc::auth::Tokens::from_config(&config.auth),
                changes,
                credential_health,
                webhooks,
            }),
        })
    }

    /// Starts the run store's rounds in the background: the deadline sweep every
    /// `[run_store] deadline_sweep_interval_ms`, the retention sweep every
    /// `retention_sweep_interval_ms`, (with admission) the outbox of failed turns owed to
    /// credential health, and (with `[[run_store.webhooks]]`) webhook delivery. A round that fails is retried by the next;
    /// they stop at the server's shutdown ([`RunStore::register`]).
    pub fn start(&self) {
        let this = self.clone();
        self.tasks
            .spawn(ROUNDS_TASK, move |cancelled| this.clone().rounds(cancelled));
        if !self.state.webhooks.is_empty() {
            let state = self.state.clone();
            self.tasks.spawn(WEBHOOKS_TASK, move |_| {
                let state = state.clone();
                async move { state.webhooks.run(&state.store).await }
            });
        }
    }

    async fn rounds(self, cancelled: runplane_grpc::Cancelled) {
        let shutdown = cancelled.cancelled();
        tokio::pin!(shutdown);
        let mut sweep = tokio::time::interval(self.state.settings.deadline_sweep_interval);
        let mut deliver = tokio::time::interval(outbox::EVERY);
        let mut retain = tokio::time::interval(self.state.settings.retention_sweep_interval);
        retain.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        deliver.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = &mut shutdown => return,
                _ = sweep.tick() => {
                    if let Err(e) = self.sweep_deadlines().await {
                        tracing::warn!(error = %e, "deadline sweep failed; next round retries");
                    }
                }
                _ = retain.tick() => {
                    if let Err(e) = self.sweep_retention().await {
                        tracing::warn!(error = %e, "retention sweep failed; next round retries");
                    }
                }
                _ = deliver.tick(), if self.state.credential_health.is_some() => {
                    if let Err(e) = self.deliver_outbox().await {
                        tracing::warn!(error = %e, "outbox delivery failed; next round retries");
                    }
                }
            }
        }
    }

    /// Ends the runs past their deadline as `deadline_exceeded`, and the runs paused past
    /// their profile's `max_pause_seconds` as `paused_too_long`: one bounded query for
    /// each kind of due run, then each is ended under its own lock, so replicas sweeping
    /// at the same time end each run once. Returns how many this call ended.
    pub async fn sweep_deadlines(&self) -> Result<u64, RunStoreError> {
        let s = &self.state;
        let mut ended = 0;
        for run_id in s.store.past_deadline(DEADLINE_SWEEP_BATCH).await? {
            if let Some(run) = s.store.expire(&run_id, &s.settings.signer).await? {
                s.changes.ended(&run.id, run.state);
                tracing::info!(run_id = %run.id, "run ended: deadline exceeded");
                ended += 1;
            }
        }
        for run_id in s.store.past_pause(DEADLINE_SWEEP_BATCH).await? {
            if let Some(run) = s.store.end_pause(&run_id, &s.settings.signer).await? {
                s.changes.ended(&run.id, run.state);
                tracing::info!(run_id = %run.id, "run ended: paused too long");
                ended += 1;
            }
        }
        Ok(ended)
    }

    /// One retention pass (tests drive it by hand with this): deletes the events, ended
    /// runs and delivered outbox rows whose time is up, in bounded batches.
    pub async fn sweep_retention(&self) -> Result<store::Swept, RunStoreError> {
        let swept = self
            .state
            .store
            .sweep_retention(&self.state.settings.retention)
            .await?;
        if swept != store::Swept::default() {
            tracing::info!(
                events = swept.events,
                runs = swept.runs,
                outbox = swept.outbox,
                "retention deleted what its time let go"
            );
        }
        Ok(swept)
    }

    /// Delivers due outbox rows once (tests drive delivery by hand with this). Each row is
    /// claimed before its call, so replicas delivering at the same time send it once.
    pub async fn deliver_outbox(&self) -> Result<u64, RunStoreError> {
        match &self.state.credential_health {
            Some(client) => outbox::deliver(self.store(), client, 100).await,
            None => Ok(0),
        }
    }

    pub fn store(&self) -> &store::Store {
        &self.state.store
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
                state: self.state.clone(),
            }),
            RunServiceServer::new(grpc::RunApi {
                state: self.state.clone(),
            }),
        )
    }

    /// The public key receipts are signed with.
    pub fn receipt_public_key(&self) -> [u8; 32] {
        self.state.settings.signer.public_key()
    }

    /// Adds the run store's gRPC services to `services`.
    pub fn register(&self, services: &mut ServiceSet) {
        let (runner, run) = self.services();
        let store = self.clone();
        services
            .authenticate(self.state.tokens.clone())
            .add(runner)
            .add(run)
            .background(&self.tasks)
            .on_shutdown(move || store.begin_shutdown());
    }

    /// Ends long polls and watches now instead of letting them hold the shutdown up:
    /// polls answer with what is pending, watches end so their clients resume elsewhere.
    pub fn begin_shutdown(&self) {
        self.state.changes.close();
    }
}
