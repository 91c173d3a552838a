//! Checks of request fields every handler shares.

use crate::error::CredentialHealthError;

/// Refuses `value` unless it is a name runplane accepts ([`runplane_ids::Name`]), or
/// empty where the field is not `required`.
pub(super) fn name(
    field: &'static str,
    value: &str,
    required: bool,
) -> Result<(), CredentialHealthError> {
    if value.is_empty() {
        return if required {
            Err(CredentialHealthError::invalid(field, "is required"))
        } else {
            Ok(())
        };
    }
    runplane_ids::Name::parse(value)
        .map(|_| ())
        .map_err(|e| CredentialHealthError::invalid(field, e.to_string()))
}
