//! The reconciler's errors and their one mapping to `tonic::Status`.

use runplane_grpc::error::{is_definite_refusal, metadata};
use runplane_grpc::{ErrorReason, ServiceError, into_status};
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
    SandboxEnded {
        id: String,
        status: crate::domain::status::SandboxStatus,
    },
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
    /// The stream recovery coordinator's answer to `method`: a definite refusal (a bad
    /// TTL, say) passes on as it came; anything else is the coordinator not answering.
    #[error("the stream recovery coordinator did not answer {method}: {:?}", .status.code())]
    Coordinator {
        method: &'static str,
        status: Status,
    },
    #[error("the route token is not valid for this sandbox on this node; resolve the route again")]
    RouteTokenInvalid,
}

impl From<Status> for ReconcilerError {
    fn from(status: Status) -> Self {
        ReconcilerError::Upstream(status)
    }
}

impl ServiceError for ReconcilerError {
    fn kind(&self) -> (Code, ErrorReason) {
        use ReconcilerError as E;
        match self {
            // Passed through (see `passthrough`); never read.
            E::Upstream(status) => (status.code(), ErrorReason::UpstreamUnavailable),
            E::Database(_) | E::Storage(_) => (Code::Unavailable, ErrorReason::StoreUnavailable),
            E::InvalidField { .. } => (Code::InvalidArgument, ErrorReason::InvalidField),
            E::Unauthenticated | E::NodeCredentialRevoked => {
                (Code::Unauthenticated, ErrorReason::Unauthenticated)
            }
            E::NodeCredentialWrongNode { .. } => {
                (Code::PermissionDenied, ErrorReason::NodeCredentialWrongNode)
            }
            E::SandboxNotFound { .. } => (Code::NotFound, ErrorReason::SandboxNotFound),
            E::SandboxEnded { .. } => (Code::FailedPrecondition, ErrorReason::SandboxEnded),
            E::NotPlaced { .. } => (Code::FailedPrecondition, ErrorReason::NotPlaced),
            E::NodeNotRegistered { .. } | E::NodeUnknown { .. } => {
                (Code::FailedPrecondition, ErrorReason::NodeNotRegistered)
            }
            E::NodeEpochStale { .. } => (Code::FailedPrecondition, ErrorReason::NodeEpochStale),
            E::NodeNotOwner { .. } => (Code::PermissionDenied, ErrorReason::NodeNotOwner),
            E::SandboxExists { .. } => (Code::AlreadyExists, ErrorReason::SandboxExists),
            E::WakeSettled { .. } => (Code::FailedPrecondition, ErrorReason::WakeSettled),
            E::Coordinator { .. } => (Code::Unavailable, ErrorReason::UpstreamUnavailable),
            E::RouteTokenInvalid => (Code::Unauthenticated, ErrorReason::RouteTokenInvalid),
        }
    }

    fn metadata(&self) -> Vec<(String, String)> {
        use ReconcilerError as E;
        match self {
            E::InvalidField { field, .. } => metadata([("field", (*field).to_owned())]),
            E::NodeCredentialWrongNode { node_id }
            | E::NodeUnknown { node_id }
            | E::NodeEpochStale { node_id, .. } => metadata([("node_id", node_id.clone())]),
            E::SandboxNotFound { id } | E::SandboxEnded { id, .. } => {
                metadata([("sandbox_id", id.clone())])
            }
            E::NotPlaced {
                id,
                wake_id,
                retry_after_ms,
            } => metadata([
                ("sandbox_id", id.clone()),
                ("wake_id", wake_id.clone()),
                ("retry_after_ms", retry_after_ms.to_string()),
            ]),
            E::NodeNotRegistered { id, node_id } => {
                metadata([("sandbox_id", id.clone()), ("node_id", node_id.clone())])
            }
            E::NodeNotOwner {
                node_id,
                sandbox_id,
            } => metadata([
                ("node_id", node_id.clone()),
                ("sandbox_id", sandbox_id.clone()),
            ]),
            E::SandboxExists { sandbox_id, .. } => metadata([("sandbox_id", sandbox_id.clone())]),
            E::WakeSettled { wake_id } => metadata([("wake_id", wake_id.clone())]),
            _ => Vec::new(),
        }
    }

    fn public_message(&self) -> Option<&'static str> {
        matches!(
            self,
            ReconcilerError::Database(_) | ReconcilerError::Storage(_)
        )
        .then_some("reconciler storage is unavailable; nothing was committed")
    }

    fn passthrough(&self) -> Option<Status> {
        match self {
            ReconcilerError::Upstream(status) => Some(status.clone()),
            ReconcilerError::Coordinator { status, .. } if is_definite_refusal(status) => {
                Some(status.clone())
            }
            _ => None,
        }
    }
}

impl From<ReconcilerError> for Status {
    fn from(error: ReconcilerError) -> Self {
        into_status(&error)
    }
}
