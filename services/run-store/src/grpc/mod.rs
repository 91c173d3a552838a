//! The tonic side of the run store: authenticate, validate, call the store, map errors.
//!
//! - [`runner`]: RunnerService, what a sandbox's runner calls with its run key;
//! - [`operator`]: RunService, what operators and services call;
//! - [`watch`]: WatchRun's stream;
//! - [`service_state`]: what every call of both works with;
//! - [`fields`]: request fields both decode alike.

mod fields;
mod operator;
mod runner;
mod service_state;
mod watch;

pub use operator::{CheckedCreateRun, RunApi, check_create_run};
pub use runner::{RunnerApi, check_acks};
pub use service_state::ServiceState;
