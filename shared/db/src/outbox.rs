//! The transactional outbox every service uses for calls it owes another service.
//!
//! A call that must not be lost (a FailRun, a turn failure to classify, a backend-error
//! outcome) is written as a row in the same transaction as the decision that owes it,
//! keyed so a second decision for the same thing is a no-op, and delivered with that key
//! until the callee answers. The callee dedupes on the key, so a delivery that was
//! processed but whose answer was lost is simply delivered again.

use sea_orm::sea_query::{Alias, ColumnDef, Expr, OnConflict, Table, TableCreateStatement};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DbErr, EntityTrait, IntoActiveModel, Order, QueryFilter,
    QueryOrder, QuerySelect,
};

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

/// Undelivered rows due at `now_us`, oldest first.
pub async fn due(
    db: &impl ConnectionTrait,
    now_us: i64,
    limit: u64,
) -> Result<Vec<OutboxRow>, DbErr> {
    entity::Entity::find()
        .filter(entity::Column::DeliveredAtUs.is_null())
        .filter(entity::Column::NextAttemptAtUs.lte(now_us))
        .order_by(entity::Column::CreatedAtUs, Order::Asc)
        .limit(limit)
        .all(db)
        .await
}

/// Every row, oldest first (tests and operators' inspection).
pub async fn all(db: &impl ConnectionTrait) -> Result<Vec<OutboxRow>, DbErr> {
    entity::Entity::find()
        .order_by(entity::Column::CreatedAtUs, Order::Asc)
        .all(db)
        .await
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
/// the row's attempts so far (1 s doubling to 60 s).
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
        .exec(db)
        .await?;
    Ok(())
}

/// 1 s doubling to 60 s: a callee that is down for a deploy is retried within a second
/// of its return, one that is down for long is not hammered.
pub fn retry_backoff_us(attempts: i32) -> i64 {
    (1_000_000i64 << attempts.clamp(0, 6)).min(60_000_000)
}

fn bounded(error: &str) -> String {
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
/// after the backoff. Returns how many were delivered.
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
    let mut delivered = 0;
    for row in due(db, now_us(), limit).await? {
        let (id, key, kind) = (
            row.id.clone(),
            row.idempotency_key.clone(),
            row.kind.clone(),
        );
        match deliver(row.clone()).await {
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

/// Whether a callee's refusal is final: retrying the same request can never succeed.
pub fn is_permanent(code: i32) -> bool {
    // tonic::Code values, without depending on tonic here: InvalidArgument (3), NotFound
    // (5), PermissionDenied (7), FailedPrecondition (9), Unimplemented (12).
    matches!(code, 3 | 5 | 7 | 9 | 12)
}
