//! How long a reattach to an idle-suspended sandbox takes to become routable: the first
//! ResolveRoute (NOT_PLACED, a wake queued) to the first ResolveRoute that answers with
//! the node's endpoint, on the process driver of a real node agent.
//!
//! The control plane is `runplane serve run-store sandbox-reconciler stream-recovery` on
//! Postgres, with the reconciler's round at its production default of 2 s, so only the
//! event-driven path (the reattach asks for a round; the round signals the node's long
//! poll) can be faster than a round. One `runplane node` on a state directory of its own
//! runs every sandbox; its idle timeout is 1 s. Each of [`ROUNDS`] rounds starts
//! [`PER_ROUND`] runs of an agent that waits for a line on stdin (idle, so suspended),
//! waits until all are suspended, then reattaches to them one at a time, polling
//! ResolveRoute every 5 ms; then it cancels them.
//!
//! Run: `cargo build --release -p runplane && cargo bench -p runplane-integration-tests
//! --bench wake_latency` (needs the local Postgres). Prints p50/p99 with the goals
//! (p50 <= 100 ms, p99 <= 1 s) beside them.

use std::time::{Duration, Instant};

use runplane_integration_tests::channel;
use runplane_integration_tests::sandboxes::{self, ControlPlane, ReapSession, eventually};
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::reconciler::v1::sandbox_service_client::SandboxServiceClient;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_testkit::authed;
use tonic::transport::Channel;

const TOKEN: &str = "wake-bench-operator-token-0123456789abcde";
const ROUNDS: usize = 10;
/// At most the node's capacity (8), so every run of a round is placed at once.
const PER_ROUND: usize = 8;
const POLL: Duration = Duration::from_millis(5);

/// From the first reattach to a routed answer.
async fn reattach(api: &SandboxServiceClient<Channel>, sandbox_id: &str) -> Duration {
    let resolve = || {
        authed(
            reconciler_pb::ResolveRouteRequest {
                sandbox_id: sandbox_id.to_owned(),
                session_id: "bench-session".into(),
            },
            TOKEN,
        )
    };
    let started = Instant::now();
    loop {
        match api.clone().resolve_route(resolve()).await {
            Ok(_) => return started.elapsed(),
            Err(status) if status.code() == tonic::Code::FailedPrecondition => {}
            Err(status) => panic!("ResolveRoute failed: {status:?}"),
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "never routable"
        );
        tokio::time::sleep(POLL).await;
    }
}

fn at(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * q).round() as usize]
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

#[tokio::main]
async fn main() {
    // Each node listens on its advertised endpoint: a free port, not a shared one.
    let node_endpoint_17101 = runplane_testkit::free_local_addr().to_string();
    let control_plane = ControlPlane::start(
        TOKEN,
        &[
            ("RUNPLANE_SANDBOX_RECONCILER__IDLE_TIMEOUT_SECONDS", "1"),
            ("RUNPLANE_SANDBOX_RECONCILER__LOCAL_SANDBOXES", "false"),
            // The production round: the safety net, not the path.
            ("RUNPLANE_SANDBOX_RECONCILER__TICK_INTERVAL_MS", "2000"),
        ],
    )
    .await;
    let endpoint = control_plane.endpoint.clone();
    let (_node, node_dir) = control_plane.node("node-a", node_endpoint_17101.as_str());
    let api = SandboxServiceClient::new(channel(&endpoint).await);
    let mut runs = RunServiceClient::new(channel(&endpoint).await);
    // The node is ready before any run exists, so dispatch on creation has somewhere to go.
    sandboxes::node_ready(&api, TOKEN, "node-a").await;

    let mut latencies = Vec::with_capacity(ROUNDS * PER_ROUND);
    for round in 0..ROUNDS {
        let mut round_runs = Vec::new();
        for i in 0..PER_ROUND {
            let run = control_plane
                .create_script_run(
                    &format!("wake-bench-{round:03}-{i:03}-request"),
                    "read go; echo done",
                )
                .await;
            round_runs.push(run.id);
        }
        let mut sandboxes = Vec::new();
        let mut reaps = Vec::new();
        for run_id in &round_runs {
            let (sandbox, pid) =
                sandboxes::idle_suspended(&api, TOKEN, run_id, &node_dir, Duration::from_secs(60))
                    .await;
            reaps.push(ReapSession(pid));
            sandboxes.push(sandbox.id);
        }
        for sandbox_id in &sandboxes {
            latencies.push(reattach(&api, sandbox_id).await);
        }
        for run_id in &round_runs {
            runs.cancel_run(authed(
                runstore_pb::CancelRunRequest {
                    run_id: run_id.clone(),
                    reason: "wake bench round over".into(),
                    idempotency_key: format!("wake-bench-cancel-{run_id}"),
                },
                TOKEN,
            ))
            .await
            .unwrap();
        }
        // The node stops the cancelled runs' sandboxes; make room for the next round.
        for sandbox_id in &sandboxes {
            let sandbox_id = sandbox_id.clone();
            eventually(Duration::from_secs(60), "the sandbox deleted", || {
                let mut api = api.clone();
                let sandbox_id = sandbox_id.clone();
                async move {
                    match api
                        .get_sandbox(authed(
                            reconciler_pb::GetSandboxRequest { sandbox_id },
                            TOKEN,
                        ))
                        .await
                    {
                        Err(status) if status.code() == tonic::Code::NotFound => Some(()),
                        Ok(answer) => (answer.into_inner().sandbox?.status()
                            == reconciler_pb::SandboxStatus::Deleted)
                            .then_some(()),
                        Err(_) => None,
                    }
                }
            })
            .await;
        }
        drop(reaps);
    }
    latencies.sort();
    println!(
        "reattach -> routable on the process driver of one node agent, {} reattaches \
         ({ROUNDS} rounds of {PER_ROUND}), reconciler round 2 s",
        latencies.len()
    );
    println!(
        "{:>8} | {:>8} | {:>8} | {:>8}",
        "", "p50 ms", "p99 ms", "max ms"
    );
    println!(
        "{:>8} | {:>8} | {:>8} | {:>8}",
        "measured",
        ms(at(&latencies, 0.5)),
        ms(at(&latencies, 0.99)),
        ms(*latencies.last().unwrap())
    );
    println!(
        "{:>8} | {:>8} | {:>8} | {:>8}",
        "goal", "<= 100", "<= 1000", "-"
    );
}
