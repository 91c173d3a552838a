//! Whatever ends a run, its agent stops: a real `runplane runner` under `runplane dev`
//! (dispatch off, so the runner is started here and nothing else can stop the agent),
//! an agent that writes its pid, and the run ended from the control plane. Every check
//! is on the agent's pid, not only on the run's state.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use runplane_integration_tests::{
    Process, channel, process_alive as alive, runplane_bin, start_dev_with_env,
};
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_testkit::authed;
use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};
use tonic::transport::Channel;

/// The runner's grace between SIGTERM and SIGKILL is 10 s; the agent is gone within it.
const GONE_WITHIN: Duration = Duration::from_secs(15);
/// The runner's breadcrumb when its verdict lost to one already recorded.
const DISCARDED: &str = "result_discarded_run_terminal";

struct Dev {
    dev: Process,
    token: String,
    dir: tempfile::TempDir,
}

/// A runner started by hand for one run, its agent and the file its pid lands in.
struct Runner {
    child: Child,
    pid_file: PathBuf,
}

impl Dev {
    async fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let dev = start_dev_with_env(
            &dir.path().join("data"),
            &[("RUNPLANE_SANDBOX_RECONCILER__DISPATCH", "false")],
        )
        .await;
        let token = std::fs::read_to_string(dir.path().join("data/operator-token"))
            .unwrap()
            .trim()
            .to_owned();
        Self { dev, token, dir }
    }

    async fn op(&self) -> RunServiceClient<Channel> {
        RunServiceClient::new(channel(&self.dev.endpoint()).await)
    }

    async fn create(&self, name: &str, max_duration: Option<Duration>) -> runstore_pb::Run {
        let pid_file = self.pid_file(name);
        self.op()
            .await
            .create_run(authed(
                runstore_pb::CreateRunRequest {
                    client_request_id: format!("run-end-{name:0>16}"),
                    org_id: "acme".into(),
                    lead_id: "lead-1".into(),
                    target: Some(runstore_pb::create_run_request::Target::CredentialId(
                        "local".into(),
                    )),
                    command: "sh".into(),
                    args: vec![
                        "-c".into(),
                        format!("echo $$ > {}; exec sleep 300", pid_file.display()),
                    ],
                    max_duration: max_duration.map(runplane_grpc::proto_duration),
                    ..Default::default()
                },
                &self.token,
            ))
            .await
            .unwrap()
            .into_inner()
            .run
            .unwrap()
    }

    fn pid_file(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}.pid"))
    }

    /// Issues the run's key as the reconciler would and starts `runplane runner` with it.
    async fn start_runner(&self, run: &runstore_pb::Run, name: &str) -> Runner {
        let key = self
            .op()
            .await
            .issue_run_key(authed(
                runstore_pb::IssueRunKeyRequest {
                    run_id: run.id.clone(),
                    sandbox_id: format!("sbx-{name}"),
                    sandbox_generation: 1,
                    idempotency_key: format!("sbx-{name}:1-by-hand"),
                    ..Default::default()
                },
                &self.token,
            ))
            .await
            .unwrap()
            .into_inner()
            .run_key;
        let child = Command::new(runplane_bin())
            .arg("runner")
            .env_remove("RUNPLANE_CONFIG")
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .env("RUST_LOG", "info")
            .env("RUNPLANE_ENDPOINT", self.dev.endpoint())
            .env("RUNPLANE_RUN_ID", &run.id)
            .env("RUNPLANE_RUN_KEY", key)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn runplane runner");
        Runner {
            child,
            pid_file: self.pid_file(name),
        }
    }

    async fn run(&self, run_id: &str) -> runstore_pb::Run {
        self.op()
            .await
            .get_run(authed(
                runstore_pb::GetRunRequest {
                    run_id: run_id.into(),
                },
                &self.token,
            ))
            .await
            .unwrap()
            .into_inner()
            .run
            .unwrap()
    }

    async fn wait_until_running(&self, run_id: &str) {
        for _ in 0..300 {
            if self.run(run_id).await.state() == runstore_pb::RunState::Running {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("run {run_id} never became RUNNING");
    }
}

impl Runner {
    /// The agent's pid, once it wrote it.
    async fn agent_pid(&self) -> i32 {
        for _ in 0..300 {
            if let Some(pid) = std::fs::read_to_string(&self.pid_file)
                .ok()
                .and_then(|p| p.trim().parse().ok())
            {
                return pid;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("the agent never wrote {}", self.pid_file.display());
    }

    /// Waits for the runner to exit and returns its status and logs.
    async fn finish(mut self) -> (std::process::ExitStatus, String) {
        let status = tokio::time::timeout(GONE_WITHIN, self.child.wait())
            .await
            .expect("the runner exits once its agent is stopped")
            .unwrap();
        let mut logs = String::new();
        if let Some(mut stderr) = self.child.stderr.take() {
            stderr.read_to_string(&mut logs).await.unwrap();
        }
        (status, logs)
    }
}

async fn assert_gone(pid: i32, what: &str) {
    let started = tokio::time::Instant::now();
    while alive(pid) {
        assert!(
            started.elapsed() < GONE_WITHIN,
            "the agent (pid {pid}) still runs {GONE_WITHIN:?} after {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A running run with its runner and its agent's pid.
async fn running(
    dev: &Dev,
    name: &str,
    max_duration: Option<Duration>,
) -> (runstore_pb::Run, Runner, i32) {
    let run = dev.create(name, max_duration).await;
    let runner = dev.start_runner(&run, name).await;
    let pid = runner.agent_pid().await;
    assert!(alive(pid));
    dev.wait_until_running(&run.id).await;
    (run, runner, pid)
}

fn assert_runner_stopped_quietly(status: std::process::ExitStatus, logs: &str) {
    assert!(status.success(), "runner failed:\n{logs}");
    assert!(
        logs.contains("the run ended in the control plane"),
        "the runner says why it stopped:\n{logs}"
    );
    assert!(
        !logs.contains(DISCARDED),
        "the runner submitted a verdict for an ended run:\n{logs}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_runs_agent_is_stopped_and_its_runner_sends_nothing_more() {
    let dev = Dev::start().await;
    let (run, runner, pid) = running(&dev, "cancel", None).await;
    let cancelled = dev
        .op()
        .await
        .cancel_run(authed(
            runstore_pb::CancelRunRequest {
                run_id: run.id.clone(),
                reason: "not needed any more".into(),
                idempotency_key: "cancel-run-end-000001".into(),
            },
            &dev.token,
        ))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    assert_eq!(cancelled.state(), runstore_pb::RunState::Cancelled);
    assert_gone(pid, "CancelRun").await;
    let (status, logs) = runner.finish().await;
    assert_runner_stopped_quietly(status, &logs);
    let after = dev.run(&run.id).await;
    assert_eq!(after.state(), runstore_pb::RunState::Cancelled);
    assert_eq!(after.verdict.unwrap().message, "not needed any more");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_past_its_max_duration_ends_deadline_exceeded_and_its_agent_is_gone() {
    let dev = Dev::start().await;
    let (run, runner, pid) = running(&dev, "deadline", Some(Duration::from_secs(3))).await;
    assert!(run.deadline.is_some());
    assert_gone(pid, "the deadline").await;
    let (status, logs) = runner.finish().await;
    assert_runner_stopped_quietly(status, &logs);
    let after = dev.run(&run.id).await;
    assert_eq!(after.state(), runstore_pb::RunState::Failed);
    assert_eq!(after.failure_reason, "deadline_exceeded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_failed_by_a_service_or_a_backend_error_have_their_agents_stopped() {
    let dev = Dev::start().await;
    let (lost, lost_runner, lost_pid) = running(&dev, "loss-grace", None).await;
    let (backend, backend_runner, backend_pid) = running(&dev, "backend", None).await;
    let mut op = dev.op().await;
    // What the reconciler sends when a loss outlives the grace: it ends the run's attempt
    // (the run goes on to attempt 2), and attempt 1's agent stops as a cancelled run's.
    op.fail_run(authed(
        runstore_pb::FailRunRequest {
            run_id: lost.id.clone(),
            reason: "sandbox_lost".into(),
            message: "sandbox lost for longer than the loss grace".into(),
            idempotency_key: "sandbox-lost:sbx-loss-grace:1".into(),
            if_sandbox_generation: Some(1),
            if_sandbox_id: "sbx-loss-grace".into(),
        },
        &dev.token,
    ))
    .await
    .unwrap();
    // What credential health sends for a classified backend error.
    op.mark_backend_error(authed(
        runstore_pb::MarkBackendErrorRequest {
            run_id: backend.id.clone(),
            idempotency_key: "backend-error-turn-0001".into(),
            kind: runstore_pb::BackendErrorKind::Error as i32,
            reason: "API Error: No response from API".into(),
            credential_id: "local".into(),
            incident_id: String::new(),
            turn_id: "turn-1".into(),
        },
        &dev.token,
    ))
    .await
    .unwrap();
    assert_gone(lost_pid, "FailRun").await;
    assert_gone(backend_pid, "MarkBackendError").await;
    for (runner, run_id, state) in [
        (lost_runner, &lost.id, runstore_pb::RunState::Starting),
        (
            backend_runner,
            &backend.id,
            runstore_pb::RunState::BackendError,
        ),
    ] {
        let (status, logs) = runner.finish().await;
        assert_runner_stopped_quietly(status, &logs);
        assert_eq!(dev.run(run_id).await.state(), state);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exhaustion_abort_reaches_the_live_runner_and_is_applied_once() {
    let dev = Dev::start().await;
    let (run, runner, pid) = running(&dev, "exhausted", None).await;
    let mut op = dev.op().await;
    // Exactly the two calls the coordinator makes when a run's recovery is exhausted,
    // in its order: the abort, then the failure.
    op.enqueue_control(authed(
        runstore_pb::EnqueueControlRequest {
            run_id: run.id.clone(),
            idempotency_key: format!("{}:abort", run.id),
            control: Some(runstore_pb::enqueue_control_request::Control::Abort(
                runstore_pb::AbortPayload {
                    reason: "stream_recovery_exhausted".into(),
                },
            )),
        },
        &dev.token,
    ))
    .await
    .unwrap();
    op.fail_run(authed(
        runstore_pb::FailRunRequest {
            run_id: run.id.clone(),
            reason: "stream_recovery_exhausted".into(),
            message: "the run's stream was taken over 5 times and kept failing".into(),
            idempotency_key: format!("{}:recovery-exhausted", run.id),
            if_sandbox_generation: None,
            if_sandbox_id: String::new(),
        },
        &dev.token,
    ))
    .await
    .unwrap();
    assert_gone(pid, "the exhaustion abort").await;
    let (status, logs) = runner.finish().await;
    assert!(status.success(), "runner failed:\n{logs}");
    assert_eq!(
        logs.matches("abort: stopping the agent").count(),
        1,
        "the abort is applied exactly once:\n{logs}"
    );
    assert!(!logs.contains(DISCARDED), "{logs}");
    let after = dev.run(&run.id).await;
    assert_eq!(after.state(), runstore_pb::RunState::Failed);
    assert_eq!(after.failure_reason, "stream_recovery_exhausted");
}
