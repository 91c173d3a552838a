//! Sandbox drivers behind one trait: `process` (local processes that outlive the
//! control plane) and a fake whose probes tests script, including changing the database
//! while a probe is in flight.

pub mod fake;
pub mod process;
pub mod routed;

use futures::future::BoxFuture;
use runplane_config::Secret;

use crate::domain::loss::Probe;
use crate::domain::sandbox::SandboxSpec;

pub use fake::FakeDriver;
pub use process::ProcessDriver;
pub use routed::RoutedDriver;

/// What a sandbox needs to start its runner. The key travels only here and into the
/// runner's environment; it is never stored or logged.
#[derive(Clone)]
pub struct Launch {
    pub endpoint: String,
    /// The stream recovery coordinator the runner streams its output to.
    pub recovery_endpoint: String,
    pub run_id: String,
    pub run_key: Secret,
    /// W3C traceparent the runner continues (`TRACEPARENT`); empty when untraced.
    pub traceparent: String,
}

#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error("could not start the sandbox: {0}")]
    Start(String),
    #[error("could not signal the sandbox: {0}")]
    Signal(String),
}

/// Starts, observes, suspends, resumes and destroys sandboxes.
pub trait Driver: Send + Sync + 'static {
    /// Starts `sandbox` (idempotently: a sandbox already running is adopted) and returns
    /// the handle that finds it again.
    fn create(
        &self,
        sandbox: &SandboxSpec,
        launch: Launch,
    ) -> BoxFuture<'static, Result<String, DriverError>>;
    /// Probes one sandbox. May take a while; the tick holds no transaction or lock across it.
    fn status(&self, sandbox: &SandboxSpec) -> BoxFuture<'static, Probe>;
    fn suspend(&self, sandbox: &SandboxSpec) -> BoxFuture<'static, Result<(), DriverError>>;
    /// Restores a suspended sandbox. Where it can be restored is the driver's to say:
    /// `process` only on the host that suspended it (a wake goes to that node, and a
    /// sandbox whose node is gone past the loss grace is declared lost, never restored
    /// elsewhere); `routed` is `process` for local sandboxes and the node agents' own
    /// `process` for the rest; `fake` restores anything, anywhere.
    fn resume(&self, sandbox: &SandboxSpec) -> BoxFuture<'static, Result<(), DriverError>>;
    fn destroy(&self, sandbox: &SandboxSpec) -> BoxFuture<'static, Result<(), DriverError>>;
}
