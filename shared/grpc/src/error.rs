//! Errors on the wire: a gRPC code plus `google.rpc.ErrorInfo` whose `reason` is one of
//! the stable names in `runplane.errors.v1.Reason`. Clients branch on the reason, never
//! on the message text.

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

/// The `ErrorInfo` a runplane server attached to `status`, if any.
pub fn error_info(status: &Status) -> Option<tonic_types::ErrorInfo> {
    status.get_details_error_info()
}
