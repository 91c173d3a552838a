//! Whether the agents of this reconciler's own sandboxes wait for input, passed to the
//! run store as it changes (a node agent reports its own sandboxes' through
//! PublishSandboxState, and the NodeService handler passes that on the same way).

use std::collections::HashMap;

use runplane_proto::runstore::v1 as runstore_pb;
use runplane_sandbox::SandboxSpec;

use super::reconciler::Reconciler;
use crate::clients::RunStoreClient;
use crate::error::ReconcilerError;

impl Reconciler {
    /// Looks at every started local sandbox's agent and reports each change of whether it
    /// waits for input to the run store (the first look after a start reports too).
    /// Returns how many local sandboxes the run store knows the state of. A report that
    /// fails is sent again by the next round.
    pub async fn report_local_waiting(
        &self,
        run_store: &RunStoreClient,
    ) -> Result<u64, ReconcilerError> {
        let mut seen: HashMap<String, (i64, bool)> = HashMap::new();
        let mut after: Option<String> = None;
        loop {
            let rows = self
                .store
                .local_started(after.as_deref(), self.settings.batch)
                .await?;
            let Some(last) = rows.last() else { break };
            after = Some(last.id.clone());
            let full = rows.len() as u64 == self.settings.batch;
            for row in rows {
                if let Some(waiting) = self.driver.waiting_for_input(&SandboxSpec::from(&row)) {
                    seen.insert(row.id.clone(), (row.execution_generation, waiting));
                    if self.waiting_reported(&row.id) != Some((row.execution_generation, waiting)) {
                        let report = runstore_pb::ReportWaitingForInputRequest {
                            run_id: row.run_id.clone(),
                            execution_generation: row.execution_generation as u64,
                            // This host's clock orders its own observations.
                            observation_seq: self.store.now_us().max(0) as u64,
                            waiting,
                        };
                        match run_store.clone().report_waiting_for_input(report).await {
                            Ok(_) => {
                                tracing::info!(sandbox_id = %row.id, run_id = %row.run_id, waiting, "agent waiting for input reported");
                                self.remember_waiting(&row.id, (row.execution_generation, waiting));
                            }
                            Err(status) => {
                                tracing::warn!(sandbox_id = %row.id, code = ?status.code(), "could not report waiting for input; next round retries")
                            }
                        }
                    }
                }
            }
            if !full {
                break;
            }
        }
        // Forget sandboxes no longer started here.
        let mut reported = self.waiting.lock().expect("not poisoned");
        reported.retain(|id, _| seen.contains_key(id));
        Ok(reported.len() as u64)
    }

    fn waiting_reported(&self, sandbox_id: &str) -> Option<(i64, bool)> {
        self.waiting
            .lock()
            .expect("not poisoned")
            .get(sandbox_id)
            .copied()
    }

    fn remember_waiting(&self, sandbox_id: &str, what: (i64, bool)) {
        self.waiting
            .lock()
            .expect("not poisoned")
            .insert(sandbox_id.to_owned(), what);
    }
}
