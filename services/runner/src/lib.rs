//! `runplane runner`: wraps the agent command inside a sandbox and keeps its run alive
//! across control-plane restarts.
//!
//! It says Hello, starts the agent as a child in its own process group, turns its output
//! lines into events sent in bounded batches behind one single-flight drain, polls
//! steering and applies it (a steer is a line on the child's stdin, an interrupt is
//! SIGINT then SIGTERM and SIGKILL after a grace), and submits the verdict. When the run
//! ends away from it (cancel, deadline, loss grace, recovery exhaustion, backend error)
//! or an `abort` arrives, it stops the agent (SIGTERM to its group, [`STOP_GRACE`], then
//! SIGKILL) and, for a run already terminal, sends nothing more. Every call
//! goes through [`runplane_transport`], whose retries come from the proto method
//! options; nothing here chooses a retry policy.

pub mod child;
pub mod ending;
pub mod events;
pub mod frames;
pub mod redact;
pub mod steering;
pub mod verdict;

use std::os::unix::process::ExitStatusExt;
use std::sync::Arc;
use std::time::Duration;

use runplane_config::Secret;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::runner_service_client::RunnerServiceClient;
use runplane_transport::{RetryConfig, RetryLayer, RunnerChannel};
use tonic::service::interceptor::InterceptedService;
use tracing::Instrument as _;

// The environment the runner reads is the sandbox contract's (`runplane_sandbox::contract`),
// where the drivers that set it read the same names; the run key is never taken from argv.
use runplane_sandbox::contract::{
    ENV_ENDPOINT, ENV_RECOVERY_ENDPOINT, ENV_RUN_ID, ENV_RUN_KEY, ENV_RUN_KEY_ON_STDIN,
};

#[derive(Debug, thiserror::Error)]
pub enum RunnerError {
    #[error("{0} is not set")]
    MissingEnv(&'static str),
    #[error("{ENV_RUN_KEY_ON_STDIN} is set, but stdin held no run key")]
    NoKeyOnStdin,
    #[error(transparent)]
    Endpoint(#[from] runplane_grpc::client::ClientError),
    #[error("hello failed: {0}")]
    Hello(String),
    #[error("could not start the agent command `{command}`: {reason}")]
    Spawn { command: String, reason: String },
    #[error("the result could not be recorded: {0}")]
    Result(String),
}

/// Where the runner reports, and as which run.
#[derive(Debug, Clone)]
pub struct RunnerEnv {
    pub endpoint: String,
    pub recovery_endpoint: String,
    pub run_id: String,
    pub run_key: Secret,
}

impl RunnerEnv {
    pub fn from_env() -> Result<Self, RunnerError> {
        let get = |name: &'static str| {
            std::env::var(name)
                .ok()
                .filter(|v| !v.trim().is_empty())
                .ok_or(RunnerError::MissingEnv(name))
        };
        let endpoint = get(ENV_ENDPOINT)?;
        Ok(Self {
            recovery_endpoint: get(ENV_RECOVERY_ENDPOINT).unwrap_or_else(|_| endpoint.clone()),
            endpoint,
            run_id: get(ENV_RUN_ID)?,
            run_key: Secret::new(match std::env::var(ENV_RUN_KEY_ON_STDIN).as_deref() {
                Ok("1") => key_from_stdin()?,
                _ => get(ENV_RUN_KEY)?,
            }),
        })
    }
}

/// The run key a driver wrote down this process's stdin ([`ENV_RUN_KEY_ON_STDIN`]): read
/// once, to its end; the agent gets stdin of its own.
fn key_from_stdin() -> Result<String, RunnerError> {
    use std::io::Read;
    let mut key = String::new();
    let _ = std::io::stdin()
        .take(runplane_sandbox::contract::MAX_RUN_KEY_BYTES)
        .read_to_string(&mut key);
    let key = key.trim();
    if key.is_empty() {
        return Err(RunnerError::NoKeyOnStdin);
    }
    Ok(key.to_owned())
}

pub use runplane_grpc::client::Bearer;

/// The run store client every runner call goes through.
pub type Client = RunnerServiceClient<InterceptedService<RunnerChannel, Bearer>>;

/// How the runner ended.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub verdict: runstore_pb::Verdict,
    /// The run store recorded this verdict (or had recorded the same one).
    pub recorded: bool,
    /// Events that could not be delivered and were reported lost.
    pub events_lost: u64,
    /// The run ended in the control plane (cancel, deadline, a service's failure) and
    /// the agent was stopped; nothing was submitted, `verdict` is the agent's exit.
    pub ended_elsewhere: bool,
}

/// Why the sandbox's containment says the agent ended, when it says
/// ([`runplane_sandbox::contract::ENDING_FILE`] in the sandbox's directory).
fn containment_ending() -> Option<String> {
    let dir = std::env::var_os(runplane_sandbox::contract::ENV_SANDBOX_DIR)?;
    let ending = std::fs::read_to_string(
        std::path::Path::new(&dir).join(runplane_sandbox::contract::ENDING_FILE),
    )
    .ok()?;
    Some(ending.trim().to_owned()).filter(|e| !e.is_empty())
}

/// Whether the sandbox's memory cgroup says its agent was killed at the limit
/// ([`runplane_sandbox::contract::ENV_MEMORY_EVENTS`]).
fn memory_limit_killed() -> bool {
    std::env::var_os(runplane_sandbox::contract::ENV_MEMORY_EVENTS)
        .filter(|path| !path.is_empty())
        .is_some_and(|path| runplane_sandbox::process::limits::oom_killed(path.as_ref()))
}

/// How long a stopped agent gets between SIGTERM and SIGKILL.
pub const STOP_GRACE: Duration = Duration::from_secs(10);

/// Runs the agent for `env`'s run to the end.
/// `clock` stamps what the runner observes (`observed_at`), never orders anything.
pub async fn run(
    env: RunnerEnv,
    retry: RetryConfig,
    clock: runplane_clock::SharedClock,
) -> Result<Outcome, RunnerError> {
    let layer = RetryLayer::new(retry.clone());
    let channel = runplane_transport::connect_lazy(&env.endpoint, &layer)?;
    let client: Client =
        RunnerServiceClient::with_interceptor(channel, Bearer::new(env.run_key.expose()))
            .max_decoding_message_size(16 << 20);
    let redactor = Arc::new(redact::Redactor::new(env.run_key.expose()));

    let nonce = format!("runner-{}", uuid::Uuid::new_v4().simple());
    let hello = client
        .clone()
        .hello(runstore_pb::HelloRequest {
            run_id: env.run_id.clone(),
            nonce: nonce.clone(),
            runner_version: env!("CARGO_PKG_VERSION").into(),
        })
        .await
        .map_err(|s| RunnerError::Hello(format!("{}: {}", s.code(), s.message())))?
        .into_inner();
    let run = hello.run.unwrap_or_default();
    let limits = hello.limits.unwrap_or_default();
    tracing::info!(run_id = %env.run_id, command = %run.command, attempt = hello.attempt, "hello accepted; starting the agent");

    // The live stream, under the run's stream lease; its own upstream, its own throttle.
    let recovery_layer = RetryLayer::new(retry);
    let recovery: frames::RecoveryClient =
        runplane_proto::recovery::v1::stream_recovery_service_client::StreamRecoveryServiceClient::with_interceptor(
            runplane_transport::connect_lazy(&env.recovery_endpoint, &recovery_layer)?,
            Bearer::new(env.run_key.expose()),
        );
    let live = frames::Frames::new(clock.clone());
    // The spawned loops stay in the run's span, so their calls join the run's trace.
    let streaming = tokio::spawn(
        frames::stream(recovery, env.run_id.clone(), nonce.clone(), live.clone()).in_current_span(),
    );

    let ending = ending::Ending::new();
    let (events_tx, events_rx) = events::channel();
    live.report_to(&events_tx);
    let mut environment = vec![
        (ENV_LABELS, labels_environment(&run.labels)),
        (ENV_ATTEMPT, hello.attempt.max(1).to_string()),
    ];
    if hello.attempt > 1 {
        environment.push((ENV_PREVIOUS_ATTEMPT, hello.previous_attempt_reason.clone()));
    }
    let spawned = child::Agent::spawn(
        &run.command,
        &run.args,
        &environment,
        events_tx.clone(),
        Some(live.clone()),
        clock.clone(),
    );
    let mut agent = match spawned {
        Ok(agent) => agent,
        Err(e) => {
            // Hello made the run RUNNING: it ends now, with the reason, instead of waiting
            // out the loss grace for a runner that is gone.
            streaming.abort();
            let reason = redactor.redact(&e.to_string());
            let verdict = verdict::not_started(&run.command, &reason);
            let submitted = submit(&client, &env, &nonce, &verdict, String::new(), Vec::new());
            if let Err(e) = verdict::recorded(submitted.await, &env.run_id, &verdict, &redactor) {
                tracing::error!(error = %e, "the failed start could not be recorded");
            }
            return Err(RunnerError::Spawn {
                command: run.command.clone(),
                reason,
            });
        }
    };
    let drain = tokio::spawn(
        events::drain(
            client.clone(),
            env.run_id.clone(),
            nonce.clone(),
            limits,
            events_rx,
            ending.clone(),
            clock.clone(),
        )
        .in_current_span(),
    );
    let pending_acks = steering::PendingAcks::default();
    let steering = tokio::spawn(
        steering::poll(
            client.clone(),
            env.run_id.clone(),
            agent.control(),
            events_tx.clone(),
            live.clone(),
            ending.clone(),
            clock.clone(),
            pending_acks.clone(),
        )
        .in_current_span(),
    );

    let control = agent.control();
    let stopped = tokio::select! {
        status = agent.wait() => Ok(status),
        stop = ending.wait() => Err(stop),
    };
    let (status, stop) = match stopped {
        Ok(status) => (status, None),
        Err(stop) => {
            control.abort(STOP_GRACE);
            let status = agent.wait().await;
            tracing::warn!(?stop, status = %verdict::describe(status), "agent stopped");
            (status, Some(stop))
        }
    };
    if stop == Some(ending::Stop::Terminal) {
        // The run is over and its verdict recorded: send nothing more.
        steering.abort();
        drain.abort();
        streaming.abort();
        let _ = tokio::time::timeout(Duration::from_secs(2), agent.finish_output()).await;
        return Ok(Outcome {
            verdict: verdict::of(status, None),
            recorded: true,
            events_lost: 0,
            ended_elsewhere: true,
        });
    }
    let interrupted = control.interrupted();
    // The agent is gone: steering has nothing left to act on. What it applied and has not
    // had acknowledged yet is sent now, before the verdict. Outputs drain to their end.
    steering.abort();
    let _ = steering.await;
    pending_acks
        .flush(&client, &env.run_id, FLUSH_ACKS_WITHIN)
        .await;
    agent.finish_output().await;
    // Frames go before the result: once the run is terminal its key stops working.
    live.finish();
    let _ = tokio::time::timeout(std::time::Duration::from_secs(10), streaming).await;
    drop(events_tx);
    let drained = drain.await.unwrap_or_default();

    let verdict = match (&stop, containment_ending()) {
        (Some(ending::Stop::Abort(reason)), _) => verdict::aborted(status, reason),
        // Killed by the kernel at the sandbox's memory limit, not a plain signal death.
        (None, _)
            if status.signal() == Some(nix::sys::signal::Signal::SIGKILL as i32)
                && memory_limit_killed() =>
        {
            verdict::out_of_memory(status)
        }
        // The containment says why, where the agent's status cannot.
        (None, Some(ending)) => verdict::ended_by_containment(&ending),
        _ => verdict::of(status, interrupted.as_deref()),
    };
    // The events are the agent's output and what steering did; the exit is in the verdict.
    let mut final_events = Vec::new();
    if drained.lost > 0 {
        final_events.push(events::lost_event(drained.lost, clock.as_ref()));
    }
    if let Some(quota) = &drained.quota {
        final_events.push(events::refused_event(
            drained.refused,
            quota,
            clock.as_ref(),
        ));
    }
    let failure_tail = if verdict.outcome() == runstore_pb::VerdictOutcome::Succeeded {
        String::new()
    } else {
        redactor.redact(&agent.tail(limits.max_failure_tail_bytes.max(1024) as usize))
    };
    let result = submit(&client, &env, &nonce, &verdict, failure_tail, final_events).await;
    let recorded =
        verdict::recorded(result, &env.run_id, &verdict, &redactor).map_err(RunnerError::Result)?;
    Ok(Outcome {
        verdict,
        recorded,
        events_lost: drained.lost + drained.refused,
        ended_elsewhere: false,
    })
}

/// Submits the run's `verdict` with the last events, as the final batch of this Hello.
async fn submit(
    client: &Client,
    env: &RunnerEnv,
    nonce: &str,
    verdict: &runstore_pb::Verdict,
    failure_tail: String,
    final_events: Vec<runstore_pb::EventInput>,
) -> Result<tonic::Response<runstore_pb::SubmitResultResponse>, tonic::Status> {
    client
        .clone()
        .submit_result(runstore_pb::SubmitResultRequest {
            run_id: env.run_id.clone(),
            verdict: Some(verdict.clone()),
            failure_tail,
            final_batch_key: format!("{nonce}-final"),
            final_events,
        })
        .await
}

/// How long the acknowledgements left at the agent's exit may take to send.
const FLUSH_ACKS_WITHIN: Duration = Duration::from_secs(10);

/// The poll wait the runner asks for; the server caps it.
pub const POLL_WAIT: Duration = Duration::from_secs(20);

/// The run's labels, as the agent finds them: `k=v` pairs, comma-separated, in key order
/// (a label's key and value never hold a comma or an `=`).
pub const ENV_LABELS: &str = "RUNPLANE_LABELS";

/// Which attempt of its run the agent is (1, 2, …): a run whose sandbox or runner died
/// is run again in a new sandbox, and the agent can resume its own session.
pub const ENV_ATTEMPT: &str = "RUNPLANE_ATTEMPT";

/// From attempt 2 on, why the previous attempt ended (`runner_exited`, `sandbox_lost`,
/// …); unset on the first.
pub const ENV_PREVIOUS_ATTEMPT: &str = "RUNPLANE_PREVIOUS_ATTEMPT";

fn labels_environment(labels: &std::collections::HashMap<String, String>) -> String {
    let mut pairs: Vec<(&String, &String)> = labels.iter().collect();
    pairs.sort_unstable();
    pairs
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}
