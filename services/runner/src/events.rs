//! The event queue, its pending buffer and its single-flight drain.
//!
//! Output lines come in on a channel, and a pump that never waits moves them into a
//! pending buffer bounded in bytes ([`PENDING_BYTES`]), so the pipe readers never park on
//! the run store: an append in flight, or a run store down for minutes, does not stop the
//! agent's pipes from being read. When the buffer is full, the oldest events not yet sent
//! are dropped, and in their place one `events_lost` event counts them (a later drop in
//! the same gap adds to that count), so a loss is never silent and its place in the
//! stream is kept.
//!
//! Beside the pump, one sender takes batches off the buffer, bounded by count, bytes and
//! time, and appends them one at a time, so order is kept and a replay (same batch key)
//! is deduplicated by the run store. A batch whose append failed for good on an outage
//! (the transport spent its budget) is kept and sent again with the same key after
//! [`RETRY_PAUSE`], for as long as the agent runs, while the buffer keeps filling behind
//! it; the drain never waits on anything but the run store, and nothing waits on the
//! drain. Once the agent is done (the queue closed), a batch that fails for good ends the
//! sending: what is left is counted in [`DrainReport::lost`] for the final report.
//!
//! Batches respect the limits Hello returned (`max_batch_events`, `max_batch_bytes`, as
//! the run store counts them: the events' encoded sizes). One event larger than a whole
//! batch is cut to fit, with a marker saying how much was cut, never dropped silently.

use runplane_clock::{Clock, SharedClock};
use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use prost::Message;
use runplane_proto::runstore::v1 as runstore_pb;
use tokio::sync::{Notify, mpsc};

use crate::Client;

/// Events the channel from the pipe readers holds. The pump empties it without waiting,
/// so it only fills while the runner's own tasks are starved of CPU.
pub const QUEUE_EVENTS: usize = 4096;
/// How long the first event of a batch waits for company.
pub const FLUSH_AFTER: Duration = Duration::from_millis(200);
/// Encoded bytes of events not yet sent the runner holds (at least two of Hello's
/// batches); past it the oldest are dropped and counted.
pub const PENDING_BYTES: usize = 8 << 20;
/// After an append failed for good on an outage, how long before it is sent again.
pub const RETRY_PAUSE: Duration = Duration::from_secs(1);
/// The batch size when Hello named none.
const DEFAULT_BATCH_BYTES: usize = 1 << 20;
/// What one drop marker counts for against [`PENDING_BYTES`].
const MARKER_BYTES: usize = 128;

/// Cuts `event`'s text so the event's encoded size fits `max_bytes`, ending it with a
/// marker naming how many bytes were cut. An event that fits is left alone.
pub fn fit(mut event: runstore_pb::EventInput, max_bytes: usize) -> runstore_pb::EventInput {
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

pub fn channel() -> (
    mpsc::Sender<runstore_pb::EventInput>,
    mpsc::Receiver<runstore_pb::EventInput>,
) {
    mpsc::channel(QUEUE_EVENTS)
}

/// What the drain did.
#[derive(Debug, Default, Clone)]
pub struct DrainReport {
    /// Events delivered (drop markers not counted).
    pub sent: u64,
    /// Events that could not be delivered and were not reported in the stream.
    pub lost: u64,
    /// Events the full pending buffer dropped (reported by `events_lost` markers, or
    /// counted in `lost` when a marker could not be delivered either).
    pub dropped: u64,
    /// Events not stored because the run reached its event quota, and that quota's name
    /// (`run_store.max_events_per_run`, …): once refused, nothing more is sent, and the
    /// count goes in one `events_lost` event with the verdict ([`refused_event`]).
    pub refused: u64,
    pub quota: Option<String>,
}

/// When the runner saw something, by `clock`: an event's `observed_at` (informational,
/// never used for ordering).
pub fn observed_at(clock: &dyn Clock) -> prost_types::Timestamp {
    runplane_clock::to_timestamp(clock.now_us())
}

/// The one `events_lost` event for `count` events the run store refused past the run's
/// event quota `quota`.
pub fn refused_event(count: u64, quota: &str, clock: &dyn Clock) -> runstore_pb::EventInput {
    let mut event = lost_event(count, clock);
    event.text = format!("{count} events were not stored: the run reached its quota {quota}");
    if let Some(data) = event.data.as_mut() {
        data.fields.insert(
            "quota".to_owned(),
            prost_types::Value {
                kind: Some(prost_types::value::Kind::StringValue(quota.to_owned())),
            },
        );
    }
    event
}

/// An `events_lost` event for `count` events.
pub fn lost_event(count: u64, clock: &dyn Clock) -> runstore_pb::EventInput {
    runstore_pb::EventInput {
        kind: runstore_pb::EventKind::EventsLost as i32,
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
        observed_at: Some(observed_at(clock)),
        ..Default::default()
    }
}

enum Item {
    /// An event and its encoded size.
    Event(runstore_pb::EventInput, usize),
    /// So many events were dropped here.
    Dropped(u64),
}

#[derive(Default)]
struct State {
    items: VecDeque<Item>,
    bytes: usize,
    closed: bool,
    dropped: u64,
}

/// The pending buffer: events not yet sent, oldest first, bounded in bytes.
struct Pending {
    state: Mutex<State>,
    wake: Notify,
    limit: usize,
    clock: SharedClock,
}

/// One batch off the buffer.
struct Batch {
    events: Vec<runstore_pb::EventInput>,
    /// The agent's (and steering's) events in it.
    real: u64,
    /// Events its drop markers count.
    dropped: u64,
}

impl Pending {
    fn new(limit: usize, clock: SharedClock) -> Self {
        Self {
            state: Mutex::default(),
            wake: Notify::new(),
            limit,
            clock,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("pending events poisoned")
    }

    /// Adds `event`; never waits. A full buffer drops its oldest events (the ones taken
    /// into a batch are no longer in it) and counts them in one marker at the front.
    fn push(&self, event: runstore_pb::EventInput) {
        let size = event.encoded_len();
        let mut s = self.lock();
        s.items.push_back(Item::Event(event, size));
        s.bytes += size;
        // Newly dropped, and what the marker at the front (merged) counts.
        let (mut dropped, mut count) = (0, 0);
        while s.bytes + MARKER_BYTES > self.limit {
            match s.items.pop_front() {
                Some(Item::Event(_, n)) => {
                    s.bytes -= n;
                    dropped += 1;
                    count += 1;
                }
                Some(Item::Dropped(c)) => {
                    s.bytes -= MARKER_BYTES;
                    count += c;
                }
                None => break,
            }
        }
        if count > 0 {
            s.dropped += dropped;
            s.items.push_front(Item::Dropped(count));
            s.bytes += MARKER_BYTES;
        }
        drop(s);
        self.wake.notify_one();
    }

    /// Puts a marker for `count` events back at the front (merged with one there).
    fn requeue_dropped(&self, count: u64) {
        let mut s = self.lock();
        match s.items.front_mut() {
            Some(Item::Dropped(c)) => *c += count,
            _ => {
                s.items.push_front(Item::Dropped(count));
                s.bytes += MARKER_BYTES;
            }
        }
    }

    fn close(&self) {
        self.lock().closed = true;
        self.wake.notify_one();
    }

    fn closed(&self) -> bool {
        self.lock().closed
    }

    fn dropped(&self) -> u64 {
        self.lock().dropped
    }

    /// The next batch: waits for a first event, then up to [`FLUSH_AFTER`] for company.
    /// `None` once the buffer is closed and empty.
    async fn batch(&self, max_events: usize, max_bytes: usize) -> Option<Batch> {
        loop {
            {
                let s = self.lock();
                if !s.items.is_empty() {
                    break;
                }
                if s.closed {
                    return None;
                }
            }
            self.wake.notified().await;
        }
        let deadline = tokio::time::Instant::now() + FLUSH_AFTER;
        loop {
            {
                let s = self.lock();
                if s.closed || s.items.len() >= max_events || s.bytes >= max_bytes {
                    break;
                }
            }
            tokio::select! {
                () = self.wake.notified() => {}
                () = tokio::time::sleep_until(deadline) => break,
            }
        }
        let mut s = self.lock();
        let mut batch = Batch {
            events: Vec::new(),
            real: 0,
            dropped: 0,
        };
        let mut bytes = 0;
        while batch.events.len() < max_events {
            let size = match s.items.front() {
                Some(Item::Event(_, n)) => *n,
                Some(Item::Dropped(c)) => lost_event(*c, self.clock.as_ref()).encoded_len(),
                None => break,
            };
            if !batch.events.is_empty() && bytes + size > max_bytes {
                break;
            }
            bytes += size;
            match s.items.pop_front() {
                Some(Item::Event(event, n)) => {
                    s.bytes -= n;
                    batch.real += 1;
                    batch.events.push(event);
                }
                Some(Item::Dropped(c)) => {
                    s.bytes -= MARKER_BYTES;
                    batch.dropped += c;
                    batch.events.push(lost_event(c, self.clock.as_ref()));
                }
                None => break,
            }
        }
        Some(batch)
    }
}

/// Drains `queue` until every sender is gone, or until the run store says the run is
/// terminal (then `ending` learns it and nothing more is sent).
pub async fn drain(
    client: Client,
    run_id: String,
    nonce: String,
    limits: runstore_pb::RunnerLimits,
    mut queue: mpsc::Receiver<runstore_pb::EventInput>,
    ending: crate::ending::Ending,
    clock: SharedClock,
) -> DrainReport {
    let max_events = limits.max_batch_events.clamp(1, 500) as usize;
    let max_bytes = match limits.max_batch_bytes {
        0 => DEFAULT_BATCH_BYTES,
        n => n as usize,
    };
    let pending = Pending::new(PENDING_BYTES.max(2 * max_bytes), clock);
    // The pump: never waits on anything but the queue.
    let pump = async {
        while let Some(event) = queue.recv().await {
            pending.push(fit(event, max_bytes));
        }
        pending.close();
    };
    let send = send(
        &client, &run_id, &nonce, max_events, max_bytes, &pending, &ending,
    );
    tokio::pin!(pump, send);
    let mut report = tokio::select! {
        report = &mut send => report,
        () = &mut pump => send.await,
    };
    report.dropped = pending.dropped();
    report
}

async fn send(
    client: &Client,
    run_id: &str,
    nonce: &str,
    max_events: usize,
    max_bytes: usize,
    pending: &Pending,
    ending: &crate::ending::Ending,
) -> DrainReport {
    let mut report = DrainReport::default();
    let mut batch_number: u64 = 0;
    // Set once an append failed for good after the agent was done: count the rest.
    let mut given_up = false;
    let mut degraded = false;
    while let Some(batch) = pending.batch(max_events, max_bytes).await {
        if given_up {
            report.lost += batch.real + batch.dropped;
            continue;
        }
        if report.quota.is_some() {
            report.refused += batch.real + batch.dropped;
            continue;
        }
        batch_number += 1;
        let key = format!("{nonce}-{batch_number}");
        loop {
            match append(client, run_id, &key, batch.events.clone()).await {
                Ok(()) => {
                    if degraded {
                        degraded = false;
                        tracing::warn!("run store reachable again; sending the pending events");
                    }
                    report.sent += batch.real;
                    break;
                }
                Err(Stop::RunTerminal) => {
                    ending.terminal();
                    return report;
                }
                // The outage outlived the transport's budget: keep the batch (same key,
                // so a replay is deduplicated) while the agent runs.
                Err(Stop::Outage) if !pending.closed() => {
                    if !degraded {
                        degraded = true;
                        tracing::error!(
                            "events could not be delivered yet; holding them (the oldest are dropped past the buffer's bound)"
                        );
                    }
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
                Err(Stop::Outage) => {
                    given_up = true;
                    report.lost += batch.real + batch.dropped;
                    break;
                }
                // Past the run's event quota: store the part of the batch that fits, then
                // count the rest and send nothing more.
                Err(Stop::OverQuota(_)) => {
                    match fit_under_quota(client, run_id, &key, &batch.events).await {
                        Ok(()) => {
                            report.sent += batch.real;
                            break;
                        }
                        Err((stored, Stop::OverQuota(quota))) => {
                            tracing::warn!(%quota, "the run reached its event quota; later events are counted, not sent");
                            report.sent += stored.iter().filter(|e| !is_marker(e)).count() as u64;
                            report.refused += represented(&batch.events[stored.len()..]);
                            report.quota = Some(quota);
                            break;
                        }
                        // Anything else: as for the whole batch, sent again with its key, whose
                        // stored parts answer as replays.
                        Err((_, Stop::RunTerminal)) => {
                            ending.terminal();
                            return report;
                        }
                        Err((_, Stop::Outage)) if !pending.closed() => {
                            tokio::time::sleep(RETRY_PAUSE).await;
                        }
                        Err((_, Stop::Outage | Stop::Refused)) => {
                            report.lost += batch.real + batch.dropped;
                            break;
                        }
                    }
                }
                // Refused for good: say so in the stream (unless that was the saying).
                Err(Stop::Refused) => {
                    if batch.real > 0 {
                        pending.requeue_dropped(batch.real + batch.dropped);
                    } else {
                        report.lost += batch.dropped;
                    }
                    break;
                }
            }
        }
    }
    report
}

/// Appends what of `events` (refused as a whole past the run's event quota) still fits:
/// halves of the part not stored yet, each under its own key derived from `key` (the
/// same split, so the same keys, when sent again), down to one event. `Err` carries the
/// events stored before the refusal that ended it.
async fn fit_under_quota<'a>(
    client: &Client,
    run_id: &str,
    key: &str,
    events: &'a [runstore_pb::EventInput],
) -> Result<(), (&'a [runstore_pb::EventInput], Stop)> {
    let mut stored = 0;
    let mut size = events.len().div_ceil(2);
    let mut part = 0;
    while stored < events.len() {
        let take = size.min(events.len() - stored);
        part += 1;
        let sent = append(
            client,
            run_id,
            &format!("{key}.{part}"),
            events[stored..stored + take].to_vec(),
        )
        .await;
        match sent {
            Ok(()) => stored += take,
            Err(Stop::OverQuota(_)) if take > 1 => size = take.div_ceil(2),
            Err(stop) => return Err((&events[..stored], stop)),
        }
    }
    Ok(())
}

/// An `events_lost` marker (of the pending buffer or of the quota).
fn is_marker(event: &runstore_pb::EventInput) -> bool {
    event.kind == runstore_pb::EventKind::EventsLost as i32
}

/// How many events `events` stand for: one each, and a marker the count it carries.
fn represented(events: &[runstore_pb::EventInput]) -> u64 {
    events
        .iter()
        .map(|e| {
            if !is_marker(e) {
                return 1;
            }
            e.data
                .as_ref()
                .and_then(|d| d.fields.get("count"))
                .and_then(|v| match v.kind {
                    Some(prost_types::value::Kind::NumberValue(n)) => Some(n as u64),
                    _ => None,
                })
                .unwrap_or(0)
        })
        .sum()
}

enum Stop {
    RunTerminal,
    /// Failed on an outage (unavailable, deadline, overload): sending again may work.
    Outage,
    /// Refused for good.
    Refused,
    /// Refused because the run reached its event quota (named).
    OverQuota(String),
}

async fn append(
    client: &Client,
    run_id: &str,
    batch_key: &str,
    events: Vec<runstore_pb::EventInput>,
) -> Result<(), Stop> {
    let result = client
        .clone()
        .append_events(runstore_pb::AppendEventsRequest {
            run_id: run_id.to_owned(),
            batch_key: batch_key.to_owned(),
            events,
        })
        .await;
    match result {
        Ok(_) => Ok(()),
        Err(status) if crate::verdict::is_run_terminal(&status) => Err(Stop::RunTerminal),
        Err(status)
            if runplane_grpc::error_info(&status).is_some_and(|info| {
                info.reason == runplane_grpc::ErrorReason::QuotaExceeded.as_str_name()
            }) =>
        {
            let quota = runplane_grpc::error_info(&status)
                .and_then(|info| info.metadata.get("quota").cloned())
                .unwrap_or_else(|| "unnamed".to_owned());
            Err(Stop::OverQuota(quota))
        }
        Err(status) => {
            tracing::error!(code = ?status.code(), message = status.message(), "append failed for good");
            use tonic::Code::*;
            match status.code() {
                Unavailable | DeadlineExceeded | ResourceExhausted | Aborted | Cancelled
                | Unknown | Internal => Err(Stop::Outage),
                _ => Err(Stop::Refused),
            }
        }
    }
}
