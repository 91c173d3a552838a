//! The tonic side of the run store: authenticate, validate, call the store, map errors.
//!
//! - [`runner`]: RunnerService, what a sandbox's runner calls with its run key;
//! - [`operator`]: RunService, what operators and services call;
//! - [`create`]: CreateRun's checks, pure;
//! - [`page`]: ListRuns' page tokens;
//! - [`pause`]: PauseRun and ResumeRun;
//! - [`watch`]: WatchRun's stream;
//! - [`webhooks`]: ListWebhooks, the webhook endpoints and their deliveries;
//! - [`service_state`]: what every call of both works with;
//! - [`fields`]: request fields both decode alike.

mod create;
mod fields;
mod operator;
mod page;
mod pause;
mod runner;
mod service_state;
mod watch;
mod webhooks;

pub use create::{CheckedCreateRun, check_create_run};
pub use operator::RunApi;
pub use runner::{RunnerApi, check_acks};
pub use service_state::ServiceState;
