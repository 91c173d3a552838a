//! How long a run goes without a live attempt once its sandbox dies, measured on the
//! process driver of `runplane serve` (run store, reconciler and coordinator on Postgres):
//!
//! - a known exit: attempt 1's runner SIGKILLed (its sandbox's shell records the exit) to
//!   attempt 2 RUNNING (its runner's Hello);
//! - an unknown loss: attempt 1's whole sandbox SIGKILLed (shell, runner and agent: no
//!   exit recorded) to attempt 2 RUNNING, which waits out the loss grace (5 s here);
//! - the baseline, in the same run: a new run's creation to RUNNING, the same dispatch,
//!   launch and Hello without a failure before them.
//!
//! The reconciler's round is at its production default (2 s), so only the event-driven
//! path (the FailRun's answer wakes a round; the backoff's end schedules one) beats it.
//! The retry policy is the default (1 s doubling, drawn from its upper half: attempt 2
//! waits 0.5 to 1 s).
//!
//! Run: `cargo build --release -p runplane && cargo bench -p runplane-integration-tests
//! --bench attempt_latency` (needs the local Postgres and bubblewrap). Prints p50/p99 per
//! path with the goals beside them (known exit: p50 <= 3 s; loss: p50 <= grace + 3 s) and
//! the ratio to the baseline.

use std::time::{Duration, Instant};

use runplane_integration_tests::channel;
use runplane_integration_tests::sandboxes::{ControlPlane, ReapSession, session_members};
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_testkit::authed;
use tonic::transport::Channel;

const TOKEN: &str = "attempt-bench-operator-token-0123456789ab";
const KNOWN_EXITS: usize = 12;
const LOSSES: usize = 6;
const LOSS_GRACE_SECONDS: u64 = 5;
const POLL: Duration = Duration::from_millis(10);
/// Attempt 1 sleeps; attempt 2 ends at once.
const SCRIPT: &str =
    "echo attempt $RUNPLANE_ATTEMPT; [ $RUNPLANE_ATTEMPT = 1 ] && exec sleep 600; true";

async fn until_running(runs: &RunServiceClient<Channel>, run_id: &str, attempt: u32) -> Instant {
    let started = Instant::now();
    loop {
        let run = runs
            .clone()
            .get_run(authed(
                runstore_pb::GetRunRequest {
                    run_id: run_id.to_owned(),
                },
                TOKEN,
            ))
            .await
            .expect("GetRun")
            .into_inner()
            .run
            .expect("a run");
        if run.attempt >= attempt
            && matches!(
                run.state(),
                runstore_pb::RunState::Running | runstore_pb::RunState::Succeeded
            )
        {
            return Instant::now();
        }
        assert!(
            !run.state().is_terminal(),
            "run {run_id} ended before attempt {attempt} ran: {run:?}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "attempt {attempt} of {run_id} never ran"
        );
        tokio::time::sleep(POLL).await;
    }
}

/// The pid of the sandbox's shell and of its runner (the shell's only child), once
/// attempt 1's agent printed.
async fn attempt_one(cp: &ControlPlane, run_id: &str) -> (u32, u32) {
    let sandbox = cp
        .sandbox_when(run_id, "attempt 1's sandbox", |s| {
            s.status() == reconciler_pb::SandboxStatus::Started
        })
        .await;
    cp.run_when(run_id, "attempt 1 to print", |r| r.last_sequence >= 1)
        .await;
    let dir = cp.state.path().join("reconciler").join(&sandbox.id);
    let shell: u32 = std::fs::read_to_string(dir.join("pid"))
        .expect("the sandbox's pid")
        .trim()
        .parse()
        .expect("a pid");
    let children: Vec<u32> =
        std::fs::read_to_string(format!("/proc/{shell}/task/{shell}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect();
    let [runner] = children.as_slice() else {
        panic!("the sandbox shell {shell} has one child, its runner: {children:?}");
    };
    (shell, *runner)
}

fn kill(pid: u32) {
    assert!(
        std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
}

fn at(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * q).round() as usize]
}

fn secs(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64())
}

#[tokio::main]
async fn main() {
    let grace = LOSS_GRACE_SECONDS.to_string();
    let cp = ControlPlane::start(
        TOKEN,
        &[
            // The production round: the safety net, not the path.
            ("RUNPLANE_SANDBOX_RECONCILER__TICK_INTERVAL_MS", "2000"),
            (
                "RUNPLANE_SANDBOX_RECONCILER__LOSS_GRACE_SECONDS",
                grace.as_str(),
            ),
        ],
    )
    .await;
    let runs = RunServiceClient::new(channel(&cp.endpoint).await);
    let (mut baseline, mut known, mut lost) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..KNOWN_EXITS + LOSSES {
        let created = Instant::now();
        let run = cp
            .create_script_run(&format!("attempt-bench-{i:04}-request"), SCRIPT)
            .await;
        baseline.push(until_running(&runs, &run.id, 1).await - created);
        let (shell, runner) = attempt_one(&cp, &run.id).await;
        let session = ReapSession(shell);
        let died = Instant::now();
        if i < KNOWN_EXITS {
            kill(runner);
            known.push(until_running(&runs, &run.id, 2).await - died);
        } else {
            // The whole session at once (a member may be gone by its turn).
            for member in session_members(shell) {
                let _ = std::process::Command::new("kill")
                    .args(["-KILL", &member.to_string()])
                    .status();
            }
            lost.push(until_running(&runs, &run.id, 2).await - died);
        }
        let ended = cp.ended(&run.id).await;
        assert_eq!(ended.state(), runstore_pb::RunState::Succeeded, "{ended:?}");
        drop(session);
    }
    for v in [&mut baseline, &mut known, &mut lost] {
        v.sort();
    }
    let p50 = |v: &[Duration]| at(v, 0.5);
    println!(
        "attempt 2 RUNNING after attempt 1 died, on the process driver of `runplane serve` \
         (Postgres), reconciler round 2 s, loss grace {LOSS_GRACE_SECONDS} s, default retry \
         policy"
    );
    println!(
        "{:<34} | {:>4} | {:>7} | {:>7} | {:>7} | {:>12} | {:>10}",
        "path", "n", "p50 s", "p99 s", "max s", "goal p50", "p50/base"
    );
    let row = |name: &str, v: &[Duration], goal: String| {
        println!(
            "{:<34} | {:>4} | {:>7} | {:>7} | {:>7} | {:>12} | {:>10}",
            name,
            v.len(),
            secs(p50(v)),
            secs(at(v, 0.99)),
            secs(*v.last().unwrap()),
            goal,
            format!(
                "{:.1}x",
                p50(v).as_secs_f64() / p50(&baseline).as_secs_f64()
            )
        );
    };
    row("baseline: created -> RUNNING", &baseline, "-".into());
    row("runner killed (known exit)", &known, "<= 3.00".into());
    row(
        "sandbox killed (unknown loss)",
        &lost,
        format!("<= {:.2}", LOSS_GRACE_SECONDS as f64 + 3.0),
    );
}
