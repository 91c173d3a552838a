//! Credential health's errors.

use runplane_grpc::error::metadata;
use runplane_grpc::{ErrorReason, ServiceError, into_status};
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

impl From<runplane_ids::OrgDenied> for CredentialHealthError {
    fn from(denied: runplane_ids::OrgDenied) -> Self {
        Self::OrgDenied { org: denied.org }
    }
}

impl CredentialHealthError {
    pub fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        Self::Invalid {
            field,
            reason: reason.into(),
        }
    }
}

impl ServiceError for CredentialHealthError {
    fn kind(&self) -> (Code, ErrorReason) {
        use CredentialHealthError as E;
        match self {
            E::Invalid { .. } => (Code::InvalidArgument, ErrorReason::InvalidField),
            E::ProfileUnknown(_) => (Code::NotFound, ErrorReason::ProfileUnknown),
            E::CredentialUnknown(_) => (Code::NotFound, ErrorReason::CredentialUnknown),
            E::TurnReused(_) => (Code::InvalidArgument, ErrorReason::IdempotencyKeyReused),
            E::Refused { reason, .. } => (Code::FailedPrecondition, *reason),
            E::NotOwned { .. } => (Code::PermissionDenied, ErrorReason::CredentialNotOwned),
            E::OrgDenied { .. } => (Code::PermissionDenied, ErrorReason::PermissionDenied),
            E::Upstream(_) => (Code::Unavailable, ErrorReason::UpstreamUnavailable),
            E::CursorInvalid(_) => (Code::InvalidArgument, ErrorReason::CursorInvalid),
            E::Unauthenticated => (Code::Unauthenticated, ErrorReason::Unauthenticated),
            E::Database(_) | E::Pattern { .. } | E::Storage(_) => {
                (Code::Unavailable, ErrorReason::StoreUnavailable)
            }
        }
    }

    fn metadata(&self) -> Vec<(String, String)> {
        use CredentialHealthError as E;
        match self {
            E::Invalid { field, .. } => metadata([("field", (*field).to_owned())]),
            E::ProfileUnknown(profile) => metadata([("profile", profile.clone())]),
            E::CredentialUnknown(credential) => metadata([("credential_id", credential.clone())]),
            E::TurnReused(_) => metadata([("field", "turn_id".to_owned())]),
            E::Refused {
                credential_id,
                cooling_off_for_seconds,
                quarantined_for_seconds,
                ..
            } => metadata([
                ("credential_id", credential_id.clone()),
                (
                    "cooling_off_for_seconds",
                    cooling_off_for_seconds.to_string(),
                ),
                (
                    "quarantined_for_seconds",
                    quarantined_for_seconds.to_string(),
                ),
            ]),
            E::NotOwned {
                org, field, value, ..
            } => metadata([("org_id", org.clone()), (*field, value.clone())]),
            E::OrgDenied { org } => metadata([("org_id", org.clone())]),
            E::Upstream(_) => metadata([("upstream", "run_store".to_owned())]),
            E::CursorInvalid(_) => metadata([("field", "after_cursor".to_owned())]),
            _ => Vec::new(),
        }
    }

    fn public_message(&self) -> Option<&'static str> {
        use CredentialHealthError as E;
        matches!(self, E::Database(_) | E::Pattern { .. } | E::Storage(_))
            .then_some("credential health storage is unavailable; retry")
    }
}

impl From<CredentialHealthError> for Status {
    fn from(e: CredentialHealthError) -> Status {
        into_status(&e)
    }
}
