//! Pause and resume (RunService.PauseRun and ResumeRun) over real processes: a working
//! agent (it prints a line every 100 ms, it never waits for input) is frozen whole,
//! prints nothing while paused, and after the resume finishes with every line once, in
//! order, on the reconciler's own process driver and on a node agent; a steer sent to a
//! paused run waits for the resume (no wake), and a cancel ends a paused run and stops
//! its processes; and `runplane pause|resume|get` against `runplane dev`, where a pause
//! past its profile's `max_pause_seconds` ends the run `paused_too_long`.

use std::process::Stdio;
use std::time::Duration;

use runplane_integration_tests::sandboxes::{
    ControlPlane, ReapSession, eventually, process_state, session_members, start_node_logging,
};
use runplane_integration_tests::{channel, profile_toml, runplane_bin, start_dev_with_env};
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_testkit::authed;

const TOKEN: &str = "pause-test-operator-token-0123456789abcdefg";

/// Prints `line 1` to `line 100`, one every 100 ms: an agent that works the whole time.
const COUNT_TO_100: &str =
    "i=0; while [ $i -lt 100 ]; do i=$((i+1)); echo line $i; sleep 0.1; done";

fn expected_lines() -> Vec<String> {
    (1..=100).map(|i| format!("line {i}")).collect()
}

async fn runs(control_plane: &ControlPlane) -> RunServiceClient<tonic::transport::Channel> {
    RunServiceClient::new(channel(&control_plane.endpoint).await)
}

async fn pause(control_plane: &ControlPlane, run_id: &str, key: &str) -> runstore_pb::Run {
    runs(control_plane)
        .await
        .pause_run(authed(
            runstore_pb::PauseRunRequest {
                run_id: run_id.into(),
                idempotency_key: key.into(),
            },
            TOKEN,
        ))
        .await
        .expect("PauseRun")
        .into_inner()
        .run
        .expect("the paused run")
}

async fn resume(control_plane: &ControlPlane, run_id: &str, key: &str) -> runstore_pb::Run {
    runs(control_plane)
        .await
        .resume_run(authed(
            runstore_pb::ResumeRunRequest {
                run_id: run_id.into(),
                idempotency_key: key.into(),
            },
            TOKEN,
        ))
        .await
        .expect("ResumeRun")
        .into_inner()
        .run
        .expect("the resumed run")
}

/// How many stdout lines the run has stored so far.
async fn lines_so_far(control_plane: &ControlPlane, run_id: &str) -> usize {
    control_plane
        .events(run_id)
        .await
        .iter()
        .filter(|e| e.kind() == runstore_pb::EventKind::Stdout)
        .count()
}

/// The session leader's pid `dir` recorded for `sandbox_id`, reaped when the guard drops.
fn reap(dir: &std::path::Path, sandbox_id: &str) -> ReapSession {
    let pid: u32 = std::fs::read_to_string(dir.join(sandbox_id).join("pid"))
        .expect("the driver recorded the sandbox's pid")
        .trim()
        .parse()
        .expect("a pid");
    assert!(pid > 1);
    ReapSession(pid)
}

/// Every process of the session is stopped (`T`).
fn all_stopped(leader: u32) -> bool {
    let members = session_members(leader);
    !members.is_empty() && members.iter().all(|pid| process_state(*pid) == Some('T'))
}

/// Pauses a working run once it printed a few lines, checks its whole session is frozen
/// and prints nothing for two seconds, resumes it and checks it ends with every line once.
/// `dir` is where the driver that runs it records its sandboxes; `suspended` says the
/// sandbox is suspended as this driver leaves it (placed locally, unplaced on a node).
async fn pause_a_working_run(
    control_plane: &ControlPlane,
    dir: &std::path::Path,
    request_id: &str,
    suspended: impl Fn(&reconciler_pb::Sandbox) -> bool,
    restores: impl Fn() -> usize,
) {
    let run = control_plane
        .create_script_run(request_id, COUNT_TO_100)
        .await;
    let sandbox = control_plane
        .sandbox_when(&run.id, "the sandbox", |s| {
            s.status() == reconciler_pb::SandboxStatus::Started
        })
        .await;
    let session = reap(dir, &sandbox.id);
    control_plane
        .run_when(&run.id, "the agent to print", |r| r.last_sequence >= 5)
        .await;

    let paused = pause(control_plane, &run.id, &format!("{request_id}-pause")).await;
    assert!(paused.paused_since.is_some(), "{paused:?}");
    assert_eq!(paused.state(), runstore_pb::RunState::Running);
    control_plane
        .sandbox_when(&run.id, "the paused run's sandbox suspended", &suspended)
        .await;
    assert!(
        all_stopped(session.0),
        "every process of the paused sandbox is stopped"
    );
    // A steer does not wake a paused run (it waits for the resume; this agent never
    // reads it).
    control_plane
        .steer(&run.id, "ignored", &format!("{request_id}-steer"))
        .await;
    // Lines already written when the agent froze may still be on their way.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = lines_so_far(control_plane, &run.id).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        lines_so_far(control_plane, &run.id).await,
        before,
        "a paused run printed"
    );
    assert!(all_stopped(session.0), "a paused run was woken");
    assert_eq!(restores(), 0, "a paused run was restored");
    assert!(before < 100, "the run finished before it was paused");
    let still = control_plane
        .run_when(&run.id, "the run still paused", |r| {
            r.paused_since.is_some()
        })
        .await;
    assert_eq!(still.state(), runstore_pb::RunState::Running);

    let resumed = resume(control_plane, &run.id, &format!("{request_id}-resume")).await;
    assert_eq!(resumed.paused_since, None);
    let ended = control_plane.ended(&run.id).await;
    assert_eq!(ended.state(), runstore_pb::RunState::Succeeded, "{ended:?}");
    assert_eq!(control_plane.stdout(&run.id).await, expected_lines());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_working_agent_on_the_process_driver_is_frozen_and_resumes_with_every_line_once() {
    let control_plane = ControlPlane::start(TOKEN, &[]).await;
    let dir = control_plane.state.path().join("reconciler");
    // The reconciler restores its own sandboxes only for a resume.
    pause_a_working_run(
        &control_plane,
        &dir,
        "pause-local-request-0001",
        |s| s.status() == reconciler_pb::SandboxStatus::Suspended,
        || 0,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_working_agent_on_a_node_agent_is_frozen_and_resumes_with_every_line_once() {
    let control_plane = ControlPlane::start(
        TOKEN,
        &[("RUNPLANE_SANDBOX_RECONCILER__LOCAL_SANDBOXES", "false")],
    )
    .await;
    let node_endpoint = runplane_testkit::free_local_addr().to_string();
    let dir = control_plane.state.path().join("node-p");
    let log = control_plane.state.path().join("node-p.log");
    let _node = start_node_logging(
        "node-p",
        &node_endpoint,
        &control_plane.endpoint,
        &control_plane.endpoint,
        &dir,
        TOKEN,
        &log,
    );
    // Suspended by its node and published unplaced, as an idle suspend is; restored by
    // its node (which logs each restore) only after the resume.
    pause_a_working_run(
        &control_plane,
        &dir,
        "pause-node-request-00001",
        |s| s.status() == reconciler_pb::SandboxStatus::Suspended && s.active_node_id.is_empty(),
        || {
            std::fs::read_to_string(&log)
                .unwrap_or_default()
                .matches("sandbox restored")
                .count()
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steer_to_a_paused_run_waits_for_the_resume_and_a_cancel_ends_it() {
    let control_plane = ControlPlane::start(TOKEN, &[]).await;
    let dir = control_plane.state.path().join("reconciler");
    let run = control_plane
        .create_script_run(
            "pause-steer-request-00001",
            "while read line; do echo got-$line; done",
        )
        .await;
    let sandbox = control_plane
        .sandbox_when(&run.id, "the sandbox", |s| {
            s.status() == reconciler_pb::SandboxStatus::Started
        })
        .await;
    let session = reap(&dir, &sandbox.id);
    pause(&control_plane, &run.id, "pause-steer-pause-00001").await;
    control_plane
        .sandbox_when(&run.id, "the sandbox suspended", |s| {
            s.status() == reconciler_pb::SandboxStatus::Suspended
        })
        .await;

    // A steer is accepted and waits: a message does not wake a paused run.
    control_plane
        .steer(&run.id, "one", "pause-steer-steer-00001")
        .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    control_plane
        .sandbox_when(&run.id, "the sandbox still suspended", |s| {
            s.status() == reconciler_pb::SandboxStatus::Suspended
        })
        .await;
    assert!(all_stopped(session.0));
    assert_eq!(lines_so_far(&control_plane, &run.id).await, 0);

    // After the resume the steer reaches the agent, once.
    resume(&control_plane, &run.id, "pause-steer-resume-0001").await;
    eventually(Duration::from_secs(60), "the steer to arrive", || async {
        (lines_so_far(&control_plane, &run.id).await == 1).then_some(())
    })
    .await;

    // Paused again and cancelled: it ends CANCELLED and nothing of it keeps running.
    pause(&control_plane, &run.id, "pause-steer-pause-00002").await;
    control_plane
        .sandbox_when(&run.id, "the sandbox suspended again", |s| {
            s.status() == reconciler_pb::SandboxStatus::Suspended
        })
        .await;
    runs(&control_plane)
        .await
        .cancel_run(authed(
            runstore_pb::CancelRunRequest {
                run_id: run.id.clone(),
                reason: "no longer needed".into(),
                idempotency_key: "pause-steer-cancel-0001".into(),
            },
            TOKEN,
        ))
        .await
        .expect("CancelRun");
    let ended = control_plane.ended(&run.id).await;
    assert_eq!(ended.state(), runstore_pb::RunState::Cancelled);
    assert_eq!(control_plane.stdout(&run.id).await, ["got-one"]);
    eventually(
        Duration::from_secs(30),
        "the paused sandbox's processes stopped",
        || async { session_members(session.0).is_empty().then_some(()) },
    )
    .await;
}

/// `runplane pause`, `get` and `resume` as an operator types them, a pause past the
/// profile's `max_pause_seconds` ending the run `paused_too_long`, and the refusals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_pauses_and_resumes_and_a_pause_past_its_limit_ends_the_run_paused_too_long() {
    let data = tempfile::tempdir().unwrap();
    let config = data.path().join("runplane.toml");
    std::fs::write(
        &config,
        profile_toml("brief", "max_pause_seconds = 2") + &profile_toml("default", ""),
    )
    .unwrap();
    let dev = start_dev_with_env(
        data.path(),
        &[("RUNPLANE_CONFIG", config.to_str().unwrap())],
    )
    .await;
    let cli = |args: &[&str]| {
        let mut command = tokio::process::Command::new(runplane_bin());
        command
            .args(args)
            .arg("--endpoint")
            .arg(dev.endpoint())
            .arg("--token-file")
            .arg(data.path().join("operator-token"))
            .env_remove("RUNPLANE_CONFIG")
            .env_remove("RUNPLANE_TOKEN")
            .stdin(Stdio::null());
        async move {
            let out = tokio::time::timeout(Duration::from_secs(60), command.output())
                .await
                .expect("the command ends within 60 s")
                .unwrap();
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        }
    };
    let (_, stdout, stderr) = cli(&["runs", "--json"]).await;
    assert_eq!(stdout.trim(), "[]", "{stderr}");

    let mut run = tokio::process::Command::new(runplane_bin());
    run.args(["run", "--endpoint", &dev.endpoint(), "--token-file"])
        .arg(data.path().join("operator-token"))
        .args(["--profile", "brief", "--", "sh", "-c", "sleep 300"])
        .env_remove("RUNPLANE_CONFIG")
        .env_remove("RUNPLANE_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let run = run.spawn().unwrap();
    let id = eventually(Duration::from_secs(60), "the run to start", || async {
        let (_, stdout, _) = cli(&["runs", "--state", "running", "--json"]).await;
        let runs: serde_json::Value = serde_json::from_str(&stdout).ok()?;
        runs.as_array()?.first()?["id"].as_str().map(str::to_owned)
    })
    .await;

    // Paused and resumed once: the run goes on.
    let (code, stdout, stderr) = cli(&["pause", &id]).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stdout.starts_with(&format!("run {id}: running (paused), paused since ")),
        "{stdout}"
    );
    let (_, stdout, _) = cli(&["get", &id]).await;
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("paused              20")),
        "{stdout}"
    );
    let (_, stdout, _) = cli(&["runs", "--paused"]).await;
    assert!(stdout.contains(&id), "{stdout}");
    let (code, stdout, stderr) = cli(&["resume", &id]).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(stdout.trim(), format!("run {id}: running"));
    let (_, stdout, _) = cli(&["runs", "--paused"]).await;
    assert!(!stdout.contains(&id), "{stdout}");

    // Paused past the profile's 2 s: the run ends paused_too_long.
    let (code, _, stderr) = cli(&["pause", &id]).await;
    assert_eq!(code, Some(0), "{stderr}");
    let out = tokio::time::timeout(Duration::from_secs(60), run.wait_with_output())
        .await
        .expect("runplane run ends within 60 s")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(stderr.contains("runplane: paused"), "{stderr}");
    assert!(stderr.contains("runplane: resumed"), "{stderr}");
    assert!(stderr.contains("paused_too_long"), "{stderr}");
    let (_, stdout, _) = cli(&["get", &id]).await;
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("reason") && l.ends_with("paused_too_long")),
        "{stdout}"
    );

    // Refused: an ended run, and an id that is not one.
    let (code, _, stderr) = cli(&["pause", &id]).await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.starts_with("error: FAILED_PRECONDITION: "),
        "{stderr}"
    );
    assert!(stderr.contains("RUN_TERMINAL"), "{stderr}");
    let (code, _, stderr) = cli(&["resume", "not-a-run"]).await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.starts_with("error: INVALID_ARGUMENT: "), "{stderr}");
}
