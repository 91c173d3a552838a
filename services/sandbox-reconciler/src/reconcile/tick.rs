//! The loss-grace tick: every live sandbox probed, and what each probe saw acted on by
//! compare-and-set against the row as it was read.

use std::time::Duration;

use futures::StreamExt;
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
                let fail = crate::owed::runner_exited(&row, code, now);
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

/// The FailRun owed for `row`, lost (or exited with no recorded status) past the grace.
fn fail_run_row(row: &sandbox::Model, what: &str, grace: Duration, now_us: i64) -> outbox::Model {
    crate::owed::sandbox_lost(
        row,
        format!(
            "sandbox {} {what} for longer than the {} s loss grace",
            row.id,
            grace.as_secs()
        ),
        now_us,
    )
}
