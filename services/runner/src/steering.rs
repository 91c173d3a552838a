//! The steering loop: poll, apply, acknowledge only what landed.
//!
//! - A message is acknowledged (on the next poll) only after its action landed; one
//!   served again because an acknowledgement was lost is acknowledged again, never
//!   applied twice.
//! - An interrupt or abort is never dropped. A steer that fails 3 times is acknowledged
//!   as dropped; the run store writes its one `steer_undeliverable` event.
//! - A served batch that yields no new acknowledgement backs the poll off (1 s doubling to
//!   15 s, jittered), so a message that cannot be applied cannot spin the loop.
//! - After an outage the loop reports one `steer_poll_degraded` event with the window;
//!   it stops only on a terminal run.
//! - A terminal run (the answer's state, or `RUN_TERMINAL`) and an `abort` both stop the
//!   agent through [`Ending`]. An abort served with the terminal answer is applied by
//!   that stop and acknowledged once before the loop ends.
//! - Acknowledgements not yet confirmed by a poll's answer are kept in [`PendingAcks`],
//!   which outlives the loop: when the agent exits, the runner stops the loop and sends
//!   what it still holds before the verdict ([`PendingAcks::flush`]), so a steer applied
//!   just before the agent exited is never left pending.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use runplane_proto::runstore::v1 as runstore_pb;
use runplane_sandbox::contract;
use tokio::sync::mpsc;

use crate::child::Control;
use crate::ending::Ending;
use crate::{Client, POLL_WAIT};

/// Attempts before a steer is dropped as undeliverable.
pub const STEER_MAX_ATTEMPTS: u32 = 3;
const BACKOFF_START: Duration = Duration::from_secs(1);
const BACKOFF_CAP: Duration = Duration::from_secs(15);

/// Acknowledgements the steering loop owes the run store: pushed once a message's action
/// landed, cleared only when a poll carrying them was answered. Shared with the runner,
/// which sends what is left when the agent has exited.
#[derive(Clone, Default)]
pub struct PendingAcks(std::sync::Arc<std::sync::Mutex<Vec<runstore_pb::SteeringAck>>>);

impl PendingAcks {
    fn push(&self, ack: runstore_pb::SteeringAck) {
        self.0.lock().expect("not poisoned").push(ack);
    }

    fn snapshot(&self) -> Vec<runstore_pb::SteeringAck> {
        self.0.lock().expect("not poisoned").clone()
    }

    fn take(&self) -> Vec<runstore_pb::SteeringAck> {
        std::mem::take(&mut *self.0.lock().expect("not poisoned"))
    }

    fn is_empty(&self) -> bool {
        self.0.lock().expect("not poisoned").is_empty()
    }

    /// Sends what is still owed with one poll that waits for nothing, bounded by
    /// `within`; called once the loop is stopped, before the verdict (the run key stops
    /// working once the run is terminal). Resending an acknowledged id changes nothing.
    pub async fn flush(&self, client: &Client, run_id: &str, within: Duration) {
        let acks = self.take();
        if acks.is_empty() {
            return;
        }
        let count = acks.len();
        let sent = tokio::time::timeout(
            within,
            client
                .clone()
                .poll_steering(runstore_pb::PollSteeringRequest {
                    run_id: run_id.to_owned(),
                    acks,
                    wait: None,
                    max_messages: 0,
                }),
        )
        .await;
        match sent {
            Ok(Ok(_)) => tracing::debug!(count, "acknowledgements sent before the verdict"),
            Ok(Err(status)) => {
                tracing::warn!(count, code = ?status.code(), "acknowledgements not sent before the verdict")
            }
            Err(_) => tracing::warn!(
                count,
                "acknowledgements not sent in time before the verdict"
            ),
        }
    }
}

enum Applied {
    Yes,
    Failed(String),
}

#[allow(clippy::too_many_arguments)]
pub async fn poll(
    client: Client,
    run_id: String,
    control: Control,
    events: mpsc::Sender<runstore_pb::EventInput>,
    frames: crate::frames::Frames,
    ending: Ending,
    clock: runplane_clock::SharedClock,
    acks: PendingAcks,
) {
    let mut applied: HashSet<String> = HashSet::new();
    let mut attempts: HashMap<String, u32> = HashMap::new();
    let mut backoff = BACKOFF_START;
    let mut degraded: Option<(i64, u32)> = None;
    let mark = PollMark::from_env();
    let mut answered: u64 = 0;
    // The loop is up: whatever is queued for the agent is served by the first poll.
    mark.record(answered, 0);

    loop {
        let sent_acks = acks.snapshot();
        let answer = client
            .clone()
            .poll_steering(runstore_pb::PollSteeringRequest {
                run_id: run_id.clone(),
                acks: sent_acks,
                wait: Some(runplane_grpc::proto_duration(POLL_WAIT)),
                max_messages: 0,
            })
            .await;
        let answer = match answer {
            Ok(a) => a.into_inner(),
            Err(status) if crate::verdict::is_run_terminal(&status) => {
                ending.terminal();
                return;
            }
            Err(status) => {
                // The transport spent its budget. Keep the acknowledgements (resending an
                // id changes nothing) and keep polling: only a terminal run ends this loop.
                let (_, failed) = degraded.get_or_insert((clock.now_us(), 0));
                *failed += 1;
                tracing::warn!(code = ?status.code(), "steering poll failed; will poll again");
                tokio::time::sleep(jittered(backoff)).await;
                backoff = (backoff * 2).min(BACKOFF_CAP);
                continue;
            }
        };
        // Answered: what it carried is acknowledged (nothing was pushed meanwhile: only
        // this loop pushes, after an answer).
        acks.take();
        if let Some((from, failed_polls)) = degraded.take() {
            let _ = events
                .send(degraded_event(from, failed_polls, clock.as_ref()))
                .await;
        }
        if answer.run_state().is_terminal() {
            // The run ended away from us: stop the agent. An abort served with this
            // answer (only aborts are) says why; it is applied by this stop and
            // acknowledged once.
            if ending.terminal() {
                tracing::warn!("the run ended in the control plane; stopping the agent");
            }
            for message in &answer.messages {
                if let Some(runstore_pb::steering_message::Payload::Abort(abort)) = &message.payload
                {
                    tracing::warn!(reason = %abort.reason, "abort: stopping the agent");
                }
                let tries = attempts.get(&message.id).copied().unwrap_or(0) + 1;
                acks.push(ack(
                    &message.id,
                    runstore_pb::AckOutcome::Applied,
                    tries,
                    "",
                ));
            }
            if !acks.is_empty() {
                let _ = client
                    .clone()
                    .poll_steering(runstore_pb::PollSteeringRequest {
                        run_id: run_id.clone(),
                        acks: acks.take(),
                        wait: None,
                        max_messages: 0,
                    })
                    .await;
            }
            return;
        }

        answered += 1;
        // Pending until applied: a node must not take the agent for parked while a
        // steer it was served is still on its way to the agent's stdin.
        mark.record(answered, answer.messages.len());
        let mut new_acks = 0;
        let mut unapplied = 0;
        for message in &answer.messages {
            if applied.contains(&message.id) {
                acks.push(ack(&message.id, runstore_pb::AckOutcome::Applied, 1, ""));
                continue;
            }
            let tries = attempts.entry(message.id.clone()).or_insert(0);
            *tries += 1;
            match apply(message, &control, &frames, &ending).await {
                Applied::Yes => {
                    applied.insert(message.id.clone());
                    acks.push(ack(
                        &message.id,
                        runstore_pb::AckOutcome::Applied,
                        *tries,
                        "",
                    ));
                    new_acks += 1;
                    let _ = events.send(applied_event(message, clock.as_ref())).await;
                }
                Applied::Failed(error)
                    if message.kind() == runstore_pb::SteeringKind::Steer
                        && *tries >= STEER_MAX_ATTEMPTS =>
                {
                    tracing::warn!(message_id = %message.id, "steer undeliverable after {tries} attempts; dropping it");
                    applied.insert(message.id.clone());
                    acks.push(ack(
                        &message.id,
                        runstore_pb::AckOutcome::DroppedUndeliverable,
                        *tries,
                        &error,
                    ));
                    new_acks += 1;
                }
                Applied::Failed(error) => {
                    unapplied += 1;
                    tracing::warn!(message_id = %message.id, attempt = *tries, %error, "steering message not applied yet");
                }
            }
        }
        mark.record(answered, unapplied);
        if !answer.messages.is_empty() && new_acks == 0 {
            tokio::time::sleep(jittered(backoff)).await;
            backoff = (backoff * 2).min(BACKOFF_CAP);
        } else {
            backoff = BACKOFF_START;
        }
    }
}

/// The sandbox driver's view of this loop, for idle suspend: its
/// [`RunnerPolls`](runplane_sandbox::contract::RunnerPolls) in
/// `$RUNPLANE_SANDBOX_DIR/steering` (outside the agent's reach), from the loop's start.
/// Without a sandbox directory (not the process driver) nothing is written.
struct PollMark(Option<std::path::PathBuf>);

/// The sandbox's directory, where the process driver set one.
fn sandbox_dir() -> Option<std::path::PathBuf> {
    std::env::var_os(contract::ENV_SANDBOX_DIR)
        .filter(|dir| !dir.is_empty())
        .map(std::path::PathBuf::from)
}

impl PollMark {
    fn from_env() -> Self {
        Self(sandbox_dir().map(|dir| dir.join(contract::STEERING_MARK)))
    }

    fn record(&self, answered: u64, pending: usize) {
        let Some(path) = &self.0 else {
            return;
        };
        let polls = contract::RunnerPolls {
            answered,
            pending: pending as u64,
        };
        if let Err(error) = polls.write(path) {
            tracing::debug!(%error, "steering mark not written");
        }
    }
}

/// Removes the agent's park mark ([`contract::PARK_MARK`]), if it left one (a link is
/// removed, never followed).
fn unpark() {
    let Some(dir) = sandbox_dir() else {
        return;
    };
    match std::fs::remove_file(contract::park_mark(&dir)) {
        Ok(()) => tracing::debug!("the agent's park mark removed before a steer"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => tracing::warn!(%error, "the agent's park mark not removed"),
    }
}

async fn apply(
    message: &runstore_pb::SteeringMessage,
    control: &Control,
    frames: &crate::frames::Frames,
    ending: &Ending,
) -> Applied {
    use runstore_pb::steering_message::Payload;
    match &message.payload {
        Some(Payload::Steer(steer)) => {
            // Input ends a park: the mark goes before the line, so a node never sees the
            // agent parked with a line it has not read.
            unpark();
            match control.write_line(&steer.text).await {
                Ok(()) => Applied::Yes,
                Err(e) => Applied::Failed(e.to_string()),
            }
        }
        Some(Payload::Interrupt(interrupt)) => {
            let grace = interrupt
                .grace
                .as_ref()
                .map(|g| Duration::new(g.seconds.max(0) as u64, g.nanos.max(0) as u32))
                .filter(|g| !g.is_zero())
                .unwrap_or(Duration::from_secs(10));
            // Sent (or moot because the agent already ended): the interrupt landed.
            control.interrupt(grace, &interrupt.reason);
            Applied::Yes
        }
        Some(Payload::Abort(abort)) => {
            // The runner stops the agent (SIGTERM to its group, then SIGKILL after the
            // grace) as soon as the first stop is decided; a second one changes nothing.
            if ending.abort(&abort.reason) {
                tracing::warn!(reason = %abort.reason, "abort: stopping the agent");
            }
            Applied::Yes
        }
        Some(Payload::ResumeStream(resume)) => {
            tracing::info!(
                attempt = resume.attempt,
                next_sequence = resume.next_sequence,
                "stream recovery claim received; resuming the stream"
            );
            frames.resume(resume.controller_token.clone(), resume.next_sequence);
            Applied::Yes
        }
        None => Applied::Failed("message has no payload".into()),
    }
}

fn ack(
    id: &str,
    outcome: runstore_pb::AckOutcome,
    attempts: u32,
    error: &str,
) -> runstore_pb::SteeringAck {
    // At most 500 bytes, cut at a character boundary (a byte cut could split one).
    let mut cut = error.len().min(500);
    while !error.is_char_boundary(cut) {
        cut -= 1;
    }
    let error = error[..cut].to_owned();
    runstore_pb::SteeringAck {
        message_id: id.to_owned(),
        outcome: outcome as i32,
        attempts,
        error,
    }
}

/// Equal jitter: at least half the step, so backing off always slows the loop.
fn jittered(step: Duration) -> Duration {
    let ms = step.as_millis() as u64;
    Duration::from_millis(rand::random_range(ms / 2..=ms))
}

fn applied_event(
    message: &runstore_pb::SteeringMessage,
    clock: &dyn runplane_clock::Clock,
) -> runstore_pb::EventInput {
    runstore_pb::EventInput {
        kind: runstore_pb::EventKind::SteerApplied as i32,
        name: crate::verdict::kind_name(message.kind()).to_owned(),
        text: message.id.clone(),
        observed_at: Some(crate::events::observed_at(clock)),
        ..Default::default()
    }
}

/// `from_us`: when the polls began failing, in microseconds.
fn degraded_event(
    from_us: i64,
    failed_polls: u32,
    clock: &dyn runplane_clock::Clock,
) -> runstore_pb::EventInput {
    let secs = |us: i64| us as f64 / 1e6;
    let field = |v: f64| prost_types::Value {
        kind: Some(prost_types::value::Kind::NumberValue(v)),
    };
    runstore_pb::EventInput {
        kind: runstore_pb::EventKind::SteerPollDegraded as i32,
        name: "steer_poll_degraded".into(),
        text: format!("steering polls failed {failed_polls} times during an outage"),
        data: Some(prost_types::Struct {
            fields: [
                ("from_unix".to_owned(), field(secs(from_us))),
                ("to_unix".to_owned(), field(secs(clock.now_us()))),
                ("failed_polls".to_owned(), field(failed_polls.into())),
            ]
            .into(),
        }),
        observed_at: Some(crate::events::observed_at(clock)),
        ..Default::default()
    }
}
