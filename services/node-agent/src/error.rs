//! The node agent's errors: why it stops, and what its session endpoint refuses.

use runplane_grpc::error::metadata;
use runplane_grpc::{ErrorReason, ServiceError, into_status};
use tonic::{Code, Status};

/// Why the agent stopped.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("background task {0} failed; the agent stops so a fresh one takes over")]
    Task(&'static str),
    #[error(transparent)]
    Endpoint(#[from] runplane_grpc::client::ClientError),
    #[error("registering with the reconciler failed: {0}")]
    Register(String),
    #[error(
        "the reconciler refuses this node's credential ({0}); it was revoked or is another node's"
    )]
    Refused(String),
    #[error("cannot listen on {0} for sessions ([node] listen): {1}")]
    Listen(String, String),
}

/// What the session endpoint refuses, with the reasons the reconciler's API uses for the
/// same refusals.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("{field}: {reason}")]
    InvalidField { field: &'static str, reason: String },
    #[error("the route token is not valid for this sandbox on this node; resolve the route again")]
    RouteTokenInvalid,
}

impl ServiceError for SessionError {
    fn kind(&self) -> (Code, ErrorReason) {
        match self {
            SessionError::InvalidField { .. } => (Code::InvalidArgument, ErrorReason::InvalidField),
            SessionError::RouteTokenInvalid => {
                (Code::Unauthenticated, ErrorReason::RouteTokenInvalid)
            }
        }
    }

    fn metadata(&self) -> Vec<(String, String)> {
        match self {
            SessionError::InvalidField { field, .. } => metadata([("field", (*field).to_owned())]),
            SessionError::RouteTokenInvalid => Vec::new(),
        }
    }
}

impl From<SessionError> for Status {
    fn from(error: SessionError) -> Self {
        into_status(&error)
    }
}
