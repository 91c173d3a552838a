//! Dispatch: queued runs get sandboxes, on the ready node with the most room or, with
//! none ready, on this host; and sandboxes decided but not started are launched.

use std::time::Duration;

use runplane_proto::runstore::v1 as runstore_pb;
use runplane_sandbox::{Driver, Launch, SandboxSpec};
use tracing::Instrument;

use crate::clients::RunStoreClient;
use crate::domain::placement::{DispatchPlan, LOCAL_NODE, NodeRoom, choose_node, plan_dispatch};
use crate::error::ReconcilerError;
use crate::store::Store;
use crate::store::entities::sandbox;

/// Where a runner reaches the run store and the stream recovery coordinator.
#[derive(Debug, Clone)]
pub struct RunnerEndpoints {
    pub run_store: String,
    pub stream_recovery: String,
}

/// What one dispatch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Dispatched {
    /// Local sandboxes started.
    pub started: u64,
    /// When the first run waiting out its retry backoff may be placed (store
    /// microseconds); `None`: none waits. The loop runs a round then, not a tick later.
    pub next_retry_at_us: Option<i64>,
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
    fleet: Option<&crate::clients::FleetClient>,
    endpoints: &RunnerEndpoints,
    idle_timeout: Duration,
    local_sandboxes: bool,
    profiles: &crate::domain::placement::ProfileSandboxes,
) -> Result<Dispatched, ReconcilerError> {
    use runplane_grpc::{ErrorReason, error_info};

    let nodes = store.ready_nodes(store.silent_since()).await?;
    // What each ready node has room for: its capacity less what is placed on it. Runs go
    // to nodes only within that room; with no node ready, they run here (when allowed).
    let mut rooms = if nodes.is_empty() {
        Vec::new()
    } else {
        let ids: Vec<String> = nodes.iter().map(|n| n.id.clone()).collect();
        let placed = store.placed_per_node(&ids).await?;
        nodes
            .iter()
            .map(|n| {
                NodeRoom::new(
                    n.id.clone(),
                    n.capacity,
                    placed.get(&n.id).copied().unwrap_or(0),
                )
            })
            .collect::<Vec<_>>()
    };
    let max_runs = match plan_dispatch(&rooms, local_sandboxes, crate::slots::CLAIM_PER_ROUND) {
        DispatchPlan::Local { max_runs } | DispatchPlan::Nodes { max_runs } => Some(max_runs),
        DispatchPlan::Wait => {
            tracing::debug!(
                nodes = nodes.len(),
                "no node agent has room and local sandboxes are off or unused; runs wait"
            );
            None
        }
    };
    let mut next_retry_at_us = None;
    let to_place = match max_runs {
        Some(max_runs) => crate::slots::runs_to_place(run_store, fleet, max_runs, store.now_us())
            .await
            .map_err(|status| {
                tracing::warn!(code = ?status.code(), message = status.message(), "no slots claimed this round; runs wait");
            })
            .ok()
            .map(|(runs, next_retry)| {
                next_retry_at_us = next_retry;
                runs
            }),
        None => None,
    };
    if let Some(runs) = to_place {
        for run in runs {
            let attempt = run.attempt.max(1);
            let new = |node_id: String, key: &str| crate::store::NewSandbox {
                // One sandbox per attempt, whichever replica places it.
                client_request_id: key.to_owned(),
                attempt,
                network: profiles.network_of(&run.profile),
                limits: profiles.limits_of(&run.profile),
                image: profiles.image_of(&run.profile),
                run_id: run.id.clone(),
                org_id: run.org_id.clone(),
                node_id,
                idle_timeout_ms: idle_timeout.as_millis() as i64,
                traceparent: run.traceparent.clone(),
            };
            // A sandbox of this attempt that ended before the run store issued it a key
            // (lost while it was created: its loss was refused, the run knowing no sandbox
            // yet) leaves the run STARTING without one. The next is keyed after it, the
            // same for every replica, so one sandbox takes its place.
            let mut key = dispatch_key(&run.id, attempt);
            for replaced in 0..=MAX_REPLACED_BEFORE_KEY {
                let placed = match nodes.is_empty() {
                    true => Some(
                        store
                            .create_placed(new(LOCAL_NODE.to_owned(), &key))
                            .await?,
                    ),
                    false => place_on_a_node(store, &mut rooms, |node| new(node, &key)).await?,
                };
                match placed {
                    Some(ended) if ended_before_its_key(&ended) => {
                        if replaced == MAX_REPLACED_BEFORE_KEY {
                            tracing::warn!(run_id = %run.id, "{replaced} sandboxes of this attempt ended before a key was issued; the run waits for its deadline");
                            break;
                        }
                        tracing::info!(run_id = %run.id, sandbox_id = %ended.id, status = %ended.status, "the run's sandbox ended before its key was issued; placing another");
                        key = replacement_key(&key, &ended.id);
                    }
                    _ => break,
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
            attempt = row.attempt.max(1),
            generation = row.execution_generation,
        );
        runplane_grpc::trace_context::continue_trace(&span, &row.traceparent);
        let issued = run_store
            .clone()
            .issue_run_key(runstore_pb::IssueRunKeyRequest {
                run_id: row.run_id.clone(),
                sandbox_id: row.id.clone(),
                sandbox_generation: row.execution_generation as u64,
                idempotency_key: format!("{}:{}", row.id, row.execution_generation),
                attempt: u32::try_from(row.attempt.max(1)).unwrap_or(u32::MAX),
                node_id: LOCAL_NODE.to_owned(),
            })
            .instrument(span.clone())
            .await;
        let key = match issued {
            Ok(answer) => Some(answer.into_inner().run_key),
            Err(status) => {
                let reason = error_info(&status).map(|i| i.reason).unwrap_or_default();
                if reason == ErrorReason::RunTerminal.as_str_name()
                    || reason == ErrorReason::AttemptSuperseded.as_str_name()
                {
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
    Ok(Dispatched {
        started,
        next_retry_at_us,
    })
}

/// How many sandboxes of one attempt dispatch replaces when each ends before its run key
/// is issued; past it the run waits STARTING for its deadline (logged).
const MAX_REPLACED_BEFORE_KEY: usize = 5;

/// Whether dispatch's sandbox for a run it was handed (STARTING, no key of this attempt
/// issued) has ended: lost, exited or deleted before any runner of it held a key.
fn ended_before_its_key(row: &sandbox::Model) -> bool {
    row.status.is_ended()
}

/// The dedupe key of the sandbox that takes the place of `ended`, keyed `key`.
fn replacement_key(key: &str, ended: &str) -> String {
    format!("{key}:after:{ended}")
}

/// Places one sandbox (`new(node)`) on the node with the most room, within its capacity
/// (checked again under the node's lock, against every replica's placements): the row
/// placed now or before under the same key, or `None` when every node is full. The run
/// then waits STARTING for the next round; only a run claimed before a crash, or by a
/// replica that placed on the same nodes at once, gets there.
async fn place_on_a_node(
    store: &Store,
    rooms: &mut [NodeRoom],
    new: impl Fn(String) -> crate::store::NewSandbox,
) -> Result<Option<sandbox::Model>, ReconcilerError> {
    use crate::store::Placed;
    loop {
        let Some(chosen) = choose_node(rooms) else {
            tracing::debug!("every ready node is full; the run waits");
            return Ok(None);
        };
        let room = &mut rooms[chosen];
        match store
            .place_within_capacity(new(room.node_id.clone()), room.capacity)
            .await?
        {
            Placed::New(row) => {
                room.free -= 1;
                return Ok(Some(row));
            }
            // A run placed earlier (its launch not claimed yet) is counted where it is.
            Placed::Existing(row) => return Ok(Some(row)),
            Placed::Full => room.free = 0,
        }
    }
}

/// The dedupe key of the sandbox dispatch makes for attempt `attempt` of `run_id`: every
/// replica that places the attempt names the same row, so it is started once. The first
/// attempt keeps the key from before attempts (`dispatch:<run>`).
pub fn dispatch_key(run_id: &str, attempt: u32) -> String {
    match attempt {
        0 | 1 => format!("dispatch:{run_id}"),
        n => format!("dispatch:{run_id}:{n}"),
    }
}
