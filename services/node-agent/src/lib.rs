//! The node agent (`runplane node`): one per host of the direct substrate. It registers
//! with the sandbox reconciler, takes the sandboxes placed on it and drives them with the
//! process driver of `runplane-sandbox` ([`agent`]), and serves their sessions at its own
//! endpoint ([`session`]).
//!
//! It depends on no database crate and on nothing of the reconciler but its gRPC API: it
//! holds only its own node credential, beside the untrusted agents it runs.

pub mod agent;
pub mod error;
mod refusals;
pub mod session;

pub use agent::{AgentConfig, run};
pub use error::AgentError;
