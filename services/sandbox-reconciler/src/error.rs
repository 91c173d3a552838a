//! The reconciler's errors and their one mapping to `tonic::Status`.

use runplane_grpc::{ErrorReason, status_with_reason};
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum ReconcilerError {
    #[error(transparent)]
    Database(#[from] runplane_db::DbError),
    #[error("reconciler storage failed: {0}")]
    Storage(sea_orm::DbErr),
    #[error("{field}: {reason}")]
    InvalidField { field: &'static str, reason: String },
    #[error("missing or unknown bearer token")]
    Unauthenticated,
    #[error("this node credential is revoked")]
    NodeCredentialRevoked,
    #[error("this node credential acts for another node than {node_id}")]
    NodeCredentialWrongNode { node_id: String },
    #[error("sandbox {id} not found")]
    SandboxNotFound { id: String },
    #[error("sandbox {id} has ended ({status})")]
    SandboxEnded { id: String, status: String },
    #[error("sandbox {id} is not placed on a node; a wake is queued, retry shortly")]
    NotPlaced {
        id: String,
        wake_id: String,
        retry_after_ms: u64,
    },
    #[error("sandbox {id}'s node {node_id} is not registered")]
    NodeNotRegistered { id: String, node_id: String },
    #[error("node {node_id} is not registered")]
    NodeUnknown { node_id: String },
    #[error("node {node_id} has registered again since (current epoch {epoch}); re-register")]
    NodeEpochStale { node_id: String, epoch: i64 },
    #[error("node {node_id} may not publish for sandbox {sandbox_id}: it is not placed there")]
    NodeNotOwner { node_id: String, sandbox_id: String },
    #[error("wake {wake_id} is settled or assigned elsewhere")]
    WakeSettled { wake_id: String },
    #[error("run {run_id} already has a live sandbox {sandbox_id}")]
    SandboxExists { run_id: String, sandbox_id: String },
    /// The run store's answer, passed on as it came (its reason included).
    #[error("run store: {}", .0.message())]
    Upstream(Status),
}

impl From<Status> for ReconcilerError {
    fn from(status: Status) -> Self {
        ReconcilerError::Upstream(status)
    }
}

impl From<ReconcilerError> for Status {
    fn from(error: ReconcilerError) -> Self {
        use ReconcilerError as E;
        let message = error.to_string();
        let (code, reason, metadata): (Code, ErrorReason, Vec<(String, String)>) = match error {
            E::Upstream(status) => return status,
            E::Database(_) | E::Storage(_) => {
                tracing::error!(error = %message, "reconciler storage error");
                return status_with_reason(
                    Code::Unavailable,
                    ErrorReason::StoreUnavailable,
                    "reconciler storage is unavailable; nothing was committed",
                    Vec::<(String, String)>::new(),
                );
            }
            E::InvalidField { field, .. } => (
                Code::InvalidArgument,
                ErrorReason::InvalidField,
                vec![("field".into(), field.into())],
            ),
            E::Unauthenticated | E::NodeCredentialRevoked => {
                (Code::Unauthenticated, ErrorReason::Unauthenticated, vec![])
            }
            E::NodeCredentialWrongNode { node_id } => (
                Code::PermissionDenied,
                ErrorReason::NodeCredentialWrongNode,
                vec![("node_id".into(), node_id)],
            ),
            E::SandboxNotFound { id } => (
                Code::NotFound,
                ErrorReason::SandboxNotFound,
                vec![("sandbox_id".into(), id)],
            ),
            E::SandboxEnded { id, .. } => (
                Code::FailedPrecondition,
                ErrorReason::SandboxEnded,
                vec![("sandbox_id".into(), id)],
            ),
            E::NotPlaced {
                id,
                wake_id,
                retry_after_ms,
            } => (
                Code::FailedPrecondition,
                ErrorReason::NotPlaced,
                vec![
                    ("sandbox_id".into(), id),
                    ("wake_id".into(), wake_id),
                    ("retry_after_ms".into(), retry_after_ms.to_string()),
                ],
            ),
            E::NodeNotRegistered { id, node_id } => (
                Code::FailedPrecondition,
                ErrorReason::NodeNotRegistered,
                vec![("sandbox_id".into(), id), ("node_id".into(), node_id)],
            ),
            E::NodeUnknown { node_id } => (
                Code::FailedPrecondition,
                ErrorReason::NodeNotRegistered,
                vec![("node_id".into(), node_id)],
            ),
            E::NodeEpochStale { node_id, .. } => (
                Code::FailedPrecondition,
                ErrorReason::NodeEpochStale,
                vec![("node_id".into(), node_id)],
            ),
            E::NodeNotOwner {
                node_id,
                sandbox_id,
            } => (
                Code::PermissionDenied,
                ErrorReason::NodeNotOwner,
                vec![
                    ("node_id".into(), node_id),
                    ("sandbox_id".into(), sandbox_id),
                ],
            ),
            E::SandboxExists { sandbox_id, .. } => (
                Code::AlreadyExists,
                ErrorReason::SandboxExists,
                vec![("sandbox_id".into(), sandbox_id)],
            ),
            E::WakeSettled { wake_id } => (
                Code::FailedPrecondition,
                ErrorReason::WakeSettled,
                vec![("wake_id".into(), wake_id)],
            ),
        };
        status_with_reason(code, reason, message, metadata)
    }
}
