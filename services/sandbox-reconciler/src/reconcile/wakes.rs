//! Sandbox wakes for parked runs with a message waiting: a steer or a control message
//! addressed to a frozen runner restores its sandbox, as a reattach does.

use runplane_proto::runstore::v1 as runstore_pb;

use super::reconciler::Reconciler;
use super::runs::{Only, RUN_IDS_PER_QUESTION, run_ids_of, runs_among};
use crate::clients::RunStoreClient;
use crate::error::ReconcilerError;

impl Reconciler {
    /// Wakes every suspended, unplaced sandbox whose run has a steering or control
    /// message its runner has not acknowledged (a steer, an interrupt, a resume_stream,
    /// an abort): the message would wait for a runner that is frozen, so whatever is
    /// addressed to a parked run wakes it, as a reattach does, with no reattach. The wake
    /// goes to the sandbox's holder like any other. Reads its rows in bounded batches and
    /// asks the run store which of their runs have such a message (it never reads the
    /// run store's tables). Returns how many wakes it queued.
    pub async fn wake_sandboxes_with_messages(
        &self,
        run_store: &RunStoreClient,
    ) -> Result<u64, ReconcilerError> {
        let batch = self.settings.batch.clamp(1, RUN_IDS_PER_QUESTION);
        let mut queued = 0;
        let mut cursor: Option<String> = None;
        loop {
            let rows = self
                .store
                .suspended_unplaced(cursor.as_deref(), batch)
                .await?;
            let Some(last) = rows.last() else { break };
            cursor = Some(last.id.clone());
            let full = rows.len() as u64 == batch;
            let run_ids = run_ids_of(&rows);
            let waiting = if run_ids.is_empty() {
                Default::default()
            } else {
                runs_with_messages(run_store, run_ids).await?
            };
            for row in rows.iter().filter(|r| waiting.contains(&r.run_id)) {
                match self
                    .store
                    .queue_wake_once(&row.id, MESSAGE_WAKE_REASON)
                    .await
                {
                    // Queued by this call, not one already open.
                    Ok((_, true)) => {
                        queued += 1;
                        tracing::info!(sandbox_id = %row.id, run_id = %row.run_id, "a message waits for the suspended run; wake queued");
                    }
                    Ok(_) => {}
                    // Ended since it was read: nothing to wake.
                    Err(ReconcilerError::SandboxEnded { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
            if !full {
                break;
            }
        }
        Ok(queued)
    }
}

/// Why a wake is queued for a parked run that has a message waiting.
pub const MESSAGE_WAKE_REASON: &str = "a message is queued for its run";

/// Which of `run_ids` (at most 500) are live and have a steering or control message not
/// yet acknowledged, as the run store says.
async fn runs_with_messages(
    run_store: &RunStoreClient,
    run_ids: Vec<String>,
) -> Result<std::collections::HashSet<String>, ReconcilerError> {
    let live = [
        runstore_pb::RunState::Starting,
        runstore_pb::RunState::Running,
    ];
    runs_among(run_store, run_ids, &live, Only::WithPendingMessages).await
}
