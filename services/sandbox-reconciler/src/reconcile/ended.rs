//! The sweep of ended runs: the sandboxes of runs the run store says are terminal are
//! deleted, and this reconciler's own deleted sandboxes are stopped.

use futures::StreamExt;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_sandbox::{Driver, SandboxSpec};

use super::reconciler::Reconciler;
use super::runs::{Only, RUN_IDS_PER_QUESTION, run_ids_of, runs_of};
use crate::clients::RunStoreClient;
use crate::domain::placement::LOCAL_NODE;
use crate::error::ReconcilerError;
use crate::store::Store;
use crate::store::entities::sandbox;

/// The run states after which a run's sandboxes are destroyed.
pub const TERMINAL_RUN_STATES: [runstore_pb::RunState; 4] = [
    runstore_pb::RunState::Succeeded,
    runstore_pb::RunState::Failed,
    runstore_pb::RunState::Cancelled,
    runstore_pb::RunState::BackendError,
];

impl Reconciler {
    /// Deletes every sandbox whose run has ended, whatever its status (creating, started,
    /// suspended and unplaced, restoring, or an exit or loss already confirmed). It reads
    /// this reconciler's not-deleted rows in bounded batches and asks the run store which
    /// of their runs are terminal (it never reads the run store's tables); each deletion is
    /// a compare-and-set on the generation it read and settles the sandbox's wakes. What
    /// stops the processes: [`Reconciler::stop_owed_local`] here, the node agents (a
    /// DESTROY assignment) for the rest. Returns how many it deleted.
    pub async fn delete_sandboxes_of_ended_runs(
        &self,
        run_store: &RunStoreClient,
    ) -> Result<u64, ReconcilerError> {
        let batch = self.settings.batch.clamp(1, RUN_IDS_PER_QUESTION);
        let mut deleted = 0;
        let mut cursor: Option<String> = None;
        loop {
            let rows = self.store.not_deleted(cursor.as_deref(), batch).await?;
            let Some(last) = rows.last() else { break };
            cursor = Some(last.id.clone());
            let full = rows.len() as u64 == batch;
            let run_ids = run_ids_of(&rows);
            let runs = if run_ids.is_empty() {
                Default::default()
            } else {
                attempts_of(run_store, run_ids).await?
            };
            for row in &rows {
                let why = match runs.get(&row.run_id) {
                    Some(RunNow::Ended) => "the run has ended",
                    Some(RunNow::OnAttempt(attempt))
                        if i64::from(*attempt) > row.attempt.max(1) =>
                    {
                        "the run went on to a later attempt"
                    }
                    _ => continue,
                };
                if self
                    .store
                    .mark_deleted(&row.id, row.execution_generation)
                    .await?
                {
                    deleted += 1;
                    tracing::info!(sandbox_id = %row.id, run_id = %row.run_id, status = %row.status, attempt = row.attempt.max(1), "{why}; sandbox deleted, its stop owed");
                }
            }
            if !full {
                break;
            }
        }
        Ok(deleted)
    }

    /// Stops the processes of this reconciler's own deleted sandboxes that are still owed
    /// a stop (deleted by the sweep, DestroySandbox or dispatch), and acknowledges each
    /// stop, so a crash in between only delays it to the next round.
    pub async fn stop_owed_local(&self) -> Result<u64, ReconcilerError> {
        let owed = self
            .store
            .destroys_owed(LOCAL_NODE, self.settings.batch)
            .await?;
        let stopped: Vec<Result<bool, ReconcilerError>> = futures::stream::iter(owed)
            .map(|row| async move { stop_local(&self.store, self.driver.as_ref(), &row).await })
            .buffer_unordered(self.settings.probe_concurrency.max(1))
            .collect()
            .await;
        let mut count = 0;
        for outcome in stopped {
            count += u64::from(outcome?);
        }
        Ok(count)
    }
}

/// Where a sandbox's run is, as the run store says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RunNow {
    Ended,
    /// Live, on this attempt.
    OnAttempt(u32),
}

/// Where each of `run_ids` (at most 500) is that the run store knows: ended, or live on
/// an attempt.
async fn attempts_of(
    run_store: &RunStoreClient,
    run_ids: Vec<String>,
) -> Result<std::collections::HashMap<String, RunNow>, ReconcilerError> {
    Ok(runs_of(run_store, run_ids, &[], Only::Any)
        .await?
        .into_iter()
        .map(|run| {
            let now = if TERMINAL_RUN_STATES.contains(&run.state()) {
                RunNow::Ended
            } else {
                RunNow::OnAttempt(run.attempt)
            };
            (run.id, now)
        })
        .collect())
}

/// Stops a deleted local sandbox's process and acknowledges the stop; `false` (logged)
/// when the driver failed, and the stop stays owed.
pub async fn stop_local(
    store: &Store,
    driver: &dyn Driver,
    row: &sandbox::Model,
) -> Result<bool, ReconcilerError> {
    match driver.destroy(&SandboxSpec::from(row)).await {
        Ok(()) => {
            store
                .acknowledge_destroyed(&row.id, row.execution_generation)
                .await?;
            tracing::info!(sandbox_id = %row.id, "deleted sandbox's process stopped");
            Ok(true)
        }
        Err(e) => {
            tracing::warn!(sandbox_id = %row.id, error = %e, "deleted sandbox not stopped yet; next round retries");
            Ok(false)
        }
    }
}
