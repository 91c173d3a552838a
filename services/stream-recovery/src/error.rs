//! The coordinator's errors and their one mapping to `tonic::Status`.

use runplane_grpc::error::{is_definite_refusal, metadata};
use runplane_grpc::{ErrorReason, ServiceError, into_status};
use tonic::{Code, Status};

use crate::domain::policy::MAX_ATTEMPTS;
use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum RecoveryError {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// At start: the store `[stream_recovery]` names cannot be reached.
    #[error("the recovery store at {url} is unreachable: {reason}")]
    Unreachable { url: String, reason: String },
    /// At start: `[run_store].endpoint` is not an endpoint.
    #[error("invalid run store endpoint: {0}")]
    Endpoint(String),
    #[error("{field}: {why}")]
    Invalid { field: String, why: String },
    #[error("a batch holds at most 1 MiB of frames")]
    BatchTooLarge { limit: u64, actual: u64 },
    #[error("a recent takeover's backoff runs; retry after not_before")]
    NotBefore {
        not_before_ms: i64,
        retry_after_ms: i64,
    },
    #[error("the run's stream recovery budget ({MAX_ATTEMPTS} takeovers) is spent")]
    Exhausted,
    #[error("missing or unknown bearer token")]
    Unauthenticated,
    /// The run store's answer: a definite refusal passes on as it came; anything else is
    /// the run store not answering.
    #[error("the run store did not answer ({:?}); nothing was changed", .0.code())]
    Upstream(Status),
}

impl ServiceError for RecoveryError {
    fn kind(&self) -> (Code, ErrorReason) {
        use RecoveryError as E;
        match self {
            E::Store(e) => match e {
                StoreError::Fenced => (Code::FailedPrecondition, ErrorReason::LeaseFenced),
                StoreError::Held { .. } => (Code::FailedPrecondition, ErrorReason::LeaseHeld),
                StoreError::TakeoverRequired => {
                    (Code::FailedPrecondition, ErrorReason::LeaseTakeoverRequired)
                }
                StoreError::Gap { .. } => (Code::FailedPrecondition, ErrorReason::FrameSequenceGap),
                // A stream's byte budget never refills, so retrying cannot help:
                // FAILED_PRECONDITION (a transport does not retry it). An org's hour does
                // refill: RESOURCE_EXHAUSTED.
                StoreError::BudgetExceeded { scope } if *scope == "stream" => {
                    (Code::FailedPrecondition, ErrorReason::BudgetExceeded)
                }
                StoreError::BudgetExceeded { .. } => {
                    (Code::ResourceExhausted, ErrorReason::BudgetExceeded)
                }
                StoreError::Backend(_) => (Code::Unavailable, ErrorReason::StoreUnavailable),
            },
            E::Unreachable { .. } | E::Endpoint(_) => {
                (Code::Unavailable, ErrorReason::StoreUnavailable)
            }
            E::Invalid { .. } => (Code::InvalidArgument, ErrorReason::InvalidField),
            E::BatchTooLarge { .. } => (Code::InvalidArgument, ErrorReason::BatchTooLarge),
            E::NotBefore { .. } => (Code::FailedPrecondition, ErrorReason::RecoveryNotBefore),
            E::Exhausted => (Code::FailedPrecondition, ErrorReason::RecoveryExhausted),
            E::Unauthenticated => (Code::Unauthenticated, ErrorReason::Unauthenticated),
            E::Upstream(_) => (Code::Unavailable, ErrorReason::UpstreamUnavailable),
        }
    }

    fn metadata(&self) -> Vec<(String, String)> {
        use RecoveryError as E;
        match self {
            E::Store(StoreError::Held { controller }) => {
                metadata([("controller_id", controller.clone())])
            }
            E::Store(StoreError::Gap { next }) => metadata([("next_sequence", next.to_string())]),
            E::Store(StoreError::BudgetExceeded {
                scope: scope @ "org_buffer",
            }) => metadata([
                ("budget_scope", (*scope).to_owned()),
                ("quota", "stream_recovery.max_org_buffered_bytes".to_owned()),
            ]),
            E::Store(StoreError::BudgetExceeded { scope }) => {
                metadata([("budget_scope", (*scope).to_owned())])
            }
            E::Invalid { field, .. } => metadata([("field", field.clone())]),
            E::BatchTooLarge { limit, actual } => {
                metadata([("limit", limit.to_string()), ("actual", actual.to_string())])
            }
            E::NotBefore {
                not_before_ms,
                retry_after_ms,
            } => metadata([
                ("not_before", not_before_ms.to_string()),
                ("retry_after_ms", retry_after_ms.to_string()),
            ]),
            E::Exhausted => metadata([("max_attempts", MAX_ATTEMPTS.to_string())]),
            _ => Vec::new(),
        }
    }

    fn public_message(&self) -> Option<&'static str> {
        matches!(
            self,
            RecoveryError::Store(StoreError::Backend(_))
                | RecoveryError::Unreachable { .. }
                | RecoveryError::Endpoint(_)
        )
        .then_some("the recovery store is unavailable; nothing was changed")
    }

    fn passthrough(&self) -> Option<Status> {
        match self {
            // A definite refusal from the run store stands as it came; only silence is
            // "unavailable".
            RecoveryError::Upstream(status) if is_definite_refusal(status) => Some(status.clone()),
            _ => None,
        }
    }
}

impl From<RecoveryError> for Status {
    fn from(error: RecoveryError) -> Self {
        into_status(&error)
    }
}
