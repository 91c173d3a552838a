//! WatchRun's stream.

use std::time::Duration;

use runplane_proto::runstore::v1 as runstore_pb;
use tonic::Status;

use super::service_state::ServiceState;
use crate::convert;

/// Streams a run's snapshot, its events after the asked sequence and a new snapshot at
/// each state change, until the run is terminal and every event was sent.
pub(super) async fn watch(
    s: &ServiceState,
    first: crate::store::entities::run::Model,
    req: &runstore_pb::WatchRunRequest,
    heartbeat: Duration,
    tx: &tokio::sync::mpsc::Sender<std::result::Result<runstore_pb::WatchRunResponse, Status>>,
) -> std::result::Result<(), Status> {
    use runstore_pb::watch_run_response::Update;
    let due = runplane_grpc::heartbeat::Due::new(heartbeat);
    let due = &due;
    let send = |update: Update| {
        due.sent();
        async move {
            tx.send(Ok(runstore_pb::WatchRunResponse {
                update: Some(update),
            }))
            .await
            .is_ok()
        }
    };
    let mut last_state = first.state;
    let mut last_updated = first.updated_at_us;
    // Whether the agent waits for input, and whether the run is paused, are sub-states:
    // a change of either is a snapshot too.
    let mut last_waiting = first.waiting_since_us;
    let mut last_paused = first.paused_at_us;
    if !send(Update::Run(convert::run(&first))).await {
        return Ok(());
    }
    let mut cursor = req.after_sequence;
    // Where this pass began reading events, and whether a snapshot went out after the
    // last event: the stream's last message is its terminal snapshot.
    let mut read_from = cursor;
    let mut snapshot_last = true;
    let mut changes = s.changes.subscribe(&req.run_id);
    // Events retention deleted are said as one gap, then the stream goes on after it.
    let mut pruned_through = first.events_pruned_through as u64;
    loop {
        if !req.states_only {
            loop {
                if pruned_through > cursor {
                    let gap = runstore_pb::EventsGap {
                        from_sequence: cursor + 1,
                        to_sequence: pruned_through,
                    };
                    cursor = pruned_through;
                    snapshot_last = false;
                    if !send(Update::Gap(gap)).await {
                        return Ok(());
                    }
                }
                let events = s.store.events_after(&req.run_id, cursor, 500).await?;
                let full = events.len() == 500;
                for e in &events {
                    let sequence = e.sequence as u64;
                    // Deleted while this stream read: the gap comes before what follows.
                    if sequence > cursor + 1 {
                        let gap = runstore_pb::EventsGap {
                            from_sequence: cursor + 1,
                            to_sequence: sequence - 1,
                        };
                        if !send(Update::Gap(gap)).await {
                            return Ok(());
                        }
                    }
                    cursor = sequence;
                    snapshot_last = false;
                    if !send(Update::Event(convert::event(e))).await {
                        return Ok(());
                    }
                }
                if !full {
                    break;
                }
            }
        }
        let run = s.store.get_run(&req.run_id).await?;
        if !req.states_only && run.events_pruned_through as u64 > cursor {
            pruned_through = run.events_pruned_through as u64;
            continue;
        }
        let caught_up = req.states_only || cursor >= run.last_sequence as u64;
        // A run that ended while its last events were still unsent (or a finished run
        // watched from before them): they go first, then the terminal snapshot ends the
        // stream, whichever snapshot was sent before them.
        if run.state.is_terminal() && !caught_up && cursor > read_from {
            read_from = cursor;
            continue;
        }
        if run.state != last_state
            || (run.state.is_terminal() && run.updated_at_us != last_updated)
            || (run.state.is_terminal() && caught_up && !snapshot_last)
            || run.waiting_since_us != last_waiting
            || run.paused_at_us != last_paused
        {
            last_state = run.state;
            last_updated = run.updated_at_us;
            last_waiting = run.waiting_since_us;
            last_paused = run.paused_at_us;
            if !send(Update::Run(convert::run(&run))).await {
                return Ok(());
            }
            snapshot_last = true;
        }
        if run.state.is_terminal() && caught_up {
            return Ok(());
        }
        if s.changes.is_closing() {
            // Shutting down: end the stream; the watcher resumes from its last sequence.
            return Err(runplane_grpc::error::status_with_reason(
                tonic::Code::Unavailable,
                runplane_grpc::ErrorReason::ShuttingDown,
                "the run store is shutting down; resume the watch from the last sequence",
                [("run_id", req.run_id.clone())],
            ));
        }
        // What this stream has: the re-check wakes it if the stored run moved past that.
        let sent_through = if req.states_only {
            run.last_sequence
        } else {
            run.last_sequence.min(cursor as i64)
        };
        changes.seen(crate::changes::Version {
            last_sequence: sent_through,
            updated_at_us: run.updated_at_us,
        });
        // Read again only when the run changed; in between, heartbeats cost no query.
        while !changes.changed(due.at()).await {
            if s.changes.is_closing() {
                break;
            }
            // Nothing sent for an interval: say the stream is alive, and where it is.
            let heartbeat = runstore_pb::Heartbeat {
                last_sequence: cursor,
                server_time: Some(runplane_clock::to_timestamp(s.store.now_us())),
            };
            if !send(Update::Heartbeat(heartbeat)).await {
                return Ok(());
            }
        }
    }
}
