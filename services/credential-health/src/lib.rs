//! Credential health: typed backend errors, outage incidents and cool-off, exhaustion
//! quarantine, admission, the fleet view and lead notices.
//!
//! docs/architecture.md "Credential health" is the contract; `runplane.credentials.v1` the surface.
//!
//! - [`config`] is what it takes from runplane's configuration;
//! - [`domain::profiles`] reads a failure tail once, into a typed outcome;
//! - [`domain::policy`] is the per-credential outage state machine (threshold, window,
//!   cool-off, quarantine), pure, with its numbers and the reasons for them;
//! - [`store`] keeps that state in the database under compare-and-set, with incidents,
//!   notices and the outbox of MarkBackendError calls owed to the run store;
//! - [`grpc`] is the service; [`start`](CredentialHealth::start) delivers the
//!   outbox and prunes old notices.

pub mod config;
pub mod domain;
pub mod error;
pub mod grpc;
pub mod store;
pub mod view;

use std::sync::Arc;
use std::time::Duration;

use prost::Message;
use runplane_clock::SharedClock;
use runplane_grpc::ServiceSet;
use runplane_proto::credentials::v1::credential_health_service_server::CredentialHealthServiceServer;
use runplane_proto::runstore::v1 as runstore_pb;
use sea_orm::DatabaseConnection;

pub use error::CredentialHealthError;

/// How often the outbox is checked without a wake-up (rows due for a retry, rows
/// another replica wrote).
const OUTBOX_EVERY: Duration = Duration::from_millis(500);

/// Started credential health, ready to be registered on a server.
#[derive(Debug, Clone)]
pub struct CredentialHealth {
    state: Arc<grpc::HealthServiceState>,
    notice_retention_ms: i64,
    /// Background work; [`CredentialHealth::register`] hands it to the server's shutdown.
    tasks: runplane_grpc::Tasks,
}

/// Re-reads every watched lead's notices now and then, in case a wake-up was lost; it
/// stops when watches close at shutdown.
const RECHECK_TASK: runplane_grpc::Task = runplane_grpc::Task {
    name: "credential-health.recheck",
    on_cancel: runplane_grpc::OnCancel::Abort,
    on_panic: runplane_grpc::OnPanic::Restart,
};

/// Outbox delivery and notice pruning: rounds, each safe to redo and safe beside another
/// replica's, so a round in hand finishes at shutdown and a panic restarts it.
const ROUNDS_TASK: runplane_grpc::Task = runplane_grpc::Task {
    name: "credential-health.rounds",
    on_cancel: runplane_grpc::OnCancel::Finish,
    on_panic: runplane_grpc::OnPanic::Restart,
};

/// The notice relay's tasks ([`runplane_db::notify::RelayTasks`]).
const RELAY_TASKS: runplane_db::notify::RelayTasks = runplane_db::notify::RelayTasks {
    publish: "credential-health.relay.publish",
    listen: "credential-health.relay.listen",
};

impl CredentialHealth {
    /// Compiles the profiles' patterns (an invalid one stops here, naming the profile),
    /// then opens and migrates the database (`[credential_health].database_url`).
    pub async fn open(
        config: &runplane_config::Config,
        clock: SharedClock,
    ) -> Result<Self, CredentialHealthError> {
        let profiles = domain::profiles::Profiles::compile(config)?;
        if !config.auth.org_tokens.is_empty() || !config.auth.org_token_sha256.is_empty() {
            for p in profiles.all().iter().filter(|p| p.orgs.is_empty()) {
                tracing::warn!(
                    profile = %p.name,
                    credential_id = %p.credential_id,
                    "profile lists no orgs: every org's runs may use its credential"
                );
            }
        }
        let db = runplane_db::connect_and_migrate::<store::Migrator>(
            &config.credential_health.database_url,
        )
        .await?;
        // Its own service token when it has one, else the shared one.
        let token = config
            .auth
            .calling_token(runplane_config::ServiceRole::CredentialHealth);
        let run_store = runplane_grpc::client::service_client(
            &config.run_store.endpoint,
            token,
            runstore_pb::run_service_client::RunServiceClient::with_interceptor,
        )
        .map_err(|e| CredentialHealthError::invalid("run_store.endpoint", e.to_string()))?;
        let tasks = runplane_grpc::Tasks::new();
        // On Postgres every replica's notices wake every replica's watchers.
        let notices = runplane_grpc::notifier::Notifier::new();
        let notice_relay = (db.get_database_backend() == sea_orm::DbBackend::Postgres).then(|| {
            runplane_db::notify::Relay::start(
                &tasks,
                RELAY_TASKS,
                db.get_postgres_connection_pool().clone(),
                grpc::NOTICE_CHANNEL,
                notices.clone(),
            )
        });
        let store = store::Store::new(db, clock, domain::policy::PolicyConfig::from_config(config));
        // The watchers' safety net: one query per re-check for every watched lead.
        tasks.spawn(RECHECK_TASK, {
            let (notices, store) = (notices.clone(), store.clone());
            move |_| {
                let (notices, store) = (notices.clone(), store.clone());
                async move {
                    notices
                        .recheck(grpc::NOTICE_RECHECK, 1000, |keys| {
                            let store = store.clone();
                            async move { store.notice_seqs(keys).await }
                        })
                        .await;
                }
            }
        });
        Ok(Self {
            state: Arc::new(grpc::HealthServiceState {
                store,
                profiles,
                run_store,
                tokens: runplane_grpc::auth::Tokens::from_config(&config.auth),
                notices,
                notice_relay,
                outbox: tokio::sync::watch::channel(0).0,
                closing: tokio::sync::watch::channel(false).0,
            }),
            notice_retention_ms: config::notice_retention_ms(config),
            tasks,
        })
    }

    pub fn database(&self) -> &DatabaseConnection {
        self.state.store.db()
    }

    pub fn store(&self) -> &store::Store {
        &self.state.store
    }

    /// The tonic service, for callers that wrap it.
    pub fn service(&self) -> CredentialHealthServiceServer<grpc::CredentialHealthApi> {
        CredentialHealthServiceServer::new(grpc::CredentialHealthApi {
            state: self.state.clone(),
        })
    }

    /// Adds the service to `services`; at shutdown, notice watches end.
    pub fn register(&self, services: &mut ServiceSet) {
        let state = self.state.clone();
        services
            .authenticate(self.state.tokens.clone())
            .add(self.service())
            .background(&self.tasks)
            .on_shutdown(move || {
                state.closing.send_replace(true);
                state.notices.close();
            });
    }

    /// Starts outbox delivery (MarkBackendError to the run store) and the pruning of
    /// notices past retention in the background; they stop at the server's shutdown
    /// ([`CredentialHealth::register`]).
    pub fn start(&self) {
        let this = self.clone();
        self.tasks
            .spawn(ROUNDS_TASK, move |cancelled| this.clone().rounds(cancelled));
    }

    async fn rounds(self, cancelled: runplane_grpc::Cancelled) {
        let this = self;
        let shutdown = cancelled.cancelled();
        tokio::pin!(shutdown);
        let mut wake = this.state.outbox.subscribe();
        let mut last_prune = 0i64;
        loop {
            if let Err(e) = this.deliver_outbox(100).await {
                tracing::warn!(error = %e, "outbox delivery failed; next round retries");
            }
            let now = this.state.store.now_ms();
            if now - last_prune >= 60_000 {
                last_prune = now;
                match this
                    .state
                    .store
                    .prune_notices(now - this.notice_retention_ms)
                    .await
                {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(pruned = n, "notices past retention pruned"),
                    Err(e) => tracing::warn!(error = %e, "notice pruning failed"),
                }
                // A retention later, what was pruned goes, with delivered outbox rows.
                match this
                    .state
                    .store
                    .delete_pruned(now - 2 * this.notice_retention_ms, 1000)
                    .await
                {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(
                        deleted = n,
                        "pruned notices and delivered outbox rows deleted"
                    ),
                    Err(e) => tracing::warn!(error = %e, "deleting pruned notices failed"),
                }
            }
            tokio::select! {
                () = &mut shutdown => return,
                _ = wake.changed() => {}
                () = tokio::time::sleep(OUTBOX_EVERY) => {}
            }
        }
    }

    /// Delivers due outbox rows once; returns how many the run store accepted. Each row is
    /// claimed before its call, so replicas delivering at the same time send it once.
    pub async fn deliver_outbox(&self, limit: u64) -> Result<u64, CredentialHealthError> {
        use runplane_db::outbox::{Delivery, deliver_due};
        use tracing::Instrument;
        let store = &self.state.store;
        let delivered = deliver_due(store.db(), || store.now_us(), limit, |row| {
            let mut client = self.state.run_store.clone();
            async move {
                let Ok(request) = runstore_pb::MarkBackendErrorRequest::decode(row.payload.as_slice())
                else {
                    return Delivery::Refused("undecodable payload".into());
                };
                // The delivery continues the trace of the report that owed it.
                let span = runplane_grpc::trace_context::outbox_span(
                    &row.kind,
                    &row.idempotency_key,
                    &row.traceparent,
                );
                match client.mark_backend_error(request).instrument(span).await {
                    Ok(answer) => {
                        let answer = answer.into_inner();
                        tracing::info!(
                            key = %row.idempotency_key,
                            run_id = answer.run.as_ref().map(|r| r.id.as_str()).unwrap_or_default(),
                            outcome = ?answer.outcome(),
                            "backend-error outcome recorded on the run"
                        );
                        Delivery::Delivered
                    }
                    Err(status) => Delivery::from_failure(status.code() as i32, status.message()),
                }
            }
        })
        .await?;
        Ok(delivered)
    }
}
