//! The live stream: the agent's output as frames in the coordinator's replay buffer.
//!
//! The runner is its run's first stream controller: it acquires the lease, renews it,
//! and appends frames fenced by its token. Events stay the durable record; frames are
//! what a tail replays and follows. When the lease is lost (fenced), the runner stops
//! appending and waits for a `resume_stream` claim, then continues with the claim's
//! token from the claim's sequence, re-sending what it still holds. A lease that is gone
//! (the coordinator lost its keys) is no fence: the next append or renewal takes it
//! back, and when the coordinator expects a sequence the ring no longer holds, the runner
//! resyncs from its first kept frame (readers get a replay_gap).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use runplane_grpc::{ErrorReason, error_info};
use runplane_proto::recovery::v1 as recovery_pb;
use runplane_proto::recovery::v1::stream_recovery_service_client::StreamRecoveryServiceClient;
use runplane_proto::runstore::v1::EventInput;
use tokio::sync::{Notify, mpsc};
use tonic::service::interceptor::InterceptedService;

/// Frames kept for re-sending after a takeover.
const RING: usize = 10_000;
const RENEW_EVERY: Duration = Duration::from_secs(10);
/// The pause before the first AcquireLease is sent again after the coordinator did not
/// answer it; it doubles up to [`ACQUIRE_RETRY_CAP`].
const ACQUIRE_RETRY_FIRST: Duration = Duration::from_secs(1);
const ACQUIRE_RETRY_CAP: Duration = Duration::from_secs(30);

/// Where the runner's own AcquireLease stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Acquire {
    /// Not answered yet: sent again after a pause.
    Due,
    /// Granted, refused for good, or overtaken by a claim.
    Done,
}
const LEASE_TTL: Duration = Duration::from_secs(30);

pub type RecoveryClient = StreamRecoveryServiceClient<
    InterceptedService<runplane_transport::RunnerChannel, runplane_grpc::client::Bearer>,
>;

#[derive(Debug, Default)]
struct State {
    token: Option<String>,
    /// The next sequence the coordinator expects from us.
    next_to_send: u64,
    /// The sequence the next pushed frame gets.
    next_sequence: u64,
    ring: VecDeque<(u64, Vec<u8>)>,
    finished: bool,
    /// The coordinator refused the stream's bytes (its replay budget is spent): this
    /// stream turn is over, and later output goes only to the run's events.
    refused: bool,
}

/// The runner's handle on its stream.
#[derive(Debug, Clone)]
pub struct Frames {
    state: Arc<Mutex<State>>,
    wake: Arc<Notify>,
    /// Where the one "live stream ended" event goes; weak, so it never keeps the event
    /// drain open.
    events: Arc<Mutex<Option<mpsc::WeakSender<EventInput>>>>,
    clock: runplane_clock::SharedClock,
}

impl Frames {
    /// Frames whose reports are stamped by `clock`.
    pub fn new(clock: runplane_clock::SharedClock) -> Self {
        Self {
            clock,
            state: Arc::new(Mutex::new(State {
                next_to_send: 1,
                next_sequence: 1,
                ..State::default()
            })),
            wake: Arc::new(Notify::new()),
            events: Arc::default(),
        }
    }

    /// Reports what a budget refusal drops as an event on the run's event queue.
    pub fn report_to(&self, events: &mpsc::Sender<EventInput>) {
        *self.events.lock().expect("frames poisoned") = Some(events.downgrade());
    }

    /// Queues one output frame.
    pub fn push(&self, data: Vec<u8>) {
        let mut s = self.state.lock().expect("frames poisoned");
        if s.refused {
            return;
        }
        let sequence = s.next_sequence;
        s.next_sequence += 1;
        s.ring.push_back((sequence, data));
        if s.ring.len() > RING {
            s.ring.pop_front();
        }
        drop(s);
        self.wake.notify_one();
    }

    /// A recovery claim reached the runner: continue with its token from its sequence.
    pub fn resume(&self, token: String, next_sequence: u64) {
        let mut s = self.state.lock().expect("frames poisoned");
        s.token = Some(token);
        s.next_to_send = next_sequence;
        drop(s);
        self.wake.notify_one();
    }

    /// No more frames will come; the stream task releases the lease once it sent all.
    pub fn finish(&self) {
        self.state.lock().expect("frames poisoned").finished = true;
        self.wake.notify_one();
    }

    /// The token, the next batch, whether the batch must resync (the ring no longer holds
    /// the sequence the coordinator expects) and whether the stream is finished.
    fn pending(&self) -> (Option<String>, Vec<recovery_pb::FrameInput>, bool, bool) {
        let s = self.state.lock().expect("frames poisoned");
        let mut size = 0;
        let batch: Vec<recovery_pb::FrameInput> = s
            .ring
            .iter()
            .filter(|(seq, _)| *seq >= s.next_to_send)
            .take(256)
            .take_while(|(_, d)| {
                size += d.len();
                size <= 1 << 20
            })
            .map(|(sequence, data)| recovery_pb::FrameInput {
                sequence: *sequence,
                data: data.clone(),
            })
            .collect();
        let resync = batch.first().is_some_and(|f| f.sequence > s.next_to_send);
        (s.token.clone(), batch, resync, s.finished)
    }

    /// The coordinator refused the batch for its budget: drop what is pending and stop
    /// streaming; returns the first sequence that was not streamed, once.
    fn refuse(&self) -> Option<u64> {
        let mut s = self.state.lock().expect("frames poisoned");
        if s.refused {
            return None;
        }
        s.refused = true;
        s.ring.clear();
        Some(s.next_to_send)
    }

    fn report_refusal(&self, from_sequence: u64, scope: &str) {
        let Some(events) = self
            .events
            .lock()
            .expect("frames poisoned")
            .as_ref()
            .and_then(mpsc::WeakSender::upgrade)
        else {
            return;
        };
        let number = |n: f64| prost_types::Value {
            kind: Some(prost_types::value::Kind::NumberValue(n)),
        };
        let text = |t: &str| prost_types::Value {
            kind: Some(prost_types::value::Kind::StringValue(t.to_owned())),
        };
        let event = EventInput {
            kind: runplane_proto::runstore::v1::EventKind::Lifecycle as i32,
            name: "live_stream_ended".into(),
            text: format!(
                "the live stream's {scope} replay budget is spent: output from frame {from_sequence} on is not streamed to tails; the run's events keep every line"
            ),
            data: Some(prost_types::Struct {
                fields: [
                    ("reason".to_owned(), text("budget_exceeded")),
                    ("budget_scope".to_owned(), text(scope)),
                    (
                        "dropped_from_sequence".to_owned(),
                        number(from_sequence as f64),
                    ),
                ]
                .into(),
            }),
            observed_at: Some(crate::events::observed_at(self.clock.as_ref())),
            ..Default::default()
        };
        if events.try_send(event).is_err() {
            tracing::warn!("the live_stream_ended event could not be queued");
        }
    }

    fn fenced(&self, token: &str) {
        let mut s = self.state.lock().expect("frames poisoned");
        if s.token.as_deref() == Some(token) {
            s.token = None;
        }
    }

    fn sent(&self, token: &str, next: u64) {
        let mut s = self.state.lock().expect("frames poisoned");
        if s.token.as_deref() == Some(token) {
            s.next_to_send = next;
        }
    }
}

fn reason_is(status: &tonic::Status, reason: ErrorReason) -> bool {
    error_info(status).is_some_and(|i| i.reason == reason.as_str_name())
}

fn ttl() -> prost_types::Duration {
    runplane_grpc::proto_duration(LEASE_TTL)
}

/// Streams frames until `frames` is finished and everything was sent (or the stream
/// cannot continue).
pub async fn stream(client: RecoveryClient, run_id: String, controller_id: String, frames: Frames) {
    // Acquired, refused for good (another controller, or a claim will hand it over), or
    // to be tried again: a coordinator unreachable past the transport's budget at the
    // start must not leave the run without a live stream for its whole life.
    let mut acquire = Acquire::Due;
    let mut acquire_pause = ACQUIRE_RETRY_FIRST;
    let mut next_acquire = tokio::time::Instant::now();
    let mut last_renewal = tokio::time::Instant::now();
    loop {
        if acquire == Acquire::Due && tokio::time::Instant::now() >= next_acquire {
            match client
                .clone()
                .acquire_lease(recovery_pb::AcquireLeaseRequest {
                    run_id: run_id.clone(),
                    controller_id: controller_id.clone(),
                    ttl: Some(ttl()),
                })
                .await
            {
                Ok(lease) => {
                    let lease = lease.into_inner();
                    frames.resume(lease.controller_token, lease.next_sequence);
                    acquire = Acquire::Done;
                    last_renewal = tokio::time::Instant::now();
                }
                Err(status) if reason_is(&status, ErrorReason::RunTerminal) => return,
                // Another controller, or one was already granted: wait for a claim.
                Err(status) if runplane_grpc::error::is_definite_refusal(&status) => {
                    tracing::warn!(code = ?status.code(), "stream lease not acquired; waiting for a recovery claim");
                    acquire = Acquire::Done;
                }
                Err(status) => {
                    tracing::warn!(code = ?status.code(), retry_in = ?acquire_pause, "stream lease not acquired yet: the coordinator did not answer");
                    next_acquire = tokio::time::Instant::now() + acquire_pause;
                    acquire_pause = (acquire_pause * 2).min(ACQUIRE_RETRY_CAP);
                }
            }
        }
        let (token, batch, resync, finished) = frames.pending();
        // A claim's token arrived meanwhile: nothing left to acquire.
        if token.is_some() {
            acquire = Acquire::Done;
        }
        if let Some(token) = &token {
            if !batch.is_empty() {
                match client
                    .clone()
                    .append_frames(recovery_pb::AppendFramesRequest {
                        run_id: run_id.clone(),
                        controller_token: token.clone(),
                        frames: batch,
                        resync,
                    })
                    .await
                {
                    Ok(a) => {
                        frames.sent(token, a.into_inner().next_sequence);
                        continue;
                    }
                    Err(s) if reason_is(&s, ErrorReason::LeaseFenced) => {
                        tracing::warn!("stream lease lost; waiting for a recovery claim");
                        frames.fenced(token);
                    }
                    Err(s) if reason_is(&s, ErrorReason::FrameSequenceGap) => {
                        let next = error_info(&s)
                            .and_then(|i| {
                                i.metadata.get("next_sequence").and_then(|n| n.parse().ok())
                            })
                            .unwrap_or(1);
                        frames.sent(token, next);
                    }
                    Err(s) if reason_is(&s, ErrorReason::RunTerminal) => return,
                    // The stream's (or org's) replay budget is spent: retrying cannot help,
                    // and handing off would only spend the restart budget. This stream turn
                    // ends: one event says what was dropped, the lease stays held (so no
                    // tail takes the run over) until the agent ends, and the agent and its
                    // events to the run store go on.
                    Err(s) if reason_is(&s, ErrorReason::BudgetExceeded) => {
                        let scope = error_info(&s)
                            .and_then(|i| i.metadata.get("budget_scope").cloned())
                            .unwrap_or_else(|| "stream".into());
                        if let Some(from) = frames.refuse() {
                            tracing::warn!(
                                from_sequence = from,
                                scope,
                                "replay budget spent; the live stream ends here"
                            );
                            frames.report_refusal(from, &scope);
                        }
                        continue;
                    }
                    // Unreadable outcome (the transport spent its budget): that proves
                    // nothing about the lease; try again later, fenced writes decide.
                    Err(s) => tracing::warn!(code = ?s.code(), "frames not appended yet"),
                }
            } else if finished {
                let _ = client
                    .clone()
                    .release_lease(recovery_pb::ReleaseLeaseRequest {
                        run_id: run_id.clone(),
                        controller_token: token.clone(),
                    })
                    .await;
                return;
            }
            if last_renewal.elapsed() >= RENEW_EVERY {
                last_renewal = tokio::time::Instant::now();
                if let Err(s) = client
                    .clone()
                    .renew_lease(recovery_pb::RenewLeaseRequest {
                        run_id: run_id.clone(),
                        controller_token: token.clone(),
                        ttl: Some(ttl()),
                    })
                    .await
                    && reason_is(&s, ErrorReason::LeaseFenced)
                {
                    frames.fenced(token);
                }
            }
        } else if finished {
            // No lease and nothing more will come: a claim would find nothing to resume.
            return;
        }
        if acquire == Acquire::Due {
            let wait = next_acquire.saturating_duration_since(tokio::time::Instant::now());
            let _ = tokio::time::timeout(wait.min(Duration::from_secs(1)), frames.wake.notified())
                .await;
            continue;
        }
        let _ = tokio::time::timeout(Duration::from_secs(1), frames.wake.notified()).await;
    }
}
