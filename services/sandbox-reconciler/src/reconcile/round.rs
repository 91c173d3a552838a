//! One round of the reconciler's background work, and the loop that runs a round every
//! interval or as soon as the run store or a node says there is work.

use std::sync::Arc;
use std::time::Duration;

use runplane_grpc::tasks::AbortOnDrop;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_telemetry::metrics;
use tracing::Instrument;

use super::dispatch::{RunnerEndpoints, dispatch};
use super::outbox::deliver_outbox;
use super::reconciler::Reconciler;
use crate::clients::RunStoreClient;

impl Reconciler {
    /// One round of the reconciler's background work: dispatch, the sweep of ended runs,
    /// local stops, wakes of parked runs with messages, pauses and resumes, wake assignment, the loss tick and
    /// outbox delivery. Each step logs its
    /// failure and the next round retries it. The sweep comes before wake assignment, so a
    /// wake of a sandbox whose run ended is settled, not assigned.
    pub async fn round(&self, run_store: &RunStoreClient, endpoints: &RunnerEndpoints) {
        if self.settings.dispatch {
            match dispatch(
                &self.store,
                self.driver.as_ref(),
                run_store,
                self.fleet.as_ref(),
                endpoints,
                self.settings.idle_timeout,
                self.settings.local_sandboxes,
                &self.settings.profiles,
            )
            .await
            {
                Ok(done) => self.retry_due_us.store(
                    done.next_retry_at_us.unwrap_or(0),
                    std::sync::atomic::Ordering::Relaxed,
                ),
                Err(e) => tracing::warn!(error = %e, "dispatch failed; next round retries"),
            }
        }
        if let Err(e) = self.delete_sandboxes_of_ended_runs(run_store).await {
            tracing::warn!(error = %e, "sweep of ended runs failed; next round retries");
        }
        if let Err(e) = self.stop_owed_local().await {
            tracing::warn!(error = %e, "stopping deleted local sandboxes failed; next round retries");
        }
        if let Err(e) = self.wake_sandboxes_with_messages(run_store).await {
            tracing::warn!(error = %e, "waking parked runs with messages failed; next round retries");
        }
        // Before wake assignment: a resumed run's wake is assigned this round.
        if let Err(e) = self.follow_pauses(run_store).await {
            tracing::warn!(error = %e, "following paused runs failed; next round retries");
        }
        if self.settings.local_sandboxes
            && let Err(e) = self.report_local_waiting(run_store).await
        {
            tracing::warn!(error = %e, "reporting whether local agents wait for input failed; next round retries");
        }
        if let Err(e) = self.store.assign_wakes(self.store.silent_since()).await {
            tracing::warn!(error = %e, "wake assignment failed; next round retries");
        }
        let started = tokio::time::Instant::now();
        match self.tick().await {
            Ok(report) => {
                self.loss_due_us.store(
                    report.next_loss_due_us.unwrap_or(0),
                    std::sync::atomic::Ordering::Relaxed,
                );
                metrics::reconcile_tick_duration().record(started.elapsed().as_secs_f64(), &[]);
                if report.stamped > 0 {
                    metrics::reconcile_loss_stamps().add(report.stamped, &[]);
                }
            }
            Err(e) => tracing::warn!(error = %e, "reconcile tick failed; next round retries"),
        }
        if let Err(e) = deliver_outbox(&self.store, run_store, 100).await {
            tracing::warn!(error = %e, "outbox delivery failed; next round retries");
        }
        if let Err(e) = self.prune().await {
            tracing::warn!(error = %e, "pruning ended records failed; next round retries");
        }
    }

    /// Deletes what retention let go (`Store::prune`), at most every [`PRUNE_EVERY`] on
    /// this replica: rounds run often, and the records wait a day.
    pub async fn prune(&self) -> Result<crate::store::Pruned, crate::error::ReconcilerError> {
        use std::sync::atomic::Ordering;
        let now = self.store.now_us();
        let last = self.pruned_at_us.load(Ordering::Relaxed);
        if last != 0 && now - last < PRUNE_EVERY.as_micros() as i64 {
            return Ok(Default::default());
        }
        self.pruned_at_us.store(now, Ordering::Relaxed);
        let before = now - self.settings.retention.as_micros() as i64;
        let pruned = self.store.prune(before, PRUNE_BATCH).await?;
        if pruned != Default::default() {
            tracing::info!(
                sandboxes = pruned.sandboxes,
                wakes = pruned.wakes,
                outbox = pruned.outbox,
                "pruned ended records past retention"
            );
        }
        Ok(pruned)
    }
}

/// How often a replica prunes ended records.
const PRUNE_EVERY: Duration = Duration::from_secs(10);
/// Most records of each kind one prune deletes.
const PRUNE_BATCH: u64 = 500;

/// The reconciler's background work, one [`Reconciler::round`] every `interval`, until
/// `shutdown`.
pub async fn run_loop(
    reconciler: Reconciler,
    run_store: RunStoreClient,
    endpoints: RunnerEndpoints,
    interval: Duration,
    signals: crate::signals::Signals,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    // A run created, a message queued or a run ended starts a round at once (see
    // `wait_for_runs`); the interval stays the safety net for everything else and for a
    // wake-up that never came.
    let run_store_work = Arc::new(tokio::sync::Notify::new());
    let _stop_waiter = AbortOnDrop(tokio::spawn(wait_for_runs(
        run_store.clone(),
        run_store_work.clone(),
    )));
    loop {
        // A run whose retry backoff ends, or a loss whose grace ends, before the next
        // interval's round is acted on then.
        let now = reconciler.store.now_us();
        let wait = [&reconciler.retry_due_us, &reconciler.loss_due_us]
            .into_iter()
            .map(|due| due.load(std::sync::atomic::Ordering::Relaxed))
            .filter(|due| *due > 0)
            .map(|due| {
                Duration::from_micros(due.saturating_sub(now).max(0) as u64)
                    .max(Duration::from_millis(50))
            })
            .fold(interval, Duration::min);
        tokio::select! {
            () = &mut shutdown => return,
            () = tokio::time::sleep(wait) => {}
            () = run_store_work.notified() => {}
            () = signals.round_wanted() => {}
        }
        // A round is background work: not a trace of its own every tick. What it does
        // for a run (a launch, a FailRun) continues that run's trace explicitly.
        reconciler
            .round(&run_store, &endpoints)
            .instrument(runplane_grpc::trace_context::background_span(
                "reconcile.round",
            ))
            .await;
        // The round may have placed, woken or destroyed sandboxes: node agents look now.
        signals.assignments_changed();
    }
}

/// How long one WaitForRuns call waits before it asks again.
const WAIT_FOR_RUNS: Duration = Duration::from_secs(25);

/// Keeps a WaitForRuns long poll open on the run store and wakes the loop when a run is
/// created, has a message queued or ends. The next call starts as soon as one answers,
/// so only a change in the gap between two calls waits for the interval's round. A run
/// store that does not have the method (an older version) is left to the interval.
async fn wait_for_runs(run_store: RunStoreClient, work: Arc<tokio::sync::Notify>) {
    loop {
        let answer = run_store
            .clone()
            .wait_for_runs(runstore_pb::WaitForRunsRequest {
                wait: Some(prost_types::Duration {
                    seconds: WAIT_FOR_RUNS.as_secs() as i64,
                    nanos: 0,
                }),
            })
            .await;
        match answer {
            Ok(a) if a.get_ref().woken => work.notify_one(),
            Ok(_) => {}
            Err(status) if status.code() == tonic::Code::Unimplemented => {
                tracing::info!(
                    "the run store cannot say when runs change; the reconciler waits for each round"
                );
                return;
            }
            Err(status) => {
                tracing::debug!(code = ?status.code(), "waiting for new runs failed; retrying in 1 s");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}
