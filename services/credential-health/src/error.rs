//! Credential health's errors.

use runplane_grpc::{ErrorReason, status_with_reason};
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum CredentialHealthError {
    #[error(transparent)]
    Database(#[from] runplane_db::DbError),
    #[error(
        "credential_health.profiles: profile `{profile}` (credential `{credential_id}`) has an invalid {field} `{pattern}`: {reason}"
    )]
    Pattern {
        profile: String,
        credential_id: String,
        field: &'static str,
        pattern: String,
        reason: String,
    },
    #[error("storage: {0}")]
    Storage(#[from] sea_orm::DbErr),
    #[error("{field}: {reason}")]
    Invalid { field: &'static str, reason: String },
    #[error("profile `{0}` is not configured")]
    ProfileUnknown(String),
    #[error("credential `{0}` is not named by any configured profile")]
    CredentialUnknown(String),
    #[error("turn_id `{0}` was already reported for another run or credential")]
    TurnReused(String),
    #[error("{message}")]
    Refused {
        reason: ErrorReason,
        message: String,
        credential_id: String,
        cooling_off_for_seconds: u32,
        quarantined_for_seconds: u32,
    },
    #[error("{target} belongs to other orgs than `{org}`")]
    NotOwned {
        org: String,
        /// `credential c1` or `profile p1`, as the run asked.
        target: String,
        /// `credential_id` or `profile`, for the ErrorInfo metadata.
        field: &'static str,
        value: String,
    },
    #[error("this token acts only in its own org, not in `{org}`")]
    OrgDenied { org: String },
    #[error("the run store is unavailable: {0}")]
    Upstream(String),
    #[error("{0}")]
    CursorInvalid(String),
    #[error("a configured token is required as `authorization: Bearer <token>`")]
    Unauthenticated,
}

impl CredentialHealthError {
    pub fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        Self::Invalid {
            field,
            reason: reason.into(),
        }
    }
}

impl From<CredentialHealthError> for Status {
    fn from(e: CredentialHealthError) -> Status {
        use CredentialHealthError as E;
        let message = e.to_string();
        match e {
            E::Invalid { field, .. } => status_with_reason(
                Code::InvalidArgument,
                ErrorReason::InvalidField,
                message,
                [("field", field)],
            ),
            E::ProfileUnknown(profile) => status_with_reason(
                Code::NotFound,
                ErrorReason::ProfileUnknown,
                message,
                [("profile", profile)],
            ),
            E::CredentialUnknown(credential) => status_with_reason(
                Code::NotFound,
                ErrorReason::CredentialUnknown,
                message,
                [("credential_id", credential)],
            ),
            E::TurnReused(_) => status_with_reason(
                Code::InvalidArgument,
                ErrorReason::IdempotencyKeyReused,
                message,
                [("field", "turn_id")],
            ),
            E::Refused {
                reason,
                credential_id,
                cooling_off_for_seconds,
                quarantined_for_seconds,
                ..
            } => status_with_reason(
                Code::FailedPrecondition,
                reason,
                message,
                [
                    ("credential_id", credential_id),
                    (
                        "cooling_off_for_seconds",
                        cooling_off_for_seconds.to_string(),
                    ),
                    (
                        "quarantined_for_seconds",
                        quarantined_for_seconds.to_string(),
                    ),
                ],
            ),
            E::NotOwned {
                org, field, value, ..
            } => status_with_reason(
                Code::PermissionDenied,
                ErrorReason::CredentialNotOwned,
                message,
                [("org_id".to_owned(), org), (field.to_owned(), value)],
            ),
            E::OrgDenied { org } => status_with_reason(
                Code::PermissionDenied,
                ErrorReason::PermissionDenied,
                message,
                [("org_id", org)],
            ),
            E::Upstream(_) => status_with_reason(
                Code::Unavailable,
                ErrorReason::UpstreamUnavailable,
                message,
                [("upstream", "run_store")],
            ),
            E::CursorInvalid(_) => status_with_reason(
                Code::InvalidArgument,
                ErrorReason::CursorInvalid,
                message,
                [("field", "after_cursor")],
            ),
            E::Unauthenticated => status_with_reason(
                Code::Unauthenticated,
                ErrorReason::Unauthenticated,
                message,
                std::iter::empty::<(String, String)>(),
            ),
            E::Database(_) | E::Pattern { .. } | E::Storage(_) => {
                tracing::error!(error = %message, "credential health storage failed");
                status_with_reason(
                    Code::Unavailable,
                    ErrorReason::StoreUnavailable,
                    "credential health storage is unavailable; retry",
                    std::iter::empty::<(String, String)>(),
                )
            }
        }
    }
}
