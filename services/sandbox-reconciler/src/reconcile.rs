//! The reconcile tick and the outbox delivery.
//!
//! A tick reads live sandboxes in bounded batches and probes them with bounded
//! concurrency. It never holds a transaction or lock across a probe; instead every write
//! it makes afterwards is a compare-and-set on what it read (stamp and generation), so
//! overlapping ticks and several reconciler replicas are safe by construction: a tick
//! with a stale snapshot simply loses.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use prost::Message;
use runplane_grpc::client::Bearer;
use runplane_proto::runstore::v1 as pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use tonic::service::interceptor::InterceptedService;

use crate::domain::loss::{Decision, Probe, decide};
use crate::domain::placement::LOCAL_NODE;
use crate::domain::sandbox::SandboxSpec;
use crate::domain::status::SandboxStatus;
use crate::drivers::{Driver, Launch};
use crate::error::ReconcilerError;
use crate::store::Store;
use crate::store::entities::{outbox, sandbox};
use runplane_grpc::tasks::AbortOnDrop;
use runplane_telemetry::metrics;
use tracing::Instrument;

/// The tick's numbers.
#[derive(Debug, Clone)]
pub struct ReconcileSettings {
    /// How long a loss must last before the run is failed (default 90 s).
    pub loss_grace: Duration,
    /// Probes in flight at once.
    pub probe_concurrency: usize,
    /// Rows read per batch.
    pub batch: u64,
    /// Idle time after which a node agent suspends a sandbox; zero for never.
    pub idle_timeout: Duration,
    /// Whether queued runs get sandboxes.
    pub dispatch: bool,
    /// Whether a run may get a local sandbox when no node agent is ready.
    pub local_sandboxes: bool,
    /// Profiles whose sandboxes get no network (`network = "none"`).
    pub offline_profiles: std::collections::BTreeSet<String>,
}

impl Default for ReconcileSettings {
    fn default() -> Self {
        Self {
            loss_grace: Duration::from_secs(90),
            probe_concurrency: 32,
            batch: 500,
            idle_timeout: Duration::ZERO,
            dispatch: true,
            local_sandboxes: true,
            offline_profiles: Default::default(),
        }
    }
}

/// What one tick did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct TickReport {
    pub probed: u64,
    pub stamped: u64,
    pub cleared: u64,
    /// Losses this tick confirmed (it won the compare-and-set and queued the FailRun).
    pub confirmed: u64,
    /// Writes whose compare-and-set found the row changed since it was read.
    pub lost_races: u64,
}

#[derive(Clone)]
pub struct Reconciler {
    store: Store,
    driver: Arc<dyn Driver>,
    settings: ReconcileSettings,
    /// Credential health, for the fleet's capacity; `None` where none runs.
    fleet: Option<crate::slots::FleetClient>,
}

impl Reconciler {
    pub fn new(store: Store, driver: Arc<dyn Driver>, settings: ReconcileSettings) -> Self {
        Self {
            store,
            driver,
            settings,
            fleet: None,
        }
    }

    /// Dispatch fills credentials only up to the capacity credential health reports.
    pub fn with_fleet(mut self, fleet: Option<crate::slots::FleetClient>) -> Self {
        self.fleet = fleet;
        self
    }

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
        let won = match decide(
            row.loss_observed_at_us,
            &probe,
            now,
            self.settings.loss_grace,
        ) {
            Decision::Nothing => return Ok(report),
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
                let stamp = row.loss_observed_at_us.expect("a stamp to confirm");
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
                    .confirm_loss(&row, stamp, status, exit_code, fail)
                    .await?;
                if won {
                    report.confirmed += 1;
                    tracing::warn!(sandbox_id = %row.id, run_id = %row.run_id, "loss outlived the grace; failing the run");
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

/// The run states after which a run's sandboxes are destroyed.
pub const TERMINAL_RUN_STATES: [pb::RunState; 4] = [
    pb::RunState::Succeeded,
    pb::RunState::Failed,
    pb::RunState::Cancelled,
    pb::RunState::BackendError,
];

/// Most run ids in one `ListRuns` question (the run store's limit).
const RUN_IDS_PER_QUESTION: u64 = 500;

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
            let ended = if run_ids.is_empty() {
                Default::default()
            } else {
                ended_runs(run_store, run_ids).await?
            };
            for row in rows.iter().filter(|r| ended.contains(&r.run_id)) {
                if self
                    .store
                    .mark_deleted(&row.id, row.execution_generation)
                    .await?
                {
                    deleted += 1;
                    tracing::info!(sandbox_id = %row.id, run_id = %row.run_id, status = %row.status, "the run has ended; sandbox destroyed");
                }
            }
            if !full {
                break;
            }
        }
        Ok(deleted)
    }

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

    /// One round of the reconciler's background work: dispatch, the sweep of ended runs,
    /// local stops, wakes of parked runs with messages, wake assignment, the loss tick and
    /// outbox delivery. Each step logs its
    /// failure and the next round retries it. The sweep comes before wake assignment, so a
    /// wake of a sandbox whose run ended is settled, not assigned.
    pub async fn round(&self, run_store: &RunStoreClient, endpoints: &RunnerEndpoints) {
        if self.settings.dispatch
            && let Err(e) = dispatch(
                &self.store,
                self.driver.as_ref(),
                run_store,
                self.fleet.as_ref(),
                endpoints,
                self.settings.idle_timeout,
                self.settings.local_sandboxes,
                &self.settings.offline_profiles,
            )
            .await
        {
            tracing::warn!(error = %e, "dispatch failed; next round retries");
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
        if let Err(e) = self.store.assign_wakes(self.store.silent_since()).await {
            tracing::warn!(error = %e, "wake assignment failed; next round retries");
        }
        let started = tokio::time::Instant::now();
        match self.tick().await {
            Ok(report) => {
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
    }
}

/// Why a wake is queued for a parked run that has a message waiting.
pub const MESSAGE_WAKE_REASON: &str = "a message is queued for its run";

/// The distinct run ids of `rows` that can name a run (a lowercase UUID): the run store
/// refuses the whole question otherwise, and no run has another id.
fn run_ids_of(rows: &[sandbox::Model]) -> Vec<String> {
    let mut run_ids: Vec<String> = rows
        .iter()
        .map(|r| r.run_id.clone())
        .filter(|id| {
            uuid::Uuid::parse_str(id).is_ok() && id.bytes().all(|b| !b.is_ascii_uppercase())
        })
        .collect();
    run_ids.sort();
    run_ids.dedup();
    run_ids
}

/// Which of `run_ids` (at most 500) are live and have a steering or control message not
/// yet acknowledged, as the run store says.
async fn runs_with_messages(
    run_store: &RunStoreClient,
    run_ids: Vec<String>,
) -> Result<std::collections::HashSet<String>, ReconcilerError> {
    let live = [pb::RunState::Starting, pb::RunState::Running];
    runs_among(run_store, run_ids, &live, true).await
}

/// Which of `run_ids` (at most 500) the run store says are terminal.
async fn ended_runs(
    run_store: &RunStoreClient,
    run_ids: Vec<String>,
) -> Result<std::collections::HashSet<String>, ReconcilerError> {
    runs_among(run_store, run_ids, &TERMINAL_RUN_STATES, false).await
}

/// Which of `run_ids` (at most 500) are in one of `states` (and, with `pending`, have a
/// message not yet acknowledged), every page of the answer read. The answer is checked
/// here too (id asked for, state one of those asked for), so a run store that ignored a
/// filter could make the caller act on no run it should not.
async fn runs_among(
    run_store: &RunStoreClient,
    run_ids: Vec<String>,
    states: &[pb::RunState],
    pending: bool,
) -> Result<std::collections::HashSet<String>, ReconcilerError> {
    let asked: std::collections::HashSet<String> = run_ids.iter().cloned().collect();
    let mut found = std::collections::HashSet::new();
    let mut page_token = String::new();
    loop {
        let page = run_store
            .clone()
            .list_runs(pb::ListRunsRequest {
                run_ids: run_ids.clone(),
                states: states.iter().map(|s| *s as i32).collect(),
                with_pending_messages: pending,
                page_size: RUN_IDS_PER_QUESTION as u32,
                page_token,
                ..Default::default()
            })
            .await?
            .into_inner();
        found.extend(
            page.runs
                .into_iter()
                .filter(|r| states.contains(&r.state()) && asked.contains(&r.id))
                .map(|r| r.id),
        );
        if page.next_page_token.is_empty() {
            return Ok(found);
        }
        page_token = page.next_page_token;
    }
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

/// The FailRun this reconciler owes the run store for `row`, as an outbox row.
fn fail_run_row(row: &sandbox::Model, what: &str, grace: Duration, now_us: i64) -> outbox::Model {
    let request = pb::FailRunRequest {
        run_id: row.run_id.clone(),
        reason: "sandbox_lost".into(),
        message: format!(
            "sandbox {} {what} for longer than the {} s loss grace",
            row.id,
            grace.as_secs()
        ),
        idempotency_key: format!("sandbox-lost:{}:{}", row.id, row.execution_generation),
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

/// The run store, called with the service token.
pub type RunStoreClient =
    RunServiceClient<InterceptedService<runplane_grpc::client::TracedChannel, Bearer>>;

/// Delivers due outbox rows; each stays until the callee answers.
pub async fn deliver_outbox(
    store: &Store,
    client: &RunStoreClient,
    limit: u64,
) -> Result<u64, ReconcilerError> {
    use runplane_db::outbox::{Delivery, deliver_due};
    let delivered = deliver_due(store.database(), || store.now_us(), limit, |row| {
        let mut client = client.clone();
        async move {
            let Ok(request) = pb::FailRunRequest::decode(row.payload.as_slice()) else {
                return Delivery::Refused("undecodable payload".into());
            };
            // The delivery continues the trace of the decision that owed it.
            let span = runplane_grpc::trace_context::outbox_span(
                &row.kind,
                &row.idempotency_key,
                &row.traceparent,
            );
            match client.fail_run(request).instrument(span).await {
                Ok(answer) => {
                    tracing::info!(key = %row.idempotency_key, outcome = ?answer.into_inner().outcome(), "fail run delivered");
                    Delivery::Delivered
                }
                Err(status) => Delivery::from_failure(status.code() as i32, status.message()),
            }
        }
    })
    .await?;
    Ok(delivered)
}

/// Where a runner reaches the run store and the stream recovery coordinator.
#[derive(Debug, Clone)]
pub struct RunnerEndpoints {
    pub run_store: String,
    pub stream_recovery: String,
}

/// Gives queued runs a sandbox and starts sandboxes that were decided but not started.
///
/// The run key is asked of the run store per sandbox generation (a replay before the
/// runner's Hello rotates the never-used secret), handed to the driver for the runner's
/// environment, and dropped: it is never stored here.
#[allow(clippy::too_many_arguments)]
pub async fn dispatch(
    store: &Store,
    driver: &dyn Driver,
    run_store: &RunStoreClient,
    fleet: Option<&crate::slots::FleetClient>,
    endpoints: &RunnerEndpoints,
    idle_timeout: Duration,
    local_sandboxes: bool,
    offline_profiles: &std::collections::BTreeSet<String>,
) -> Result<u64, ReconcilerError> {
    use runplane_grpc::{ErrorReason, error_info};

    use crate::store::Placed;

    let nodes = store.ready_nodes(store.silent_since()).await?;
    // What each ready node has room for: its capacity less what is placed on it. Runs go
    // to nodes only within that room; with no node ready, they run here (when allowed).
    let mut room = if nodes.is_empty() {
        Vec::new()
    } else {
        let ids: Vec<String> = nodes.iter().map(|n| n.id.clone()).collect();
        let placed = store.placed_per_node(&ids).await?;
        nodes
            .iter()
            .map(|n| {
                let capacity = i64::from(n.capacity);
                let used = placed.get(&n.id).copied().unwrap_or(0);
                (n.id.clone(), capacity, (capacity - used).max(0))
            })
            .collect::<Vec<_>>()
    };
    let free: i64 = room.iter().map(|(_, _, free)| free).sum();
    // Slots are claimed only where a sandbox can be placed; otherwise runs wait queued.
    let placeable = if nodes.is_empty() {
        local_sandboxes
    } else {
        free > 0
    };
    if !placeable {
        tracing::debug!(
            nodes = nodes.len(),
            "no node agent has room and local sandboxes are off or unused; runs wait"
        );
    }
    let max_runs = if nodes.is_empty() {
        crate::slots::CLAIM_PER_ROUND
    } else {
        u32::try_from(free).unwrap_or(u32::MAX)
    };
    let to_place = if placeable {
        crate::slots::runs_to_place(run_store, fleet, max_runs)
            .await
            .map_err(|status| {
                tracing::warn!(code = ?status.code(), message = status.message(), "no slots claimed this round; runs wait");
            })
            .ok()
    } else {
        None
    };
    if let Some(runs) = to_place {
        for run in runs {
            let new = |node_id: String| crate::store::NewSandbox {
                client_request_id: format!("dispatch:{}", run.id),
                network: crate::domain::placement::network_of(offline_profiles, &run.profile),
                run_id: run.id.clone(),
                org_id: run.org_id.clone(),
                node_id,
                idle_timeout_ms: idle_timeout.as_millis() as i64,
                traceparent: run.traceparent.clone(),
            };
            if nodes.is_empty() {
                store.create_placed(new(LOCAL_NODE.to_owned())).await?;
                continue;
            }
            // The node with the most room, within its capacity (checked again under the
            // node's lock, against every replica's placements). With none left the run
            // waits STARTING for the next round; only a run claimed before a crash, or
            // by a replica that placed on the same nodes at once, gets here.
            loop {
                let Some((node, capacity, free)) = room
                    .iter_mut()
                    .filter(|(_, _, free)| *free > 0)
                    .max_by(|a, b| a.2.cmp(&b.2).then_with(|| b.0.cmp(&a.0)))
                else {
                    tracing::debug!(run_id = %run.id, "every ready node is full; the run waits");
                    break;
                };
                match store
                    .place_within_capacity(new(node.clone()), *capacity)
                    .await?
                {
                    Placed::New(_) => {
                        *free -= 1;
                        break;
                    }
                    // A run placed earlier (its launch not claimed yet) is counted where
                    // it is.
                    Placed::Existing(_) => break,
                    Placed::Full => *free = 0,
                }
            }
        }
    }

    let mut started = 0;
    // Node agents launch their own sandboxes (ClaimLaunch); this launches the local ones.
    for row in store
        .creating(50)
        .await?
        .into_iter()
        .filter(|r| r.active_node_id.as_deref() == Some(LOCAL_NODE))
    {
        // The launch (its key, the runner it starts) is part of the run's trace.
        let span = tracing::info_span!(
            "sandbox.launch",
            run_id = %row.run_id,
            sandbox_id = %row.id,
            node_id = LOCAL_NODE,
            attempt = row.execution_generation,
        );
        runplane_grpc::trace_context::continue_trace(&span, &row.traceparent);
        let issued = run_store
            .clone()
            .issue_run_key(pb::IssueRunKeyRequest {
                run_id: row.run_id.clone(),
                sandbox_id: row.id.clone(),
                sandbox_generation: row.execution_generation as u64,
                idempotency_key: format!("{}:{}", row.id, row.execution_generation),
            })
            .instrument(span.clone())
            .await;
        let key = match issued {
            Ok(answer) => Some(answer.into_inner().run_key),
            Err(status) => {
                let reason = error_info(&status).map(|i| i.reason).unwrap_or_default();
                if reason == ErrorReason::RunTerminal.as_str_name() {
                    store
                        .mark_deleted(&row.id, row.execution_generation)
                        .await?;
                    continue;
                }
                if reason != ErrorReason::RunKeyClaimed.as_str_name() {
                    tracing::warn!(sandbox_id = %row.id, code = ?status.code(), "run key not issued yet");
                    continue;
                }
                // A runner of this generation already said Hello: adopt it, start nothing.
                None
            }
        };
        let launch = Launch {
            endpoint: endpoints.run_store.clone(),
            recovery_endpoint: endpoints.stream_recovery.clone(),
            run_id: row.run_id.clone(),
            run_key: runplane_config::Secret::new(key.unwrap_or_default()),
            traceparent: span
                .in_scope(runplane_grpc::trace_context::current_traceparent)
                .unwrap_or_default(),
        };
        match driver
            .create(&SandboxSpec::from(&row), launch)
            .instrument(span)
            .await
        {
            Ok(handle) => {
                if store
                    .mark_started(&row.id, row.execution_generation, &handle)
                    .await?
                {
                    started += 1;
                    tracing::info!(sandbox_id = %row.id, run_id = %row.run_id, %handle, "sandbox started");
                } else {
                    // Deleted while it started (its stop may already be acknowledged): stop
                    // what this call started, so nothing of it keeps running.
                    let started_row = sandbox::Model {
                        driver_handle: handle,
                        ..row.clone()
                    };
                    if let Err(e) = driver.destroy(&SandboxSpec::from(&started_row)).await {
                        tracing::warn!(sandbox_id = %row.id, error = %e, "a sandbox deleted while it started was not stopped");
                    }
                }
            }
            Err(e) => tracing::error!(sandbox_id = %row.id, error = %e, "sandbox not started"),
        }
    }
    Ok(started)
}

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
        tokio::select! {
            () = &mut shutdown => return,
            () = tokio::time::sleep(interval) => {}
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
            .wait_for_runs(pb::WaitForRunsRequest {
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
