//! The run store's errors and their one mapping to `tonic::Status`.

use runplane_grpc::{ErrorReason, status_with_reason};
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum RunStoreError {
    #[error(transparent)]
    Database(#[from] runplane_db::DbError),
}

impl From<RunStoreError> for Status {
    fn from(error: RunStoreError) -> Self {
        match error {
            // The cause is logged where it happened; the caller learns only that it may retry.
            RunStoreError::Database(_) => status_with_reason(
                Code::Unavailable,
                ErrorReason::StoreUnavailable,
                "run store storage is unavailable",
                std::iter::empty::<(String, String)>(),
            ),
        }
    }
}
