//! What every driver is: the trait the reconciler and the node agents drive sandboxes
//! through, the spec they are given of a sandbox, what starting one needs, and what a
//! probe can say.

use futures::future::BoxFuture;
use runplane_config::Secret;

/// Which sandbox, which execution of it, how its process is found again and how it is
/// contained. The reconciler makes one from its row; a node agent, which has no
/// database, from its assignment.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxSpec {
    pub id: String,
    pub run_id: String,
    /// The execution this spec is of; a later one supersedes it.
    pub execution_generation: i64,
    /// What the driver needs to find the sandbox again (a pid for `process`); empty
    /// before it was started.
    pub driver_handle: String,
    /// Its agent has no network (its run's profile says `network = "none"`); otherwise
    /// it has the deployment's.
    pub offline: bool,
    /// The node it is placed on; `None` when unplaced.
    pub active_node_id: Option<String>,
    /// How long it may sit idle before its node suspends it; zero: never.
    pub idle_timeout_ms: i64,
    /// What it may use, when its run's profile says; `None`: the driver's own
    /// (`[sandbox_reconciler.limits]` where it runs).
    pub limits: Option<runplane_config::SandboxLimits>,
    /// The image of its container, when its run's profile names one; `None`: the
    /// driver's own (`sandbox_reconciler.container.image`). A process driver refuses a
    /// sandbox that has one.
    pub image: Option<String>,
}

/// What a driver's probe said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// Running (or suspended, or being restored): a live observation.
    Alive,
    /// The runner process exited with this status (when known).
    Exited(Option<i32>),
    /// The driver cannot find it.
    Lost,
}

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
    /// Probes one sandbox. May take a while; the caller holds no transaction or lock
    /// across it.
    fn status(&self, sandbox: &SandboxSpec) -> BoxFuture<'static, Probe>;
    fn suspend(&self, sandbox: &SandboxSpec) -> BoxFuture<'static, Result<(), DriverError>>;
    /// Restores a suspended sandbox. Where it can be restored is the driver's to say:
    /// `process` only on the host that suspended it (a wake goes to that node, and a
    /// sandbox whose node is gone past the loss grace is declared lost, never restored
    /// elsewhere); the reconciler's `routed` driver is `process` for local sandboxes and
    /// the node agents' own `process` for the rest; its `fake` restores anything,
    /// anywhere.
    fn resume(&self, sandbox: &SandboxSpec) -> BoxFuture<'static, Result<(), DriverError>>;
    fn destroy(&self, sandbox: &SandboxSpec) -> BoxFuture<'static, Result<(), DriverError>>;
    /// Whether `sandbox`'s agent is parked (waiting for input, with no steer pending),
    /// where this driver can see it from its host; `None` where it cannot (a sandbox a
    /// node agent runs: that node reports it).
    fn waiting_for_input(&self, _sandbox: &SandboxSpec) -> Option<bool> {
        None
    }
}
