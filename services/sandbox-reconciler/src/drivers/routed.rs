//! The reconciler's view of every sandbox: local ones through the process driver, ones
//! on node agents through what those nodes publish and how recently they heartbeat.
//!
//! Restores: the node agents run the process driver, so a sandbox suspended on a node
//! is restored by that node or not at all (see [`crate::domain::wake`]); a holder silent
//! past [`NODE_SILENCE`](crate::domain::placement::NODE_SILENCE) probes the sandbox lost, and the loss grace then ends it.

use futures::future::BoxFuture;

use runplane_sandbox::{Driver, DriverError, Launch, Probe, ProcessDriver, SandboxSpec};

use crate::domain::placement::LOCAL_NODE;
use crate::domain::sandbox::Substrate;
use crate::domain::status::SandboxStatus;
use crate::store::Store;

#[derive(Debug, Clone)]
pub struct RoutedDriver {
    local: ProcessDriver,
    store: Store,
}

impl RoutedDriver {
    pub fn new(local: ProcessDriver, store: Store) -> Self {
        Self { local, store }
    }

    fn is_local(sandbox: &SandboxSpec) -> bool {
        sandbox.active_node_id.as_deref() == Some(LOCAL_NODE)
    }
}

impl Driver for RoutedDriver {
    fn create(
        &self,
        sandbox: &SandboxSpec,
        launch: Launch,
    ) -> BoxFuture<'static, Result<String, DriverError>> {
        if Self::is_local(sandbox) {
            return self.local.create(sandbox, launch);
        }
        Box::pin(async {
            Err(DriverError::Start(
                "a node agent launches this sandbox".into(),
            ))
        })
    }

    fn status(&self, sandbox: &SandboxSpec) -> BoxFuture<'static, Probe> {
        if Self::is_local(sandbox) {
            return self.local.status(sandbox);
        }
        let store = self.store.clone();
        let (id, generation) = (sandbox.id.clone(), sandbox.execution_generation);
        Box::pin(async move {
            // What its node last published, read now.
            let Ok(row) = store.sandbox(&id).await else {
                // The database is what failed; that says nothing about the sandbox.
                return Probe::Alive;
            };
            // A newer execution's report says nothing about the one probed.
            if row.execution_generation != generation {
                return Probe::Alive;
            }
            // Placed: its node. Suspended for idleness and unplaced: the node holding it
            // (its route identity), which is the only one that can restore it, so a
            // holder gone for good ends it through the loss grace like a placed one.
            let node_id = match store.holder_of(&row).await {
                Ok(Some(node_id)) => node_id,
                // No node holds a direct execution: nothing can ever restore it.
                Ok(None) if row.substrate == Substrate::DIRECT => return Probe::Lost,
                // Restorable by any node: it waits for a wake.
                Ok(None) => return Probe::Alive,
                // The database is what failed; that says nothing about the sandbox.
                Err(_) => return Probe::Alive,
            };
            match store.ready_nodes(store.silent_since()).await {
                Ok(nodes) if nodes.iter().any(|n| n.id == node_id) => {}
                Ok(_) => return Probe::Lost,
                // The database is what failed; that says nothing about the sandbox.
                Err(_) => return Probe::Alive,
            }
            match row.observed() {
                Some(SandboxStatus::Exited) => Probe::Exited(row.exit_code),
                Some(SandboxStatus::Lost) => Probe::Lost,
                _ => Probe::Alive,
            }
        })
    }

    fn suspend(&self, sandbox: &SandboxSpec) -> BoxFuture<'static, Result<(), DriverError>> {
        self.local.suspend(sandbox)
    }

    fn resume(&self, sandbox: &SandboxSpec) -> BoxFuture<'static, Result<(), DriverError>> {
        self.local.resume(sandbox)
    }

    fn destroy(&self, sandbox: &SandboxSpec) -> BoxFuture<'static, Result<(), DriverError>> {
        self.local.destroy(sandbox)
    }

    fn waiting_for_input(&self, sandbox: &SandboxSpec) -> Option<bool> {
        // A node's own sandboxes are its to report (PublishSandboxState).
        Self::is_local(sandbox)
            .then(|| self.local.waiting_for_input(sandbox))
            .flatten()
    }
}
