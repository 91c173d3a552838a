//! The run store's errors and their one mapping to `tonic::Status`.
//!
//! Messages are for people and never carry a key, token or failure tail; clients branch on
//! the `ErrorInfo` reason. Storage causes are logged here and not sent.

use runplane_grpc::{ErrorReason, status_with_reason};
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum RunStoreError {
    #[error(transparent)]
    Database(#[from] runplane_db::DbError),
    #[error("run store storage failed: {0}")]
    Storage(#[from] sea_orm::DbErr),
    #[error("invalid receipt signing key: {0}")]
    SigningKey(String),

    #[error("{field}: {reason}")]
    InvalidField { field: String, reason: String },
    #[error("batch has {actual} {unit}, more than the limit of {limit}")]
    BatchTooLarge {
        unit: &'static str,
        limit: u64,
        actual: u64,
    },
    #[error("event {index}: {reason}")]
    EventMalformed { index: usize, reason: String },
    #[error("page_token was not issued for these filters")]
    CursorInvalid,
    #[error("{field} was already used with a different request")]
    KeyReused { field: &'static str },
    #[error("acknowledgement {index}: {reason}")]
    AckInvalid { index: usize, reason: String },
    #[error("acknowledgement {index}: a {kind} cannot be dropped; only a steer can")]
    AckDropForbidden { index: usize, kind: &'static str },

    #[error("{0}")]
    Upstream(String),
    #[error("missing or unknown bearer token")]
    Unauthenticated,
    #[error("the run key is not valid")]
    RunKeyInvalid,
    #[error("the run key was revoked")]
    RunKeyRevoked,
    #[error("the run key belongs to another run")]
    RunKeyWrongRun,
    #[error("the token may not act in org {org}")]
    OrgDenied { org: String },

    #[error("run {run_id} not found")]
    RunNotFound { run_id: String },
    #[error("run {run_id} is terminal ({outcome}: {reason})")]
    RunTerminal {
        run_id: String,
        outcome: String,
        reason: String,
        exit_code: Option<i32>,
    },
    #[error("run key already claimed by another runner instance")]
    HelloNonceMismatch,
    #[error("generation {requested} is older than generation {current} already issued")]
    GenerationStale { requested: u64, current: u64 },
    #[error("the key for this generation was already claimed by a runner")]
    RunKeyClaimed,
    #[error("run {run_id} has no receipt yet: it is not terminal")]
    ReceiptNotSealed { run_id: String },
    #[error("no receipt key {key_id}")]
    ReceiptKeyUnknown { key_id: String },
    #[error("{0}")]
    VerdictConflict(String),
}

impl RunStoreError {
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        RunStoreError::InvalidField {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

type Meta = Vec<(String, String)>;

fn meta<const N: usize>(pairs: [(&str, String); N]) -> Meta {
    pairs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
}

impl From<RunStoreError> for Status {
    fn from(error: RunStoreError) -> Self {
        use RunStoreError as E;
        let message = error.to_string();
        let (code, reason, metadata): (Code, ErrorReason, Meta) = match error {
            E::Database(_) | E::Storage(_) | E::SigningKey(_) => {
                tracing::error!(error = %message, "run store storage error");
                return status_with_reason(
                    Code::Unavailable,
                    ErrorReason::StoreUnavailable,
                    "run store storage is unavailable; nothing was committed",
                    Meta::new(),
                );
            }
            E::InvalidField { field, .. } => (
                Code::InvalidArgument,
                ErrorReason::InvalidField,
                meta([("field", field)]),
            ),
            E::BatchTooLarge { limit, actual, .. } => (
                Code::InvalidArgument,
                ErrorReason::BatchTooLarge,
                meta([("limit", limit.to_string()), ("actual", actual.to_string())]),
            ),
            E::EventMalformed { index, .. } => (
                Code::InvalidArgument,
                ErrorReason::EventMalformed,
                meta([("index", index.to_string())]),
            ),
            E::CursorInvalid => (
                Code::InvalidArgument,
                ErrorReason::CursorInvalid,
                meta([("field", "page_token".to_owned())]),
            ),
            E::KeyReused { field } => (
                Code::InvalidArgument,
                ErrorReason::IdempotencyKeyReused,
                meta([("field", field.to_owned())]),
            ),
            E::AckInvalid { index, .. } => (
                Code::InvalidArgument,
                ErrorReason::AckIdInvalid,
                meta([("index", index.to_string())]),
            ),
            E::AckDropForbidden { index, .. } => (
                Code::InvalidArgument,
                ErrorReason::AckDropForbidden,
                meta([("index", index.to_string())]),
            ),
            E::Upstream(_) => (
                Code::Unavailable,
                ErrorReason::UpstreamUnavailable,
                meta([("upstream", "credential_health".to_owned())]),
            ),
            E::Unauthenticated => (
                Code::Unauthenticated,
                ErrorReason::Unauthenticated,
                Meta::new(),
            ),
            E::RunKeyInvalid => (
                Code::Unauthenticated,
                ErrorReason::RunKeyInvalid,
                Meta::new(),
            ),
            E::RunKeyRevoked => (
                Code::Unauthenticated,
                ErrorReason::RunKeyRevoked,
                Meta::new(),
            ),
            E::RunKeyWrongRun => (
                Code::PermissionDenied,
                ErrorReason::RunKeyWrongRun,
                Meta::new(),
            ),
            E::OrgDenied { .. } => (
                Code::PermissionDenied,
                ErrorReason::PermissionDenied,
                Meta::new(),
            ),
            E::RunNotFound { run_id } => (
                Code::NotFound,
                ErrorReason::RunNotFound,
                meta([("run_id", run_id)]),
            ),
            E::RunTerminal {
                run_id,
                outcome,
                reason,
                exit_code,
            } => {
                let mut m = meta([
                    ("run_id", run_id),
                    ("recorded_verdict_outcome", outcome),
                    ("recorded_verdict_reason", reason),
                ]);
                if let Some(code) = exit_code {
                    m.push(("recorded_exit_code".into(), code.to_string()));
                }
                (Code::FailedPrecondition, ErrorReason::RunTerminal, m)
            }
            E::HelloNonceMismatch => (
                Code::FailedPrecondition,
                ErrorReason::HelloNonceMismatch,
                Meta::new(),
            ),
            E::GenerationStale { .. } => (
                Code::FailedPrecondition,
                ErrorReason::GenerationStale,
                Meta::new(),
            ),
            E::RunKeyClaimed => (
                Code::FailedPrecondition,
                ErrorReason::RunKeyClaimed,
                Meta::new(),
            ),
            E::ReceiptNotSealed { run_id } => (
                Code::FailedPrecondition,
                ErrorReason::ReceiptNotSealed,
                meta([("run_id", run_id)]),
            ),
            E::ReceiptKeyUnknown { .. } => {
                (Code::NotFound, ErrorReason::ReceiptKeyUnknown, Meta::new())
            }
            E::VerdictConflict(_) => (
                Code::FailedPrecondition,
                ErrorReason::VerdictConflict,
                Meta::new(),
            ),
        };
        status_with_reason(code, reason, message, metadata)
    }
}
