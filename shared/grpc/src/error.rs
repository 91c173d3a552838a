//! Errors on the wire: a gRPC code plus `google.rpc.ErrorInfo` whose `reason` is one of
//! the stable names in `runplane.errors.v1.Reason`. Clients branch on the reason, never
//! on the message text. Also the error of building a client ([`ClientError`]), and
//! `error_chain` to show any error with its causes.

use std::collections::HashMap;

use runplane_proto::ERROR_DOMAIN;
pub use runplane_proto::errors::v1::Reason as ErrorReason;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

/// A status with `ErrorInfo { reason, domain: "runplane.dev", metadata }`.
///
/// `message` is for people; keep secrets and internal causes out of it.
pub fn status_with_reason<K, V>(
    code: Code,
    reason: ErrorReason,
    message: impl Into<String>,
    metadata: impl IntoIterator<Item = (K, V)>,
) -> Status
where
    K: Into<String>,
    V: Into<String>,
{
    let metadata: HashMap<String, String> = metadata
        .into_iter()
        .map(|(k, v)| (k.into(), v.into()))
        .collect();
    Status::with_error_details(
        code,
        message,
        ErrorDetails::with_error_info(reason.as_str_name(), ERROR_DOMAIN, metadata),
    )
}

/// A service's error as the wire sees it. Each service's error enum implements this once,
/// and [`into_status`] is the one mapping from it to a `Status`, so every service answers
/// the same way: the code, a stable reason clients branch on, the `ErrorInfo` metadata,
/// and a message for people that never carries an internal cause.
pub trait ServiceError: std::fmt::Display {
    /// The gRPC code and the stable reason.
    fn kind(&self) -> (Code, ErrorReason);

    /// The `ErrorInfo` metadata (the field, the id, the limit: what a client needs).
    fn metadata(&self) -> Vec<(String, String)> {
        Vec::new()
    }

    /// For an internal cause (storage, configuration): what the client is told instead.
    /// [`into_status`] logs the error itself and never sends it. `None` sends the error's
    /// own message.
    fn public_message(&self) -> Option<&'static str> {
        None
    }

    /// A status passed on as it came (an upstream service's answer, its reason included).
    fn passthrough(&self) -> Option<Status> {
        None
    }
}

/// The `Status` of `error`: see [`ServiceError`].
pub fn into_status(error: &impl ServiceError) -> Status {
    if let Some(status) = error.passthrough() {
        return status;
    }
    let (code, reason) = error.kind();
    match error.public_message() {
        Some(public) => {
            tracing::error!(%error, ?code, reason = reason.as_str_name(), "internal error (not sent to the client)");
            status_with_reason(code, reason, public, error.metadata())
        }
        None => status_with_reason(code, reason, error.to_string(), error.metadata()),
    }
}

/// Whether `status` from another runplane service is a definite refusal (it carries an
/// `ErrorInfo` reason and is not UNAVAILABLE), which a caller passes on as it came; any
/// other failure means the service did not answer.
pub fn is_definite_refusal(status: &Status) -> bool {
    status.code() != Code::Unavailable && error_info(status).is_some()
}

/// `[(key, value)]` as ErrorInfo metadata.
pub fn metadata<const N: usize>(pairs: [(&str, String); N]) -> Vec<(String, String)> {
    pairs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
}

/// The `ErrorInfo` a runplane server attached to `status`, if any.
pub fn error_info(status: &Status) -> Option<tonic_types::ErrorInfo> {
    status.get_details_error_info()
}

/// Why a channel to a runplane service could not be built or connected.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid endpoint `{endpoint}`: {reason}")]
    InvalidEndpoint { endpoint: String, reason: String },
    #[error("could not connect to {endpoint}: {reason}")]
    Connect { endpoint: String, reason: String },
}

/// `e` and each of its sources, joined by `: `.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}
