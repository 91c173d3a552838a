//! A run's end in the split topology (each service its own `runplane serve`, on
//! Postgres and Redis): a cancelled run's agent is gone and its sandbox destroyed; a run
//! whose profile sets max_run_seconds ends deadline_exceeded and its agent is gone. The
//! reconciler dispatches as in production; agents write their pids, and every check is on
//! the pid and on the sandbox's recorded status.

use std::path::{Path, PathBuf};
use std::time::Duration;

use runplane_integration_tests::split::{Split, TOKEN};
use runplane_integration_tests::{channel, process_alive as alive, wait_for};
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::reconciler::v1::sandbox_service_client::SandboxServiceClient;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_testkit::authed;

const GONE_WITHIN: Duration = Duration::from_secs(15);

struct World {
    split: Split,
    dir: tempfile::TempDir,
}

impl World {
    async fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("runplane.toml");
        std::fs::write(
            &config,
            r#"
[[credential_health.profiles]]
name = "default"
credential_id = "local"
capacity = 8
error_pattern = "API Error:"
exhausted_pattern = "quota exceeded"

[[credential_health.profiles]]
name = "timed"
credential_id = "timed-cred"
capacity = 8
error_pattern = "API Error:"
exhausted_pattern = "quota exceeded"
max_run_seconds = 3
"#,
        )
        .unwrap();
        let state = dir.path().join("sandboxes");
        // The agents write their pids to the test's files, as the host numbers them:
        // uncontained, or the pid namespace and private /tmp would hide both.
        let split = Split::start(
            Some(&config),
            &state,
            &[("RUNPLANE_SANDBOX_RECONCILER__ISOLATION", "none")],
        )
        .await;
        Self { split, dir }
    }

    async fn runs(&self) -> RunServiceClient<tonic::transport::Channel> {
        RunServiceClient::new(channel(&self.split.url("run-store")).await)
    }

    /// A run of an agent that writes its pid; returns the run and the pid file.
    async fn create(
        &self,
        name: &str,
        target: runstore_pb::create_run_request::Target,
    ) -> (runstore_pb::Run, PathBuf) {
        let pid_file = self.dir.path().join(format!("{name}.pid"));
        let run = self
            .runs()
            .await
            .create_run(authed(
                runstore_pb::CreateRunRequest {
                    client_request_id: format!("split-end-{name:0>12}"),
                    org_id: "acme".into(),
                    lead_id: "lead-1".into(),
                    target: Some(target),
                    command: "sh".into(),
                    args: vec![
                        "-c".into(),
                        format!("echo $$ > {}; exec sleep 300", pid_file.display()),
                    ],
                    ..Default::default()
                },
                TOKEN,
            ))
            .await
            .unwrap()
            .into_inner()
            .run
            .unwrap();
        (run, pid_file)
    }

    async fn run(&self, run_id: &str) -> runstore_pb::Run {
        self.runs()
            .await
            .get_run(authed(
                runstore_pb::GetRunRequest {
                    run_id: run_id.into(),
                },
                TOKEN,
            ))
            .await
            .unwrap()
            .into_inner()
            .run
            .unwrap()
    }

    async fn sandboxes(&self, run_id: &str) -> Vec<reconciler_pb::Sandbox> {
        SandboxServiceClient::new(channel(&self.split.url("sandbox-reconciler")).await)
            .list_sandboxes(authed(
                reconciler_pb::ListSandboxesRequest {
                    run_id: run_id.into(),
                    ..Default::default()
                },
                TOKEN,
            ))
            .await
            .unwrap()
            .into_inner()
            .sandboxes
    }
}

async fn agent_pid(pid_file: &Path) -> i32 {
    let mut pid = 0;
    wait_for("the agent starts", Duration::from_secs(30), async || {
        pid = std::fs::read_to_string(pid_file)
            .ok()
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or(0);
        pid != 0
    })
    .await;
    pid
}

async fn assert_converged(w: &World, run_id: &str, pid: i32, what: &str) {
    wait_for(
        &format!("the agent is gone after {what}"),
        GONE_WITHIN,
        async || !alive(pid),
    )
    .await;
    wait_for(
        &format!("the sandbox is destroyed after {what}"),
        GONE_WITHIN,
        async || {
            let sandboxes = w.sandboxes(run_id).await;
            !sandboxes.is_empty()
                && sandboxes
                    .iter()
                    .all(|s| s.status() == reconciler_pb::SandboxStatus::Deleted)
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_run_in_the_split_topology_leaves_no_agent_and_no_sandbox() {
    let w = World::start().await;
    let (run, pid_file) = w
        .create(
            "cancel",
            runstore_pb::create_run_request::Target::CredentialId("local".into()),
        )
        .await;
    let pid = agent_pid(&pid_file).await;
    wait_for("the run runs", Duration::from_secs(30), async || {
        w.run(&run.id).await.state() == runstore_pb::RunState::Running
    })
    .await;
    let cancelled = w
        .runs()
        .await
        .cancel_run(authed(
            runstore_pb::CancelRunRequest {
                run_id: run.id.clone(),
                reason: "operator cancel".into(),
                idempotency_key: "split-cancel-key-0001".into(),
            },
            TOKEN,
        ))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    assert_eq!(cancelled.state(), runstore_pb::RunState::Cancelled);
    assert_converged(&w, &run.id, pid, "CancelRun").await;
    assert_eq!(
        w.run(&run.id).await.state(),
        runstore_pb::RunState::Cancelled
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profiles_max_run_seconds_ends_its_run_deadline_exceeded() {
    let w = World::start().await;
    let (run, pid_file) = w
        .create(
            "deadline",
            runstore_pb::create_run_request::Target::Profile("timed".into()),
        )
        .await;
    assert!(
        run.deadline.is_some(),
        "the profile's default deadline applies"
    );
    let pid = agent_pid(&pid_file).await;
    assert_converged(&w, &run.id, pid, "the deadline").await;
    let after = w.run(&run.id).await;
    assert_eq!(after.state(), runstore_pb::RunState::Failed);
    assert_eq!(after.failure_reason, "deadline_exceeded");
}
