//! Paused runs: the run store records PauseRun and ResumeRun; each round asks it which of
//! this reconciler's sandboxes' runs are paused and carries that out. A paused run's
//! running sandbox is suspended whatever its agent is doing (its stream parked first, so
//! its lapsed lease is never taken over): a node's by a SUSPEND assignment, a local one
//! here. A resumed run's sandbox is restored: a node's by a wake to its holder, a local
//! one here, its stream then handed back.

use std::time::Duration;

use runplane_proto::recovery::v1 as recovery_pb;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_sandbox::SandboxSpec;

use super::reconciler::Reconciler;
use super::runs::{Only, RUN_IDS_PER_QUESTION, run_ids_of, runs_among};
use crate::domain::placement::LOCAL_NODE;
use crate::domain::status::SandboxStatus;
use crate::error::ReconcilerError;
use crate::store::entities::sandbox;

/// Why a wake is queued for the sandbox of a resumed run.
pub const RESUME_WAKE_REASON: &str = "its run was resumed";

/// The lease time a restored local runner gets before its next renewal (a node agent
/// gives its own the same).
const UNPARK_TTL: Duration = Duration::from_secs(30);

/// How long a park or unpark may take before the round moves on.
const PARK_TIMEOUT: Duration = Duration::from_secs(5);

impl Reconciler {
    /// Reads this reconciler's live rows in bounded batches, asks the run store which of
    /// their runs are paused (it never reads the run store's tables), records each change
    /// on the row and carries it out ([`Reconciler::carry_out_pause`]). Returns how many
    /// rows changed.
    pub async fn follow_pauses(
        &self,
        run_store: &crate::clients::RunStoreClient,
    ) -> Result<u64, ReconcilerError> {
        let batch = self.settings.batch.clamp(1, RUN_IDS_PER_QUESTION);
        let live = [
            runstore_pb::RunState::Queued,
            runstore_pb::RunState::Starting,
            runstore_pb::RunState::Running,
        ];
        let mut changed = 0;
        let mut cursor: Option<String> = None;
        loop {
            let rows = self.store.not_deleted(cursor.as_deref(), batch).await?;
            let Some(last) = rows.last() else { break };
            cursor = Some(last.id.clone());
            let full = rows.len() as u64 == batch;
            let run_ids = run_ids_of(&rows);
            let paused = if run_ids.is_empty() {
                Default::default()
            } else {
                runs_among(run_store, run_ids, &live, Only::Paused).await?
            };
            for mut row in rows {
                let want = paused.contains(&row.run_id);
                if row.is_paused() != want {
                    // A resume owes the sandbox its restore until it runs again.
                    let next = if want {
                        sandbox::PAUSED
                    } else {
                        sandbox::RESUME_OWED
                    };
                    if !self
                        .store
                        .set_paused(&row.id, row.execution_generation, row.paused, next)
                        .await?
                    {
                        continue;
                    }
                    changed += 1;
                    row.paused = next;
                    tracing::info!(sandbox_id = %row.id, run_id = %row.run_id, paused = want, "run {}", if want { "paused" } else { "resumed" });
                }
                self.carry_out_pause(&row).await?;
            }
            if !full {
                break;
            }
        }
        Ok(changed)
    }

    /// Makes `row`'s sandbox what its pause says, where this reconciler can: a local one
    /// running while paused is suspended here, a local one suspended and owed its resume
    /// is restored here, and a node's suspended one owed its resume gets a wake for its
    /// holder (an idle-suspended one, owed nothing, is left for a message or a reattach to
    /// wake). A node's running one while paused is its node's to suspend (a SUSPEND
    /// assignment). Once a resumed sandbox runs again, nothing more is owed. A step that
    /// fails is logged and the next round tries again.
    async fn carry_out_pause(&self, row: &sandbox::Model) -> Result<(), ReconcilerError> {
        let local = row.active_node_id.as_deref() == Some(LOCAL_NODE);
        if row.is_paused() {
            if local && row.status == SandboxStatus::Started {
                self.suspend_local(row).await?;
            }
            return Ok(());
        }
        if !row.resume_owed() {
            return Ok(());
        }
        match row.status {
            SandboxStatus::Suspended if local => self.restore_local(row).await,
            SandboxStatus::Suspended if row.active_node_id.is_none() => {
                match self
                    .store
                    .queue_wake_once(&row.id, RESUME_WAKE_REASON)
                    .await
                {
                    Ok((_, true)) => {
                        tracing::info!(sandbox_id = %row.id, run_id = %row.run_id, "run resumed; wake queued for its holder");
                        Ok(())
                    }
                    Ok(_) | Err(ReconcilerError::SandboxEnded { .. }) => Ok(()),
                    Err(e) => Err(e),
                }
            }
            // Running again (restored, or never suspended): the resume is done.
            SandboxStatus::Started | SandboxStatus::Creating => {
                self.store
                    .set_paused(&row.id, row.execution_generation, sandbox::RESUME_OWED, 0)
                    .await?;
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Parks the run's stream, then suspends the local sandbox and marks it suspended
    /// (still placed here). A stream that could not be parked leaves it running this
    /// round: frozen, its runner would stop renewing and the lapsed lease be taken over.
    async fn suspend_local(&self, row: &sandbox::Model) -> Result<(), ReconcilerError> {
        if !self.park(row).await {
            return Ok(());
        }
        let suspended = self.driver.suspend(&SandboxSpec::from(row)).await;
        self.local_moved(
            row,
            suspended,
            SandboxStatus::Started,
            SandboxStatus::Suspended,
        )
        .await?;
        Ok(())
    }

    /// Restores a local sandbox suspended for a pause, marks it started and hands its
    /// stream back to its runner.
    async fn restore_local(&self, row: &sandbox::Model) -> Result<(), ReconcilerError> {
        let resumed = self.driver.resume(&SandboxSpec::from(row)).await;
        if self
            .local_moved(
                row,
                resumed,
                SandboxStatus::Suspended,
                SandboxStatus::Started,
            )
            .await?
        {
            self.unpark(row).await;
        }
        Ok(())
    }

    /// Marks a local sandbox `to` (from `from`) once the driver did what it was asked;
    /// whether the driver did (a failure is logged, and the next round tries again).
    async fn local_moved(
        &self,
        row: &sandbox::Model,
        driver: Result<(), runplane_sandbox::DriverError>,
        from: SandboxStatus,
        to: SandboxStatus,
    ) -> Result<bool, ReconcilerError> {
        if let Err(e) = driver {
            tracing::warn!(sandbox_id = %row.id, error = %e, status = %to, "local sandbox not moved for its run's pause; next round retries");
            return Ok(false);
        }
        if self
            .store
            .move_local(&row.id, row.execution_generation, from, to)
            .await?
        {
            tracing::info!(sandbox_id = %row.id, run_id = %row.run_id, status = %to, "local sandbox moved for its run's pause");
        }
        Ok(true)
    }

    /// Parks `row`'s run's stream at the coordinator; whether it answered that it did (a
    /// run whose lease was never granted has nothing to park, which is fine). Without a
    /// coordinator client nothing can take the stream over, and there is nothing to park.
    async fn park(&self, row: &sandbox::Model) -> bool {
        let Some(recovery) = &self.recovery else {
            return true;
        };
        let parked = tokio::time::timeout(
            PARK_TIMEOUT,
            recovery
                .clone()
                .park_stream(recovery_pb::ParkStreamRequest {
                    run_id: row.run_id.clone(),
                    sandbox_id: row.id.clone(),
                }),
        )
        .await;
        match parked {
            Ok(Ok(_)) => true,
            Ok(Err(status)) => {
                tracing::warn!(sandbox_id = %row.id, code = ?status.code(), "stream not parked; not suspending this round");
                false
            }
            Err(_) => {
                tracing::warn!(sandbox_id = %row.id, "ParkStream did not answer in time; not suspending this round");
                false
            }
        }
    }

    /// Hands a restored sandbox's stream back. Should this fail, the lease stays parked
    /// (never taken over) until the runner's next renewal or append takes it back.
    async fn unpark(&self, row: &sandbox::Model) {
        let Some(recovery) = &self.recovery else {
            return;
        };
        let unparked = tokio::time::timeout(
            PARK_TIMEOUT,
            recovery
                .clone()
                .unpark_stream(recovery_pb::UnparkStreamRequest {
                    run_id: row.run_id.clone(),
                    ttl: Some(runplane_grpc::proto_duration(UNPARK_TTL)),
                }),
        )
        .await;
        if !matches!(unparked, Ok(Ok(_))) {
            tracing::warn!(sandbox_id = %row.id, "stream not unparked; the runner takes it back at its next renewal");
        }
    }
}
