//! Lifecycle webhook deliveries: written in the transaction of the run's change, so an
//! event the run store decided is never lost, and claimed per endpoint by the delivery
//! loop (`crate::webhooks`) with a lease, as the outbox is (`runplane_db::outbox`).

use sea_orm::sea_query::{Expr, LockBehavior, LockType, OnConflict, Query};
use sea_orm::{
    ColumnTrait, DatabaseTransaction, EntityTrait, IntoActiveModel, Order, QueryFilter, QueryOrder,
    QuerySelect,
};

use super::Store;
use super::entities::run;
use crate::domain::webhook::{self, RunFacts};
use crate::error::RunStoreError;

type Result<T> = std::result::Result<T, RunStoreError>;

pub mod delivery {
    use sea_orm::entity::prelude::*;

    /// One event owed to one endpoint.
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "webhook_deliveries")]
    pub struct Model {
        /// The `webhook-id` sent on every attempt.
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: String,
        pub endpoint_id: String,
        pub run_id: String,
        pub org_id: String,
        pub event_type: String,
        /// The JSON body, fixed when the event happened.
        pub body: String,
        pub created_at_us: i64,
        /// Not before then: after a failed attempt, the end of its backoff; while a
        /// replica delivers it, the end of that replica's claim.
        pub next_attempt_at_us: i64,
        pub attempts: i32,
        /// The HTTP status of the last attempt that got one.
        pub last_status: Option<i32>,
        /// Why the last attempt failed; empty once one succeeded.
        pub last_error: String,
        /// When the last attempt was booked.
        pub last_attempt_at_us: Option<i64>,
        pub delivered_at_us: Option<i64>,
        pub given_up_at_us: Option<i64>,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub use delivery::Model as Delivery;

/// How one attempt ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    /// The endpoint answered 2xx.
    Delivered { status: u16 },
    /// Anything else: a status, a refused connection, a timeout; `status` when one came.
    Failed { status: Option<u16>, error: String },
}

/// What `runplane webhooks` shows of one endpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EndpointStats {
    pub pending: u64,
    pub delivered: u64,
    pub given_up: u64,
    pub last_delivered_at_us: Option<i64>,
    pub last_failed_at_us: Option<i64>,
    pub last_error: String,
}

impl Store {
    /// Owes `event` of `run` (as it is after the change) to every endpoint whose filters
    /// take it, in the caller's transaction. The same event written twice is owed once.
    pub(super) async fn owe_webhooks(
        &self,
        txn: &DatabaseTransaction,
        run: &run::Model,
        event: &str,
        now_us: i64,
    ) -> Result<()> {
        self.owe_webhooks_of(txn, run, event, now_us, None).await
    }

    /// [`Store::owe_webhooks`] for an event a run can have more than once (a pause, a
    /// resume, a wait for input): `occurrence` (the time it began) tells them apart, so
    /// each is owed once.
    pub(super) async fn owe_webhooks_of(
        &self,
        txn: &DatabaseTransaction,
        run: &run::Model,
        event: &str,
        now_us: i64,
        occurrence: Option<i64>,
    ) -> Result<()> {
        let endpoints: Vec<&str> = self.webhooks.matching(event, &run.org_id).collect();
        if endpoints.is_empty() {
            return Ok(());
        }
        let facts = RunFacts {
            run_id: &run.id,
            org_id: &run.org_id,
            lead_id: &run.lead_id,
            labels: serde_json::from_str(&run.labels).unwrap_or_default(),
            state: run.state,
            verdict: run.verdict(),
        };
        let body = webhook::body(event, now_us, &facts);
        let rows = endpoints.into_iter().map(|endpoint| {
            Delivery {
                id: match occurrence {
                    None => webhook::message_id(endpoint, &run.id, event),
                    Some(at) => webhook::message_id(endpoint, &run.id, &format!("{event}@{at}")),
                },
                endpoint_id: endpoint.to_owned(),
                run_id: run.id.clone(),
                org_id: run.org_id.clone(),
                event_type: event.to_owned(),
                body: body.clone(),
                created_at_us: now_us,
                next_attempt_at_us: now_us,
                attempts: 0,
                last_status: None,
                last_error: String::new(),
                last_attempt_at_us: None,
                delivered_at_us: None,
                given_up_at_us: None,
            }
            .into_active_model()
        });
        delivery::Entity::insert_many(rows)
            .on_conflict(
                OnConflict::column(delivery::Column::Id)
                    .do_nothing()
                    .to_owned(),
            )
            .exec_without_returning(txn)
            .await?;
        Ok(())
    }

    /// Claims up to `limit` of `endpoint`'s due deliveries, oldest first, for
    /// `claim_for_us`: no other replica is handed them before then. On Postgres the rows
    /// are picked `FOR UPDATE SKIP LOCKED`, so two replicas claim different rows.
    pub async fn claim_webhooks(
        &self,
        endpoint: &str,
        limit: u64,
        claim_for_us: i64,
    ) -> Result<Vec<Delivery>> {
        use delivery::{Column, Entity};
        let now = self.now_us();
        let due = Query::select()
            .column(Column::Id)
            .from(Entity)
            .and_where(Column::EndpointId.eq(endpoint))
            .and_where(Column::DeliveredAtUs.is_null())
            .and_where(Column::GivenUpAtUs.is_null())
            .and_where(Column::NextAttemptAtUs.lte(now))
            .order_by(Column::CreatedAtUs, Order::Asc)
            .limit(limit)
            .lock_with_behavior(LockType::Update, LockBehavior::SkipLocked)
            .to_owned();
        let claim = Query::update()
            .table(Entity)
            .value(Column::NextAttemptAtUs, now + claim_for_us)
            .and_where(Column::Id.in_subquery(due))
            .returning_all()
            .to_owned();
        Ok(Entity::find()
            .from_raw_sql(self.db.get_database_backend().build(&claim))
            .all(&self.db)
            .await?)
    }

    /// Books how an attempt of the claimed `row` ended: delivered, due again after
    /// `retry_after_us`, or (past `give_up_at_us`, the event's time plus the retry
    /// window) given up. Only the claim this replica holds is replaced, so a claimant
    /// that outlived its claim cannot undo another replica's booking.
    pub async fn book_webhook(
        &self,
        row: &Delivery,
        attempt: &Attempt,
        retry_after_us: i64,
        give_up_at_us: i64,
    ) -> Result<()> {
        use delivery::{Column, Entity};
        let now = self.now_us();
        let update = Entity::update_many()
            .col_expr(Column::Attempts, Expr::value(row.attempts + 1))
            .col_expr(Column::LastAttemptAtUs, Expr::value(now))
            .filter(Column::Id.eq(row.id.as_str()))
            .filter(Column::NextAttemptAtUs.eq(row.next_attempt_at_us))
            .filter(Column::DeliveredAtUs.is_null())
            .filter(Column::GivenUpAtUs.is_null());
        let update = match attempt {
            Attempt::Delivered { status } => update
                .col_expr(Column::LastStatus, Expr::value(i32::from(*status)))
                .col_expr(Column::LastError, Expr::value(""))
                .col_expr(Column::DeliveredAtUs, Expr::value(now)),
            Attempt::Failed { status, error } => {
                let update = update
                    .col_expr(Column::LastStatus, Expr::value(status.map(i32::from)))
                    .col_expr(
                        Column::LastError,
                        Expr::value(runplane_db::outbox::bounded(error)),
                    );
                if now + retry_after_us > give_up_at_us {
                    update.col_expr(Column::GivenUpAtUs, Expr::value(now))
                } else {
                    update.col_expr(Column::NextAttemptAtUs, Expr::value(now + retry_after_us))
                }
            }
        };
        update.exec(&self.db).await?;
        Ok(())
    }

    /// Each endpoint's counts and last outcomes, over the deliveries still kept.
    pub async fn webhook_stats(&self, endpoint: &str) -> Result<EndpointStats> {
        use delivery::{Column, Entity};
        let count = |filter: sea_orm::Condition| {
            Entity::find()
                .filter(Column::EndpointId.eq(endpoint))
                .filter(filter)
                .count(&self.db)
        };
        use sea_orm::{Condition, PaginatorTrait};
        let pending = count(
            Condition::all()
                .add(Column::DeliveredAtUs.is_null())
                .add(Column::GivenUpAtUs.is_null()),
        )
        .await?;
        let delivered = count(Condition::all().add(Column::DeliveredAtUs.is_not_null())).await?;
        let given_up = count(Condition::all().add(Column::GivenUpAtUs.is_not_null())).await?;
        let last_delivered_at_us: Option<Option<i64>> = Entity::find()
            .select_only()
            .column_as(Column::DeliveredAtUs.max(), "at")
            .filter(Column::EndpointId.eq(endpoint))
            .into_tuple()
            .one(&self.db)
            .await?;
        let last_failure = Entity::find()
            .filter(Column::EndpointId.eq(endpoint))
            .filter(Column::LastError.ne(""))
            .order_by(Column::LastAttemptAtUs, Order::Desc)
            .one(&self.db)
            .await?;
        Ok(EndpointStats {
            pending,
            delivered,
            given_up,
            last_delivered_at_us: last_delivered_at_us.flatten(),
            last_failed_at_us: last_failure.as_ref().and_then(|d| d.last_attempt_at_us),
            last_error: last_failure.map(|d| d.last_error).unwrap_or_default(),
        })
    }

    /// Deletes up to `limit` deliveries settled before `before_us`, and those of
    /// endpoints no longer configured (`keep`), so the table holds about one retry
    /// window of events. Returns how many.
    pub async fn prune_webhooks(&self, keep: &[&str], before_us: i64, limit: u64) -> Result<u64> {
        use delivery::{Column, Entity};
        use sea_orm::Condition;
        let ids: Vec<String> = Entity::find()
            .select_only()
            .column(Column::Id)
            .filter(
                Condition::any()
                    .add(Column::DeliveredAtUs.lt(before_us))
                    .add(Column::GivenUpAtUs.lt(before_us))
                    .add(Column::EndpointId.is_not_in(keep.iter().copied())),
            )
            .limit(limit)
            .into_tuple()
            .all(&self.db)
            .await?;
        if ids.is_empty() {
            return Ok(0);
        }
        Ok(Entity::delete_many()
            .filter(Column::Id.is_in(ids))
            .exec(&self.db)
            .await?
            .rows_affected)
    }

    /// Every delivery of `run_id`, oldest first (tests).
    pub async fn webhook_deliveries(&self, run_id: &str) -> Result<Vec<Delivery>> {
        use delivery::{Column, Entity};
        Ok(Entity::find()
            .filter(Column::RunId.eq(run_id))
            .order_by(Column::CreatedAtUs, Order::Asc)
            .all(&self.db)
            .await?)
    }
}
