//! The run store's errors and their one mapping to `tonic::Status`.
//!
//! Messages are for people and never carry a key, token or failure tail; clients branch on
//! the `ErrorInfo` reason. Storage causes are logged here and not sent.

use runplane_grpc::error::metadata;
use runplane_grpc::{ErrorReason, ServiceError, into_status};
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

    #[error("{holder} {id} has {limit} {what}, its quota ({quota}); nothing was written: {then}")]
    QuotaExceeded {
        /// `org` or `run`: what holds the quota.
        holder: &'static str,
        id: String,
        quota: &'static str,
        limit: u64,
        what: &'static str,
        /// What lets the caller try again.
        then: &'static str,
    },

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
    #[error("attempt {attempt} of run {run_id} has ended; the run is on attempt {current}")]
    AttemptSuperseded {
        run_id: String,
        attempt: u32,
        current: u32,
    },
    #[error("run {run_id} retries in {retry_after_ms} ms (its attempt's backoff)")]
    RetryBackoff { run_id: String, retry_after_ms: u64 },
}

impl From<runplane_ids::OrgDenied> for RunStoreError {
    fn from(denied: runplane_ids::OrgDenied) -> Self {
        Self::OrgDenied { org: denied.org }
    }
}

impl RunStoreError {
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        RunStoreError::InvalidField {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

impl ServiceError for RunStoreError {
    fn kind(&self) -> (Code, ErrorReason) {
        use RunStoreError as E;
        match self {
            E::Database(_) | E::Storage(_) | E::SigningKey(_) => {
                (Code::Unavailable, ErrorReason::StoreUnavailable)
            }
            E::InvalidField { .. } => (Code::InvalidArgument, ErrorReason::InvalidField),
            E::BatchTooLarge { .. } => (Code::InvalidArgument, ErrorReason::BatchTooLarge),
            E::EventMalformed { .. } => (Code::InvalidArgument, ErrorReason::EventMalformed),
            E::CursorInvalid => (Code::InvalidArgument, ErrorReason::CursorInvalid),
            E::KeyReused { .. } => (Code::InvalidArgument, ErrorReason::IdempotencyKeyReused),
            E::AckInvalid { .. } => (Code::InvalidArgument, ErrorReason::AckIdInvalid),
            E::AckDropForbidden { .. } => (Code::InvalidArgument, ErrorReason::AckDropForbidden),
            E::QuotaExceeded { .. } => (Code::ResourceExhausted, ErrorReason::QuotaExceeded),
            E::Upstream(_) => (Code::Unavailable, ErrorReason::UpstreamUnavailable),
            E::Unauthenticated => (Code::Unauthenticated, ErrorReason::Unauthenticated),
            E::RunKeyInvalid => (Code::Unauthenticated, ErrorReason::RunKeyInvalid),
            E::RunKeyRevoked => (Code::Unauthenticated, ErrorReason::RunKeyRevoked),
            E::RunKeyWrongRun => (Code::PermissionDenied, ErrorReason::RunKeyWrongRun),
            E::OrgDenied { .. } => (Code::PermissionDenied, ErrorReason::PermissionDenied),
            E::RunNotFound { .. } => (Code::NotFound, ErrorReason::RunNotFound),
            E::RunTerminal { .. } => (Code::FailedPrecondition, ErrorReason::RunTerminal),
            E::HelloNonceMismatch => (Code::FailedPrecondition, ErrorReason::HelloNonceMismatch),
            E::GenerationStale { .. } => (Code::FailedPrecondition, ErrorReason::GenerationStale),
            E::RunKeyClaimed => (Code::FailedPrecondition, ErrorReason::RunKeyClaimed),
            E::ReceiptNotSealed { .. } => (Code::FailedPrecondition, ErrorReason::ReceiptNotSealed),
            E::ReceiptKeyUnknown { .. } => (Code::NotFound, ErrorReason::ReceiptKeyUnknown),
            E::VerdictConflict(_) => (Code::FailedPrecondition, ErrorReason::VerdictConflict),
            E::AttemptSuperseded { .. } => {
                (Code::FailedPrecondition, ErrorReason::AttemptSuperseded)
            }
            E::RetryBackoff { .. } => (Code::Unavailable, ErrorReason::RetryBackoff),
        }
    }

    fn metadata(&self) -> Vec<(String, String)> {
        use RunStoreError as E;
        match self {
            E::InvalidField { field, .. } => metadata([("field", field.clone())]),
            E::BatchTooLarge { limit, actual, .. } => {
                metadata([("limit", limit.to_string()), ("actual", actual.to_string())])
            }
            E::EventMalformed { index, .. }
            | E::AckInvalid { index, .. }
            | E::AckDropForbidden { index, .. } => metadata([("index", index.to_string())]),
            E::CursorInvalid => metadata([("field", "page_token".to_owned())]),
            E::KeyReused { field } => metadata([("field", (*field).to_owned())]),
            E::QuotaExceeded {
                holder,
                id,
                quota,
                limit,
                ..
            } => vec![
                (format!("{holder}_id"), id.clone()),
                ("quota".to_owned(), (*quota).to_owned()),
                ("limit".to_owned(), limit.to_string()),
            ],
            E::Upstream(_) => metadata([("upstream", "credential_health".to_owned())]),
            E::AttemptSuperseded {
                attempt, current, ..
            } => metadata([
                ("attempt", attempt.to_string()),
                ("current_attempt", current.to_string()),
            ]),
            E::RetryBackoff { retry_after_ms, .. } => {
                metadata([("retry_after_ms", retry_after_ms.to_string())])
            }
            E::RunNotFound { run_id } | E::ReceiptNotSealed { run_id } => {
                metadata([("run_id", run_id.clone())])
            }
            E::RunTerminal {
                run_id,
                outcome,
                reason,
                exit_code,
            } => {
                let mut m = metadata([
                    ("run_id", run_id.clone()),
                    ("recorded_verdict_outcome", outcome.clone()),
                    ("recorded_verdict_reason", reason.clone()),
                ]);
                if let Some(code) = exit_code {
                    m.push(("recorded_exit_code".into(), code.to_string()));
                }
                m
            }
            _ => Vec::new(),
        }
    }

    fn public_message(&self) -> Option<&'static str> {
        matches!(
            self,
            RunStoreError::Database(_) | RunStoreError::Storage(_) | RunStoreError::SigningKey(_)
        )
        .then_some("run store storage is unavailable; nothing was committed")
    }
}

impl From<RunStoreError> for Status {
    fn from(error: RunStoreError) -> Self {
        into_status(&error)
    }
}
