//! A runner that exits without a verdict (here SIGKILLed, as an OOM kill or a crash would
//! end it) is certain to be gone: its sandbox's shell records its exit status, and its
//! attempt ends `runner_exited` in the round that sees it, on the reconciler's own process
//! driver and on a node agent, instead of holding its slot and keys for the whole loss
//! grace (90 s here, longer than these tests wait). The run outlives it: attempt 2 runs in
//! a new sandbox and succeeds. The agent attempt 1 leaves behind is stopped with its
//! sandbox.

use std::time::Duration;

use runplane_integration_tests::sandboxes::{
    ControlPlane, ReapSession, eventually, session_members, start_node_logging,
};
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::runstore::v1 as runstore_pb;

const TOKEN: &str = "runner-exit-operator-token-0123456789abcdef";

/// The direct children of `pid`.
fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Starts a run whose agent prints which attempt it is and, on attempt 1, sleeps;
/// SIGKILLs attempt 1's runner (the sandbox shell's only child) and checks the attempt
/// ends at once, without the loss grace (90 s here, longer than these tests wait), and
/// attempt 2 runs in a new sandbox, learns why attempt 1 ended and succeeds: every line
/// of both attempts once, attempt 1's agent stopped, the receipt listing both attempts
/// and verifying. `dir` is where the driver records its sandboxes.
async fn kill_the_runner(control_plane: &ControlPlane, dir: &std::path::Path, request_id: &str) {
    let run = control_plane
        .create_script_run(
            request_id,
            "echo \"attempt $RUNPLANE_ATTEMPT after ${RUNPLANE_PREVIOUS_ATTEMPT:-nothing}\"; \
             if [ \"$RUNPLANE_ATTEMPT\" = 1 ]; then exec sleep 600; fi",
        )
        .await;
    let sandbox = control_plane
        .sandbox_when(&run.id, "the sandbox", |s| {
            s.status() == reconciler_pb::SandboxStatus::Started
        })
        .await;
    let shell: u32 = std::fs::read_to_string(dir.join(&sandbox.id).join("pid"))
        .expect("the driver recorded the sandbox's pid")
        .trim()
        .parse()
        .expect("a pid");
    assert!(shell > 1);
    let session = ReapSession(shell);
    control_plane
        .run_when(&run.id, "the agent to print", |r| r.last_sequence >= 1)
        .await;
    let runner = match children(shell).as_slice() {
        [runner] => *runner,
        other => panic!("the sandbox shell {shell} has one child, its runner: {other:?}"),
    };
    assert!(
        std::process::Command::new("kill")
            .args(["-KILL", &runner.to_string()])
            .status()
            .unwrap()
            .success()
    );

    let ended = control_plane.ended(&run.id).await;
    assert_eq!(ended.state(), runstore_pb::RunState::Succeeded, "{ended:?}");
    assert_eq!(ended.attempt, 2, "{ended:?}");
    assert_eq!(
        control_plane.stdout(&run.id).await,
        ["attempt 1 after nothing", "attempt 2 after runner_exited"]
    );
    let attempts: Vec<(u32, String, String)> = ended
        .attempts
        .iter()
        .map(|a| (a.number, a.end_reason.clone(), a.end_message.clone()))
        .collect();
    assert_eq!(
        attempts,
        [
            (
                1,
                "runner_exited".to_owned(),
                format!(
                    "the runner of sandbox {} was killed by signal 9 without a verdict",
                    sandbox.id
                )
            ),
            (2, "exit_zero".to_owned(), "exited with status 0".to_owned()),
        ]
    );
    assert_eq!(ended.attempts[0].sandbox_id, sandbox.id);
    assert_ne!(ended.attempts[1].sandbox_id, sandbox.id, "a new sandbox");
    let kinds: Vec<runstore_pb::EventKind> = control_plane
        .events(&run.id)
        .await
        .iter()
        .map(|e| e.kind())
        .filter(|k| {
            matches!(
                k,
                runstore_pb::EventKind::AttemptEnded | runstore_pb::EventKind::AttemptStarted
            )
        })
        .collect();
    assert_eq!(
        kinds,
        [
            runstore_pb::EventKind::AttemptEnded,
            runstore_pb::EventKind::AttemptStarted
        ]
    );
    let receipt = control_plane.verified_receipt(&run.id).await;
    let listed: Vec<(u32, &str)> = receipt
        .attempts
        .iter()
        .map(|a| (a.number, a.end_reason.as_str()))
        .collect();
    assert_eq!(listed, [(1, "runner_exited"), (2, "exit_zero")]);
    eventually(
        Duration::from_secs(30),
        "attempt 1's orphaned agent stopped with its sandbox",
        || async { session_members(session.0).is_empty().then_some(()) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_runner_is_followed_by_a_second_attempt_on_the_process_driver() {
    let control_plane = ControlPlane::start(TOKEN, &[]).await;
    let dir = control_plane.state.path().join("reconciler");
    kill_the_runner(&control_plane, &dir, "runner-exit-local-000001").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_runner_is_followed_by_a_second_attempt_on_a_node_agent() {
    let control_plane = ControlPlane::start(
        TOKEN,
        &[("RUNPLANE_SANDBOX_RECONCILER__LOCAL_SANDBOXES", "false")],
    )
    .await;
    let node_endpoint = runplane_testkit::free_local_addr().to_string();
    let dir = control_plane.state.path().join("node-x");
    let _node = start_node_logging(
        "node-x",
        &node_endpoint,
        &control_plane.endpoint,
        &control_plane.endpoint,
        &dir,
        TOKEN,
        &control_plane.state.path().join("node-x.log"),
    );
    kill_the_runner(&control_plane, &dir, "runner-exit-node-0000001").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_exits_3_is_not_retried() {
    // The agent's own failure proves nothing against the infrastructure: one attempt, the
    // run ends with the agent's exit code.
    let control_plane = ControlPlane::start(TOKEN, &[]).await;
    let run = control_plane
        .create_script_run(
            "agent-exit-3-request-01",
            "echo attempt $RUNPLANE_ATTEMPT; exit 3",
        )
        .await;
    let ended = control_plane.ended(&run.id).await;
    assert_eq!(ended.state(), runstore_pb::RunState::Failed, "{ended:?}");
    assert_eq!(ended.attempt, 1);
    let verdict = ended.verdict.unwrap();
    assert_eq!(
        (verdict.reason.as_str(), verdict.exit_code),
        ("exit_nonzero", Some(3))
    );
    assert_eq!(control_plane.stdout(&run.id).await, ["attempt 1"]);
}
