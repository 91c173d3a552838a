//! Sandbox drivers: how the reconciler observes (and later starts, suspends, resumes and
//! destroys) a sandbox. The `process` driver lands with the node agent; the fake here lets
//! tests script every probe, including changing the database while one is in flight.

use std::sync::Arc;

use futures::future::BoxFuture;

use crate::domain::loss::Probe;
use crate::store::entities::sandbox;

/// Observes sandboxes.
pub trait Driver: Send + Sync + 'static {
    /// Probes one sandbox. May take a while (a network call); the tick does not hold a
    /// transaction or lock across it.
    fn status(&self, sandbox: &sandbox::Model) -> BoxFuture<'static, Probe>;
}

type Script = dyn Fn(sandbox::Model) -> BoxFuture<'static, Probe> + Send + Sync;

/// A driver whose probes are a script: a test decides what each probe answers and what
/// happens while it is in flight.
#[derive(Clone)]
pub struct FakeDriver {
    script: Arc<Script>,
}

impl FakeDriver {
    pub fn new(
        script: impl Fn(sandbox::Model) -> BoxFuture<'static, Probe> + Send + Sync + 'static,
    ) -> Self {
        Self {
            script: Arc::new(script),
        }
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
    fn status(&self, sandbox: &sandbox::Model) -> BoxFuture<'static, Probe> {
        (self.script)(sandbox.clone())
    }
}
