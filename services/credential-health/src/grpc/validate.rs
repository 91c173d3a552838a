//! Checks of request fields every handler shares.

use crate::error::CredentialHealthError;

/// Refuses `value` unless it is a name runplane accepts (`runplane_config::is_name`), or
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
    if runplane_config::is_name(value) {
        Ok(())
    } else {
        Err(CredentialHealthError::invalid(
            field,
            "must be 1-128 characters of A-Z a-z 0-9 . _ : -",
        ))
    }
}
