//! The loss-grace tick: every live sandbox probed, and what each probe saw acted on by
//! compare-and-set against the row as it was read.

use std::time::Duration;

use futures::StreamExt;
use prost::Message;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_sandbox::{Probe, SandboxSpec};

use super::reconciler::{Reconciler, TickReport};
use crate::domain::loss::{Decision, decide};
use crate::domain::status::SandboxStatus;
use crate::error::ReconcilerError;
use crate::store::entities::{outbox, sandbox};

impl Reconciler {
    /// Probes every live sandbox once.
    #[tracing::instrument(skip_all, name = "reconcile.tick")]
    pub async fn tick(&self) -> Result<TickReport, ReconcilerError> {
        let mut report = TickReport::default();
        let mut cursor: Option<String> = None;
        loop {
            let rows = self
                .store
                .probe_candidates(cursor.as_deref(), self.settings.batch)
                .await?;
            let Some(last) = rows.last() else { break };
            cursor = Some(last.id.clone());
            let full = rows.len() as u64 == self.settings.batch;
            let outcomes: Vec<Result<TickReport, ReconcilerError>> = futures::stream::iter(rows)
                .map(|row| self.observe(row))
                .buffer_unordered(self.settings.probe_concurrency.max(1))
                .collect()
                .await;
            for outcome in outcomes {
                let o = outcome?;
                report.probed += o.probed;
                report.stamped += o.stamped;
                report.cleared += o.cleared;
                report.confirmed += o.confirmed;
                report.lost_races += o.lost_races;
                report.next_loss_due_us = match (report.next_loss_due_us, o.next_loss_due_us) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
            }
            if !full {
                break;
            }
        }
        Ok(report)
    }

    /// Probes one sandbox and acts on what it saw, against the row as it was read.
    pub async fn observe(&self, row: sandbox::Model) -> Result<TickReport, ReconcilerError> {
        let mut report = TickReport {
            probed: 1,
            ..TickReport::default()
        };
        let probe = self.driver.status(&SandboxSpec::from(&row)).await;
        let now = self.store.now_us();
        let grace_us = self.settings.loss_grace.as_micros().min(i64::MAX as u128) as i64;
        let won = match decide(
            row.loss_observed_at_us,
            &probe,
            now,
            self.settings.loss_grace,
        ) {
            Decision::Nothing => {
                // A loss still within its grace: due when the grace ends.
                report.next_loss_due_us = row
                    .loss_observed_at_us
                    .filter(|_| !matches!(probe, Probe::Alive))
                    .map(|stamp| stamp.saturating_add(grace_us));
                return Ok(report);
            }
            Decision::StampLoss | Decision::ReplaceStamp => {
                let won = self
                    .store
                    .stamp_loss(
                        &row.id,
                        row.execution_generation,
                        row.loss_observed_at_us,
                        now,
                    )
                    .await?;
                if won {
                    report.stamped += 1;
                    report.next_loss_due_us = Some(now.saturating_add(grace_us));
                    tracing::info!(sandbox_id = %row.id, run_id = %row.run_id, probe = ?probe, "loss observed; waiting out the grace");
                }
                won
            }
            Decision::ClearLoss => {
                let stamp = row.loss_observed_at_us.expect("a stamp to clear");
                let won = self
                    .store
                    .clear_loss(&row.id, row.execution_generation, stamp)
                    .await?;
                if won {
                    report.cleared += 1;
                    tracing::info!(sandbox_id = %row.id, "sandbox seen alive again; loss cleared");
                }
                won
            }
            Decision::ConfirmLoss => {
                let (status, exit_code, what) = match probe {
                    Probe::Exited(code) => (
                        SandboxStatus::Exited,
                        code,
                        code.map_or("exited".to_owned(), |c| format!("exited with status {c}")),
                    ),
                    _ => (SandboxStatus::Lost, None, "lost".to_owned()),
                };
                let fail = fail_run_row(&row, &what, self.settings.loss_grace, now);
                let won = self
                    .store
                    .confirm_loss(&row, row.loss_observed_at_us, status, exit_code, fail)
                    .await?;
                if won {
                    report.confirmed += 1;
                    tracing::warn!(sandbox_id = %row.id, run_id = %row.run_id, "loss outlived the grace; failing the run");
                }
                won
            }
            Decision::ConfirmExit => {
                let Probe::Exited(code) = probe else {
                    unreachable!("only a recorded exit is certain")
                };
                let fail = runner_exited_row(&row, code, now);
                let won = self
                    .store
                    .confirm_loss(
                        &row,
                        row.loss_observed_at_us,
                        SandboxStatus::Exited,
                        code,
                        fail,
                    )
                    .await?;
                if won {
                    report.confirmed += 1;
                    tracing::warn!(sandbox_id = %row.id, run_id = %row.run_id, exit_code = ?code, "the runner exited; ending the run unless it has a verdict");
                }
                won
            }
        };
        if !won {
            report.lost_races += 1;
        }
        Ok(report)
    }
}

/// The FailRun this reconciler owes the run store for `row`, as an outbox row.
fn fail_run_row(row: &sandbox::Model, what: &str, grace: Duration, now_us: i64) -> outbox::Model {
    owed_fail_run(
        row,
        "sandbox_lost",
        format!(
            "sandbox {} {what} for longer than the {} s loss grace",
            row.id,
            grace.as_secs()
        ),
        format!("sandbox-lost:{}:{}", row.id, row.execution_generation),
        now_us,
    )
}

/// The FailRun owed for `row` whose runner exited with `code` (recorded by its driver).
/// A runner that submitted its verdict before it exited left its run terminal, and the
/// run store answers this one with that verdict, changing nothing.
fn runner_exited_row(row: &sandbox::Model, code: Option<i32>, now_us: i64) -> outbox::Model {
    let status = code.map_or("exited".to_owned(), |c| match c {
        // The shell's convention: 128 + the signal that killed it.
        129..=192 => format!("was killed by signal {}", c - 128),
        c => format!("exited with status {c}"),
    });
    owed_fail_run(
        row,
        REASON_RUNNER_EXITED,
        format!(
            "the runner of sandbox {} {status} without a verdict",
            row.id
        ),
        format!("runner-exited:{}:{}", row.id, row.execution_generation),
        now_us,
    )
}

/// Why a run ends when its runner exited without a verdict.
pub const REASON_RUNNER_EXITED: &str = "runner_exited";

fn owed_fail_run(
    row: &sandbox::Model,
    reason: &str,
    message: String,
    idempotency_key: String,
    now_us: i64,
) -> outbox::Model {
    let request = runstore_pb::FailRunRequest {
        run_id: row.run_id.clone(),
        reason: reason.into(),
        message,
        idempotency_key,
        // Only the sandbox and execution this reconciler watched: a run that moved on (to
        // a newer generation, or to a replacement sandbox, which starts at generation 1
        // again) is left alone.
        if_sandbox_generation: Some(row.execution_generation as u64),
        if_sandbox_id: row.id.clone(),
    };
    let mut owed = runplane_db::outbox::row(
        "run_store.fail_run",
        request.idempotency_key.clone(),
        request.encode_to_vec(),
        now_us,
    );
    // The run's trace, so the loss and the run's end read as one story.
    owed.traceparent = row.traceparent.clone();
    owed
}
