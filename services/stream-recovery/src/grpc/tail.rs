//! Tail: a run's frames from its replay buffer, then, when following, new frames as the
//! store wakes the tail, its run's end, heartbeats, and the recoveries it plans while the
//! lease is free.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use runplane_grpc::{ErrorReason, error_info};
use runplane_proto::recovery::v1 as recovery_pb;
use runplane_proto::runstore::v1 as runstore_pb;
use tonic::{Code, Request, Response, Status};

use super::state::{CoordinatorState, budget_of, store_error, timestamp};
use super::validate;

pub(super) type TailStream =
    Pin<Box<dyn Stream<Item = Result<recovery_pb::TailResponse, Status>> + Send + 'static>>;

/// How often a following tail of a run whose lease is free plans a recovery, at most.
const TAIL_PLAN_EVERY: Duration = Duration::from_secs(1);
/// A tail re-reads the buffer this often even with no wake-up (the safety net).
const TAIL_RECHECK: Duration = Duration::from_secs(30);

/// Checks a Tail request and starts serving it: the stream's items come from a task of
/// their own, which ends when the client goes.
pub(super) async fn open(
    s: Arc<CoordinatorState>,
    request: Request<recovery_pb::TailRequest>,
) -> Result<Response<TailStream>, Status> {
    s.operator(&request)?;
    let req = request.into_inner();
    validate::run_id(&req.run_id)?;
    let heartbeat = validate::heartbeat_interval(req.heartbeat_interval.as_ref())?;
    // An unknown run is NOT_FOUND before anything is read or written for it.
    s.run(&req.run_id).await?;
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        if let Err(status) = serve(&s, &req, heartbeat, &tx).await {
            let _ = tx.send(Err(status)).await;
        }
    });
    Ok(Response::new(Box::pin(
        tokio_stream::wrappers::ReceiverStream::new(rx),
    )))
}

/// Serves one Tail until it is done, its client goes, or it fails (`open` sends the
/// failure as the stream's last item).
async fn serve(
    s: &CoordinatorState,
    req: &recovery_pb::TailRequest,
    heartbeat: Duration,
    tx: &tokio::sync::mpsc::Sender<Result<recovery_pb::TailResponse, Status>>,
) -> Result<(), Status> {
    use recovery_pb::tail_response::Item;
    let due = runplane_grpc::heartbeat::Due::new(heartbeat);
    let due = &due;
    let send = |item: Item| {
        due.sent();
        async move {
            tx.send(Ok(recovery_pb::TailResponse { item: Some(item) }))
                .await
                .is_ok()
        }
    };
    // Subscribe before the first read, so a frame appended in between wakes this tail.
    let mut changes = s.store.notifier().subscribe(&req.run_id);
    let mut next = req.from_sequence.max(1);
    let first = s
        .store
        .read(&req.run_id, next, 0)
        .await
        .map_err(store_error)?;
    if req.from_sequence > 0 && req.from_sequence < first.first_available
        || (req.from_sequence == 0 && first.first_available > 1)
    {
        if !send(Item::ReplayGap(recovery_pb::ReplayGap {
            requested_from: req.from_sequence,
            first_available: first.first_available,
        }))
        .await
        {
            return Ok(());
        }
        next = first.first_available;
    }
    let mut caught_up = false;
    let mut run = None;
    // "No controller yet" is reported once, not on every plan while the run waits.
    let mut last_decision = None;
    // When the lease is next worth a look: at once, then as its state says.
    let mut plan_at = tokio::time::Instant::now();
    loop {
        let replay = s
            .store
            .read(&req.run_id, next, 256)
            .await
            .map_err(store_error)?;
        // The buffer restarted past what this reader has (lost keys, a resync): say so.
        if replay.first_available > next {
            if !send(Item::ReplayGap(recovery_pb::ReplayGap {
                requested_from: next,
                first_available: replay.first_available,
            }))
            .await
            {
                return Ok(());
            }
            next = replay.first_available;
        }
        for f in &replay.frames {
            next = f.sequence.saturating_add(1);
            if !send(Item::Frame(recovery_pb::Frame {
                sequence: f.sequence,
                data: f.data.clone(),
                appended_at: Some(timestamp(f.appended_ms)),
            }))
            .await
            {
                return Ok(());
            }
        }
        if replay.frames.len() == 256 {
            continue;
        }
        if !caught_up {
            caught_up = true;
            if !send(Item::CaughtUp(recovery_pb::CaughtUp {
                next_sequence: next,
            }))
            .await
                || !req.follow
            {
                return Ok(());
            }
        }
        // The run's state, followed from the run store rather than polled.
        let followed = run.get_or_insert_with(|| follow_run(s, &req.run_id));
        let state = loop {
            let seen = followed.borrow_and_update().clone();
            match seen {
                RunSeen::Known(run) => break run,
                RunSeen::Gone(status) => return Err(status),
                RunSeen::Unknown => {
                    if followed.changed().await.is_err() {
                        return Err(runplane_grpc::error::status_with_reason(
                            tonic::Code::Unavailable,
                            ErrorReason::UpstreamUnavailable,
                            "the run's state cannot be followed from the run store; retry",
                            [
                                ("run_id", req.run_id.clone()),
                                ("upstream", "run_store".to_owned()),
                            ],
                        ));
                    }
                }
            }
        };
        if state.state().is_terminal() {
            let reason = state.verdict.map(|v| v.reason).unwrap_or_default();
            send(Item::Ended(recovery_pb::StreamEnded { reason })).await;
            return Ok(());
        }
        // A tail of a live run whose lease is free plans a recovery, at most once a second;
        // while the lease is held it looks again when the lease would lapse.
        if tokio::time::Instant::now() >= plan_at {
            let b = s
                .store
                .budget(&req.run_id, s.now_ms())
                .await
                .map_err(store_error)?;
            plan_at = match (&b.lease, b.parked) {
                // Parked: only an unpark (which wakes this tail) changes anything.
                (Some(_), true) => tokio::time::Instant::now() + TAIL_RECHECK,
                (Some((_, expires_ms)), false) => {
                    let lapses = Duration::from_millis((expires_ms - s.now_ms()).max(0) as u64);
                    tokio::time::Instant::now() + lapses.max(TAIL_PLAN_EVERY)
                }
                (None, _) => tokio::time::Instant::now() + TAIL_PLAN_EVERY,
            };
            // A run no runner has started has no controller to replace (what plan() would
            // answer after reading the run again); its start wakes this tail.
            let unstarted = matches!(
                state.state(),
                runstore_pb::RunState::Queued | runstore_pb::RunState::Starting
            );
            if b.lease.is_none() {
                let planned = if unstarted {
                    Ok((recovery_pb::RecoveryDecision::NoControllerYet, None))
                } else {
                    s.plan(&req.run_id, "tail").await
                };
                let decision = match planned {
                    Ok((decision, _)) => Some(decision),
                    Err(status) => match error_info(&status).map(|i| i.reason) {
                        Some(r) if r == ErrorReason::RecoveryNotBefore.as_str_name() => {
                            Some(recovery_pb::RecoveryDecision::Wait)
                        }
                        Some(r) if r == ErrorReason::RecoveryExhausted.as_str_name() => {
                            Some(recovery_pb::RecoveryDecision::Exhausted)
                        }
                        _ => None,
                    },
                };
                let new = decision.filter(|d| {
                    *d != recovery_pb::RecoveryDecision::LeaseHeld
                        && !(*d == recovery_pb::RecoveryDecision::NoControllerYet
                            && last_decision == Some(*d))
                });
                if decision.is_some() {
                    last_decision = decision;
                }
                if let Some(decision) = new {
                    let b = s
                        .store
                        .budget(&req.run_id, s.now_ms())
                        .await
                        .map_err(store_error)?;
                    if !send(Item::Recovery(recovery_pb::RecoveryNotice {
                        decision: decision as i32,
                        budget: Some(budget_of(&b)),
                    }))
                    .await
                    {
                        return Ok(());
                    }
                }
            }
        }
        // Wait for a change to the run's stream, its state, a plan, or a heartbeat.
        let wake_at = due
            .at()
            .min(plan_at)
            .min(tokio::time::Instant::now() + TAIL_RECHECK);
        let woken = tokio::select! {
            woken = changes.changed(wake_at) => woken,
            changed = followed.changed() => changed.is_ok(),
            () = tx.closed() => return Ok(()),
        };
        if woken {
            // A lease may have changed hands: look at it again, within the plan limit.
            plan_at = plan_at.min(tokio::time::Instant::now() + TAIL_PLAN_EVERY);
        }
        // Nothing sent for an interval: say the stream is alive, and where it is.
        if due.is_due()
            && !send(Item::Heartbeat(recovery_pb::Heartbeat {
                next_sequence: next,
                server_time: Some(timestamp(s.now_ms())),
            }))
            .await
        {
            return Ok(());
        }
    }
}

/// What a tail knows of its run's state, from the run store's WatchRun.
#[derive(Debug, Clone)]
enum RunSeen {
    Unknown,
    Known(Box<runstore_pb::Run>),
    Gone(Status),
}

/// Follows `run_id`'s state through the run store's WatchRun (states only, re-opened a
/// second after it fails), so a tail learns that its run started or ended when it
/// happens, without polling the run store. Stops when the receiver is dropped.
fn follow_run(s: &CoordinatorState, run_id: &str) -> tokio::sync::watch::Receiver<RunSeen> {
    let (tx, rx) = tokio::sync::watch::channel(RunSeen::Unknown);
    let (mut client, run_id) = (s.run_store.clone(), run_id.to_owned());
    tokio::spawn(async move {
        let request = || runstore_pb::WatchRunRequest {
            run_id: run_id.clone(),
            states_only: true,
            heartbeat_interval: Some(runplane_grpc::proto_duration(Duration::from_secs(60))),
            ..Default::default()
        };
        loop {
            let opened = tokio::select! {
                () = tx.closed() => return,
                opened = client.watch_run(request()) => opened,
            };
            match opened {
                Ok(stream) => {
                    let mut stream = stream.into_inner();
                    loop {
                        let next = tokio::select! {
                            () = tx.closed() => return,
                            next = stream.message() => next,
                        };
                        match next {
                            Ok(Some(runstore_pb::WatchRunResponse {
                                update: Some(runstore_pb::watch_run_response::Update::Run(run)),
                            })) => {
                                let terminal = run.state().is_terminal();
                                tx.send_replace(RunSeen::Known(Box::new(run)));
                                if terminal {
                                    return;
                                }
                            }
                            Ok(Some(_)) => {}
                            Ok(None) | Err(_) => break,
                        }
                    }
                }
                Err(status) if status.code() == Code::NotFound => {
                    tx.send_replace(RunSeen::Gone(status));
                    return;
                }
                Err(status) => {
                    tracing::debug!(run_id = %run_id, code = ?status.code(), "cannot follow the run's state; retrying in 1 s");
                }
            }
            tokio::select! {
                () = tx.closed() => return,
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    });
    rx
}
