//! A run's events as `runplane run` and `runplane logs` print them: the agent's stdout
//! lines on stdout, its stderr lines on stderr, everything else (state changes, life-cycle
//! notes, steers applied, gaps) as `runplane: …` notes on stderr. A broken stream is
//! resumed from the last sequence printed, so no line is printed twice or skipped. The
//! server heartbeats a quiet stream; one silent for three heartbeats is dead (a wedged
//! replica, a proxy that stopped forwarding) and is re-opened on a new connection.

use std::io::Write;
use std::time::Duration;

use anyhow::{Context, bail};
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::watch_run_response::Update;

use runplane_transport::{Watch, WatchError};

use crate::connect::RunStoreClient;
use crate::output::state_name;

/// How long the stream may stay broken before the command gives up.
const GIVE_UP_AFTER: Duration = Duration::from_secs(300);
const RECONNECT_DELAY: Duration = Duration::from_millis(500);

/// Where printing stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Until {
    /// The events stored when the watch began (the first snapshot's last sequence).
    Now,
    /// The run's end: its terminal snapshot and every event before it.
    End,
}

/// `--heartbeat`: a duration from 1 s to 60 s.
pub fn parse_heartbeat(text: &str) -> Result<Duration, String> {
    let d = crate::duration::parse_positive(text)?;
    runplane_grpc::heartbeat::interval(Some(&crate::duration::to_proto(d)))
        .map_err(|_| "the heartbeat must be 1s to 60s".to_owned())
}

/// Prints the run's events after `after` until `until`, asking the server for a
/// heartbeat every `heartbeat`; returns the last snapshot of the run seen.
pub async fn print_events(
    client: &mut RunStoreClient,
    run_id: &str,
    mut after: u64,
    until: Until,
    heartbeat: Duration,
) -> anyhow::Result<runstore_pb::Run> {
    let mut last_state = runstore_pb::RunState::Unspecified;
    let mut last_waiting = false;
    let mut last_paused = false;
    let mut last_run: Option<runstore_pb::Run> = None;
    // For Until::Now: the last sequence stored when the first snapshot was taken.
    let mut stop_at: Option<u64> = None;
    let mut broken_since: Option<tokio::time::Instant> = None;
    loop {
        let opened = client
            .watch_run(runstore_pb::WatchRunRequest {
                run_id: run_id.to_owned(),
                after_sequence: after,
                states_only: false,
                heartbeat_interval: Some(crate::duration::to_proto(heartbeat)),
            })
            .await;
        let mut stream = match opened {
            Ok(s) => Watch::new(s, heartbeat),
            // A refusal will not change on a retry (the transport already retried the
            // failures that might).
            Err(status) if is_refusal(status.code()) => return Err(crate::connect::rpc(status)),
            Err(status) => {
                let since = *broken_since.get_or_insert_with(tokio::time::Instant::now);
                if since.elapsed() > GIVE_UP_AFTER {
                    bail!("lost the run's stream: {}", crate::connect::rpc(status));
                }
                tokio::time::sleep(RECONNECT_DELAY).await;
                continue;
            }
        };
        loop {
            let update = match stream.message().await {
                Ok(Some(item)) => item.update,
                // The stream ends after the terminal snapshot and every event before it.
                Ok(None) => {
                    if let Some(run) = last_run.as_ref().filter(|r| r.state().is_terminal()) {
                        return Ok(run.clone());
                    }
                    break;
                }
                // Silent past its heartbeats: its connection is condemned, so the re-open
                // goes out on a new one at once.
                Err(silent @ WatchError::Silent { .. }) => {
                    broken_since.get_or_insert_with(tokio::time::Instant::now);
                    eprintln!(
                        "runplane: stream silent ({silent}); resuming after event {after} on a new connection"
                    );
                    break;
                }
                Err(WatchError::Status(_)) => {
                    broken_since.get_or_insert_with(tokio::time::Instant::now);
                    eprintln!("runplane: stream interrupted; resuming after event {after}");
                    tokio::time::sleep(RECONNECT_DELAY).await;
                    break;
                }
            };
            broken_since = None;
            match update {
                Some(Update::Run(run)) => {
                    // The terminal state is the caller's to print, with the verdict.
                    if run.state() != last_state {
                        last_state = run.state();
                        if !last_state.is_terminal() {
                            eprintln!("runplane: {}", state_name(last_state));
                        }
                    }
                    // The agent's wait for input, as it starts and ends.
                    let waiting = run.waiting_for_input_since.is_some();
                    if waiting != last_waiting && !last_state.is_terminal() {
                        last_waiting = waiting;
                        eprintln!(
                            "runplane: {}",
                            if waiting {
                                "waiting for input"
                            } else {
                                "working"
                            }
                        );
                    }
                    // A pause, as it starts and ends.
                    let paused = run.paused_since.is_some();
                    if paused != last_paused && !last_state.is_terminal() {
                        last_paused = paused;
                        eprintln!("runplane: {}", if paused { "paused" } else { "resumed" });
                    }
                    if until == Until::Now && stop_at.is_none() {
                        stop_at = Some(run.last_sequence);
                    }
                    last_run = Some(run);
                }
                Some(Update::Event(event)) => {
                    after = event.sequence;
                    print_event(&event)?;
                }
                Some(Update::Gap(gap)) => {
                    eprintln!(
                        "runplane: events {}..{} are no longer stored",
                        gap.from_sequence, gap.to_sequence
                    );
                    after = after.max(gap.to_sequence);
                }
                // Where the stream is: everything up to it was sent on this stream.
                Some(Update::Heartbeat(h)) => after = after.max(h.last_sequence),
                None => {}
            }
            if let (Some(stop), Some(run)) = (stop_at, &last_run)
                && after >= stop
            {
                return Ok(run.clone());
            }
        }
    }
}

fn is_refusal(code: tonic::Code) -> bool {
    matches!(
        code,
        tonic::Code::NotFound
            | tonic::Code::InvalidArgument
            | tonic::Code::PermissionDenied
            | tonic::Code::Unauthenticated
            | tonic::Code::FailedPrecondition
            | tonic::Code::Unimplemented
    )
}

/// Fails only when stdout is gone (a closed pipe): nobody reads the lines any more.
fn print_event(event: &runstore_pb::Event) -> anyhow::Result<()> {
    match event.kind() {
        runstore_pb::EventKind::Stdout => {
            let mut out = std::io::stdout().lock();
            writeln!(out, "{}", event.text)
                .and_then(|()| out.flush())
                .context("writing to stdout")?;
        }
        runstore_pb::EventKind::Stderr => eprintln!("{}", event.text),
        runstore_pb::EventKind::AttemptEnded => eprintln!(
            "runplane: attempt {} ended ({}: {}); the next starts at {}",
            field(event, "attempt"),
            field(event, "reason"),
            field(event, "message"),
            field(event, "retry_at"),
        ),
        runstore_pb::EventKind::AttemptStarted => eprintln!(
            "runplane: attempt {} started in sandbox {} on {}",
            field(event, "attempt"),
            field(event, "sandbox_id"),
            field(event, "node_id"),
        ),
        kind => eprintln!(
            "runplane: [{}] {} {}",
            kind.as_str_name()
                .trim_start_matches("EVENT_KIND_")
                .to_lowercase(),
            event.name,
            event.text
        ),
    }
    Ok(())
}

/// One field of an event's data as text ("-" when absent).
fn field(event: &runstore_pb::Event, name: &str) -> String {
    use prost_types::value::Kind;
    match event
        .data
        .as_ref()
        .and_then(|d| d.fields.get(name))
        .and_then(|v| v.kind.as_ref())
    {
        Some(Kind::StringValue(s)) if !s.is_empty() => s.clone(),
        Some(Kind::NumberValue(n)) => format!("{n}"),
        Some(Kind::BoolValue(b)) => b.to_string(),
        _ => "-".to_owned(),
    }
}
