//! The reconciler's errors.

#[derive(Debug, thiserror::Error)]
pub enum ReconcilerError {
    #[error(transparent)]
    Database(#[from] runplane_db::DbError),
}
