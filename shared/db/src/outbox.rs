//! The transactional outbox every service uses for calls it owes another service.
//!
//! A call that must not be lost (a FailRun, a turn failure to classify, a backend-error
//! outcome) is written as a row in the same transaction as the decision that owes it,
//! keyed so a second decision for the same thing is a no-op, and delivered with that key
//! until the callee answers. The callee dedupes on the key, so a delivery that was
//! processed but whose answer was lost is simply delivered again.
//!
//! Every replica of a service runs the delivery loop over the same table, so a row is
//! claimed before it is sent: the claim is a lease written into `next_attempt_at_us`
//! (the row is not due for anyone else until the lease lapses), taken by one
//! `UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED) RETURNING` on Postgres,
//! the same statement without the lock clause on SQLite (one process, and SQLite runs
//! one write at a time). A replica that dies mid-delivery never books an outcome, so its
//! lease lapses after [`CLAIM_TIMEOUT`] and another replica sends the row.
//!
//! Why a lease in `next_attempt_at_us` rather than a lock held across the call or a
//! `claimed_until` column: the call to the other service happens outside any
//! transaction (holding a row lock and a pooled connection across a remote call would
//! tie the database to the callee's latency), and the column already means "not before
//! then", which is exactly what a claim is. Keeping the table as it is also claims the
//! rows of every service that shares this table, with no migration.

use std::time::Duration;

use sea_orm::sea_query::{
    Alias, ColumnDef, Expr, LockBehavior, LockType, OnConflict, Query, Table, TableCreateStatement,
};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DbErr, EntityTrait, IntoActiveModel, Order, QueryFilter,
    QueryOrder, QuerySelect,
};

/// How long one delivery attempt may take before it counts as failed. It bounds how
/// long a replica holds a row, so it stays well under [`CLAIM_TIMEOUT`].
pub const DELIVERY_DEADLINE: Duration = Duration::from_secs(10);

/// How long a claim keeps a row from the other replicas. A live claimant books its
/// outcome within [`DELIVERY_DEADLINE`]; a claim still standing after three of those
/// belongs to a replica that died, and the row is due again.
pub const CLAIM_TIMEOUT: Duration = Duration::from_secs(30);

pub mod entity {
    use sea_orm::entity::prelude::*;

    /// A call to another service that must not be lost, written in the transaction that
    /// decided it and delivered (with its idempotency key) until the callee answers.
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "outbox")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: String,
        /// What to call, e.g. `run_store.fail_run`.
        pub kind: String,
        /// The request, protobuf-encoded.
        pub payload: Vec<u8>,
        #[sea_orm(unique)]
        pub idempotency_key: String,
        /// W3C `traceparent` of the decision, so the delivery joins its trace.
        pub traceparent: String,
        pub attempts: i32,
        /// When the row is next due: after a failed attempt, the end of its backoff;
        /// while a replica delivers it, the end of that replica's claim.
        pub next_attempt_at_us: i64,
        /// Why the last attempt failed; on a delivered row, why it was given up on (empty
        /// when the callee accepted it).
        pub last_error: String,
        pub created_at_us: i64,
        pub delivered_at_us: Option<i64>,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub use entity::Model as OutboxRow;

/// The `outbox` table, for a service's migration.
pub fn create_table() -> TableCreateStatement {
    let col = |name: &str| ColumnDef::new(Alias::new(name));
    Table::create()
        .table(Alias::new("outbox"))
        .if_not_exists()
        .col(col("id").text().not_null().primary_key())
        .col(col("kind").text().not_null())
        .col(col("payload").blob().not_null())
        .col(col("idempotency_key").text().not_null().unique_key())
        .col(col("traceparent").text().not_null())
        .col(col("attempts").integer().not_null())
        .col(col("next_attempt_at_us").big_integer().not_null())
        .col(col("last_error").text().not_null())
        .col(col("created_at_us").big_integer().not_null())
        .col(col("delivered_at_us").big_integer().null())
        .to_owned()
}

/// A new row for `kind`, due now; the caller sets `traceparent` from its span.
pub fn row(kind: &str, idempotency_key: String, payload: Vec<u8>, now_us: i64) -> OutboxRow {
    OutboxRow {
        id: uuid::Uuid::new_v4().to_string(),
        kind: kind.to_owned(),
        idempotency_key,
        payload,
        traceparent: String::new(),
        attempts: 0,
        next_attempt_at_us: now_us,
        last_error: String::new(),
        created_at_us: now_us,
        delivered_at_us: None,
    }
}

/// Writes `row` inside the caller's transaction. A row with the same idempotency key
/// already there wins: the decision was taken before, and is owed once. Returns whether
/// this row was written.
pub async fn enqueue(db: &impl ConnectionTrait, row: OutboxRow) -> Result<bool, DbErr> {
    let written = entity::Entity::insert(row.into_active_model())
        .on_conflict(
            OnConflict::column(entity::Column::IdempotencyKey)
                .do_nothing()
                .to_owned(),
        )
        .exec_without_returning(db)
        .await?;
    Ok(written == 1)
}

/// Claims the oldest undelivered row due at `now_us` for `claim_for_us`: the returned
/// row's `next_attempt_at_us` is the end of the claim, and no other replica is handed
/// the row before then. `None` when nothing is due (or every due row is being claimed
/// by someone else right now).
pub async fn claim_next(
    db: &impl ConnectionTrait,
    now_us: i64,
    claim_for_us: i64,
) -> Result<Option<OutboxRow>, DbErr> {
    use entity::{Column, Entity};
    // SQLite's builder leaves the lock clause out: SQLite runs one write at a time, so
    // the statement alone is the claim there.
    let oldest_due = Query::select()
        .column(Column::Id)
        .from(Entity)
        .and_where(Column::DeliveredAtUs.is_null())
        .and_where(Column::NextAttemptAtUs.lte(now_us))
        .order_by(Column::CreatedAtUs, Order::Asc)
        .limit(1)
        .lock_with_behavior(LockType::Update, LockBehavior::SkipLocked)
        .to_owned();
    let claim = Query::update()
        .table(Entity)
        .value(Column::NextAttemptAtUs, now_us + claim_for_us)
        .and_where(Column::Id.in_subquery(oldest_due))
        .returning_all()
        .to_owned();
    Entity::find()
        .from_raw_sql(db.get_database_backend().build(&claim))
        .one(db)
        .await
}

/// Every row, oldest first (tests and operators' inspection).
pub async fn all(db: &impl ConnectionTrait) -> Result<Vec<OutboxRow>, DbErr> {
    entity::Entity::find()
        .order_by(entity::Column::CreatedAtUs, Order::Asc)
        .all(db)
        .await
}

/// Deletes up to `limit` rows delivered (or given up on) before `before_us`; returns how
/// many. A delivered row only dedupes a decision made again, which no longer happens
/// once what it was about has ended long since. The rows are picked by id, then
/// deleted by id, so the statement is bounded on every backend.
pub async fn prune_delivered(
    db: &impl ConnectionTrait,
    before_us: i64,
    limit: u64,
) -> Result<u64, DbErr> {
    let ids: Vec<String> = entity::Entity::find()
        .select_only()
        .column(entity::Column::Id)
        .filter(entity::Column::DeliveredAtUs.lt(before_us))
        .limit(limit)
        .into_tuple()
        .all(db)
        .await?;
    if ids.is_empty() {
        return Ok(0);
    }
    Ok(entity::Entity::delete_many()
        .filter(entity::Column::Id.is_in(ids))
        .exec(db)
        .await?
        .rows_affected)
}

/// The callee answered: the row is done.
pub async fn mark_delivered(db: &impl ConnectionTrait, id: &str, now_us: i64) -> Result<(), DbErr> {
    settle(db, id, now_us, "").await
}

/// The callee refused the call for good (it can never succeed): the row is done, and
/// keeps why. The caller logs it at WARN.
pub async fn give_up(
    db: &impl ConnectionTrait,
    id: &str,
    now_us: i64,
    error: &str,
) -> Result<(), DbErr> {
    settle(db, id, now_us, error).await
}

async fn settle(
    db: &impl ConnectionTrait,
    id: &str,
    now_us: i64,
    error: &str,
) -> Result<(), DbErr> {
    entity::Entity::update_many()
        .col_expr(entity::Column::DeliveredAtUs, Expr::value(now_us))
        .col_expr(entity::Column::LastError, Expr::value(bounded(error)))
        .filter(entity::Column::Id.eq(id))
        .filter(entity::Column::DeliveredAtUs.is_null())
        .exec(db)
        .await?;
    Ok(())
}

/// The call failed in a way a later attempt may not: try again after the backoff for
/// the row's attempts so far (1 s doubling to 60 s). `row` is the claimed row: only the
/// claim it holds is replaced, so a claimant that outlived its claim cannot push back a
/// row another replica has claimed since.
pub async fn delivery_failed(
    db: &impl ConnectionTrait,
    row: &OutboxRow,
    now_us: i64,
    error: &str,
) -> Result<(), DbErr> {
    entity::Entity::update_many()
        .col_expr(entity::Column::Attempts, Expr::value(row.attempts + 1))
        .col_expr(
            entity::Column::NextAttemptAtUs,
            Expr::value(now_us + retry_backoff_us(row.attempts)),
        )
        .col_expr(entity::Column::LastError, Expr::value(bounded(error)))
        .filter(entity::Column::Id.eq(row.id.as_str()))
        .filter(entity::Column::DeliveredAtUs.is_null())
        .filter(entity::Column::NextAttemptAtUs.eq(row.next_attempt_at_us))
        .exec(db)
        .await?;
    Ok(())
}

/// 1 s doubling to 60 s: a callee that is down for a deploy is retried within a second
/// of its return, one that is down for long is not hammered.
pub fn retry_backoff_us(attempts: i32) -> i64 {
    (1_000_000i64 << attempts.clamp(0, 6)).min(60_000_000)
}

/// At most 512 bytes of an error, cut on a character boundary, as the outbox tables
/// store it.
pub fn bounded(error: &str) -> String {
    let mut end = error.len().min(512);
    while !error.is_char_boundary(end) {
        end -= 1;
    }
    error[..end].to_owned()
}

/// What one delivery attempt came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivery {
    /// The callee answered: the row is done.
    Delivered,
    /// The callee refused for good (or the row cannot be sent): given up, with why.
    Refused(String),
    /// It may work later: retried after the backoff, with why.
    Failed(String),
}

impl Delivery {
    /// A gRPC failure (`code` as `tonic::Code` numbers it): refused for good when
    /// retrying cannot help ([`is_permanent`]), failed for now otherwise.
    pub fn from_failure(code: i32, message: &str) -> Self {
        if is_permanent(code) {
            Self::Refused(message.to_owned())
        } else {
            Self::Failed(message.to_owned())
        }
    }
}

/// Delivers the rows due at `now_us()` once, oldest first, through `deliver`, and books
/// each outcome: delivered, given up (logged at WARN, kept with why), or rescheduled
/// after the backoff. Each row is claimed (see the module doc) just before its call, so
/// replicas running this at the same time send each row once, and a claim covers one
/// call, not a batch. Returns how many were delivered.
pub async fn deliver_due<F, Fut>(
    db: &impl ConnectionTrait,
    now_us: impl Fn() -> i64,
    limit: u64,
    mut deliver: F,
) -> Result<u64, DbErr>
where
    F: FnMut(OutboxRow) -> Fut,
    Fut: std::future::Future<Output = Delivery>,
{
    let claim_for_us = micros(CLAIM_TIMEOUT);
    let mut delivered = 0;
    for _ in 0..limit {
        let Some(row) = claim_next(db, now_us(), claim_for_us).await? else {
            break;
        };
        let (id, key, kind) = (
            row.id.clone(),
            row.idempotency_key.clone(),
            row.kind.clone(),
        );
        let outcome = tokio::time::timeout(DELIVERY_DEADLINE, deliver(row.clone()))
            .await
            .unwrap_or_else(|_| Delivery::Failed("no answer within the delivery deadline".into()));
        match outcome {
            Delivery::Delivered => {
                mark_delivered(db, &id, now_us()).await?;
                delivered += 1;
            }
            Delivery::Refused(why) => {
                tracing::warn!(%kind, %key, reason = %why, "outbox call refused for good; given up");
                give_up(db, &id, now_us(), &why).await?;
            }
            Delivery::Failed(why) => {
                tracing::debug!(%kind, %key, reason = %why, "outbox call not delivered yet");
                delivery_failed(db, &row, now_us(), &why).await?;
            }
        }
    }
    Ok(delivered)
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// Whether a callee's refusal is final: retrying the same request can never succeed.
pub fn is_permanent(code: i32) -> bool {
    // tonic::Code values, without depending on tonic here: InvalidArgument (3), NotFound
    // (5), PermissionDenied (7), FailedPrecondition (9), Unimplemented (12).
    matches!(code, 3 | 5 | 7 | 9 | 12)
}
