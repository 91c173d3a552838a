//! The event queue and its single-flight drain.
//!
//! Output lines queue in a bounded channel (bounded memory; a full queue parks the pipe
//! readers, so the agent waits instead of losing output). One drain task takes batches
//! off it, bounded by count, bytes and time, and appends them one at a time, so order is
//! kept and a replay (same batch key) is deduplicated by the run store. A batch that
//! fails for good (the outage outlived the budget) is counted as lost, the drain stops
//! sending and keeps emptying the queue so the agent can still run to its end, and the
//! loss is reported as an `events_lost` event once the run store answers again.
//!
//! Batches respect the limits Hello returned (`max_batch_events`, `max_batch_bytes`, as
//! the run store counts them: the events' encoded sizes). One event larger than a whole
//! batch is cut to fit, with a marker saying how much was cut, never dropped silently.
//! While degraded, the probe that tries to report the loss runs beside the drain, bounded
//! by [`PROBE_DEADLINE`], so the drain keeps emptying the queue and the agent never
//! waits on the run store.

use std::time::Duration;

use prost::Message;
use runplane_proto::runstore::v1 as pb;
use tokio::sync::mpsc;

use crate::Client;

/// Events the queue holds before the pipe readers are parked.
pub const QUEUE_EVENTS: usize = 4096;
/// How long the first event of a batch waits for company.
pub const FLUSH_AFTER: Duration = Duration::from_millis(200);
/// While degraded, how often the drain tries to report the loss (and so reconnect).
pub const PROBE_EVERY: Duration = Duration::from_secs(5);
/// How long one probe may take, retries included, before it counts as failed.
pub const PROBE_DEADLINE: Duration = Duration::from_secs(2);
/// The batch size when Hello named none.
const DEFAULT_BATCH_BYTES: usize = 1 << 20;

/// Cuts `event`'s text so the event's encoded size fits `max_bytes`, ending it with a
/// marker naming how many bytes were cut. An event that fits is left alone.
pub fn fit(mut event: pb::EventInput, max_bytes: usize) -> pb::EventInput {
    let size = event.encoded_len();
    if size <= max_bytes {
        return event;
    }
    let over = size - max_bytes;
    // Room for the marker, whose own length varies with the count.
    let mut keep = event.text.len().saturating_sub(over + 64);
    while !event.text.is_char_boundary(keep) {
        keep -= 1;
    }
    let cut = event.text.len() - keep;
    event.text.truncate(keep);
    event.text.push_str(&format!(
        " [runplane: {cut} bytes cut to fit the batch limit]"
    ));
    event
}

pub fn channel() -> (mpsc::Sender<pb::EventInput>, mpsc::Receiver<pb::EventInput>) {
    mpsc::channel(QUEUE_EVENTS)
}

/// What the drain did.
#[derive(Debug, Default, Clone)]
pub struct DrainReport {
    pub sent: u64,
    /// Events dropped because they could not be delivered (and not yet reported).
    pub lost: u64,
}

/// An `events_lost` event for `count` events.
pub fn lost_event(count: u64) -> pb::EventInput {
    pb::EventInput {
        kind: pb::EventKind::EventsLost as i32,
        name: "events_lost".into(),
        text: format!("{count} events could not be delivered during an outage and were dropped"),
        data: Some(prost_types::Struct {
            fields: [(
                "count".to_owned(),
                prost_types::Value {
                    kind: Some(prost_types::value::Kind::NumberValue(count as f64)),
                },
            )]
            .into(),
        }),
        observed_at: Some(crate::child::now()),
        ..Default::default()
    }
}

/// Drains `queue` until every sender is gone, or until the run store says the run is
/// terminal (then `ending` learns it and nothing more is sent).
pub async fn drain(
    client: Client,
    run_id: String,
    nonce: String,
    limits: pb::RunnerLimits,
    mut queue: mpsc::Receiver<pb::EventInput>,
    ending: crate::ending::Ending,
) -> DrainReport {
    let max_events = limits.max_batch_events.clamp(1, 500) as usize;
    let max_bytes = match limits.max_batch_bytes {
        0 => DEFAULT_BATCH_BYTES,
        n => n as usize,
    };
    let mut report = DrainReport::default();
    let mut batch_number: u64 = 0;
    let mut next = queue.recv().await;
    let mut degraded_since: Option<tokio::time::Instant> = None;
    let mut probe: Option<(tokio::task::JoinHandle<Result<(), Stop>>, u64)> = None;

    while let Some(first) = next.take() {
        let first = fit(first, max_bytes);
        let mut bytes = first.encoded_len();
        let mut batch = vec![first];
        let deadline = tokio::time::Instant::now() + FLUSH_AFTER;
        while batch.len() < max_events {
            tokio::select! {
                event = queue.recv() => match event {
                    Some(e) => {
                        let e = fit(e, max_bytes);
                        if bytes + e.encoded_len() > max_bytes {
                            next = Some(e);
                            break;
                        }
                        bytes += e.encoded_len();
                        batch.push(e);
                    }
                    None => break,
                },
                () = tokio::time::sleep_until(deadline) => break,
            }
        }

        if let Some(since) = degraded_since {
            // Degraded: do not hold the agent up. Count the batch; now and then a probe,
            // beside the drain, tries to report the loss, which is also how the drain
            // learns the way is clear.
            report.lost += batch.len() as u64;
            if let Some((handle, reported)) = probe.take_if(|(h, _)| h.is_finished()) {
                match handle.await.unwrap_or(Err(Stop::Failed)) {
                    Ok(()) => {
                        tracing::warn!(
                            lost = reported,
                            "run store reachable again; reported lost events"
                        );
                        // What was lost while the probe was out goes in the final report.
                        report.lost -= reported;
                        degraded_since = None;
                    }
                    Err(Stop::RunTerminal) => {
                        ending.terminal();
                        return report;
                    }
                    Err(Stop::Failed) => degraded_since = Some(tokio::time::Instant::now()),
                }
            } else if probe.is_none() && since.elapsed() >= PROBE_EVERY {
                batch_number += 1;
                let reported = report.lost;
                let client = client.clone();
                let run_id = run_id.clone();
                let key = format!("{nonce}-{batch_number}");
                probe = Some((
                    tokio::spawn(async move {
                        let probe = append(&client, &run_id, &key, vec![lost_event(reported)]);
                        tokio::time::timeout(PROBE_DEADLINE, probe)
                            .await
                            .unwrap_or(Err(Stop::Failed))
                    }),
                    reported,
                ));
            }
        } else {
            batch_number += 1;
            let count = batch.len() as u64;
            match append(&client, &run_id, &format!("{nonce}-{batch_number}"), batch).await {
                Ok(()) => report.sent += count,
                Err(Stop::RunTerminal) => {
                    ending.terminal();
                    return report;
                }
                Err(Stop::Failed) => {
                    report.lost += count;
                    degraded_since = Some(tokio::time::Instant::now());
                    tracing::error!(
                        lost = count,
                        "events could not be delivered; releasing the agent's pipes"
                    );
                }
            }
        }
        if next.is_none() {
            next = queue.recv().await;
        }
    }
    if let Some((handle, reported)) = probe
        && let Ok(Ok(())) = handle.await
    {
        report.lost -= reported;
    }
    report
}

enum Stop {
    RunTerminal,
    Failed,
}

async fn append(
    client: &Client,
    run_id: &str,
    batch_key: &str,
    events: Vec<pb::EventInput>,
) -> Result<(), Stop> {
    let result = client
        .clone()
        .append_events(pb::AppendEventsRequest {
            run_id: run_id.to_owned(),
            batch_key: batch_key.to_owned(),
            events,
        })
        .await;
    match result {
        Ok(_) => Ok(()),
        Err(status) if crate::verdict::is_run_terminal(&status) => Err(Stop::RunTerminal),
        Err(status) => {
            tracing::error!(code = ?status.code(), message = status.message(), "append failed for good");
            Err(Stop::Failed)
        }
    }
}
