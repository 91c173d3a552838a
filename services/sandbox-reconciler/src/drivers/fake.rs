//! A driver whose probes are a script.

use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;

use runplane_sandbox::{Driver, DriverError, Launch, Probe, SandboxSpec};

type Script = dyn Fn(SandboxSpec) -> BoxFuture<'static, Probe> + Send + Sync;

/// A test decides what each probe answers and what happens while it is in flight.
/// Creating, suspending, resuming (on any node: it holds nothing) and destroying always
/// succeed; destroys are recorded.
#[derive(Clone)]
pub struct FakeDriver {
    script: Arc<Script>,
    destroyed: Arc<Mutex<Vec<String>>>,
}

impl FakeDriver {
    pub fn new(
        script: impl Fn(SandboxSpec) -> BoxFuture<'static, Probe> + Send + Sync + 'static,
    ) -> Self {
        Self {
            script: Arc::new(script),
            destroyed: Arc::default(),
        }
    }

    /// The ids of the sandboxes destroyed so far, in order.
    pub fn destroyed(&self) -> Vec<String> {
        self.destroyed.lock().expect("not poisoned").clone()
    }

    /// Every probe answers `probe` at once.
    pub fn always(probe: Probe) -> Self {
        Self::new(move |_| {
            let probe = probe.clone();
            Box::pin(async move { probe })
        })
    }
}

impl Driver for FakeDriver {
    fn create(
        &self,
        sandbox: &SandboxSpec,
        _: Launch,
    ) -> BoxFuture<'static, Result<String, DriverError>> {
        let handle = format!("fake:{}", sandbox.id);
        Box::pin(async move { Ok(handle) })
    }

    fn status(&self, sandbox: &SandboxSpec) -> BoxFuture<'static, Probe> {
        (self.script)(sandbox.clone())
    }

    fn suspend(&self, _: &SandboxSpec) -> BoxFuture<'static, Result<(), DriverError>> {
        Box::pin(async { Ok(()) })
    }

    fn resume(&self, _: &SandboxSpec) -> BoxFuture<'static, Result<(), DriverError>> {
        Box::pin(async { Ok(()) })
    }

    fn destroy(&self, sandbox: &SandboxSpec) -> BoxFuture<'static, Result<(), DriverError>> {
        self.destroyed
            .lock()
            .expect("not poisoned")
            .push(sandbox.id.clone());
        Box::pin(async { Ok(()) })
    }
}
