//! The reconciler's persistence.
//!
//! What we persist and why:
//! - `sandboxes`: intent and observation of each sandbox. `execution_generation` is bumped
//!   before any new execution; `loss_observed_at_us` is the first unconfirmed loss
//!   observation. Every write the tick makes is a compare-and-set on the values it read.
//!   `deleted` is final; a deleted row whose `observed_status` is not `deleted` yet still
//!   owes a stop of its process (by its node, or by this reconciler for local ones), so a
//!   crash between the deletion and the stop cannot leave the process running.
//! - `route_identities`: which node serves a direct sandbox's sessions; read only while
//!   the sandbox has an `active_node_id` (see `domain::placement`).
//! - `nodes`: registered node agents and their endpoints; `fenced_at_us` (0: not fenced)
//!   marks a node whose credentials were all revoked: it gets no placement until it
//!   registers again with a new credential (see `fence`).
//! - `node_credentials`: node agents' own bearer credentials, one node id each, kept as
//!   the SHA-256 of the secret; revoked rows stay (revoked_at_us) for the listing.
//! - `wakes`: restore requests, at most one open per sandbox (a partial unique index).
//! - `outbox`: calls to other services decided in a transaction here (failing a run),
//!   delivered with an idempotency key until the callee answers.

pub mod entities;
mod fence;
pub mod migration;
pub mod node_credentials;
pub mod nodes;
mod pause;

use runplane_clock::SharedClock;
use sea_orm::sea_query::{Expr, Order};
use sea_orm::{
    ColumnTrait, DatabaseConnection, DbErr, EntityTrait, IntoActiveModel, QueryFilter, QueryOrder,
    QuerySelect, SqlErr, TransactionTrait,
};

pub use migration::Migrator;

use crate::domain::sandbox::Substrate;
use crate::domain::status::SandboxStatus;
use crate::error::ReconcilerError;
use entities::{node, outbox, route_identity, sandbox, wake};

type Result<T> = std::result::Result<T, ReconcilerError>;

/// Statuses a sandbox can still leave on its own; only these are probed, stamped or
/// failed.
pub const LIVE: [SandboxStatus; 4] = SandboxStatus::LIVE;

/// Statuses of a sandbox that runs, or is about to, on the node it is placed on: what a
/// node's capacity is weighed against (a suspended one is parked there, not running).
pub const PLACED: [SandboxStatus; 3] = SandboxStatus::PLACED;

/// Writes `row` as its sandbox's route identity (replacing the one it had), on `db` or in
/// a caller's transaction.
async fn upsert_route_identity(
    db: &impl sea_orm::ConnectionTrait,
    row: route_identity::Model,
) -> Result<()> {
    route_identity::Entity::insert(row.into_active_model())
        .on_conflict(
            sea_orm::sea_query::OnConflict::column(route_identity::Column::SandboxId)
                .update_columns([
                    route_identity::Column::CurrentNodeId,
                    route_identity::Column::ExecutionGeneration,
                ])
                .to_owned(),
        )
        .exec_without_returning(db)
        .await?;
    Ok(())
}

/// What [`Store::place_within_capacity`] did.
#[derive(Debug)]
pub enum Placed {
    /// Placed now.
    New(sandbox::Model),
    /// The request's sandbox already existed (a replay, or another replica placed it).
    Existing(sandbox::Model),
    /// The node has no room (or was fenced: it takes nothing).
    Full,
}

/// The row of a new direct sandbox in `creating`, at generation 1.
fn new_direct_sandbox(new: NewSandbox, now: i64) -> sandbox::Model {
    let NewSandbox {
        client_request_id,
        run_id,
        org_id,
        node_id,
        idle_timeout_ms,
        network,
        limits,
        image,
        traceparent,
        attempt,
    } = new;
    sandbox::Model {
        id: uuid::Uuid::new_v4().to_string(),
        client_request_id,
        run_id,
        org_id,
        substrate: Substrate::DIRECT.into(),
        status: SandboxStatus::Creating,
        active_node_id: Some(node_id),
        execution_generation: 1,
        loss_observed_at_us: None,
        idle_timeout_ms,
        exit_code: None,
        driver_handle: String::new(),
        observation_seq: 0,
        observed_status: String::new(),
        created_at_us: now,
        updated_at_us: now,
        traceparent,
        network,
        limits,
        image,
        paused: 0,
        attempt: i64::from(attempt),
    }
}

/// The final status: destroyed. Its `observed_status` becomes `deleted` too once the
/// process is known to be stopped.
pub const DELETED: SandboxStatus = SandboxStatus::Deleted;

/// A wake's `last_error` when its sandbox ended before it was restored.
pub const WAKE_SANDBOX_ENDED: &str = "the sandbox ended before it was restored";

/// A wake's `last_error` when the node holding its sandbox reported the process gone
/// (a restore found it exited or missing); the loss grace ends the sandbox.
pub const WAKE_GONE_ON_HOLDER: &str =
    "the node holding the sandbox found its process gone; the loss grace ends it";

/// A wake's `last_error` when no node holds its (direct) sandbox's execution, so no node
/// can restore it; the loss grace ends the sandbox.
pub const WAKE_NO_HOLDER: &str = "no node holds this sandbox's execution to restore it";

/// A placed sandbox's serving node, as the one placement query reads it.
#[derive(Debug, Clone)]
pub struct Placement {
    pub sandbox: sandbox::Model,
    /// The route identity, joined only while `active_node_id` is set.
    pub route: Option<route_identity::Model>,
    /// The serving node's row, when the sandbox is placed and the node is registered.
    pub node: Option<node::Model>,
}

#[derive(Debug, Clone)]
pub struct Store {
    pub(crate) db: DatabaseConnection,
    clock: SharedClock,
}

/// What a new sandbox is made of ([`Store::create_placed`]).
#[derive(Debug, Clone)]
pub struct NewSandbox {
    /// The dedupe key: a replay returns the row the first call wrote.
    pub client_request_id: String,
    pub run_id: String,
    pub org_id: String,
    /// Where it is placed.
    pub node_id: String,
    pub idle_timeout_ms: i64,
    /// `none` for no network, empty for the deployment's ([`sandbox::Model::network`]).
    pub network: String,
    /// The profile's own limits, empty for the deployment's ([`sandbox::Model::limits`]).
    pub limits: String,
    /// The profile's own image, empty for the deployment's ([`sandbox::Model::image`]).
    pub image: String,
    /// The run's trace.
    pub traceparent: String,
    /// The attempt of the run it is made for (1, 2, …).
    pub attempt: u32,
}

/// How a live sandbox ends ([`Store::end_live`]): its final status (exited or lost), the
/// exit code its driver recorded, and the FailRun owed to its run.
#[derive(Debug, Clone)]
pub struct Ending {
    pub final_status: SandboxStatus,
    pub exit_code: Option<i32>,
    pub fail_run: outbox::Model,
}

/// What one [`Store::prune`] deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pruned {
    pub sandboxes: u64,
    pub wakes: u64,
    pub outbox: u64,
}

impl Store {
    pub fn new(db: DatabaseConnection, clock: SharedClock) -> Self {
        Self { db, clock }
    }

    pub fn database(&self) -> &DatabaseConnection {
        &self.db
    }

    pub fn now_us(&self) -> i64 {
        self.clock.now_us()
    }

    /// Heartbeats at or after this instant make a node ready; older ones, silent.
    pub fn silent_since(&self) -> i64 {
        self.now_us() - crate::domain::placement::NODE_SILENCE.as_micros() as i64
    }

    /// A new sandbox of `new.run_id` in `creating` on `new.node_id`, keyed by `client_request_id`
    /// (a replay returns the row the first call wrote). A sandbox placed on a node agent
    /// gets its route identity now; a local one is routed by the local loop.
    pub async fn create_placed(&self, new: NewSandbox) -> Result<sandbox::Model> {
        let row = self
            .insert_sandbox(new_direct_sandbox(new, self.now_us()))
            .await?;
        if let Some(node) = row
            .active_node_id
            .as_ref()
            .filter(|n| n.as_str() != crate::domain::placement::LOCAL_NODE)
        {
            self.set_route_identity(route_identity::Model {
                sandbox_id: row.id.clone(),
                current_node_id: node.clone(),
                execution_generation: row.execution_generation,
            })
            .await?;
        }
        Ok(row)
    }

    /// [`Store::create_placed`] on node agent `new.node_id` only while it has room: fewer
    /// than `capacity` sandboxes placed there (creating, started or restoring). The node's
    /// row is locked while it counts and inserts, so reconciler replicas placing on one
    /// node at once never put more on it than its capacity.
    pub async fn place_within_capacity(&self, new: NewSandbox, capacity: i64) -> Result<Placed> {
        if let Some(existing) = self.sandbox_for_request(&new.client_request_id).await? {
            return Ok(Placed::Existing(existing));
        }
        let node_id = new.node_id.clone();
        let txn = runplane_db::write_tx(&self.db).await?;
        let node = node::Entity::find_by_id(node_id.clone())
            .lock_exclusive()
            .one(&txn)
            .await?;
        // Fenced since dispatch read it as ready: the fence holds this lock while it ends
        // the node's sandboxes, so nothing is placed on it after.
        if node.is_some_and(|n| n.is_fenced()) {
            txn.rollback().await?;
            return Ok(Placed::Full);
        }
        let placed = sea_orm::PaginatorTrait::count(
            sandbox::Entity::find()
                .filter(sandbox::Column::ActiveNodeId.eq(node_id.as_str()))
                .filter(sandbox::Column::Status.is_in(PLACED)),
            &txn,
        )
        .await?;
        if placed as i64 >= capacity {
            txn.rollback().await?;
            return Ok(Placed::Full);
        }
        let row = new_direct_sandbox(new, self.now_us());
        let inserted = sandbox::Entity::insert(row.clone().into_active_model())
            .exec_without_returning(&txn)
            .await;
        match inserted {
            Ok(_) => {}
            // Placed by a concurrent call meanwhile: that one is the sandbox.
            Err(e) if matches!(e.sql_err(), Some(SqlErr::UniqueConstraintViolation(_))) => {
                txn.rollback().await?;
                return self
                    .sandbox_for_request(&row.client_request_id)
                    .await?
                    .map(Placed::Existing)
                    .ok_or(ReconcilerError::Storage(e));
            }
            Err(e) => return Err(e.into()),
        }
        upsert_route_identity(
            &txn,
            route_identity::Model {
                sandbox_id: row.id.clone(),
                current_node_id: node_id,
                execution_generation: row.execution_generation,
            },
        )
        .await?;
        txn.commit().await?;
        Ok(Placed::New(row))
    }

    pub async fn insert_sandbox(&self, row: sandbox::Model) -> Result<sandbox::Model> {
        match sandbox::Entity::insert(row.clone().into_active_model())
            .exec_without_returning(&self.db)
            .await
        {
            Ok(_) => Ok(row),
            Err(e) if matches!(e.sql_err(), Some(SqlErr::UniqueConstraintViolation(_))) => self
                .sandbox_for_request(&row.client_request_id)
                .await?
                .ok_or(ReconcilerError::Storage(e)),
            Err(e) => Err(e.into()),
        }
    }

    /// The sandbox created for `client_request_id`, if there is one.
    pub async fn sandbox_for_request(
        &self,
        client_request_id: &str,
    ) -> Result<Option<sandbox::Model>> {
        Ok(sandbox::Entity::find()
            .filter(sandbox::Column::ClientRequestId.eq(client_request_id))
            .one(&self.db)
            .await?)
    }

    pub async fn sandbox(&self, id: &str) -> Result<sandbox::Model> {
        sandbox::Entity::find_by_id(id.to_owned())
            .one(&self.db)
            .await?
            .ok_or_else(|| ReconcilerError::SandboxNotFound { id: id.to_owned() })
    }

    /// Sandboxes by id order after `after`, filtered by run and by active node.
    pub async fn list_sandboxes(
        &self,
        run_id: Option<&str>,
        node_id: Option<&str>,
        after: Option<&str>,
        limit: u64,
    ) -> Result<Vec<sandbox::Model>> {
        let mut query = sandbox::Entity::find();
        if let Some(run) = run_id {
            query = query.filter(sandbox::Column::RunId.eq(run));
        }
        if let Some(node) = node_id {
            query = query.filter(sandbox::Column::ActiveNodeId.eq(node));
        }
        if let Some(after) = after {
            query = query.filter(sandbox::Column::Id.gt(after));
        }
        Ok(query
            .order_by(sandbox::Column::Id, Order::Asc)
            .limit(limit)
            .all(&self.db)
            .await?)
    }

    /// The one placement query every placement read goes through.
    pub async fn placement(&self, id: &str) -> Result<Placement> {
        let sandbox = self.sandbox(id).await?;
        let route = match (
            &sandbox.active_node_id,
            Substrate::named(&sandbox.substrate),
        ) {
            (Some(_), Substrate::Direct) => {
                route_identity::Entity::find_by_id(id.to_owned())
                    .one(&self.db)
                    .await?
            }
            _ => None,
        };
        let node = match crate::domain::placement::serving_node(
            &sandbox.placement(),
            route.as_ref().map(route_identity::Model::identity),
        ) {
            Some(node_id) => node::Entity::find_by_id(node_id).one(&self.db).await?,
            None => None,
        };
        Ok(Placement {
            sandbox,
            route,
            node,
        })
    }

    pub async fn upsert_node(&self, row: node::Model) -> Result<()> {
        node::Entity::insert(row.into_active_model())
            .on_conflict(
                sea_orm::sea_query::OnConflict::column(node::Column::Id)
                    .update_columns([
                        node::Column::Endpoint,
                        node::Column::Capacity,
                        node::Column::LastHeartbeatUs,
                    ])
                    .to_owned(),
            )
            .exec_without_returning(&self.db)
            .await?;
        Ok(())
    }

    /// Writes a route identity (what a node's start or restore writes with placement).
    pub async fn set_route_identity(&self, row: route_identity::Model) -> Result<()> {
        upsert_route_identity(&self.db, row).await
    }

    /// Sets status and placement, compare-and-set on the generation (what a node's
    /// publication writes; an idle suspend publishes `suspended` with no node).
    pub async fn publish(
        &self,
        id: &str,
        generation: i64,
        status: &str,
        active_node_id: Option<&str>,
    ) -> Result<bool> {
        let done = sandbox::Entity::update_many()
            .col_expr(sandbox::Column::Status, Expr::value(status))
            .col_expr(
                sandbox::Column::ActiveNodeId,
                Expr::value(active_node_id.map(str::to_owned)),
            )
            .col_expr(sandbox::Column::UpdatedAtUs, Expr::value(self.now_us()))
            .filter(sandbox::Column::Id.eq(id))
            .filter(sandbox::Column::ExecutionGeneration.eq(generation))
            .exec(&self.db)
            .await?;
        Ok(done.rows_affected == 1)
    }

    /// The open wake of `sandbox_id`, queued now if there is none (one per sandbox).
    /// An ended sandbox gets none (SANDBOX_ENDED): the insert is made under a guarded
    /// write on the sandbox row, so it either lands before a deletion (whose transaction
    /// then settles it) or sees the deletion and refuses.
    pub async fn queue_wake(&self, sandbox_id: &str, reason: &str) -> Result<wake::Model> {
        Ok(self.queue_wake_once(sandbox_id, reason).await?.0)
    }

    /// [`Store::queue_wake`], saying whether this call queued it (`true`) or found it
    /// open (queued before, or by a concurrent call).
    pub async fn queue_wake_once(
        &self,
        sandbox_id: &str,
        reason: &str,
    ) -> Result<(wake::Model, bool)> {
        if let Some(open) = self.open_wake(sandbox_id).await? {
            return Ok((open, false));
        }
        let txn = self.db.begin().await?;
        // Writes nothing new; takes the row's lock only while it has not ended.
        let live = sandbox::Entity::update_many()
            .col_expr(sandbox::Column::Status, Expr::col(sandbox::Column::Status))
            .filter(sandbox::Column::Id.eq(sandbox_id))
            .filter(sandbox::Column::Status.is_not_in(crate::domain::placement::ENDED))
            .exec(&txn)
            .await?;
        if live.rows_affected != 1 {
            txn.rollback().await?;
            let row = self.sandbox(sandbox_id).await?;
            return Err(ReconcilerError::SandboxEnded {
                id: row.id,
                status: row.status,
            });
        }
        let row = wake::Model {
            id: uuid::Uuid::new_v4().to_string(),
            sandbox_id: sandbox_id.to_owned(),
            state: "pending".into(),
            node_id: None,
            attempts: 0,
            last_error: String::new(),
            reason: reason.to_owned(),
            requested_at_us: self.now_us(),
            settled_at_us: None,
            not_before_us: self.requeue_not_before(&txn, sandbox_id).await?,
        };
        match wake::Entity::insert(row.clone().into_active_model())
            .exec_without_returning(&txn)
            .await
        {
            Ok(_) => {
                txn.commit().await?;
                Ok((row, true))
            }
            // A concurrent request queued it first.
            Err(e) if matches!(e.sql_err(), Some(SqlErr::UniqueConstraintViolation(_))) => {
                txn.rollback().await?;
                self.open_wake(sandbox_id)
                    .await?
                    .map(|open| (open, false))
                    .ok_or(ReconcilerError::Storage(e))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// When a new wake of `sandbox_id` may first be handed out: a while after its
    /// previous wake failed for good, so reattaching to a sandbox its holder cannot
    /// restore queues wakes that back off instead of restoring in a loop; `None` (at
    /// once) otherwise.
    async fn requeue_not_before(
        &self,
        db: &impl sea_orm::ConnectionTrait,
        sandbox_id: &str,
    ) -> Result<Option<i64>> {
        let last_failure = wake::Entity::find()
            .filter(wake::Column::SandboxId.eq(sandbox_id))
            .filter(wake::Column::State.eq("failed"))
            .order_by(wake::Column::SettledAtUs, Order::Desc)
            .one(db)
            .await?;
        let wait = crate::domain::wake::RESTORE_BACKOFF_CAP.as_micros() as i64;
        Ok(last_failure
            .and_then(|w| w.settled_at_us)
            .map(|settled| settled + wait)
            .filter(|due| *due > self.now_us()))
    }

    pub async fn open_wake(&self, sandbox_id: &str) -> Result<Option<wake::Model>> {
        Ok(wake::Entity::find()
            .filter(wake::Column::SandboxId.eq(sandbox_id))
            .filter(wake::Column::SettledAtUs.is_null())
            .one(&self.db)
            .await?)
    }

    /// Live sandboxes to probe, oldest first, after `after` (an id cursor), at most `limit`.
    pub async fn probe_candidates(
        &self,
        after: Option<&str>,
        limit: u64,
    ) -> Result<Vec<sandbox::Model>> {
        self.sandboxes_page(sandbox::Column::Status.is_in(LIVE), after, limit)
            .await
    }

    /// Started sandboxes this reconciler runs itself (node `local`), by id after `after`.
    pub async fn local_started(
        &self,
        after: Option<&str>,
        limit: u64,
    ) -> Result<Vec<sandbox::Model>> {
        self.sandboxes_page(
            sea_orm::Condition::all()
                .add(sandbox::Column::Status.eq(SandboxStatus::Started))
                .add(sandbox::Column::ActiveNodeId.eq(crate::domain::placement::LOCAL_NODE)),
            after,
            limit,
        )
        .await
    }

    /// The sandboxes `filter` selects, by id after `after`, at most `limit`.
    async fn sandboxes_page(
        &self,
        filter: impl sea_orm::sea_query::IntoCondition,
        after: Option<&str>,
        limit: u64,
    ) -> Result<Vec<sandbox::Model>> {
        let mut query = sandbox::Entity::find().filter(filter);
        if let Some(after) = after {
            query = query.filter(sandbox::Column::Id.gt(after));
        }
        Ok(query
            .order_by(sandbox::Column::Id, Order::Asc)
            .limit(limit)
            .all(&self.db)
            .await?)
    }

    /// The sandbox `id` at `generation`, while it is live.
    fn live_guard(id: &str, generation: i64) -> sea_orm::Condition {
        sea_orm::Condition::all()
            .add(sandbox::Column::Id.eq(id))
            .add(sandbox::Column::ExecutionGeneration.eq(generation))
            .add(sandbox::Column::Status.is_in(LIVE))
    }

    /// [`Store::live_guard`] with the loss stamp the tick read.
    fn loss_guard(id: &str, generation: i64, read_stamp: Option<i64>) -> sea_orm::Condition {
        let stamp = match read_stamp {
            None => sandbox::Column::LossObservedAtUs.is_null(),
            Some(s) => sandbox::Column::LossObservedAtUs.eq(s),
        };
        Self::live_guard(id, generation).add(stamp)
    }

    /// Stamps the first loss observation, compare-and-set against the stamp the tick read
    /// (none, or a corrupt one being replaced) and guarded to live statuses.
    pub async fn stamp_loss(
        &self,
        id: &str,
        generation: i64,
        read_stamp: Option<i64>,
        now_us: i64,
    ) -> Result<bool> {
        let done = sandbox::Entity::update_many()
            .col_expr(sandbox::Column::LossObservedAtUs, Expr::value(now_us))
            .col_expr(sandbox::Column::UpdatedAtUs, Expr::value(now_us))
            .filter(Self::loss_guard(id, generation, read_stamp))
            .exec(&self.db)
            .await?;
        Ok(done.rows_affected == 1)
    }

    /// Clears a stamp the tick read, only if it is still that stamp: a stale snapshot
    /// cannot delete a stamp written after it was read.
    pub async fn clear_loss(&self, id: &str, generation: i64, read_stamp: i64) -> Result<bool> {
        let done = sandbox::Entity::update_many()
            .col_expr(
                sandbox::Column::LossObservedAtUs,
                Expr::value(Option::<i64>::None),
            )
            .col_expr(sandbox::Column::UpdatedAtUs, Expr::value(self.now_us()))
            .filter(Self::loss_guard(id, generation, Some(read_stamp)))
            .exec(&self.db)
            .await?;
        Ok(done.rows_affected == 1)
    }

    /// Confirms a loss that outlived the grace, or an exit that is certain at once: one
    /// compare-and-set on the stamp the tick read (none, for an exit seen first), and the
    /// FailRun for the run store in the same transaction. Only the winner gets `true` (and
    /// its outbox row).
    pub async fn confirm_loss(
        &self,
        row: &sandbox::Model,
        read_stamp: Option<i64>,
        final_status: SandboxStatus,
        exit_code: Option<i32>,
        fail_run: outbox::Model,
    ) -> Result<bool> {
        let txn = self.db.begin().await?;
        let ended = Ending {
            final_status,
            exit_code,
            fail_run,
        };
        let guard = Self::loss_guard(&row.id, row.execution_generation, read_stamp);
        if !Self::end_live(&txn, &row.id, guard, ended, self.now_us()).await? {
            txn.rollback().await?;
            return Ok(false);
        }
        txn.commit().await?;
        Ok(true)
    }

    /// The one way a live sandbox ends as exited or lost, whoever established it (the
    /// tick, a node's fence): the row `guard` selects (a compare-and-set on what its
    /// caller read, always within [`Store::live_guard`]) takes its final status, the
    /// FailRun owed for it joins the outbox and its open wakes are settled, all in `db`'s
    /// transaction. `false`, with nothing written, when the guard no longer holds: another
    /// replica's tick or fence ended it first, so its attempt ends once.
    pub(crate) async fn end_live(
        db: &impl sea_orm::ConnectionTrait,
        id: &str,
        guard: sea_orm::Condition,
        ended: Ending,
        now_us: i64,
    ) -> Result<bool> {
        let done = sandbox::Entity::update_many()
            .col_expr(sandbox::Column::Status, Expr::value(ended.final_status))
            .col_expr(sandbox::Column::ExitCode, Expr::value(ended.exit_code))
            .col_expr(sandbox::Column::UpdatedAtUs, Expr::value(now_us))
            .filter(guard)
            .exec(db)
            .await?;
        if done.rows_affected != 1 {
            return Ok(false);
        }
        outbox::Entity::insert(ended.fail_run.into_active_model())
            .exec_without_returning(db)
            .await?;
        // Nothing restores a sandbox whose loss is confirmed.
        Self::settle_wakes_of_ended(db, id, now_us).await?;
        Ok(true)
    }

    /// Sandboxes decided but not started yet, oldest first.
    pub async fn creating(&self, limit: u64) -> Result<Vec<sandbox::Model>> {
        Ok(sandbox::Entity::find()
            .filter(sandbox::Column::Status.eq(SandboxStatus::Creating))
            .order_by(sandbox::Column::CreatedAtUs, Order::Asc)
            .limit(limit)
            .all(&self.db)
            .await?)
    }

    /// Records a started sandbox's handle: creating → started, compare-and-set on the
    /// generation.
    pub async fn mark_started(&self, id: &str, generation: i64, handle: &str) -> Result<bool> {
        let done = sandbox::Entity::update_many()
            .col_expr(sandbox::Column::Status, Expr::value(SandboxStatus::Started))
            .col_expr(sandbox::Column::DriverHandle, Expr::value(handle))
            .col_expr(sandbox::Column::UpdatedAtUs, Expr::value(self.now_us()))
            .filter(sandbox::Column::Id.eq(id))
            .filter(sandbox::Column::ExecutionGeneration.eq(generation))
            .filter(sandbox::Column::Status.eq(SandboxStatus::Creating))
            .exec(&self.db)
            .await?;
        Ok(done.rows_affected == 1)
    }

    /// A live sandbox of `run_id`, if one exists.
    pub async fn live_sandbox_of(&self, run_id: &str) -> Result<Option<sandbox::Model>> {
        Ok(sandbox::Entity::find()
            .filter(sandbox::Column::RunId.eq(run_id))
            .filter(sandbox::Column::Status.is_in(LIVE))
            .one(&self.db)
            .await?)
    }

    /// Ends a sandbox for good: deleted, compare-and-set on the generation it was read at,
    /// and its open wakes settled failed in the same transaction, so no node restores
    /// what was destroyed. Only the call that deleted it gets `true`. Stopping its process
    /// is owed from then on (see [`Store::destroys_owed`]).
    pub async fn mark_deleted(&self, id: &str, generation: i64) -> Result<bool> {
        let txn = self.db.begin().await?;
        let now = self.now_us();
        let done = sandbox::Entity::update_many()
            .col_expr(sandbox::Column::Status, Expr::value(DELETED))
            .col_expr(sandbox::Column::UpdatedAtUs, Expr::value(now))
            .filter(sandbox::Column::Id.eq(id))
            .filter(sandbox::Column::ExecutionGeneration.eq(generation))
            .filter(sandbox::Column::Status.ne(DELETED))
            .exec(&txn)
            .await?;
        if done.rows_affected != 1 {
            txn.rollback().await?;
            return Ok(false);
        }
        Self::settle_wakes_of_ended(&txn, id, now).await?;
        txn.commit().await?;
        Ok(true)
    }

    /// Settles every open wake of `sandbox_id` (which has ended) as failed.
    pub(crate) async fn settle_wakes_of_ended(
        db: &impl sea_orm::ConnectionTrait,
        sandbox_id: &str,
        now_us: i64,
    ) -> Result<u64> {
        let done = wake::Entity::update_many()
            .col_expr(wake::Column::State, Expr::value("failed"))
            .col_expr(wake::Column::LastError, Expr::value(WAKE_SANDBOX_ENDED))
            .col_expr(wake::Column::SettledAtUs, Expr::value(now_us))
            .filter(wake::Column::SandboxId.eq(sandbox_id))
            .filter(wake::Column::SettledAtUs.is_null())
            .exec(db)
            .await?;
        Ok(done.rows_affected)
    }

    /// Sandboxes not deleted yet (whatever their status: creating, live, or an exit or
    /// loss already confirmed), by id after `after`, at most `limit`: what the sweep of
    /// terminal runs reads.
    pub async fn not_deleted(
        &self,
        after: Option<&str>,
        limit: u64,
    ) -> Result<Vec<sandbox::Model>> {
        self.sandboxes_page(sandbox::Column::Status.ne(DELETED), after, limit)
            .await
    }

    /// Sandboxes suspended and unplaced (parked for idleness), by id after `after`, at
    /// most `limit`: what the round reads to wake the ones whose run has a message
    /// waiting.
    pub async fn suspended_unplaced(
        &self,
        after: Option<&str>,
        limit: u64,
    ) -> Result<Vec<sandbox::Model>> {
        // A paused run's sandbox is not woken by a message: it waits for ResumeRun.
        let parked = sea_orm::Condition::all()
            .add(sandbox::Column::Status.eq(SandboxStatus::Suspended))
            .add(sandbox::Column::ActiveNodeId.is_null())
            .add(sandbox::Column::Paused.ne(sandbox::PAUSED));
        self.sandboxes_page(parked, after, limit).await
    }

    /// Deleted sandboxes whose process `node_id` still owes a stop: placed there when
    /// they were deleted, or suspended unplaced with a route identity naming it. A stop is
    /// owed until the node (or, for [`LOCAL_NODE`](crate::domain::placement::LOCAL_NODE), the
    /// reconciler) acknowledges it with [`Store::acknowledge_destroyed`].
    pub async fn destroys_owed(&self, node_id: &str, limit: u64) -> Result<Vec<sandbox::Model>> {
        use sea_orm::sea_query::Query;
        let routed_here = Query::select()
            .column(route_identity::Column::SandboxId)
            .from(route_identity::Entity)
            .and_where(route_identity::Column::CurrentNodeId.eq(node_id))
            .to_owned();
        Ok(sandbox::Entity::find()
            .filter(sandbox::Column::Status.eq(DELETED))
            .filter(sandbox::Column::ObservedStatus.ne(DELETED))
            .filter(
                sea_orm::Condition::any()
                    .add(sandbox::Column::ActiveNodeId.eq(node_id))
                    .add(
                        sea_orm::Condition::all()
                            .add(sandbox::Column::ActiveNodeId.is_null())
                            .add(sandbox::Column::Id.in_subquery(routed_here)),
                    ),
            )
            .order_by(sandbox::Column::Id, Order::Asc)
            .limit(limit)
            .all(&self.db)
            .await?)
    }

    /// Records that a deleted sandbox's process is stopped: nothing owes it a stop any
    /// more. Only a deleted row at `generation` is acknowledged.
    pub async fn acknowledge_destroyed(&self, id: &str, generation: i64) -> Result<bool> {
        self.acknowledge_destroyed_where(
            &self.db,
            sea_orm::Condition::all()
                .add(sandbox::Column::Id.eq(id))
                .add(sandbox::Column::ExecutionGeneration.eq(generation)),
        )
        .await
    }

    /// [`Store::acknowledge_destroyed`] of the row `which` selects (a node's
    /// acknowledgement adds its ownership to it).
    pub(crate) async fn acknowledge_destroyed_where(
        &self,
        db: &impl sea_orm::ConnectionTrait,
        which: sea_orm::Condition,
    ) -> Result<bool> {
        let done = sandbox::Entity::update_many()
            .col_expr(sandbox::Column::ObservedStatus, Expr::value(DELETED))
            .col_expr(sandbox::Column::UpdatedAtUs, Expr::value(self.now_us()))
            .filter(which)
            .filter(sandbox::Column::Status.eq(DELETED))
            .filter(sandbox::Column::ObservedStatus.ne(DELETED))
            .exec(db)
            .await?;
        Ok(done.rows_affected == 1)
    }

    /// Deletes, up to `limit` of each, what ended before `before_us`: deleted sandboxes
    /// whose stop was acknowledged (with their route identity and wakes), settled wakes,
    /// and delivered outbox rows. A sandbox still owed a stop is kept whatever its age.
    pub async fn prune(&self, before_us: i64, limit: u64) -> Result<Pruned> {
        let ids: Vec<String> = sandbox::Entity::find()
            .select_only()
            .column(sandbox::Column::Id)
            .filter(sandbox::Column::Status.eq(DELETED))
            .filter(sandbox::Column::ObservedStatus.eq(DELETED))
            .filter(sandbox::Column::UpdatedAtUs.lt(before_us))
            .limit(limit)
            .into_tuple()
            .all(&self.db)
            .await?;
        let mut pruned = Pruned::default();
        if !ids.is_empty() {
            let txn = self.db.begin().await?;
            wake::Entity::delete_many()
                .filter(wake::Column::SandboxId.is_in(ids.iter().cloned()))
                .exec(&txn)
                .await?;
            route_identity::Entity::delete_many()
                .filter(route_identity::Column::SandboxId.is_in(ids.iter().cloned()))
                .exec(&txn)
                .await?;
            pruned.sandboxes = sandbox::Entity::delete_many()
                .filter(sandbox::Column::Id.is_in(ids))
                .filter(sandbox::Column::Status.eq(DELETED))
                .filter(sandbox::Column::ObservedStatus.eq(DELETED))
                .exec(&txn)
                .await?
                .rows_affected;
            txn.commit().await?;
        }
        let settled: Vec<String> = wake::Entity::find()
            .select_only()
            .column(wake::Column::Id)
            .filter(wake::Column::SettledAtUs.lt(before_us))
            .limit(limit)
            .into_tuple()
            .all(&self.db)
            .await?;
        if !settled.is_empty() {
            pruned.wakes = wake::Entity::delete_many()
                .filter(wake::Column::Id.is_in(settled))
                .exec(&self.db)
                .await?
                .rows_affected;
        }
        pruned.outbox = runplane_db::outbox::prune_delivered(&self.db, before_us, limit).await?;
        Ok(pruned)
    }

    /// Every outbox row, oldest first.
    pub async fn outbox(&self) -> Result<Vec<outbox::Model>> {
        Ok(runplane_db::outbox::all(&self.db).await?)
    }
}

impl From<DbErr> for ReconcilerError {
    fn from(e: DbErr) -> Self {
        ReconcilerError::Storage(e)
    }
}
