//! Credential health's decisions, without I/O.
//!
//! - [`profiles`] reads a failure tail once, into a typed outcome;
//! - [`policy`] is the per-credential outage state machine (threshold, window, cool-off,
//!   quarantine), pure, with its numbers and the reasons for them.

pub mod policy;
pub mod profiles;
