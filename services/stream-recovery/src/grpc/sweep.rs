//! The orphan sweep: SweepOrphans on demand, and the same batches on a schedule.

use std::sync::Arc;
use std::time::Duration;

use runplane_proto::recovery::v1 as recovery_pb;
use runplane_proto::runstore::v1 as runstore_pb;
use tonic::{Code, Request, Response, Status};

use super::state::{CoordinatorState, store_error};
use super::validate;
use crate::domain::policy::{MAX_ATTEMPTS, RESET_AFTER};

impl CoordinatorState {
    /// One bounded batch of the orphan sweep, after `cursor` (in run id order): runs the
    /// run store reports terminal or unknown lose their keys; a live run whose lease is
    /// free, not parked, and whose budget is spent within the reset window is ended as
    /// exhausted. The reset rule is a claim's: a spent budget whose last takeover is more
    /// than RESET_AFTER old would start afresh on the next claim. A running run whose
    /// lease is free otherwise (its controller lapsed, or a reset budget) gets a takeover
    /// planned as a Tail would plan it ([`CoordinatorState::plan`]: within its budget,
    /// only for a controller that existed, not before its backoff), so recovery does not
    /// wait for someone to watch the run. Every settlement is guarded and keyed, and a
    /// claim holds the lease it takes, so replicas sweeping at once, or a batch replayed,
    /// change nothing twice. A dry run names the runs it would settle or try to take over.
    /// Returns the results and the next cursor (empty at the end of a pass).
    pub async fn sweep(
        &self,
        cursor: &str,
        limit: usize,
        dry_run: bool,
    ) -> Result<(Vec<recovery_pb::OrphanResult>, String), Status> {
        let runs = self.store.runs(cursor, limit).await.map_err(store_error)?;
        let mut results = Vec::new();
        for run_id in &runs {
            let action = match self.run(run_id).await {
                Err(status) if status.code() == Code::NotFound => {
                    recovery_pb::OrphanAction::KeysDeleted
                }
                Err(status) => return Err(status),
                Ok(run) if run.state().is_terminal() => recovery_pb::OrphanAction::KeysDeleted,
                Ok(run) => {
                    // The time is read after the run store answers, however long that
                    // took: the lease and the window are judged at the same moment the
                    // store reads them, or a spent budget whose window lapsed meanwhile
                    // (its lease gone too) would be ended though a claim starts afresh.
                    let now = self.now_ms();
                    let b = self.store.budget(run_id, now).await.map_err(store_error)?;
                    let in_window = b
                        .claimed_ms
                        .is_some_and(|c| now - c <= RESET_AFTER.as_millis() as i64);
                    if b.lease.is_none()
                        && (b.exhausted || (b.attempts >= MAX_ATTEMPTS && in_window))
                    {
                        recovery_pb::OrphanAction::RunEnded
                    } else if b.lease.is_none()
                        && !b.parked
                        && run.state() == runstore_pb::RunState::Running
                    {
                        recovery_pb::OrphanAction::TakeoverPlanned
                    } else {
                        recovery_pb::OrphanAction::Skipped
                    }
                }
            };
            let action = if dry_run {
                action
            } else {
                match action {
                    recovery_pb::OrphanAction::KeysDeleted => {
                        self.store.forget(run_id).await.map_err(store_error)?;
                        action
                    }
                    recovery_pb::OrphanAction::RunEnded => {
                        self.end_exhausted(run_id).await?;
                        action
                    }
                    recovery_pb::OrphanAction::TakeoverPlanned => self.sweep_plan(run_id).await?,
                    _ => action,
                }
            };
            results.push(recovery_pb::OrphanResult {
                run_id: run_id.clone(),
                action: action as i32,
            });
        }
        let next = if runs.len() == limit {
            runs.last().cloned().unwrap_or_default()
        } else {
            String::new()
        };
        Ok((results, next))
    }
}

impl CoordinatorState {
    /// Plans a takeover of `run_id` for the sweep: claimed (TAKEOVER_PLANNED), ended
    /// because its budget is spent (RUN_ENDED), or nothing to do yet (SKIPPED: no
    /// controller ever held the lease, a holder came back, the backoff runs).
    async fn sweep_plan(&self, run_id: &str) -> Result<recovery_pb::OrphanAction, Status> {
        use runplane_grpc::ErrorReason;
        match self.plan(run_id, "sweep").await {
            Ok((recovery_pb::RecoveryDecision::Claimed, _)) => {
                Ok(recovery_pb::OrphanAction::TakeoverPlanned)
            }
            Ok(_) => Ok(recovery_pb::OrphanAction::Skipped),
            Err(status) => {
                let reason = runplane_grpc::error_info(&status).map(|i| i.reason);
                if reason.as_deref() == Some(ErrorReason::RecoveryNotBefore.as_str_name()) {
                    Ok(recovery_pb::OrphanAction::Skipped)
                } else if reason.as_deref() == Some(ErrorReason::RecoveryExhausted.as_str_name()) {
                    Ok(recovery_pb::OrphanAction::RunEnded)
                } else {
                    Err(status)
                }
            }
        }
    }
}

/// The scheduled sweep: one bounded batch every `every`, continuing from the previous
/// batch's cursor, so a pass over many runs is spread over rounds. A failed round is
/// logged and retried from the same cursor at the next tick. Runs until aborted.
pub async fn sweep_forever(state: Arc<CoordinatorState>, every: Duration, batch: usize) {
    let mut cursor = String::new();
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        match state.sweep(&cursor, batch, false).await {
            Ok((results, next)) => {
                let count = |a: recovery_pb::OrphanAction| {
                    results.iter().filter(|r| r.action() == a).count()
                };
                let (deleted, ended, planned) = (
                    count(recovery_pb::OrphanAction::KeysDeleted),
                    count(recovery_pb::OrphanAction::RunEnded),
                    count(recovery_pb::OrphanAction::TakeoverPlanned),
                );
                for (action, n) in [
                    ("keys_deleted", deleted),
                    ("run_ended", ended),
                    ("takeover_planned", planned),
                ] {
                    if n > 0 {
                        runplane_telemetry::metrics::recovery_sweep_settled().add(
                            n as u64,
                            &[runplane_telemetry::metrics::attr("action", action)],
                        );
                    }
                }
                if deleted + ended + planned > 0 {
                    tracing::info!(
                        examined = results.len(),
                        deleted,
                        ended,
                        planned,
                        "orphan sweep settled runs"
                    );
                }
                cursor = next;
            }
            Err(status) => {
                tracing::warn!(code = ?status.code(), message = status.message(), "orphan sweep round failed")
            }
        }
    }
}

pub(super) async fn sweep_orphans(
    s: &CoordinatorState,
    request: Request<recovery_pb::SweepOrphansRequest>,
) -> Result<Response<recovery_pb::SweepOrphansResponse>, Status> {
    s.operator(&request)?;
    let req = request.get_ref();
    let limit = validate::sweep_limit(req.limit)?;
    let (results, next_cursor) = s.sweep(&req.cursor, limit, req.dry_run).await?;
    Ok(Response::new(recovery_pb::SweepOrphansResponse {
        results,
        next_cursor,
    }))
}
