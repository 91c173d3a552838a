//! Fencing a node: what revoking the last of its credentials does to it.
//!
//! The operator has said the node is not to be trusted, so nothing of it is waited on:
//! in the revocation's own transaction the node gets no more placements and every live
//! sandbox it holds is lost at once, without the loss grace (which is for what is
//! unknown; this is certain). Each sandbox ends through [`Store::end_live`], the path a
//! loss past the grace takes, so its run's attempt ends `sandbox_lost` once whichever of
//! a fence and a tick (on any replica) gets there first, and the run's next attempt is
//! placed elsewhere. The node's epoch is bumped, so a call its agent had in flight when
//! the credential was revoked finds it stale.

use sea_orm::sea_query::{Expr, ExprTrait};
use sea_orm::{ColumnTrait, DatabaseTransaction, EntityTrait, QueryFilter, QuerySelect};

use super::entities::{node, route_identity, sandbox};
use super::{Ending, LIVE, Result, Store};
use crate::domain::status::SandboxStatus;

impl Store {
    /// Fences `node_id` in the caller's transaction (the revocation of its credentials):
    /// marks it fenced, bumps its epoch and ends every live sandbox it holds as lost, each
    /// with its FailRun `sandbox_lost`. Returns how many sandboxes this fence ended, or
    /// `None` when there was nothing to fence (the node never registered, or it is fenced
    /// already: a replay changes nothing).
    ///
    /// The node's row is locked first, as dispatch's placement and a node's publication
    /// lock it, so neither lands on the node between the fence and its commit.
    pub(super) async fn fence_node(
        &self,
        txn: &DatabaseTransaction,
        node_id: &str,
        now_us: i64,
    ) -> Result<Option<u64>> {
        let Some(node) = node::Entity::find_by_id(node_id.to_owned())
            .lock_exclusive()
            .one(txn)
            .await?
        else {
            return Ok(None);
        };
        if node.is_fenced() {
            return Ok(None);
        }
        node::Entity::update_many()
            .col_expr(node::Column::FencedAtUs, Expr::value(now_us))
            .col_expr(node::Column::Epoch, Expr::col(node::Column::Epoch).add(1))
            .filter(node::Column::Id.eq(node_id))
            .exec(txn)
            .await?;
        let mut lost = 0;
        for row in Self::held_by(txn, node_id).await? {
            let ended = Ending {
                final_status: SandboxStatus::Lost,
                exit_code: None,
                fail_run: crate::owed::sandbox_lost(
                    &row,
                    format!(
                        "sandbox {} lost: its node {node_id} was fenced (its credentials were revoked)",
                        row.id
                    ),
                    now_us,
                ),
            };
            let guard = Self::live_guard(&row.id, row.execution_generation);
            if Self::end_live(txn, &row.id, guard, ended, now_us).await? {
                lost += 1;
                tracing::warn!(sandbox_id = %row.id, run_id = %row.run_id, "node fenced; sandbox lost, its attempt ends");
            }
        }
        Ok(Some(lost))
    }

    /// The live sandboxes whose execution `node_id` holds (placed there, or suspended
    /// unplaced with a route identity naming it at their generation: the holder
    /// [`crate::domain::wake::holder`] finds), as `txn` reads them.
    async fn held_by(txn: &DatabaseTransaction, node_id: &str) -> Result<Vec<sandbox::Model>> {
        use sea_orm::sea_query::Query;
        let routed_here = Query::select()
            .column(route_identity::Column::SandboxId)
            .from(route_identity::Entity)
            .and_where(route_identity::Column::CurrentNodeId.eq(node_id))
            .to_owned();
        let candidates = sandbox::Entity::find()
            .filter(sandbox::Column::Status.is_in(LIVE))
            .filter(
                sea_orm::Condition::any()
                    .add(sandbox::Column::ActiveNodeId.eq(node_id))
                    .add(
                        sea_orm::Condition::all()
                            .add(sandbox::Column::ActiveNodeId.is_null())
                            .add(sandbox::Column::Id.in_subquery(routed_here)),
                    ),
            )
            .all(txn)
            .await?;
        let routes: std::collections::HashMap<String, route_identity::Model> =
            route_identity::Entity::find()
                .filter(
                    route_identity::Column::SandboxId
                        .is_in(candidates.iter().map(|r| r.id.clone())),
                )
                .all(txn)
                .await?
                .into_iter()
                .map(|r| (r.sandbox_id.clone(), r))
                .collect();
        Ok(candidates
            .into_iter()
            .filter(|row| {
                crate::domain::wake::holder(
                    &row.placement(),
                    routes.get(&row.id).map(route_identity::Model::identity),
                ) == Some(node_id)
            })
            .collect())
    }
}
