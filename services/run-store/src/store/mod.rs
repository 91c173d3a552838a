//! The run store's persistence (sea-orm; Postgres in production, SQLite embedded).
//!
//! What we persist and why:
//! - `runs`: one row per run, and the lock every change to a run takes first (`FOR UPDATE`
//!   on Postgres; SQLite transactions begin `IMMEDIATE`, which serialises writers), so
//!   appends, steering sequences, verdicts and failures of one run never interleave.
//! - `run_keys`: only the SHA-256 of each key, its run, org and generation, its claim
//!   (the Hello nonce) and its revocation.
//! - `events` and `event_batches`: the events with their chain digests, and one row per
//!   batch key, written in the same transaction, so a replayed batch is found and answered
//!   like the first instead of being stored twice.
//! - `steering_messages`: pending until an acknowledgement names them; a poll never
//!   writes.
//! - `receipts`: the signed seal, written in the transaction that makes the run terminal.
//! - `keyed_answers`: the stored answer of keyed calls whose effect is not a row of its
//!   own (FailRun, MarkBackendError), so a replay gets the first answer back.

mod append;
pub mod entities;
pub mod migration;

use std::collections::HashMap;
use std::sync::Arc;

use prost::Message;
use runplane_clock::SharedClock;
use runplane_proto::runstore::v1 as pb;
use sea_orm::sea_query::{Expr, Order};
use sea_orm::{
    ActiveModelTrait, ColumnTrait, ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbErr,
    EntityTrait, IntoActiveModel, PaginatorTrait, QueryFilter, QueryOrder, QuerySelect, SqlErr,
};

pub use migration::Migrator;

use crate::domain::chain::{self, ChainedEvent};
use crate::domain::ids;
use crate::domain::receipt::ReceiptSigner;
use crate::domain::state;
use crate::domain::validate::CheckedEvent;
use crate::error::RunStoreError;
use entities::{event, event_batch, keyed_answer, receipt, run, run_key, steering_message};

type Result<T> = std::result::Result<T, RunStoreError>;

/// Why a key stopped working.
pub const REVOKED_SUPERSEDED: &str = "superseded";
pub const REVOKED_TERMINAL: &str = "terminal";

/// Verdict reasons the run store itself records.
pub const REASON_CANCELLED: &str = "cancelled";
pub const REASON_DEADLINE_EXCEEDED: &str = "deadline_exceeded";

/// The run store's storage, over one database connection pool.
#[derive(Debug, Clone)]
pub struct Store {
    db: DatabaseConnection,
    clock: SharedClock,
    postgres: bool,
    /// Owe credential health a ReportTurnFailure for each failed turn (`[run_store]
    /// admission`).
    report_failures: bool,
    /// The chain tips this replica last committed or read, for one-statement appends.
    tips: Arc<append::ChainTips>,
    /// Writes one-statement appends in groups (Postgres), started at the first.
    groups: Arc<std::sync::OnceLock<append::AppendGroups>>,
}

/// `run_store → credential_health.report_turn_failure`.
pub const OUTBOX_REPORT_TURN_FAILURE: &str = "credential_health.report_turn_failure";

/// Credential health reads at most this much of a failure tail: its end, where the
/// agent's last words are.
const MAX_REPORTED_TAIL_BYTES: usize = 8 << 10;

/// The last `max` bytes of `s`, cut at a character boundary.
fn tail_end(s: &str, max: usize) -> &str {
    let mut start = s.len().saturating_sub(max);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

/// The event kind of a failed agent turn.
const TURN_FAILED: i32 = pb::EventKind::TurnFailed as i32;

/// Active runs counted three ways (see [`Store::count_active`]).
#[derive(Debug, Clone, Default)]
pub struct ActiveCounts {
    pub by_credential: HashMap<String, u32>,
    /// QUEUED runs per credential (waiting for a slot).
    pub queued_by_credential: HashMap<String, u32>,
    pub by_profile: HashMap<String, u32>,
    pub by_profile_credential: HashMap<String, u32>,
}

/// What ClaimSlots may put on one credential.
#[derive(Debug, Clone, Default)]
pub struct SlotLimit {
    pub capacity: u32,
    /// Why it takes nothing now; empty when it may.
    pub unavailable: String,
}

/// Why a queued run on `credential` is passed over, `free` being its slots left (≤ 0).
fn waiting_reason(credential: &str, limit: Option<&SlotLimit>, free: i64) -> String {
    match limit {
        None => format!("credential {credential} is not in the fleet"),
        Some(l) if !l.unavailable.is_empty() => {
            format!("credential {credential} is {}", l.unavailable)
        }
        Some(l) => format!(
            "credential {credential} is full: {} of {} slots busy",
            i64::from(l.capacity) - free,
            l.capacity
        ),
    }
}

/// A new run as CreateRun asks for it.
#[derive(Debug, Clone)]
pub struct NewRun {
    pub org_id: String,
    pub lead_id: String,
    pub client_request_id: String,
    pub request_digest: String,
    pub credential_id: String,
    pub profile: String,
    pub command: String,
    pub args: Vec<String>,
    pub labels: std::collections::BTreeMap<String, String>,
    /// How long the run may live from its creation; `None` for no deadline.
    pub max_duration_us: Option<i64>,
}

/// Filters and position of a ListRuns page.
#[derive(Debug, Clone, Default)]
pub struct RunFilter {
    pub org_id: Option<String>,
    pub lead_id: Option<String>,
    pub credential_id: Option<String>,
    pub profile: Option<String>,
    pub states: Vec<&'static str>,
    /// Only these runs (empty: any).
    pub run_ids: Vec<String>,
    /// Only runs with a steering message not yet acknowledged.
    pub with_pending_messages: bool,
    /// Start after this (created_at_us, id), newest first.
    pub after: Option<(i64, String)>,
    pub limit: u64,
}

/// The answer to an AppendEvents (or the final batch of a result).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Appended {
    pub first_sequence: u64,
    pub last_sequence: u64,
    pub chain_head: Vec<u8>,
}

/// An authenticated runner: its key and the run as of the check.
#[derive(Debug, Clone)]
pub struct RunnerAuth {
    pub key: run_key::Model,
    pub run: run::Model,
}

/// What an acknowledgement says about one message.
#[derive(Debug, Clone)]
pub struct Ack {
    pub message_id: String,
    pub dropped: bool,
    pub attempts: u32,
    pub error: String,
}

/// A service's request to fail a run.
#[derive(Debug, Clone, Copy)]
pub struct FailRequest<'a> {
    pub reason: &'a str,
    pub message: &'a str,
    pub idempotency_key: &'a str,
    /// Fail only while the run's sandbox generation is this one.
    pub guard_generation: Option<u64>,
    /// Fail only while the run's sandbox is this one.
    pub guard_sandbox: Option<&'a str>,
    pub request_digest: &'a str,
}

/// The result of a call that may make a run terminal.
#[derive(Debug, Clone)]
pub struct Finished {
    pub run: run::Model,
    /// This call made the run terminal (side effects are its to run).
    pub made_terminal: bool,
}

fn is_unique_violation(e: &DbErr) -> bool {
    matches!(e.sql_err(), Some(SqlErr::UniqueConstraintViolation(_)))
}

impl Store {
    pub fn new(db: DatabaseConnection, clock: SharedClock) -> Self {
        let postgres = runplane_db::is_postgres(&db);
        Self {
            db,
            clock,
            postgres,
            report_failures: false,
            tips: Arc::default(),
            groups: Arc::default(),
        }
    }

    /// Writes a ReportTurnFailure for credential health into the outbox with every failed
    /// turn and failed result, in the transaction that records it.
    pub fn with_failure_reports(mut self, on: bool) -> Self {
        self.report_failures = on;
        self
    }

    /// Owes credential health the classification of one failed turn of `run`. Keyed by
    /// the turn, so recording the same failure again owes nothing more.
    async fn owe_turn_failure(
        &self,
        txn: &DatabaseTransaction,
        run: &run::Model,
        turn_id: String,
        failure_tail: &str,
    ) -> Result<()> {
        if !self.report_failures || run.credential_id.is_empty() {
            return Ok(());
        }
        let now = self.now_us();
        let request = runplane_proto::credentials::v1::ReportTurnFailureRequest {
            turn_id: turn_id.clone(),
            run_id: run.id.clone(),
            org_id: run.org_id.clone(),
            lead_id: run.lead_id.clone(),
            credential_id: run.credential_id.clone(),
            profile: run.profile.clone(),
            failure_tail: tail_end(failure_tail, MAX_REPORTED_TAIL_BYTES).to_owned(),
            failed_at: Some(runplane_clock::to_timestamp(now)),
        };
        let mut row = runplane_db::outbox::row(
            OUTBOX_REPORT_TURN_FAILURE,
            turn_id,
            prost::Message::encode_to_vec(&request),
            now,
        );
        row.traceparent = runplane_grpc::trace_context::current_traceparent().unwrap_or_default();
        runplane_db::outbox::enqueue(txn, row).await?;
        Ok(())
    }

    pub fn database(&self) -> &DatabaseConnection {
        &self.db
    }

    pub fn now_us(&self) -> i64 {
        self.clock.now_us()
    }

    /// A transaction that may write. On SQLite it takes the write lock at `BEGIN`, so two
    /// writers queue instead of one failing when both upgrade from a read.
    async fn write_tx(&self) -> Result<DatabaseTransaction> {
        Ok(runplane_db::write_tx(&self.db).await?)
    }

    /// The run row, locked for the rest of `txn` (Postgres; SQLite holds the database
    /// write lock already).
    async fn lock_run(&self, txn: &DatabaseTransaction, run_id: &str) -> Result<run::Model> {
        let mut query = run::Entity::find_by_id(run_id.to_owned());
        if self.postgres {
            query = query.lock_exclusive();
        }
        query
            .one(txn)
            .await?
            .ok_or_else(|| RunStoreError::RunNotFound {
                run_id: run_id.to_owned(),
            })
    }

    // --- runs ----------------------------------------------------------------------

    /// Creates the run, or returns the one this org already created with the same
    /// client request id (`false`). A reused id with another body is refused.
    pub async fn create_run(&self, new: NewRun) -> Result<(run::Model, bool)> {
        if let Some(existing) = self
            .find_by_request(&new.org_id, &new.client_request_id)
            .await?
        {
            return same_request(existing, &new.request_digest).map(|r| (r, false));
        }
        let now = self.now_us();
        let id = ids::new_run_id();
        let model = run::Model {
            chain_head: chain::genesis(&id),
            id,
            org_id: new.org_id.clone(),
            lead_id: new.lead_id,
            client_request_id: new.client_request_id.clone(),
            request_digest: new.request_digest.clone(),
            state: state::QUEUED.to_owned(),
            credential_id: new.credential_id,
            profile: new.profile,
            command: new.command,
            args: serde_json::to_string(&new.args).expect("strings serialise"),
            labels: serde_json::to_string(&new.labels).expect("strings serialise"),
            sandbox_generation: 0,
            last_sequence: 0,
            steering_sequence: 0,
            verdict_outcome: None,
            verdict_reason: None,
            verdict_exit_code: None,
            verdict_signal: None,
            verdict_message: None,
            failure_tail: None,
            backend_error: None,
            traceparent: runplane_grpc::trace_context::current_traceparent().unwrap_or_default(),
            sandbox_id: String::new(),
            deadline_at_us: new.max_duration_us.map(|d| now.saturating_add(d)),
            waiting_reason: String::new(),
            created_at_us: now,
            started_at_us: None,
            ended_at_us: None,
            updated_at_us: now,
        };
        match run::Entity::insert(model.clone().into_active_model())
            .exec_without_returning(&self.db)
            .await
        {
            Ok(_) => Ok((model, true)),
            // A concurrent create with the same id won the unique index; answer with its run.
            Err(e) if is_unique_violation(&e) => {
                let existing = self
                    .find_by_request(&new.org_id, &new.client_request_id)
                    .await?
                    .ok_or(RunStoreError::Storage(e))?;
                same_request(existing, &new.request_digest).map(|r| (r, false))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The run this org already created with `request_id`, if any; a reused id with
    /// another body is refused.
    pub async fn existing_run(
        &self,
        org: &str,
        request_id: &str,
        request_digest: &str,
    ) -> Result<Option<run::Model>> {
        match self.find_by_request(org, request_id).await? {
            Some(run) => same_request(run, request_digest).map(Some),
            None => Ok(None),
        }
    }

    async fn find_by_request(&self, org: &str, request_id: &str) -> Result<Option<run::Model>> {
        Ok(run::Entity::find()
            .filter(run::Column::OrgId.eq(org))
            .filter(run::Column::ClientRequestId.eq(request_id))
            .one(&self.db)
            .await?)
    }

    pub async fn get_run(&self, run_id: &str) -> Result<run::Model> {
        run::Entity::find_by_id(run_id.to_owned())
            .one(&self.db)
            .await?
            .ok_or_else(|| RunStoreError::RunNotFound {
                run_id: run_id.to_owned(),
            })
    }

    /// The stored versions of `run_ids` (those that exist), for the watchers' re-check.
    pub async fn versions(
        &self,
        run_ids: Vec<String>,
    ) -> Result<Vec<(String, crate::changes::Version)>> {
        let rows: Vec<(String, i64, i64)> = run::Entity::find()
            .select_only()
            .column(run::Column::Id)
            .column(run::Column::LastSequence)
            .column(run::Column::UpdatedAtUs)
            .filter(run::Column::Id.is_in(run_ids))
            .into_tuple()
            .all(&self.db)
            .await?;
        Ok(rows
            .into_iter()
            .map(|(id, last_sequence, updated_at_us)| {
                let version = crate::changes::Version {
                    last_sequence,
                    updated_at_us,
                };
                (id, version)
            })
            .collect())
    }

    /// A page of runs, newest first.
    pub async fn list_runs(&self, filter: &RunFilter) -> Result<Vec<run::Model>> {
        let mut query = run::Entity::find();
        if let Some(org) = &filter.org_id {
            query = query.filter(run::Column::OrgId.eq(org.as_str()));
        }
        if let Some(lead) = &filter.lead_id {
            query = query.filter(run::Column::LeadId.eq(lead.as_str()));
        }
        if let Some(credential) = &filter.credential_id {
            query = query.filter(run::Column::CredentialId.eq(credential.as_str()));
        }
        if let Some(profile) = &filter.profile {
            query = query.filter(run::Column::Profile.eq(profile.as_str()));
        }
        if !filter.states.is_empty() {
            query = query.filter(run::Column::State.is_in(filter.states.iter().copied()));
        }
        if !filter.run_ids.is_empty() {
            query = query.filter(run::Column::Id.is_in(filter.run_ids.iter().cloned()));
        }
        if filter.with_pending_messages {
            // EXISTS on the run's own messages (the (run_id, sequence) index), not a scan
            // of every message ever queued.
            query = query.filter(Expr::exists(
                sea_orm::sea_query::Query::select()
                    .expr(Expr::val(1))
                    .from(steering_message::Entity)
                    .and_where(sea_orm::sea_query::ExprTrait::equals(
                        Expr::col((steering_message::Entity, steering_message::Column::RunId)),
                        (run::Entity, run::Column::Id),
                    ))
                    .and_where(steering_message::Column::AckedAtUs.is_null())
                    .to_owned(),
            ));
        }
        if let Some((created, id)) = &filter.after {
            query = query.filter(
                sea_orm::Condition::any()
                    .add(run::Column::CreatedAtUs.lt(*created))
                    .add(
                        sea_orm::Condition::all()
                            .add(run::Column::CreatedAtUs.eq(*created))
                            .add(run::Column::Id.lt(id.as_str())),
                    ),
            );
        }
        Ok(query
            .order_by(run::Column::CreatedAtUs, Order::Desc)
            .order_by(run::Column::Id, Order::Desc)
            .limit(filter.limit)
            .all(&self.db)
            .await?)
    }

    /// Runs in STARTING or RUNNING, counted per credential, per profile and per
    /// (profile, credential) pair keyed `profile/credential`; only runs on one of
    /// `credential_ids` or in one of `profiles` when either is given (empty: all).
    pub async fn count_active(
        &self,
        credential_ids: &[String],
        profiles: &[String],
    ) -> Result<ActiveCounts> {
        let mut query = run::Entity::find();
        if !credential_ids.is_empty() || !profiles.is_empty() {
            query = query.filter(
                sea_orm::Condition::any()
                    .add(run::Column::CredentialId.is_in(credential_ids.iter().cloned()))
                    .add(run::Column::Profile.is_in(profiles.iter().cloned())),
            );
        }
        let rows: Vec<(String, String, i64)> = query
            .select_only()
            .column(run::Column::CredentialId)
            .column(run::Column::Profile)
            .column_as(run::Column::Id.count(), "n")
            .filter(run::Column::State.is_in([state::STARTING, state::RUNNING]))
            .group_by(run::Column::CredentialId)
            .group_by(run::Column::Profile)
            .into_tuple()
            .all(&self.db)
            .await?;
        let mut counts = ActiveCounts::default();
        let mut queued = run::Entity::find()
            .select_only()
            .column(run::Column::CredentialId)
            .column_as(run::Column::Id.count(), "n")
            .filter(run::Column::State.eq(state::QUEUED))
            .filter(run::Column::CredentialId.ne(""));
        if !credential_ids.is_empty() {
            queued = queued.filter(run::Column::CredentialId.is_in(credential_ids.iter().cloned()));
        }
        let queued: Vec<(String, i64)> = queued
            .group_by(run::Column::CredentialId)
            .into_tuple()
            .all(&self.db)
            .await?;
        for (credential, n) in queued {
            counts
                .queued_by_credential
                .insert(credential, u32::try_from(n).unwrap_or(u32::MAX));
        }
        for (credential, profile, n) in rows {
            let n = u32::try_from(n).unwrap_or(u32::MAX);
            if !credential.is_empty() {
                *counts.by_credential.entry(credential.clone()).or_insert(0) += n;
            }
            if !profile.is_empty() {
                *counts.by_profile.entry(profile.clone()).or_insert(0) += n;
                if !credential.is_empty() {
                    *counts
                        .by_profile_credential
                        .entry(format!("{profile}/{credential}"))
                        .or_insert(0) += n;
                }
            }
        }
        Ok(counts)
    }

    // --- slots ---------------------------------------------------------------------

    /// Moves queued runs to STARTING, oldest first, while their credential has a free
    /// slot: `capacity` (None: no limit) minus its runs in STARTING or RUNNING. Runs passed
    /// over get a `waiting_reason`. One transaction holds a lock per credential for the
    /// count and the claims, taken in id order so two claimers never deadlock: a second
    /// replica's claim waits, then counts what the first one claimed.
    pub async fn claim_slots(
        &self,
        capacity: Option<&HashMap<String, SlotLimit>>,
        max_runs: u64,
    ) -> Result<Vec<run::Model>> {
        let txn = self.write_tx().await?;
        // Oldest first; a bounded window of the queue per call.
        let queued = run::Entity::find()
            .filter(run::Column::State.eq(state::QUEUED))
            .order_by(run::Column::CreatedAtUs, Order::Asc)
            .order_by(run::Column::Id, Order::Asc)
            .limit(max_runs.saturating_mul(4).max(100))
            .all(&txn)
            .await?;
        let mut credentials: Vec<&str> = queued.iter().map(|r| r.credential_id.as_str()).collect();
        credentials.sort_unstable();
        credentials.dedup();
        let mut free: HashMap<String, i64> = HashMap::new();
        if let Some(capacity) = capacity {
            if self.postgres {
                for credential in &credentials {
                    txn.execute_raw(sea_orm::Statement::from_sql_and_values(
                        sea_orm::DbBackend::Postgres,
                        "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
                        [format!("runplane.slots:{credential}").into()],
                    ))
                    .await?;
                }
            }
            let active: Vec<(String, i64)> = run::Entity::find()
                .select_only()
                .column(run::Column::CredentialId)
                .column_as(run::Column::Id.count(), "n")
                .filter(run::Column::State.is_in([state::STARTING, state::RUNNING]))
                .filter(run::Column::CredentialId.is_in(credentials.iter().map(|c| c.to_string())))
                .group_by(run::Column::CredentialId)
                .into_tuple()
                .all(&txn)
                .await?;
            let active: HashMap<String, i64> = active.into_iter().collect();
            for credential in &credentials {
                let limit = capacity.get(*credential);
                let slots = match limit {
                    Some(l) if l.unavailable.is_empty() => i64::from(l.capacity),
                    _ => 0,
                };
                free.insert(
                    credential.to_string(),
                    slots - active.get(*credential).copied().unwrap_or(0),
                );
            }
        }
        let now = self.now_us();
        let mut claimed = Vec::new();
        for run in queued {
            let why = match capacity {
                _ if claimed.len() as u64 >= max_runs => None,
                None => Some(String::new()),
                Some(capacity) => {
                    let left = free.get_mut(&run.credential_id).expect("counted above");
                    if *left > 0 {
                        *left -= 1;
                        Some(String::new())
                    } else {
                        Some(waiting_reason(
                            &run.credential_id,
                            capacity.get(&run.credential_id),
                            *left,
                        ))
                    }
                }
            };
            let Some(why) = why else { break };
            if why.is_empty() {
                // Compare-and-set: a cancel that took the run first keeps it.
                let done = run::Entity::update_many()
                    .col_expr(run::Column::State, Expr::value(state::STARTING))
                    .col_expr(run::Column::WaitingReason, Expr::value(""))
                    .col_expr(run::Column::UpdatedAtUs, Expr::value(now))
                    .filter(run::Column::Id.eq(run.id.as_str()))
                    .filter(run::Column::State.eq(state::QUEUED))
                    .exec(&txn)
                    .await?;
                if done.rows_affected == 1 {
                    let mut run = run;
                    run.state = state::STARTING.to_owned();
                    run.waiting_reason.clear();
                    run.updated_at_us = now;
                    claimed.push(run);
                }
            } else if run.waiting_reason != why {
                run::Entity::update_many()
                    .col_expr(run::Column::WaitingReason, Expr::value(why))
                    .filter(run::Column::Id.eq(run.id.as_str()))
                    .filter(run::Column::State.eq(state::QUEUED))
                    .exec(&txn)
                    .await?;
            }
        }
        txn.commit().await?;
        Ok(claimed)
    }

    // --- run keys ------------------------------------------------------------------

    /// Mints the key of one sandbox generation. Returns the key row and the secret,
    /// which exists only in this answer.
    pub async fn issue_run_key(
        &self,
        run_id: &str,
        sandbox_id: &str,
        generation: u64,
        idempotency_key: &str,
    ) -> Result<(run_key::Model, String)> {
        let txn = self.write_tx().await?;
        let run = self.lock_run(&txn, run_id).await?;
        if state::is_terminal(&run.state) {
            return Err(terminal_error(&run));
        }
        let now = self.now_us();
        let secret = ids::new_run_key();
        let generation_i = generation as i64;

        let existing = run_key::Entity::find()
            .filter(run_key::Column::RunId.eq(run_id))
            .filter(run_key::Column::IdempotencyKey.eq(idempotency_key))
            .one(&txn)
            .await?;
        if let Some(existing) = existing {
            if existing.sandbox_id != sandbox_id || existing.sandbox_generation != generation_i {
                return Err(RunStoreError::KeyReused {
                    field: "idempotency_key",
                });
            }
            if existing.hello_nonce.is_some() {
                return Err(RunStoreError::RunKeyClaimed);
            }
            if existing.revoked_at_us.is_some() {
                // A newer generation superseded it; this replay is stale.
                return Err(RunStoreError::GenerationStale {
                    requested: generation,
                    current: run.sandbox_generation as u64,
                });
            }
            // The first secret was never used (no Hello) and cannot be shown again: it is
            // replaced under the same key id, so no second live key exists.
            let mut active = existing.clone().into_active_model();
            active.key_hash = sea_orm::Set(ids::secret_hash(&secret));
            let key = active.update(&txn).await?;
            txn.commit().await?;
            return Ok((key, secret));
        }

        if generation_i < run.sandbox_generation {
            return Err(RunStoreError::GenerationStale {
                requested: generation,
                current: run.sandbox_generation as u64,
            });
        }
        // One live key per run: whatever was issued before is superseded.
        run_key::Entity::update_many()
            .col_expr(
                run_key::Column::RevokedReason,
                Expr::value(REVOKED_SUPERSEDED),
            )
            .col_expr(run_key::Column::RevokedAtUs, Expr::value(now))
            .filter(run_key::Column::RunId.eq(run_id))
            .filter(run_key::Column::RevokedAtUs.is_null())
            .exec(&txn)
            .await?;
        let key = run_key::Model {
            key_id: ids::new_key_id(),
            run_id: run_id.to_owned(),
            org_id: run.org_id.clone(),
            key_hash: ids::secret_hash(&secret),
            sandbox_id: sandbox_id.to_owned(),
            sandbox_generation: generation_i,
            idempotency_key: idempotency_key.to_owned(),
            created_at_us: now,
            revoked_reason: None,
            revoked_at_us: None,
            hello_nonce: None,
            hello_at_us: None,
        };
        run_key::Entity::insert(key.clone().into_active_model())
            .exec_without_returning(&txn)
            .await?;
        let mut active = run.clone().into_active_model();
        active.sandbox_generation = sea_orm::Set(generation_i);
        active.sandbox_id = sea_orm::Set(sandbox_id.to_owned());
        if run.state == state::QUEUED {
            active.state = sea_orm::Set(state::STARTING.to_owned());
        }
        active.updated_at_us = sea_orm::Set(now);
        active.update(&txn).await?;
        txn.commit().await?;
        Ok((key, secret))
    }

    /// Checks a runner's key against the run it names.
    ///
    /// An unknown key is `RunKeyInvalid`, a key of another run `RunKeyWrongRun`, a key
    /// superseded by a newer generation `RunKeyRevoked`. A key revoked because its run
    /// ended passes only when `allow_terminal` (SubmitResult answers replays with it);
    /// otherwise the caller learns the run is terminal.
    pub async fn authenticate_runner(
        &self,
        secret: &str,
        run_id: &str,
        allow_terminal: bool,
    ) -> Result<RunnerAuth> {
        self.authenticate_key_hash(&ids::secret_hash(secret), run_id, allow_terminal)
            .await
    }

    /// As [`Store::authenticate_runner`], from the key's SHA-256 (hex).
    pub async fn authenticate_key_hash(
        &self,
        key_hash: &str,
        run_id: &str,
        allow_terminal: bool,
    ) -> Result<RunnerAuth> {
        let key = run_key::Entity::find()
            .filter(run_key::Column::KeyHash.eq(key_hash))
            .one(&self.db)
            .await?
            .ok_or(RunStoreError::RunKeyInvalid)?;
        if key.run_id != run_id {
            return Err(RunStoreError::RunKeyWrongRun);
        }
        let run = self.get_run(run_id).await?;
        match key.revoked_reason.as_deref() {
            None => {}
            Some(REVOKED_TERMINAL) if allow_terminal => {}
            Some(REVOKED_TERMINAL) => return Err(terminal_error(&run)),
            Some(_) => return Err(RunStoreError::RunKeyRevoked),
        }
        if !allow_terminal && state::is_terminal(&run.state) {
            return Err(terminal_error(&run));
        }
        Ok(RunnerAuth { key, run })
    }

    /// Claims the key for the runner instance `nonce`. The same nonce gets the same
    /// claim time back; another nonce on a claimed key is refused.
    pub async fn hello(
        &self,
        key_id: &str,
        run_id: &str,
        nonce: &str,
    ) -> Result<(run::Model, i64)> {
        let txn = self.write_tx().await?;
        let run = self.lock_run(&txn, run_id).await?;
        let key = run_key::Entity::find_by_id(key_id.to_owned())
            .one(&txn)
            .await?
            .ok_or(RunStoreError::RunKeyInvalid)?;
        if let (Some(claimed), Some(at)) = (&key.hello_nonce, key.hello_at_us) {
            if claimed == nonce {
                txn.commit().await?;
                return Ok((run, at));
            }
            return Err(RunStoreError::HelloNonceMismatch);
        }
        if key.revoked_at_us.is_some() {
            return Err(if key.revoked_reason.as_deref() == Some(REVOKED_TERMINAL) {
                terminal_error(&run)
            } else {
                RunStoreError::RunKeyRevoked
            });
        }
        if state::is_terminal(&run.state) {
            return Err(terminal_error(&run));
        }
        let now = self.now_us();
        let claimed = run_key::Entity::update_many()
            .col_expr(run_key::Column::HelloNonce, Expr::value(nonce))
            .col_expr(run_key::Column::HelloAtUs, Expr::value(now))
            .filter(run_key::Column::KeyId.eq(key_id))
            .filter(run_key::Column::HelloNonce.is_null())
            .exec(&txn)
            .await?;
        if claimed.rows_affected != 1 {
            return Err(RunStoreError::HelloNonceMismatch);
        }
        let mut active = run.clone().into_active_model();
        if run.state != state::RUNNING {
            active.state = sea_orm::Set(state::RUNNING.to_owned());
        }
        if run.started_at_us.is_none() {
            active.started_at_us = sea_orm::Set(Some(now));
        }
        active.updated_at_us = sea_orm::Set(now);
        let run = active.update(&txn).await?;
        txn.commit().await?;
        Ok((run, now))
    }

    // --- events --------------------------------------------------------------------

    /// A runner's AppendEvents: checks its key (`secret`) as [`Store::authenticate_runner`]
    /// does for a live run, then appends as [`Store::append_events`] does.
    ///
    /// On Postgres the plain case is one statement (see [`append`]); anything else, and
    /// SQLite, takes the checked path, which gives every refusal and replay its answer.
    pub async fn append_for_runner(
        &self,
        secret: &str,
        run_id: &str,
        batch_key: &str,
        events: &[CheckedEvent],
    ) -> Result<Appended> {
        let key_hash = ids::secret_hash(secret);
        if let Some(appended) = self
            .append_in_one_statement(&key_hash, run_id, batch_key, events)
            .await?
        {
            return Ok(appended);
        }
        self.authenticate_key_hash(&key_hash, run_id, false).await?;
        self.append_events(run_id, batch_key, events).await
    }

    /// The one-statement append from the tip this replica remembers (or reads); `None`
    /// when it wrote nothing and the checked path must decide.
    async fn append_in_one_statement(
        &self,
        key_hash: &str,
        run_id: &str,
        batch_key: &str,
        events: &[CheckedEvent],
    ) -> Result<Option<Appended>> {
        // The outbox row of a failed turn is written by the checked path.
        let owes_report = self.report_failures && events.iter().any(|e| e.kind == TURN_FAILED);
        if !self.postgres || owes_report {
            return Ok(None);
        }
        let pool = self.db.get_postgres_connection_pool();
        let from = match self.tips.get(run_id) {
            Some(tip) => tip,
            None => match append::read_tip(pool, run_id).await? {
                Some(tip) => tip,
                None => return Ok(None),
            },
        };
        let rows = chain_rows(run_id, &from, events, self.now_us());
        let Some(last) = rows.last() else {
            return Ok(None);
        };
        let appended = Appended {
            first_sequence: (from.last_sequence + 1) as u64,
            last_sequence: last.sequence as u64,
            chain_head: last.digest.clone(),
        };
        let batch = append::Chained {
            key_hash: key_hash.to_owned(),
            run_id: run_id.to_owned(),
            batch_key: batch_key.to_owned(),
            batch_digest: crate::domain::validate::batch_digest(events),
            from_sequence: from.last_sequence,
            rows,
        };
        if !self.append_groups(pool).append(batch).await {
            self.tips.forget(run_id);
            return Ok(None);
        }
        self.remember_tip(run_id, &appended);
        runplane_telemetry::metrics::events_appended().add(events.len() as u64, &[]);
        Ok(Some(appended))
    }

    fn append_groups(&self, pool: &sea_orm::sqlx::PgPool) -> &append::AppendGroups {
        self.groups.get_or_init(|| {
            let clock = self.clock.clone();
            append::AppendGroups::start(pool.clone(), move || clock.now_us())
        })
    }

    /// Remembers a committed append's end as the run's tip, for its next append.
    fn remember_tip(&self, run_id: &str, appended: &Appended) {
        if self.postgres {
            self.tips.remember(
                run_id,
                append::ChainTip {
                    last_sequence: appended.last_sequence as i64,
                    head: appended.chain_head.clone(),
                },
            );
        }
    }

    /// Appends a batch, deduped on its key inside the transaction: a replay writes
    /// nothing and gets the first answer; the same key with other events is refused.
    pub async fn append_events(
        &self,
        run_id: &str,
        batch_key: &str,
        events: &[CheckedEvent],
    ) -> Result<Appended> {
        let digest = crate::domain::validate::batch_digest(events);
        let txn = self.write_tx().await?;
        let run = self.lock_run(&txn, run_id).await?;
        if let Some(done) = self.find_batch(&txn, run_id, batch_key, &digest).await? {
            txn.commit().await?;
            return Ok(done);
        }
        if state::is_terminal(&run.state) {
            return Err(terminal_error(&run));
        }
        let appended = self
            .append_locked(&txn, &run, batch_key, &digest, events)
            .await?;
        txn.commit().await?;
        self.remember_tip(run_id, &appended);
        runplane_telemetry::metrics::events_appended().add(events.len() as u64, &[]);
        Ok(appended)
    }

    async fn find_batch(
        &self,
        txn: &DatabaseTransaction,
        run_id: &str,
        batch_key: &str,
        digest: &str,
    ) -> Result<Option<Appended>> {
        let Some(batch) =
            event_batch::Entity::find_by_id((run_id.to_owned(), batch_key.to_owned()))
                .one(txn)
                .await?
        else {
            return Ok(None);
        };
        if batch.batch_digest != digest {
            return Err(RunStoreError::KeyReused { field: "batch_key" });
        }
        Ok(Some(Appended {
            first_sequence: batch.first_sequence as u64,
            last_sequence: batch.last_sequence as u64,
            chain_head: batch.chain_head,
        }))
    }

    /// Writes `events` after the run's last one, extending the chain, and the batch row;
    /// the caller holds the run lock and commits. Returns the new head.
    async fn append_locked(
        &self,
        txn: &DatabaseTransaction,
        run: &run::Model,
        batch_key: &str,
        digest: &str,
        events: &[CheckedEvent],
    ) -> Result<Appended> {
        let now = self.now_us();
        let from = append::ChainTip {
            last_sequence: run.last_sequence,
            head: run.chain_head.clone(),
        };
        let rows = chain_rows(&run.id, &from, events, now);
        let (sequence, head) = rows
            .last()
            .map_or((from.last_sequence, from.head.clone()), |r| {
                (r.sequence, r.digest.clone())
            });
        // Insert in chunks: a statement has a bounded number of parameters.
        let mut rows = rows
            .into_iter()
            .map(IntoActiveModel::into_active_model)
            .peekable();
        while rows.peek().is_some() {
            let chunk: Vec<_> = rows.by_ref().take(500).collect();
            event::Entity::insert_many(chunk)
                .exec_without_returning(txn)
                .await?;
        }
        for (i, e) in events.iter().enumerate() {
            if e.kind == TURN_FAILED {
                let sequence = run.last_sequence + 1 + i as i64;
                self.owe_turn_failure(txn, run, format!("{}:{sequence}", run.id), &e.text)
                    .await?;
            }
        }
        let appended = Appended {
            first_sequence: (run.last_sequence + 1) as u64,
            last_sequence: sequence as u64,
            chain_head: head.clone(),
        };
        event_batch::Entity::insert(
            event_batch::Model {
                run_id: run.id.clone(),
                batch_key: batch_key.to_owned(),
                batch_digest: digest.to_owned(),
                first_sequence: appended.first_sequence as i64,
                last_sequence: sequence,
                chain_head: head.clone(),
            }
            .into_active_model(),
        )
        .exec_without_returning(txn)
        .await?;
        run::Entity::update_many()
            .col_expr(run::Column::LastSequence, Expr::value(sequence))
            .col_expr(run::Column::ChainHead, Expr::value(head))
            .col_expr(run::Column::UpdatedAtUs, Expr::value(now))
            .filter(run::Column::Id.eq(run.id.as_str()))
            .exec(txn)
            .await?;
        Ok(appended)
    }

    /// Events after `after`, in order, at most `limit`.
    pub async fn events_after(
        &self,
        run_id: &str,
        after: u64,
        limit: u64,
    ) -> Result<Vec<event::Model>> {
        Ok(event::Entity::find()
            .filter(event::Column::RunId.eq(run_id))
            .filter(event::Column::Sequence.gt(after as i64))
            .order_by(event::Column::Sequence, Order::Asc)
            .limit(limit)
            .all(&self.db)
            .await?)
    }

    pub async fn count_events(&self, run_id: &str) -> Result<u64> {
        Ok(event::Entity::find()
            .filter(event::Column::RunId.eq(run_id))
            .count(&self.db)
            .await?)
    }

    // --- steering ------------------------------------------------------------------

    /// Enqueues a steering message, deduped on (run, idempotency key). `on_terminal`
    /// says whether a terminal run still takes it (an abort does).
    pub async fn enqueue(
        &self,
        run_id: &str,
        kind: pb::SteeringKind,
        payload: Vec<u8>,
        idempotency_key: &str,
        accept_on_terminal: bool,
    ) -> Result<steering_message::Model> {
        let txn = self.write_tx().await?;
        let run = self.lock_run(&txn, run_id).await?;
        let existing = steering_message::Entity::find()
            .filter(steering_message::Column::RunId.eq(run_id))
            .filter(steering_message::Column::IdempotencyKey.eq(idempotency_key))
            .one(&txn)
            .await?;
        if let Some(existing) = existing {
            if existing.kind != kind as i32 || existing.payload != payload {
                return Err(RunStoreError::KeyReused {
                    field: "idempotency_key",
                });
            }
            txn.commit().await?;
            return Ok(existing);
        }
        if state::is_terminal(&run.state) && !accept_on_terminal {
            return Err(terminal_error(&run));
        }
        let now = self.now_us();
        let sequence = run.steering_sequence + 1;
        let message = steering_message::Model {
            id: ids::new_message_id(),
            run_id: run_id.to_owned(),
            org_id: run.org_id.clone(),
            sequence,
            kind: kind as i32,
            payload,
            idempotency_key: idempotency_key.to_owned(),
            enqueued_at_us: now,
            acked_at_us: None,
            ack_outcome: None,
            ack_attempts: None,
        };
        steering_message::Entity::insert(message.clone().into_active_model())
            .exec_without_returning(&txn)
            .await?;
        run::Entity::update_many()
            .col_expr(run::Column::SteeringSequence, Expr::value(sequence))
            .col_expr(run::Column::UpdatedAtUs, Expr::value(now))
            .filter(run::Column::Id.eq(run_id))
            .exec(&txn)
            .await?;
        txn.commit().await?;
        Ok(message)
    }

    /// Applies acknowledgements, all or nothing. Every id must name a message of this
    /// run (and so of its org); only a steer may be dropped. A message acknowledged
    /// before stays as it was. A steer newly dropped writes one `steer_undeliverable`
    /// event.
    pub async fn acknowledge(&self, run_id: &str, acks: &[Ack]) -> Result<()> {
        if acks.is_empty() {
            return Ok(());
        }
        let txn = self.write_tx().await?;
        let run = self.lock_run(&txn, run_id).await?;
        let found: HashMap<String, steering_message::Model> = steering_message::Entity::find()
            .filter(steering_message::Column::RunId.eq(run_id))
            .filter(steering_message::Column::Id.is_in(acks.iter().map(|a| a.message_id.clone())))
            .all(&txn)
            .await?
            .into_iter()
            .map(|m| (m.id.clone(), m))
            .collect();
        for (index, ack) in acks.iter().enumerate() {
            let Some(message) = found.get(&ack.message_id) else {
                return Err(RunStoreError::AckInvalid {
                    index,
                    reason: "no such message for this run".into(),
                });
            };
            if ack.dropped && message.kind != pb::SteeringKind::Steer as i32 {
                return Err(RunStoreError::AckDropForbidden {
                    index,
                    kind: kind_name(message.kind),
                });
            }
        }
        let now = self.now_us();
        let mut undeliverable = Vec::new();
        for ack in acks {
            let outcome = if ack.dropped {
                "dropped_undeliverable"
            } else {
                "applied"
            };
            let marked = steering_message::Entity::update_many()
                .col_expr(steering_message::Column::AckedAtUs, Expr::value(now))
                .col_expr(steering_message::Column::AckOutcome, Expr::value(outcome))
                .col_expr(
                    steering_message::Column::AckAttempts,
                    Expr::value(ack.attempts.min(i32::MAX as u32) as i32),
                )
                .filter(steering_message::Column::Id.eq(ack.message_id.as_str()))
                .filter(steering_message::Column::AckedAtUs.is_null())
                .exec(&txn)
                .await?;
            if marked.rows_affected == 1 && ack.dropped {
                undeliverable.push(ack);
            }
        }
        if !undeliverable.is_empty() && !state::is_terminal(&run.state) {
            let events: Vec<CheckedEvent> = undeliverable
                .iter()
                .map(|ack| CheckedEvent {
                    kind: pb::EventKind::SteerUndeliverable as i32,
                    text: String::new(),
                    data: serde_json::json!({
                        "message_id": ack.message_id,
                        "attempts": ack.attempts,
                        "error": ack.error,
                    })
                    .to_string(),
                    check: false,
                    name: "steer_undeliverable".into(),
                    observed_at_us: None,
                })
                .collect();
            let digest = crate::domain::validate::batch_digest(&events);
            // Keyed by the first dropped message: the ack that drops it happens once.
            let key = format!("ack:{}", undeliverable[0].message_id);
            self.append_locked(&txn, &run, &key, &digest, &events)
                .await?;
        }
        txn.commit().await?;
        Ok(())
    }

    /// Messages not yet acknowledged, in enqueue order.
    pub async fn pending_messages(
        &self,
        run_id: &str,
        limit: u64,
    ) -> Result<Vec<steering_message::Model>> {
        Ok(steering_message::Entity::find()
            .filter(steering_message::Column::RunId.eq(run_id))
            .filter(steering_message::Column::AckedAtUs.is_null())
            .order_by(steering_message::Column::Sequence, Order::Asc)
            .limit(limit)
            .all(&self.db)
            .await?)
    }

    pub async fn get_message(&self, id: &str) -> Result<Option<steering_message::Model>> {
        Ok(steering_message::Entity::find_by_id(id.to_owned())
            .one(&self.db)
            .await?)
    }

    // --- verdicts ------------------------------------------------------------------

    /// Records a runner's verdict (after its final batch, if any). The same verdict
    /// again is a replay; another one on a terminal run is refused with the recorded one.
    pub async fn submit_result(
        &self,
        run_id: &str,
        verdict: &pb::Verdict,
        failure_tail: &str,
        final_batch: Option<(&str, &[CheckedEvent])>,
        signer: &ReceiptSigner,
    ) -> Result<Finished> {
        let txn = self.write_tx().await?;
        let mut run = self.lock_run(&txn, run_id).await?;
        if state::is_terminal(&run.state) {
            if same_verdict(&run, verdict) {
                txn.commit().await?;
                return Ok(Finished {
                    run,
                    made_terminal: false,
                });
            }
            return Err(terminal_error(&run));
        }
        if let Some((batch_key, events)) = final_batch {
            let digest = crate::domain::validate::batch_digest(events);
            if self
                .find_batch(&txn, run_id, batch_key, &digest)
                .await?
                .is_none()
            {
                self.append_locked(&txn, &run, batch_key, &digest, events)
                    .await?;
                run = self.lock_run(&txn, run_id).await?;
            }
        }
        let run = self
            .finish_locked(&txn, run, verdict, Some(failure_tail), signer)
            .await?;
        if verdict.outcome() == pb::VerdictOutcome::Failed && !failure_tail.is_empty() {
            self.owe_turn_failure(&txn, &run, format!("{}:result", run.id), failure_tail)
                .await?;
        }
        txn.commit().await?;
        Ok(Finished {
            run,
            made_terminal: true,
        })
    }

    /// Fails a run for a service: one atomic claim that folds in the optional guard.
    /// A replay with the same idempotency key gets the stored answer.
    pub async fn fail_run(
        &self,
        run_id: &str,
        request: &FailRequest<'_>,
        signer: &ReceiptSigner,
    ) -> Result<(pb::FailRunOutcome, run::Model)> {
        let FailRequest {
            reason,
            message,
            idempotency_key,
            guard_generation,
            guard_sandbox,
            request_digest,
        } = *request;
        const METHOD: &str = "FailRun";
        let txn = self.write_tx().await?;
        let run = self.lock_run(&txn, run_id).await?;
        if let Some(answer) = self
            .keyed_answer(&txn, run_id, METHOD, idempotency_key, request_digest)
            .await?
        {
            let outcome = pb::FailRunOutcome::try_from(stored_outcome(&answer))
                .unwrap_or(pb::FailRunOutcome::Unspecified);
            txn.commit().await?;
            return Ok((outcome, run));
        }
        let (outcome, run) = if state::is_terminal(&run.state) {
            (pb::FailRunOutcome::AlreadyTerminal, run)
        } else if guard_generation.is_some_and(|g| i64::try_from(g) != Ok(run.sandbox_generation))
            || guard_sandbox.is_some_and(|id| id != run.sandbox_id)
        {
            (pb::FailRunOutcome::GuardMismatch, run)
        } else {
            let verdict = pb::Verdict {
                outcome: pb::VerdictOutcome::Failed as i32,
                reason: reason.to_owned(),
                message: message.to_owned(),
                ..Default::default()
            };
            let run = self
                .finish_locked(&txn, run, &verdict, None, signer)
                .await?;
            (pb::FailRunOutcome::MadeTerminal, run)
        };
        self.store_answer(
            &txn,
            run_id,
            METHOD,
            idempotency_key,
            request_digest,
            (outcome as i32).to_be_bytes().to_vec(),
        )
        .await?;
        txn.commit().await?;
        Ok((outcome, run))
    }

    /// Ends a QUEUED run as cancelled (an interrupt before any sandbox existed).
    pub async fn cancel_queued(
        &self,
        run_id: &str,
        reason: &str,
        signer: &ReceiptSigner,
    ) -> Result<Option<run::Model>> {
        let txn = self.write_tx().await?;
        let run = self.lock_run(&txn, run_id).await?;
        if run.state != state::QUEUED {
            return Ok(None);
        }
        let verdict = pb::Verdict {
            outcome: pb::VerdictOutcome::Cancelled as i32,
            reason: "interrupted".into(),
            message: reason.to_owned(),
            ..Default::default()
        };
        let run = self
            .finish_locked(&txn, run, &verdict, None, signer)
            .await?;
        txn.commit().await?;
        Ok(Some(run))
    }

    /// Cancels a run for an operator through the guarded terminal path. A replay of the
    /// cancel that won (same idempotency key) gets the run back with `made_terminal`
    /// false; any other cancel of a terminal run is refused with its recorded verdict.
    pub async fn cancel_run(
        &self,
        run_id: &str,
        message: &str,
        idempotency_key: &str,
        request_digest: &str,
        signer: &ReceiptSigner,
    ) -> Result<Finished> {
        const METHOD: &str = "CancelRun";
        let txn = self.write_tx().await?;
        let run = self.lock_run(&txn, run_id).await?;
        if self
            .keyed_answer(&txn, run_id, METHOD, idempotency_key, request_digest)
            .await?
            .is_some()
        {
            txn.commit().await?;
            return Ok(Finished {
                run,
                made_terminal: false,
            });
        }
        if state::is_terminal(&run.state) {
            return Err(terminal_error(&run));
        }
        let verdict = pb::Verdict {
            outcome: pb::VerdictOutcome::Cancelled as i32,
            reason: REASON_CANCELLED.into(),
            message: message.to_owned(),
            ..Default::default()
        };
        let run = self
            .finish_locked(&txn, run, &verdict, None, signer)
            .await?;
        self.store_answer(
            &txn,
            run_id,
            METHOD,
            idempotency_key,
            request_digest,
            Vec::new(),
        )
        .await?;
        txn.commit().await?;
        Ok(Finished {
            run,
            made_terminal: true,
        })
    }

    /// Live runs whose deadline has passed, soonest first: one bounded read on the
    /// deadline index.
    pub async fn past_deadline(&self, limit: u64) -> Result<Vec<String>> {
        Ok(run::Entity::find()
            .select_only()
            .column(run::Column::Id)
            .filter(run::Column::DeadlineAtUs.lte(self.now_us()))
            .filter(run::Column::State.is_in(state::LIVE))
            .order_by(run::Column::DeadlineAtUs, Order::Asc)
            .limit(limit)
            .into_tuple()
            .all(&self.db)
            .await?)
    }

    /// Ends `run_id` as `deadline_exceeded` if it is still live and past its deadline
    /// under the run's lock, so of several replicas sweeping at once exactly one ends it
    /// and the others find it terminal. `None` when nothing changed.
    pub async fn expire(&self, run_id: &str, signer: &ReceiptSigner) -> Result<Option<run::Model>> {
        let txn = self.write_tx().await?;
        let run = self.lock_run(&txn, run_id).await?;
        let now = self.now_us();
        if state::is_terminal(&run.state) || run.deadline_at_us.is_none_or(|d| d > now) {
            return Ok(None);
        }
        let limit_s = (run.deadline_at_us.unwrap_or(now) - run.created_at_us) / 1_000_000;
        let verdict = pb::Verdict {
            outcome: pb::VerdictOutcome::Failed as i32,
            reason: REASON_DEADLINE_EXCEEDED.into(),
            message: format!("the run outlived its {limit_s} s deadline"),
            ..Default::default()
        };
        let run = self
            .finish_locked(&txn, run, &verdict, None, signer)
            .await?;
        txn.commit().await?;
        Ok(Some(run))
    }

    /// Records the durable backend-error outcome: from a live run it ends the run, from
    /// a succeeded or failed one it changes only the state and the outcome.
    #[allow(clippy::too_many_arguments)]
    pub async fn mark_backend_error(
        &self,
        run_id: &str,
        idempotency_key: &str,
        request_digest: &str,
        outcome_json: &str,
        reason: &str,
        signer: &ReceiptSigner,
    ) -> Result<(pb::MarkBackendErrorOutcome, run::Model)> {
        const METHOD: &str = "MarkBackendError";
        let txn = self.write_tx().await?;
        let run = self.lock_run(&txn, run_id).await?;
        if let Some(answer) = self
            .keyed_answer(&txn, run_id, METHOD, idempotency_key, request_digest)
            .await?
        {
            let outcome = pb::MarkBackendErrorOutcome::try_from(stored_outcome(&answer))
                .unwrap_or(pb::MarkBackendErrorOutcome::Unspecified);
            txn.commit().await?;
            return Ok((outcome, run));
        }
        let now = self.now_us();
        let (outcome, run) = match run.state.as_str() {
            state::BACKEND_ERROR => (pb::MarkBackendErrorOutcome::AlreadyMarked, run),
            state::QUEUED | state::CANCELLED => {
                return Err(RunStoreError::VerdictConflict(format!(
                    "a {} run cannot carry a backend error",
                    run.state
                )));
            }
            state::STARTING | state::RUNNING => {
                let verdict = pb::Verdict {
                    outcome: pb::VerdictOutcome::Failed as i32,
                    reason: "backend_error".into(),
                    message: reason.to_owned(),
                    ..Default::default()
                };
                let run = self
                    .finish_locked(&txn, run, &verdict, None, signer)
                    .await?;
                let mut active = run.into_active_model();
                active.state = sea_orm::Set(state::BACKEND_ERROR.to_owned());
                active.backend_error = sea_orm::Set(Some(outcome_json.to_owned()));
                active.updated_at_us = sea_orm::Set(now);
                (
                    pb::MarkBackendErrorOutcome::Marked,
                    active.update(&txn).await?,
                )
            }
            _ => {
                // Done already (succeeded or failed): the receipt stays as sealed; the
                // roster records what the run really died of.
                let mut active = run.into_active_model();
                active.state = sea_orm::Set(state::BACKEND_ERROR.to_owned());
                active.backend_error = sea_orm::Set(Some(outcome_json.to_owned()));
                active.updated_at_us = sea_orm::Set(now);
                (
                    pb::MarkBackendErrorOutcome::Marked,
                    active.update(&txn).await?,
                )
            }
        };
        self.store_answer(
            &txn,
            run_id,
            METHOD,
            idempotency_key,
            request_digest,
            (outcome as i32).to_be_bytes().to_vec(),
        )
        .await?;
        txn.commit().await?;
        Ok((outcome, run))
    }

    async fn keyed_answer(
        &self,
        txn: &DatabaseTransaction,
        run_id: &str,
        method: &str,
        idempotency_key: &str,
        request_digest: &str,
    ) -> Result<Option<Vec<u8>>> {
        let Some(answer) = keyed_answer::Entity::find_by_id((
            run_id.to_owned(),
            method.to_owned(),
            idempotency_key.to_owned(),
        ))
        .one(txn)
        .await?
        else {
            return Ok(None);
        };
        if answer.request_digest != request_digest {
            return Err(RunStoreError::KeyReused {
                field: "idempotency_key",
            });
        }
        Ok(Some(answer.answer))
    }

    async fn store_answer(
        &self,
        txn: &DatabaseTransaction,
        run_id: &str,
        method: &str,
        idempotency_key: &str,
        request_digest: &str,
        answer: Vec<u8>,
    ) -> Result<()> {
        keyed_answer::Entity::insert(
            keyed_answer::Model {
                run_id: run_id.to_owned(),
                method: method.to_owned(),
                idempotency_key: idempotency_key.to_owned(),
                request_digest: request_digest.to_owned(),
                answer,
                created_at_us: self.now_us(),
            }
            .into_active_model(),
        )
        .exec_without_returning(txn)
        .await?;
        Ok(())
    }

    /// Makes a locked, live run terminal with `verdict`: revokes its keys and seals its
    /// receipt, all in the caller's transaction.
    async fn finish_locked(
        &self,
        txn: &DatabaseTransaction,
        run: run::Model,
        verdict: &pb::Verdict,
        failure_tail: Option<&str>,
        signer: &ReceiptSigner,
    ) -> Result<run::Model> {
        let now = self.now_us();
        let terminal = state::for_outcome(verdict.outcome())
            .ok_or_else(|| RunStoreError::invalid("verdict.outcome", "is unspecified"))?;
        let mut active = run.clone().into_active_model();
        active.state = sea_orm::Set(terminal.to_owned());
        active.verdict_outcome =
            sea_orm::Set(Some(state::outcome_name(verdict.outcome()).to_owned()));
        active.verdict_reason = sea_orm::Set(Some(verdict.reason.clone()));
        active.verdict_exit_code = sea_orm::Set(verdict.exit_code);
        active.verdict_signal = sea_orm::Set(verdict.signal);
        active.verdict_message = sea_orm::Set(Some(verdict.message.clone()));
        active.failure_tail =
            sea_orm::Set(failure_tail.filter(|t| !t.is_empty()).map(str::to_owned));
        active.ended_at_us = sea_orm::Set(Some(now));
        active.updated_at_us = sea_orm::Set(now);
        let run = active.update(txn).await?;

        run_key::Entity::update_many()
            .col_expr(
                run_key::Column::RevokedReason,
                Expr::value(REVOKED_TERMINAL),
            )
            .col_expr(run_key::Column::RevokedAtUs, Expr::value(now))
            .filter(run_key::Column::RunId.eq(run.id.as_str()))
            .filter(run_key::Column::RevokedAtUs.is_null())
            .exec(txn)
            .await?;

        let checks = event::Entity::find()
            .filter(event::Column::RunId.eq(run.id.as_str()))
            .filter(event::Column::IsCheck.eq(true))
            .order_by(event::Column::Sequence, Order::Asc)
            .all(txn)
            .await?;
        let body = pb::ReceiptBody {
            run_id: run.id.clone(),
            org_id: run.org_id.clone(),
            verdict: Some(verdict_of(&run)),
            event_count: run.last_sequence as u64,
            check_events: checks
                .into_iter()
                .map(|e| pb::CheckEventRef {
                    sequence: e.sequence as u64,
                    digest: e.digest,
                    name: e.name,
                })
                .collect(),
            chain_head: run.chain_head.clone(),
            sealed_at: Some(runplane_clock::to_timestamp(now)),
            key_id: String::new(),
        };
        let sealed = signer.seal(body);
        receipt::Entity::insert(
            receipt::Model {
                run_id: run.id.clone(),
                signed_payload: sealed.signed_payload,
                signature: sealed.signature,
                key_id: sealed.key_id,
                sealed_at_us: now,
            }
            .into_active_model(),
        )
        .exec_without_returning(txn)
        .await?;
        Ok(run)
    }

    pub async fn receipt(&self, run_id: &str) -> Result<Option<pb::Receipt>> {
        Ok(receipt::Entity::find_by_id(run_id.to_owned())
            .one(&self.db)
            .await?
            .map(|r| pb::Receipt {
                body: pb::ReceiptBody::decode(r.signed_payload.as_slice()).ok(),
                signed_payload: r.signed_payload,
                signature: r.signature,
                key_id: r.key_id,
            }))
    }
}

/// The rows of `events` appended after `from`, each with its chain digest.
fn chain_rows(
    run_id: &str,
    from: &append::ChainTip,
    events: &[CheckedEvent],
    recorded_at_us: i64,
) -> Vec<event::Model> {
    let mut head = from.head.clone();
    let mut sequence = from.last_sequence;
    let mut rows = Vec::with_capacity(events.len());
    for e in events {
        sequence += 1;
        head = chain::extend(
            &head,
            &ChainedEvent {
                sequence: sequence as u64,
                kind: e.kind,
                check: e.check,
                name: &e.name,
                text: &e.text,
                data: &e.data,
                observed_at_us: e.observed_at_us,
            },
        );
        rows.push(event::Model {
            run_id: run_id.to_owned(),
            sequence,
            kind: e.kind,
            text: e.text.clone(),
            data: e.data.clone(),
            is_check: e.check,
            name: e.name.clone(),
            observed_at_us: e.observed_at_us,
            recorded_at_us,
            digest: head.clone(),
        });
    }
    rows
}

/// The outcome enum number a keyed answer was stored as (4 bytes, big-endian).
fn stored_outcome(answer: &[u8]) -> i32 {
    answer
        .get(..4)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map(i32::from_be_bytes)
        .unwrap_or_default()
}

fn same_request(existing: run::Model, digest: &str) -> Result<run::Model> {
    if existing.request_digest == digest {
        Ok(existing)
    } else {
        Err(RunStoreError::KeyReused {
            field: "client_request_id",
        })
    }
}

/// Two verdicts are the same when outcome, reason and exit code agree.
fn same_verdict(run: &run::Model, verdict: &pb::Verdict) -> bool {
    run.verdict_outcome.as_deref() == Some(state::outcome_name(verdict.outcome()))
        && run.verdict_reason.as_deref() == Some(verdict.reason.as_str())
        && run.verdict_exit_code == verdict.exit_code
}

/// `RunTerminal` carrying the recorded verdict.
pub fn terminal_error(run: &run::Model) -> RunStoreError {
    RunStoreError::RunTerminal {
        run_id: run.id.clone(),
        outcome: run
            .verdict_outcome
            .clone()
            .unwrap_or_else(|| run.state.clone()),
        reason: run.verdict_reason.clone().unwrap_or_default(),
        exit_code: run.verdict_exit_code,
    }
}

pub fn kind_name(kind: i32) -> &'static str {
    match pb::SteeringKind::try_from(kind) {
        Ok(pb::SteeringKind::Steer) => "steer",
        Ok(pb::SteeringKind::Interrupt) => "interrupt",
        Ok(pb::SteeringKind::ResumeStream) => "resume_stream",
        Ok(pb::SteeringKind::Abort) => "abort",
        _ => "message",
    }
}

/// The recorded verdict of a terminal run.
pub fn verdict_of(run: &run::Model) -> pb::Verdict {
    pb::Verdict {
        outcome: state::outcome_from_name(run.verdict_outcome.as_deref().unwrap_or_default())
            as i32,
        reason: run.verdict_reason.clone().unwrap_or_default(),
        exit_code: run.verdict_exit_code,
        signal: run.verdict_signal,
        message: run.verdict_message.clone().unwrap_or_default(),
    }
}
