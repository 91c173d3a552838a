//! Request fields both services decode the same way.

use std::time::Duration;

use crate::error::RunStoreError;

/// An optional non-negative duration; a negative one is refused naming `field`.
pub(super) fn from_duration(
    field: &'static str,
    d: Option<&prost_types::Duration>,
) -> Result<Option<Duration>, RunStoreError> {
    match d {
        None => Ok(None),
        Some(d) if d.seconds < 0 || d.nanos < 0 => {
            Err(RunStoreError::invalid(field, "must not be negative"))
        }
        Some(d) => Ok(Some(Duration::new(d.seconds as u64, d.nanos as u32))),
    }
}
