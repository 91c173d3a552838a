//! What node agents write: registration, heartbeats, state publications, restores.

use sea_orm::sea_query::Expr;
use sea_orm::{
    ActiveModelTrait, ColumnTrait, EntityTrait, IntoActiveModel, QueryFilter, QueryOrder,
    QuerySelect, TransactionTrait,
};

use super::Store;
use super::entities::{node, node_credential, route_identity, sandbox, wake};
use crate::domain::status::SandboxStatus;
use crate::error::ReconcilerError;

type Result<T> = std::result::Result<T, ReconcilerError>;

/// Longest wake error kept (ReportWakeFailed's documented bound).
pub const MAX_WAKE_ERROR_BYTES: usize = 512;

/// `s` cut to at most `max` bytes, at a character boundary (`String::truncate` inside a
/// character panics). `str::floor_char_boundary` is newer than the workspace's MSRV.
fn truncated(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// What a node is asked to do with one sandbox.
#[derive(Debug, Clone)]
pub enum Assigned {
    /// Run (or keep running) this sandbox generation.
    Run(sandbox::Model),
    /// Restore this unplaced sandbox: the wake and its attempt number.
    Restore(sandbox::Model, wake::Model),
    /// Its run is paused: suspend this running sandbox and publish it unplaced.
    Suspend(sandbox::Model),
    /// Stop this deleted sandbox's process, then acknowledge with a DELETED publication.
    Destroy(sandbox::Model),
}

/// Destroys handed to a node per assignment list; the rest follow as these are
/// acknowledged.
pub const DESTROYS_PER_LIST: u64 = 100;

/// A node's observation of one sandbox.
#[derive(Debug, Clone)]
pub struct Observation<'a> {
    pub sandbox_id: &'a str,
    pub generation: i64,
    pub seq: i64,
    pub status: SandboxStatus,
    /// False for an idle suspend: the node gives up the placement.
    pub placed: bool,
    pub exit_code: Option<i32>,
}

/// How many failed restores before a wake gives up.
pub const WAKE_ATTEMPTS: i32 = 3;

impl Store {
    /// Registers a node with its live credential `credential_id`. The same boot again
    /// keeps its epoch; a new boot bumps it, which fences every call the previous boot
    /// still makes. A fenced node registers as a fresh one: a new epoch, unfenced.
    ///
    /// The credential is read share-locked in the transaction, so a revocation is
    /// ordered before or after the whole registration: a registration authenticated just
    /// before its credential was revoked cannot lift the fence that revocation set
    /// (it finds the credential revoked and is refused), and one that committed first is
    /// fenced by it.
    pub async fn register_node(
        &self,
        credential_id: &str,
        id: &str,
        boot_id: &str,
        endpoint: &str,
        capacity: i32,
    ) -> Result<node::Model> {
        let txn = runplane_db::write_tx(&self.db).await?;
        let live = node_credential::Entity::find_by_id(credential_id.to_owned())
            .filter(node_credential::Column::RevokedAtUs.is_null())
            .lock_shared()
            .one(&txn)
            .await?;
        if live.is_none() {
            txn.rollback().await?;
            return Err(ReconcilerError::NodeCredentialRevoked);
        }
        let now = self.now_us();
        let node = match node::Entity::find_by_id(id.to_owned()).one(&txn).await? {
            None => {
                let row = node::Model {
                    id: id.to_owned(),
                    endpoint: endpoint.to_owned(),
                    capacity,
                    last_heartbeat_us: now,
                    boot_id: boot_id.to_owned(),
                    epoch: 1,
                    used: 0,
                    registered_at_us: now,
                    fenced_at_us: 0,
                };
                node::Entity::insert(row.clone().into_active_model())
                    .exec_without_returning(&txn)
                    .await?;
                row
            }
            Some(existing) => {
                let epoch = if existing.boot_id == boot_id && !existing.is_fenced() {
                    existing.epoch
                } else {
                    existing.epoch + 1
                };
                let mut active = existing.into_active_model();
                active.endpoint = sea_orm::Set(endpoint.to_owned());
                active.capacity = sea_orm::Set(capacity);
                active.boot_id = sea_orm::Set(boot_id.to_owned());
                active.epoch = sea_orm::Set(epoch);
                active.last_heartbeat_us = sea_orm::Set(now);
                active.fenced_at_us = sea_orm::Set(0);
                active.update(&txn).await?
            }
        };
        txn.commit().await?;
        Ok(node)
    }

    /// The node, if `epoch` is its current one.
    pub async fn node_at_epoch(&self, id: &str, epoch: i64) -> Result<node::Model> {
        let node = node::Entity::find_by_id(id.to_owned())
            .one(&self.db)
            .await?
            .ok_or_else(|| ReconcilerError::NodeUnknown {
                node_id: id.to_owned(),
            })?;
        if node.epoch != epoch {
            return Err(ReconcilerError::NodeEpochStale {
                node_id: id.to_owned(),
                epoch: node.epoch,
            });
        }
        Ok(node)
    }

    pub async fn heartbeat(&self, id: &str, epoch: i64, used: i32) -> Result<()> {
        let done = node::Entity::update_many()
            .col_expr(node::Column::LastHeartbeatUs, Expr::value(self.now_us()))
            .col_expr(node::Column::Used, Expr::value(used))
            .filter(node::Column::Id.eq(id))
            .filter(node::Column::Epoch.eq(epoch))
            .exec(&self.db)
            .await?;
        if done.rows_affected == 0 {
            self.node_at_epoch(id, epoch).await?;
        }
        Ok(())
    }

    /// Registered nodes by id after `after`.
    pub async fn list_nodes(&self, after: Option<&str>, limit: u64) -> Result<Vec<node::Model>> {
        let mut query = node::Entity::find();
        if let Some(after) = after {
            query = query.filter(node::Column::Id.gt(after));
        }
        Ok(query
            .order_by_asc(node::Column::Id)
            .limit(limit)
            .all(&self.db)
            .await?)
    }

    /// Nodes that heartbeat since `since_us` and are not fenced, least used first.
    pub async fn ready_nodes(&self, since_us: i64) -> Result<Vec<node::Model>> {
        Ok(node::Entity::find()
            .filter(node::Column::LastHeartbeatUs.gte(since_us))
            .filter(node::Column::FencedAtUs.eq(0))
            .order_by_asc(node::Column::Used)
            .order_by_asc(node::Column::Id)
            .all(&self.db)
            .await?)
    }

    /// How many sandboxes each of `node_ids` runs or is about to (placed there: creating,
    /// started or restoring), as this reconciler placed them; what dispatch weighs against
    /// a node's capacity. A suspended sandbox is parked, not running, as the node's own
    /// `used` counts it.
    pub async fn placed_per_node(
        &self,
        node_ids: &[String],
    ) -> Result<std::collections::HashMap<String, i64>> {
        let rows: Vec<(Option<String>, i64)> = sandbox::Entity::find()
            .select_only()
            .column(sandbox::Column::ActiveNodeId)
            .column_as(sandbox::Column::Id.count(), "n")
            .filter(sandbox::Column::ActiveNodeId.is_in(node_ids.iter().cloned()))
            .filter(sandbox::Column::Status.is_in(super::PLACED))
            .group_by(sandbox::Column::ActiveNodeId)
            .into_tuple()
            .all(&self.db)
            .await?;
        Ok(rows
            .into_iter()
            .filter_map(|(node, n)| Some((node?, n)))
            .collect())
    }

    /// What `node_id` should be doing.
    pub async fn assignments(&self, node_id: &str) -> Result<Vec<Assigned>> {
        let mut out: Vec<Assigned> = sandbox::Entity::find()
            .filter(sandbox::Column::ActiveNodeId.eq(node_id))
            .filter(sandbox::Column::Status.is_in(super::PLACED))
            .order_by_asc(sandbox::Column::Id)
            .all(&self.db)
            .await?
            .into_iter()
            .map(|row| {
                // A paused run's started sandbox is to be suspended; once it is, it is
                // unplaced and no longer listed here.
                if row.is_paused() && row.status == SandboxStatus::Started {
                    Assigned::Suspend(row)
                } else {
                    Assigned::Run(row)
                }
            })
            .collect();
        let wakes = wake::Entity::find()
            .filter(wake::Column::NodeId.eq(node_id))
            .filter(wake::Column::State.eq("assigned"))
            .filter(wake::Column::SettledAtUs.is_null())
            .all(&self.db)
            .await?;
        for w in wakes {
            if let Some(s) = sandbox::Entity::find_by_id(w.sandbox_id.clone())
                .one(&self.db)
                .await?
                // An ended sandbox is never restored (its deletion settles its wakes).
                .filter(|s| !s.status.is_ended())
            {
                out.push(Assigned::Restore(s, w));
            }
        }
        out.extend(
            self.destroys_owed(node_id, DESTROYS_PER_LIST)
                .await?
                .into_iter()
                .map(Assigned::Destroy),
        );
        Ok(out)
    }

    /// Applies a node's observation. A node may publish only for rows placed on it, or
    /// unplaced rows whose route identity names it at the same generation (its own idle
    /// suspend), and only at its current `epoch`. Older observations (by sequence) and
    /// other generations change nothing.
    ///
    /// Ownership is part of the UPDATE itself ([`owned_by`]), and the node's row is held
    /// at `epoch` until it commits: a restore that commits first wins, a new boot of the
    /// node is ordered before or after the whole publication, and a publication that lost
    /// is answered NODE_NOT_OWNER or NODE_EPOCH_STALE instead of overwriting anything.
    pub async fn publish_observation(
        &self,
        node_id: &str,
        epoch: i64,
        o: &Observation<'_>,
    ) -> Result<(bool, sandbox::Model)> {
        let owned = owned_by(node_id, epoch, o.generation);
        let txn = self.db.begin().await?;
        // The node's row at `epoch`, share-locked until the write commits: a new boot's
        // registration waits for this publication (and so does anything that boot then
        // restores), or has committed and this publication finds the epoch stale. The
        // UPDATE's own epoch test alone would be read from its statement's snapshot.
        let at_epoch = node::Entity::find_by_id(node_id.to_owned())
            .filter(node::Column::Epoch.eq(epoch))
            .lock_shared()
            .one(&txn)
            .await?
            .is_some();
        let applied = at_epoch
            && if o.status == super::DELETED {
                // The node stopped a deleted sandbox's process: its destroy is acknowledged.
                self.acknowledge_destroyed_where(
                    &txn,
                    sea_orm::Condition::all()
                        .add(sandbox::Column::Id.eq(o.sandbox_id))
                        .add(owned),
                )
                .await?
            } else {
                self.apply_observation(&txn, node_id, o, owned).await?
            };
        txn.commit().await?;
        let row = self.sandbox(o.sandbox_id).await?;
        if !applied {
            self.explain_unapplied(node_id, epoch, o, &row).await?;
        }
        Ok((applied, row))
    }

    /// The observation's UPDATE, guarded by `owned` (node, epoch, generation), the
    /// sequence and a live status; whether it applied.
    async fn apply_observation(
        &self,
        db: &impl sea_orm::ConnectionTrait,
        node_id: &str,
        o: &Observation<'_>,
        owned: sea_orm::Condition,
    ) -> Result<bool> {
        let mut update = sandbox::Entity::update_many()
            .col_expr(sandbox::Column::ObservedStatus, Expr::value(o.status))
            .col_expr(sandbox::Column::ObservationSeq, Expr::value(o.seq))
            .col_expr(sandbox::Column::ExitCode, Expr::value(o.exit_code))
            .col_expr(sandbox::Column::UpdatedAtUs, Expr::value(self.now_us()));
        // A live status is taken as is; an exit or loss stays an observation until the
        // loss grace confirms it.
        if super::LIVE.contains(&o.status) {
            update = update.col_expr(sandbox::Column::Status, Expr::value(o.status));
        }
        // Giving up the placement clears active_node_id and leaves the route identity.
        update = update.col_expr(
            sandbox::Column::ActiveNodeId,
            Expr::value(o.placed.then(|| node_id.to_owned())),
        );
        let done = update
            .filter(sandbox::Column::Id.eq(o.sandbox_id))
            .filter(owned)
            .filter(sandbox::Column::ObservationSeq.lt(o.seq))
            .filter(sandbox::Column::Status.is_in(super::LIVE))
            .exec(db)
            .await?;
        Ok(done.rows_affected == 1)
    }

    /// Why a publication changed nothing, read after its UPDATE: a stale epoch or a row
    /// that is not (or no longer) the node's is an error; an older sequence, another
    /// generation or an ended row is `applied: false`.
    async fn explain_unapplied(
        &self,
        node_id: &str,
        epoch: i64,
        o: &Observation<'_>,
        row: &sandbox::Model,
    ) -> Result<()> {
        self.node_at_epoch(node_id, epoch).await?;
        let owns = match &row.active_node_id {
            Some(active) => active == node_id,
            None => self.route_of(&row.id).await?.is_some_and(|r| {
                r.current_node_id == node_id && r.execution_generation == o.generation
            }),
        };
        if !owns {
            return Err(ReconcilerError::NodeNotOwner {
                node_id: node_id.to_owned(),
                sandbox_id: row.id.clone(),
            });
        }
        Ok(())
    }

    /// `sandbox_id`'s route identity, whether or not the sandbox is placed: who holds it,
    /// not where to route (routes read it only through [`Store::placement`]).
    pub async fn route_of(&self, sandbox_id: &str) -> Result<Option<route_identity::Model>> {
        Ok(route_identity::Entity::find_by_id(sandbox_id.to_owned())
            .one(&self.db)
            .await?)
    }

    /// The node holding `row`'s execution (see [`crate::domain::wake::holder`]).
    pub async fn holder_of(&self, row: &sandbox::Model) -> Result<Option<String>> {
        let route = self.route_of(&row.id).await?;
        Ok(crate::domain::wake::holder(
            &row.placement(),
            route.as_ref().map(route_identity::Model::identity),
        )
        .map(str::to_owned))
    }

    /// Gives pending wakes that are due to the nodes that can restore them; returns how
    /// many. A direct sandbox's wake goes only to its holder, and waits while the holder
    /// is not ready (the loss grace decides if it never returns); a wake nothing can
    /// serve (the sandbox ended, its holder saw it gone, or nobody holds it) is settled
    /// failed instead. Other substrates go to the least used ready node.
    pub async fn assign_wakes(&self, ready_since_us: i64) -> Result<u64> {
        use crate::domain::wake::{WakeTarget, gone_on_holder, wake_target};
        let nodes = self.ready_nodes(ready_since_us).await?;
        if nodes.is_empty() {
            return Ok(0);
        }
        let now = self.now_us();
        let pending = wake::Entity::find()
            .filter(wake::Column::State.eq("pending"))
            .filter(wake::Column::SettledAtUs.is_null())
            .filter(
                sea_orm::Condition::any()
                    .add(wake::Column::NotBeforeUs.is_null())
                    .add(wake::Column::NotBeforeUs.lte(now)),
            )
            .order_by_asc(wake::Column::RequestedAtUs)
            .all(&self.db)
            .await?;
        let mut assigned = 0;
        let mut spread = nodes.iter().cycle();
        for w in &pending {
            let row = sandbox::Entity::find_by_id(w.sandbox_id.clone())
                .one(&self.db)
                .await?;
            // A wake of a sandbox that ended is settled, never assigned (a deletion
            // settles its wakes; this catches one queued as the deletion committed).
            let Some(row) = row.filter(|s| !s.status.is_ended()) else {
                Store::settle_wakes_of_ended(&self.db, &w.sandbox_id, now).await?;
                continue;
            };
            // A paused run's sandbox stays suspended: its wake waits for ResumeRun.
            if row.is_paused() {
                continue;
            }
            if gone_on_holder(&row.placement()) {
                self.settle_wake_failed(w, super::WAKE_GONE_ON_HOLDER)
                    .await?;
                continue;
            }
            let route = self.route_of(&row.id).await?;
            let node_id = match wake_target(
                &row.placement(),
                route.as_ref().map(route_identity::Model::identity),
            ) {
                WakeTarget::Holder(holder) => match nodes.iter().find(|n| n.id == holder) {
                    Some(node) => node.id.clone(),
                    None => continue,
                },
                WakeTarget::AnyNode => spread.next().expect("nodes is not empty").id.clone(),
                WakeTarget::Nobody => {
                    self.settle_wake_failed(w, super::WAKE_NO_HOLDER).await?;
                    continue;
                }
            };
            let done = wake::Entity::update_many()
                .col_expr(wake::Column::State, Expr::value("assigned"))
                .col_expr(wake::Column::NodeId, Expr::value(node_id))
                .col_expr(wake::Column::Attempts, Expr::value(w.attempts + 1))
                .filter(wake::Column::Id.eq(w.id.as_str()))
                .filter(wake::Column::State.eq("pending"))
                .exec(&self.db)
                .await?;
            assigned += done.rows_affected;
        }
        Ok(assigned)
    }

    /// Settles pending wake `w` failed with `error`, compare-and-set on it still pending.
    async fn settle_wake_failed(&self, w: &wake::Model, error: &str) -> Result<()> {
        wake::Entity::update_many()
            .col_expr(wake::Column::State, Expr::value("failed"))
            .col_expr(wake::Column::LastError, Expr::value(error))
            .col_expr(wake::Column::SettledAtUs, Expr::value(self.now_us()))
            .filter(wake::Column::Id.eq(w.id.as_str()))
            .filter(wake::Column::State.eq("pending"))
            .exec(&self.db)
            .await?;
        tracing::info!(wake_id = %w.id, sandbox_id = %w.sandbox_id, error, "wake settled failed");
        Ok(())
    }

    /// A wake restored its sandbox on `node_id`: placement and route identity are written
    /// with the wake's settlement in one transaction. An ended sandbox is never revived:
    /// the restore is refused (SANDBOX_ENDED) and its wake settles failed. The sandbox row
    /// is written before the wake, the order a deletion takes too, so the two serialize:
    /// a deletion that committed first wins, and one that comes after destroys the
    /// restored sandbox. The same report again (this node, this attempt) answers with the
    /// sandbox as it is and writes nothing.
    pub async fn report_restored(
        &self,
        node_id: &str,
        wake_id: &str,
        attempt: i32,
    ) -> Result<sandbox::Model> {
        let settled = || ReconcilerError::WakeSettled {
            wake_id: wake_id.to_owned(),
        };
        let assigned_here = sea_orm::Condition::all()
            .add(wake::Column::Id.eq(wake_id))
            .add(wake::Column::NodeId.eq(node_id))
            .add(wake::Column::Attempts.eq(attempt))
            .add(wake::Column::State.eq("assigned"));
        let txn = self.db.begin().await?;
        let now = self.now_us();
        let wake = wake::Entity::find_by_id(wake_id.to_owned())
            .one(&txn)
            .await?
            .ok_or_else(settled)?;
        if wake.state == "restored"
            && wake.node_id.as_deref() == Some(node_id)
            && wake.attempts == attempt
        {
            // A replay of the report that settled it (its answer was lost): the same
            // answer, nothing written.
            txn.commit().await?;
            return self.sandbox(&wake.sandbox_id).await;
        }
        let row = sandbox::Entity::find_by_id(wake.sandbox_id.clone())
            .one(&txn)
            .await?
            .ok_or_else(|| ReconcilerError::SandboxNotFound {
                id: wake.sandbox_id.clone(),
            })?;
        let placed = if row.status.is_ended() {
            0
        } else {
            sandbox::Entity::update_many()
                .col_expr(sandbox::Column::ActiveNodeId, Expr::value(node_id))
                .col_expr(sandbox::Column::Status, Expr::value(SandboxStatus::Started))
                .col_expr(
                    sandbox::Column::LossObservedAtUs,
                    Expr::value(Option::<i64>::None),
                )
                .col_expr(sandbox::Column::UpdatedAtUs, Expr::value(now))
                .filter(sandbox::Column::Id.eq(row.id.as_str()))
                .filter(sandbox::Column::ExecutionGeneration.eq(row.execution_generation))
                // A deletion that committed since the row was read wins.
                .filter(sandbox::Column::Status.is_in(super::LIVE))
                .exec(&txn)
                .await?
                .rows_affected
        };
        if placed != 1 {
            // Ended: settle this attempt's wake failed (a deletion has usually done so).
            wake::Entity::update_many()
                .col_expr(wake::Column::State, Expr::value("failed"))
                .col_expr(
                    wake::Column::LastError,
                    Expr::value(super::WAKE_SANDBOX_ENDED),
                )
                .col_expr(wake::Column::SettledAtUs, Expr::value(now))
                .filter(assigned_here)
                .exec(&txn)
                .await?;
            txn.commit().await?;
            let now = self.sandbox(&row.id).await?;
            return Err(ReconcilerError::SandboxEnded {
                id: now.id,
                status: now.status,
            });
        }
        let restored = wake::Entity::update_many()
            .col_expr(wake::Column::State, Expr::value("restored"))
            .col_expr(wake::Column::SettledAtUs, Expr::value(now))
            .filter(assigned_here)
            .exec(&txn)
            .await?;
        if restored.rows_affected != 1 {
            txn.rollback().await?;
            return Err(settled());
        }
        super::upsert_route_identity(
            &txn,
            route_identity::Model {
                sandbox_id: row.id.clone(),
                current_node_id: node_id.to_owned(),
                execution_generation: row.execution_generation,
            },
        )
        .await?;
        txn.commit().await?;
        self.sandbox(&row.id).await
    }

    /// A wake could not restore here: back to the queue after a backoff
    /// ([`restore_backoff`](crate::domain::wake::restore_backoff)), or failed after its
    /// attempts.
    /// `error` is kept to its first [`MAX_WAKE_ERROR_BYTES`], cut at a character.
    pub async fn report_wake_failed(
        &self,
        node_id: &str,
        wake_id: &str,
        attempt: i32,
        error: &str,
    ) -> Result<wake::Model> {
        // The API refuses a longer error; a caller inside the service may still pass
        // one, and a cut inside a character would panic.
        let error = truncated(error, MAX_WAKE_ERROR_BYTES);
        let current = wake::Entity::find_by_id(wake_id.to_owned())
            .one(&self.db)
            .await?
            .ok_or_else(|| ReconcilerError::WakeSettled {
                wake_id: wake_id.to_owned(),
            })?;
        let give_up = current.attempts >= WAKE_ATTEMPTS;
        let now = self.now_us();
        let mut update = wake::Entity::update_many()
            .col_expr(
                wake::Column::State,
                Expr::value(if give_up { "failed" } else { "pending" }),
            )
            .col_expr(wake::Column::LastError, Expr::value(error))
            .col_expr(wake::Column::NodeId, Expr::value(Option::<String>::None));
        update = if give_up {
            update.col_expr(wake::Column::SettledAtUs, Expr::value(now))
        } else {
            // Backs off before the next attempt, so a restore that keeps failing settles
            // after its attempts instead of looping.
            let wait = crate::domain::wake::restore_backoff(current.attempts);
            update.col_expr(
                wake::Column::NotBeforeUs,
                Expr::value(now + wait.as_micros() as i64),
            )
        };
        update
            .filter(wake::Column::Id.eq(wake_id))
            .filter(wake::Column::NodeId.eq(node_id))
            .filter(wake::Column::Attempts.eq(attempt))
            .filter(wake::Column::State.eq("assigned"))
            .exec(&self.db)
            .await?;
        Ok(wake::Entity::find_by_id(wake_id.to_owned())
            .one(&self.db)
            .await?
            .unwrap_or(current))
    }
}

/// Rows `node_id` may write at `epoch` for execution `generation`: placed on it, or
/// unplaced with a route identity naming it at that generation (its own idle suspend),
/// and only while `epoch` is the node's current one. It goes into the UPDATE itself, so
/// a restore or a re-registration that commits between a publication's read and its
/// write makes the write change nothing.
fn owned_by(node_id: &str, epoch: i64, generation: i64) -> sea_orm::Condition {
    use sea_orm::sea_query::Query;
    let routed_here = Query::select()
        .column(route_identity::Column::SandboxId)
        .from(route_identity::Entity)
        .and_where(route_identity::Column::CurrentNodeId.eq(node_id))
        .and_where(route_identity::Column::ExecutionGeneration.eq(generation))
        .to_owned();
    let at_epoch = Query::select()
        .column(node::Column::Id)
        .from(node::Entity)
        .and_where(node::Column::Id.eq(node_id))
        .and_where(node::Column::Epoch.eq(epoch))
        .to_owned();
    sea_orm::Condition::all()
        .add(sandbox::Column::ExecutionGeneration.eq(generation))
        .add(
            sea_orm::Condition::any()
                .add(sandbox::Column::ActiveNodeId.eq(node_id))
                .add(
                    sea_orm::Condition::all()
                        .add(sandbox::Column::ActiveNodeId.is_null())
                        .add(sandbox::Column::Id.in_subquery(routed_here)),
                ),
        )
        .add(Expr::exists(at_epoch))
}
