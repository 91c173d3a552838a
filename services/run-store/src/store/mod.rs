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
pub mod attempts;
pub mod entities;
mod events;
mod keys;
pub mod migration;
mod pause;
mod retention;
mod runs;
mod slots;
mod steering;
mod terminal;
pub mod webhooks;

use std::collections::HashMap;
use std::sync::Arc;

use prost::Message;
use runplane_clock::SharedClock;
use runplane_proto::credentials::v1 as credentials_pb;
use runplane_proto::limits::MAX_FAILURE_TAIL_BYTES;
use runplane_proto::runstore::v1 as runstore_pb;
use sea_orm::sea_query::{Expr, Order};
use sea_orm::{
    ActiveModelTrait, ColumnTrait, ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbErr,
    EntityTrait, IntoActiveModel, PaginatorTrait, QueryFilter, QueryOrder, QuerySelect, SqlErr,
};

pub use keys::{Hello, KeyFor};
pub use migration::Migrator;
pub use pause::{PauseRule, Paused, REASON_PAUSED_TOO_LONG};
pub use retention::{Retention, Swept};

use crate::domain::chain::{self, ChainedEvent};
use crate::domain::ids;
use crate::domain::receipt::ReceiptSigner;
use crate::domain::state::RunState;
use crate::domain::validate::CheckedEvent;
use crate::domain::verdict::{Verdict, VerdictOutcome};
use crate::error::RunStoreError;
use entities::{
    event, event_batch, keyed_answer, receipt, run, run_key, run_label, steering_message,
};

type Result<T> = std::result::Result<T, RunStoreError>;

/// Why a key stopped working.
pub const REVOKED_SUPERSEDED: &str = "superseded";
pub const REVOKED_TERMINAL: &str = "terminal";

/// Revokes every live key of `run_id` for `reason`, in the caller's transaction: one
/// live key per run (a new one supersedes the last), none once its attempt or the run
/// has ended.
pub(super) async fn revoke_live_keys(
    txn: &DatabaseTransaction,
    run_id: &str,
    reason: &str,
    now: i64,
) -> Result<()> {
    run_key::Entity::update_many()
        .col_expr(run_key::Column::RevokedReason, Expr::value(reason))
        .col_expr(run_key::Column::RevokedAtUs, Expr::value(now))
        .filter(run_key::Column::RunId.eq(run_id))
        .filter(run_key::Column::RevokedAtUs.is_null())
        .exec(txn)
        .await?;
    Ok(())
}

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
    /// Where the group writer runs as a declared task: the service's group once the run
    /// store joins it ([`Store::with_tasks`]), a group of its own otherwise.
    tasks: runplane_grpc::Tasks,
    /// The waiting reasons this replica's claims last wrote (`store::slots`).
    reasons: Arc<slots::WrittenReasons>,
    /// What one run may store of events (`run_store.max_events_per_run`, …).
    event_quota: EventQuota,
    /// The webhook endpoints and the events each takes (`[[run_store.webhooks]]`).
    webhooks: Arc<crate::domain::webhook::Routes>,
    /// Each profile's retry policy (`retry` of `[[credential_health.profiles]]`).
    retry_rules: Arc<crate::domain::retry::RetryRules>,
}

/// Most events and event bytes (text, data and names) one run stores; a runner's append
/// past either is refused. A verdict's own final events are always stored: they carry
/// the run's end and the count of what was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventQuota {
    pub max_events: i64,
    pub max_bytes: i64,
}

impl EventQuota {
    /// `run_store.max_events_per_run` and `max_event_bytes_per_run`.
    pub fn from_config(config: &runplane_config::RunStoreConfig) -> Self {
        Self {
            max_events: config.max_events_per_run.into(),
            max_bytes: config.max_event_bytes_per_run.min(i64::MAX as u64) as i64,
        }
    }
}

impl Default for EventQuota {
    fn default() -> Self {
        Self::from_config(&runplane_config::RunStoreConfig::default())
    }
}

/// The bytes of `events` a run's event quota counts: their text, data and names.
pub(super) fn stored_bytes(events: &[CheckedEvent]) -> i64 {
    events
        .iter()
        .map(|e| (e.text.len() + e.data.len() + e.name.len()) as i64)
        .sum()
}

/// `run_store → credential_health.report_turn_failure`.
pub const OUTBOX_REPORT_TURN_FAILURE: &str = "credential_health.report_turn_failure";

/// The last `max` bytes of `s`, cut at a character boundary.
fn tail_end(s: &str, max: usize) -> &str {
    let mut start = s.len().saturating_sub(max);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

/// The event kind of a failed agent turn.
const TURN_FAILED: i32 = runstore_pb::EventKind::TurnFailed as i32;

/// Active runs counted three ways (see [`Store::count_active`]).
#[derive(Debug, Clone, Default)]
pub struct ActiveCounts {
    pub by_credential: HashMap<String, u32>,
    /// QUEUED runs per credential (waiting for a slot).
    pub queued_by_credential: HashMap<String, u32>,
    pub by_profile: HashMap<String, u32>,
    pub by_profile_credential: HashMap<String, u32>,
}

pub use crate::domain::share::SlotLimit;

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
    /// Its place among its org's queued runs (0–9, higher first).
    pub priority: i32,
    /// Most runs its org may have queued; `None`: no quota.
    pub max_queued: Option<u32>,
}

/// Filters and position of a ListRuns page.
#[derive(Debug, Clone, Default)]
pub struct RunFilter {
    pub org_id: Option<String>,
    pub lead_id: Option<String>,
    pub credential_id: Option<String>,
    pub profile: Option<String>,
    pub states: Vec<RunState>,
    /// Only these runs (empty: any).
    pub run_ids: Vec<String>,
    /// Only runs with a steering message not yet acknowledged.
    pub with_pending_messages: bool,
    /// Only paused runs.
    pub paused_only: bool,
    /// Only runs these label selector terms all select.
    pub labels: Vec<crate::domain::labels::Term>,
    /// Start after this (created_at_us, id), newest first.
    pub after: Option<(i64, String)>,
    pub limit: u64,
    /// Read the runs without their spec (command, args, labels): [`basic`].
    pub basic: bool,
}

/// `select` of runs without their spec: command, args and labels read as empty, so a
/// read of many runs costs the same whatever the runs hold.
pub fn basic(select: sea_orm::Select<run::Entity>) -> sea_orm::Select<run::Entity> {
    use sea_orm::{Iterable, QuerySelect};
    let spec = |c: &run::Column| {
        matches!(
            c,
            run::Column::Command | run::Column::Args | run::Column::Labels
        )
    };
    select
        .select_only()
        .columns(run::Column::iter().filter(|c| !spec(c)))
        .column_as(Expr::val(""), "command")
        .column_as(Expr::val("[]"), "args")
        .column_as(Expr::val("{}"), "labels")
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

/// The answer of a keyed call that may end a run: its outcome, the run after it, and
/// whether it was a replay answered from the stored first answer.
#[derive(Debug)]
pub struct Keyed<O> {
    pub outcome: O,
    pub run: run::Model,
    pub replayed: bool,
}

/// The result of a call that may make a run terminal.
#[derive(Debug, Clone)]
pub struct Finished {
    pub run: run::Model,
    /// This call made the run terminal (side effects are its to run).
    pub made_terminal: bool,
    /// This call ended the run's attempt instead, and the next is due.
    pub retried: bool,
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
            tasks: runplane_grpc::Tasks::new(),
            reasons: Arc::default(),
            event_quota: EventQuota::default(),
            webhooks: Arc::default(),
            retry_rules: Arc::default(),
        }
    }

    /// Retries runs' attempts by their profiles' policies ([`crate::domain::retry`]).
    pub fn with_retries(mut self, rules: crate::domain::retry::RetryRules) -> Self {
        self.retry_rules = Arc::new(rules);
        self
    }

    /// Owes lifecycle events to these endpoints ([`crate::domain::webhook::Routes`]).
    pub fn with_webhooks(mut self, routes: crate::domain::webhook::Routes) -> Self {
        self.webhooks = Arc::new(routes);
        self
    }

    /// Bounds what one run stores of events ([`EventQuota`]).
    pub fn with_event_quota(mut self, quota: EventQuota) -> Self {
        self.event_quota = quota;
        self
    }

    /// Runs the store's own background work (the append-group writer) in `tasks`, the
    /// service's group, so it is declared, cancelled at shutdown and restarted on a panic.
    pub fn with_tasks(mut self, tasks: runplane_grpc::Tasks) -> Self {
        self.tasks = tasks;
        self
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
        let request = credentials_pb::ReportTurnFailureRequest {
            turn_id: turn_id.clone(),
            run_id: run.id.clone(),
            org_id: run.org_id.clone(),
            lead_id: run.lead_id.clone(),
            credential_id: run.credential_id.clone(),
            profile: run.profile.clone(),
            // Credential health reads at most this much of a failure tail: its end,
            // where the agent's last words are.
            failure_tail: tail_end(failure_tail, MAX_FAILURE_TAIL_BYTES).to_owned(),
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
fn same_verdict(run: &run::Model, verdict: &Verdict) -> bool {
    run.verdict_outcome == Some(verdict.outcome)
        && run.verdict_reason.as_deref() == Some(verdict.reason.as_str())
        && run.verdict_exit_code == verdict.exit_code
}

/// `RunTerminal` carrying the recorded verdict.
pub fn terminal_error(run: &run::Model) -> RunStoreError {
    RunStoreError::RunTerminal {
        run_id: run.id.clone(),
        outcome: run
            .verdict_outcome
            .map_or(run.state.as_str(), VerdictOutcome::as_str)
            .to_owned(),
        reason: run.verdict_reason.clone().unwrap_or_default(),
        exit_code: run.verdict_exit_code,
    }
}

pub fn kind_name(kind: i32) -> &'static str {
    match runstore_pb::SteeringKind::try_from(kind) {
        Ok(runstore_pb::SteeringKind::Steer) => "steer",
        Ok(runstore_pb::SteeringKind::Interrupt) => "interrupt",
        Ok(runstore_pb::SteeringKind::ResumeStream) => "resume_stream",
        Ok(runstore_pb::SteeringKind::Abort) => "abort",
        _ => "message",
    }
}
