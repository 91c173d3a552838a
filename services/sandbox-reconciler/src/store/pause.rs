//! Paused runs' sandboxes: which rows are paused, as the run store last said, and the
//! suspend and restore of the reconciler's own (local) ones, which stay placed here.

use sea_orm::sea_query::Expr;
use sea_orm::{ColumnTrait, EntityTrait, QueryFilter};

use super::Store;
use super::entities::sandbox;
use crate::domain::status::SandboxStatus;
use crate::error::ReconcilerError;

type Result<T> = std::result::Result<T, ReconcilerError>;

impl Store {
    /// Records `id`'s pause ([`sandbox::Model::paused`]: 0, [`sandbox::PAUSED`] or
    /// [`sandbox::RESUME_OWED`]), compare-and-set on its generation, the value read and a
    /// live status; whether it changed.
    pub async fn set_paused(
        &self,
        id: &str,
        generation: i64,
        read: i64,
        paused: i64,
    ) -> Result<bool> {
        let done = sandbox::Entity::update_many()
            .col_expr(sandbox::Column::Paused, Expr::value(paused))
            .col_expr(sandbox::Column::UpdatedAtUs, Expr::value(self.now_us()))
            .filter(sandbox::Column::Id.eq(id))
            .filter(sandbox::Column::ExecutionGeneration.eq(generation))
            .filter(sandbox::Column::Paused.eq(read))
            .filter(sandbox::Column::Status.is_in(super::LIVE))
            .exec(&self.db)
            .await?;
        Ok(done.rows_affected == 1)
    }

    /// Moves a sandbox of this generation from `from` to `to`, keeping its placement:
    /// the reconciler suspended (or restored) one of its own. Whether it moved; a row
    /// deleted or superseded meanwhile is left alone.
    pub async fn move_local(
        &self,
        id: &str,
        generation: i64,
        from: SandboxStatus,
        to: SandboxStatus,
    ) -> Result<bool> {
        let done = sandbox::Entity::update_many()
            .col_expr(sandbox::Column::Status, Expr::value(to))
            .col_expr(sandbox::Column::UpdatedAtUs, Expr::value(self.now_us()))
            .filter(sandbox::Column::Id.eq(id))
            .filter(sandbox::Column::ExecutionGeneration.eq(generation))
            .filter(sandbox::Column::Status.eq(from))
            .exec(&self.db)
            .await?;
        Ok(done.rows_affected == 1)
    }
}
