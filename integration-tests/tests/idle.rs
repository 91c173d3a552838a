//! Idle means parked, not silent (docs/architecture.md "Sandbox reconciler"), over a real node
//! agent, its process driver and real agents in bubblewrap, with a 3 s idle timeout:
//! an agent that is quiet but working (`sleep 10`) is never suspended and finishes; an
//! agent blocked reading its stdin is suspended, woken by a reattach on its own node, not
//! frozen again before its runner polled, given its line by a steer, and finishes; and
//! whatever is addressed to a parked run (a steer, an interrupt, a resume_stream, a
//! cancel) reaches it with no reattach.

use std::time::Duration;

use runplane_integration_tests::channel;
use runplane_integration_tests::sandboxes::{
    ControlPlane, ReapSession, eventually, parked, start_node_logging,
};
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_testkit::authed;

const TOKEN: &str = "idle-test-operator-token-0123456789abcdefgh";
const IDLE_TIMEOUT: Duration = Duration::from_secs(3);
/// What a node's log says each time it suspends a sandbox for idleness.
const SUSPENDED: &str = "idle: suspended";

/// A control plane with a 3 s idle timeout and one node agent, `node-i`, which holds
/// every sandbox; the agent's log is kept to count its suspends.
struct Cluster {
    runs: RunServiceClient<tonic::transport::Channel>,
    node_dir: std::path::PathBuf,
    node_log: std::path::PathBuf,
    _node: tokio::process::Child,
    control_plane: ControlPlane,
}

impl std::ops::Deref for Cluster {
    type Target = ControlPlane;

    /// The control plane's run and sandbox helpers.
    fn deref(&self) -> &ControlPlane {
        &self.control_plane
    }
}

impl Cluster {
    async fn start(node_endpoint: &str) -> Self {
        let idle = IDLE_TIMEOUT.as_secs().to_string();
        let control_plane = ControlPlane::start(
            TOKEN,
            &[
                ("RUNPLANE_SANDBOX_RECONCILER__IDLE_TIMEOUT_SECONDS", &idle),
                // Every sandbox goes to the node agent.
                ("RUNPLANE_SANDBOX_RECONCILER__LOCAL_SANDBOXES", "false"),
            ],
        )
        .await;
        let endpoint = control_plane.endpoint.clone();
        let node_dir = control_plane.state.path().join("node-i");
        let node_log = control_plane.state.path().join("node-i.log");
        let node = start_node_logging(
            "node-i",
            node_endpoint,
            &endpoint,
            &endpoint,
            &node_dir,
            TOKEN,
            &node_log,
        );
        Self {
            runs: RunServiceClient::new(channel(&endpoint).await),
            node_dir,
            node_log,
            _node: node,
            control_plane,
        }
    }

    async fn create_run(&self, request_id: &str, script: &str) -> runstore_pb::Run {
        self.control_plane
            .create_script_run(request_id, script)
            .await
    }

    /// The sandbox's session leader, whose session is killed whole when the guard drops
    /// (a failing test must leave no frozen processes behind).
    fn reap(&self, sandbox_id: &str) -> ReapSession {
        let pid: u32 = std::fs::read_to_string(self.node_dir.join(sandbox_id).join("pid"))
            .expect("the node recorded the sandbox's pid")
            .trim()
            .parse()
            .expect("a pid");
        assert!(pid > 1);
        ReapSession(pid)
    }

    /// Steers the line `go` to `run_id`, keyed `key`.
    async fn steer_go(&self, run_id: &str, key: &str) {
        self.control_plane.steer(run_id, "go", key).await
    }

    /// The kinds of the steering messages the run's runner applied, in order.
    async fn applied(&self, run_id: &str) -> Vec<String> {
        self.events(run_id)
            .await
            .into_iter()
            .filter(|e| e.kind() == runstore_pb::EventKind::SteerApplied)
            .map(|e| e.name)
            .collect()
    }

    fn suspends(&self) -> usize {
        std::fs::read_to_string(&self.node_log)
            .unwrap_or_default()
            .matches(SUSPENDED)
            .count()
    }
}

/// Started and placed on its node.
fn running_on_its_node(s: &reconciler_pb::Sandbox) -> bool {
    s.status() == reconciler_pb::SandboxStatus::Started && !s.active_node_id.is_empty()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_agent_that_is_working_is_never_suspended_and_finishes() {
    // Each node listens on its advertised endpoint: a free port, not a shared one.
    let node_endpoint_17041 = runplane_testkit::free_local_addr().to_string();
    let cluster = Cluster::start(node_endpoint_17041.as_str()).await;
    // Silent for 10 s, over three idle timeouts, but never waiting for input.
    let run = cluster
        .create_run("idle-working-request-001", "sleep 10; echo done")
        .await;
    let sandbox = cluster
        .sandbox_when(&run.id, "the sandbox on the node", running_on_its_node)
        .await;
    let _reap = cluster.reap(&sandbox.id);

    let ended = cluster.ended(&run.id).await;
    assert_eq!(ended.state(), runstore_pb::RunState::Succeeded, "{ended:?}");
    assert_eq!(cluster.stdout(&run.id).await, ["done"]);
    assert_eq!(cluster.suspends(), 0, "a working agent was frozen");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_waiting_for_input_is_suspended_woken_by_a_reattach_and_steered_to_the_end() {
    // Each node listens on its advertised endpoint: a free port, not a shared one.
    let node_endpoint_17042 = runplane_testkit::free_local_addr().to_string();
    let cluster = Cluster::start(node_endpoint_17042.as_str()).await;
    let run = cluster
        .create_run("idle-parked-request-0001", "read line; echo got-$line")
        .await;

    // Parked: suspended and published unplaced.
    let sandbox = cluster
        .sandbox_when(&run.id, "the idle suspend", parked)
        .await;
    let _reap = cluster.reap(&sandbox.id);
    // The node publishes the suspend before it logs it.
    runplane_integration_tests::wait_for(
        "the node to log its suspend",
        Duration::from_secs(10),
        async || cluster.suspends() > 0,
    )
    .await;
    assert_eq!(cluster.suspends(), 1);

    // The reattach: not placed, a wake is queued, and the node holding it restores it.
    let refused = cluster
        .resolve_route(&sandbox.id, "session-1")
        .await
        .unwrap_err();
    assert_eq!(
        runplane_grpc::error_info(&refused).unwrap().reason,
        "NOT_PLACED"
    );
    cluster
        .sandbox_when(&run.id, "the wake to restore it", running_on_its_node)
        .await;
    let route = cluster
        .resolve_route(&sandbox.id, "session-1")
        .await
        .unwrap();
    assert_eq!(route.node_id, "node-i");

    // Still parked, but its runner has not had a poll answered since the restore (the
    // poll it was frozen in is held for 20 s): past the idle timeout and a node round,
    // the node has not frozen it again, so what is sent now reaches it. This window is
    // where a node that restarts the idle clock alone suspends it a second time.
    tokio::time::sleep(IDLE_TIMEOUT + Duration::from_secs(2)).await;
    assert_eq!(
        cluster.suspends(),
        1,
        "suspended again before its runner polled"
    );

    cluster.steer_go(&run.id, "idle-parked-steer-00001").await;
    let ended = cluster.ended(&run.id).await;
    assert_eq!(ended.state(), runstore_pb::RunState::Succeeded, "{ended:?}");
    assert_eq!(cluster.stdout(&run.id).await, ["got-go"]);
}

/// A node reports its agents' waits for input: the run shows `waiting_for_input` while
/// its agent reads its stdin, still after the idle suspend froze it, and no longer once
/// a steer has set it working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_agents_parked_agent_shows_waiting_for_input_through_its_suspend() {
    let node_endpoint = runplane_testkit::free_local_addr().to_string();
    let cluster = Cluster::start(node_endpoint.as_str()).await;
    let run = cluster
        .create_run(
            "idle-waiting-request-001",
            "read line; echo got-$line; sleep 300",
        )
        .await;
    let waiting = cluster
        .run_when(&run.id, "the run to wait for input", |r| {
            r.waiting_for_input_since.is_some()
        })
        .await;
    assert_eq!(waiting.state(), runstore_pb::RunState::Running);
    let sandbox = cluster
        .sandbox_when(&run.id, "the idle suspend", parked)
        .await;
    let _reap = cluster.reap(&sandbox.id);
    let frozen = cluster
        .run_when(&run.id, "the run after the suspend", |_| true)
        .await;
    assert_eq!(
        frozen.waiting_for_input_since, waiting.waiting_for_input_since,
        "a suspended agent still waits, since the same time"
    );

    cluster.steer_go(&run.id, "idle-waiting-steer-00001").await;
    cluster
        .run_when(&run.id, "the agent to work again", |r| {
            r.state() == runstore_pb::RunState::Running && r.waiting_for_input_since.is_none()
        })
        .await;
    assert_eq!(cluster.stdout(&run.id).await, ["got-go"]);
    cluster
        .runs
        .clone()
        .cancel_run(authed(
            runstore_pb::CancelRunRequest {
                run_id: run.id.clone(),
                reason: "done".into(),
                idempotency_key: "idle-waiting-cancel-0001".into(),
            },
            TOKEN,
        ))
        .await
        .unwrap();
    let ended = cluster.ended(&run.id).await;
    assert_eq!(ended.state(), runstore_pb::RunState::Cancelled);
    assert_eq!(ended.waiting_for_input_since, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whatever_is_addressed_to_a_parked_run_wakes_it_without_a_reattach() {
    let node_endpoint = runplane_testkit::free_local_addr().to_string();
    let cluster = Cluster::start(node_endpoint.as_str()).await;
    let script = "read line; echo got-$line";
    let steered = cluster.create_run("parked-steer-request-01", script).await;
    let interrupted = cluster.create_run("parked-interrupt-req-01", script).await;
    let resumed = cluster.create_run("parked-resume-request-1", script).await;
    let cancelled = cluster.create_run("parked-cancel-request-1", script).await;
    let mut reaps = Vec::new();
    for run in [&steered, &interrupted, &resumed, &cancelled] {
        let sandbox = cluster
            .sandbox_when(&run.id, "the idle suspend", parked)
            .await;
        reaps.push(cluster.reap(&sandbox.id));
    }
    let mut runs = cluster.runs.clone();

    // A steer alone: the run is woken on its node, takes its line and finishes.
    cluster
        .steer_go(&steered.id, "parked-steer-key-000001")
        .await;
    let ended = cluster.ended(&steered.id).await;
    assert_eq!(ended.state(), runstore_pb::RunState::Succeeded, "{ended:?}");
    assert_eq!(cluster.stdout(&steered.id).await, ["got-go"]);

    // An interrupt alone: woken, the runner applies it, and the agent it stops ends the run.
    runs.interrupt(authed(
        runstore_pb::InterruptRequest {
            run_id: interrupted.id.clone(),
            reason: "enough".into(),
            idempotency_key: "parked-interrupt-key-01".into(),
            grace: None,
        },
        TOKEN,
    ))
    .await
    .unwrap();
    let ended = cluster.ended(&interrupted.id).await;
    assert!(ended.state().is_terminal(), "{ended:?}");
    assert_eq!(cluster.applied(&interrupted.id).await, ["interrupt"]);

    // A resume_stream (what the stream recovery coordinator sends) alone: woken, placed on
    // its node again, and applied by the runner.
    let mut service = RunServiceClient::new(
        runplane_integration_tests::channel(&cluster.control_plane.endpoint).await,
    );
    service
        .enqueue_control(runplane_testkit::authed(
            runstore_pb::EnqueueControlRequest {
                run_id: resumed.id.clone(),
                idempotency_key: "parked-resume-key-00001".into(),
                control: Some(runstore_pb::enqueue_control_request::Control::ResumeStream(
                    runstore_pb::ResumeStreamPayload {
                        controller_token: "a-controller-token".into(),
                        next_sequence: 1,
                        attempt: 1,
                        lease_expires_at: None,
                    },
                )),
            },
            runplane_integration_tests::SERVICE_TOKEN,
        ))
        .await
        .unwrap();
    cluster
        .sandbox_when(&resumed.id, "the resume_stream to restore it", |s| {
            s.status() == reconciler_pb::SandboxStatus::Started && s.active_node_id == "node-i"
        })
        .await;
    eventually(
        Duration::from_secs(30),
        "the runner applying the resume_stream",
        || async { (cluster.applied(&resumed.id).await == ["resume_stream"]).then_some(()) },
    )
    .await;

    // A cancel: the run ends at once, and its frozen agent is destroyed with its sandbox.
    runs.cancel_run(authed(
        runstore_pb::CancelRunRequest {
            run_id: cancelled.id.clone(),
            reason: "not needed".into(),
            idempotency_key: "parked-cancel-key-00001".into(),
        },
        TOKEN,
    ))
    .await
    .unwrap();
    let leader = reaps[3].0;
    eventually(
        Duration::from_secs(30),
        "the cancelled run's agent to be gone",
        || async {
            runplane_integration_tests::sandboxes::session_members(leader)
                .is_empty()
                .then_some(())
        },
    )
    .await;
    cluster
        .sandbox_when(&cancelled.id, "the cancelled run's sandbox deleted", |s| {
            s.status() == reconciler_pb::SandboxStatus::Deleted
        })
        .await;
}

/// An agent that waits for input by polling its stdin (a non-blocking read between
/// sleeps), as an event loop does: the syscall rule sees it sleeping, so it is working
/// and never frozen, unless it says it is parked with its park mark (`$RUNPLANE_PARK`).
const POLLING_AGENT: &str = "while :; do l=$(dd iflag=nonblock bs=64 count=1 2>/dev/null); \
     [ -n \"$l\" ] && break; sleep 0.3; done; rm -f \"$RUNPLANE_PARK\"; echo got-$l";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_leaves_its_park_mark_is_suspended_however_it_waits() {
    let node_endpoint = runplane_testkit::free_local_addr().to_string();
    let cluster = Cluster::start(node_endpoint.as_str()).await;
    let marked = cluster
        .create_run(
            "park-mark-request-000001",
            &format!("touch \"$RUNPLANE_PARK\"; {POLLING_AGENT}"),
        )
        .await;
    let unmarked = cluster
        .create_run("park-none-request-000001", POLLING_AGENT)
        .await;
    let working = cluster
        .sandbox_when(
            &unmarked.id,
            "the unmarked agent's sandbox",
            running_on_its_node,
        )
        .await;
    let _reap_working = cluster.reap(&working.id);
    // Reaped from its start, so a failing test leaves none of it running.
    let started = cluster
        .sandbox_when(&marked.id, "the marked agent's sandbox", |s| {
            matches!(
                s.status(),
                reconciler_pb::SandboxStatus::Started | reconciler_pb::SandboxStatus::Suspended
            )
        })
        .await;
    let _reap_parked = cluster.reap(&started.id);
    cluster
        .sandbox_when(&marked.id, "the marked agent's idle suspend", parked)
        .await;

    // Past another idle timeout and a node round, the agent polling without a mark is
    // still running: it is working as far as anyone can tell.
    tokio::time::sleep(IDLE_TIMEOUT + Duration::from_secs(2)).await;
    assert_eq!(cluster.suspends(), 1, "only the marked agent was frozen");
    cluster
        .sandbox_when(
            &unmarked.id,
            "the unmarked agent still running",
            running_on_its_node,
        )
        .await;

    // A steer wakes the parked one, its runner removes the mark before the line, and
    // both take their line and finish.
    for (run, key) in [
        (&marked, "park-mark-steer-000001"),
        (&unmarked, "park-none-steer-000001"),
    ] {
        cluster.steer_go(&run.id, key).await;
    }
    for run in [&marked, &unmarked] {
        let ended = cluster.ended(&run.id).await;
        assert_eq!(ended.state(), runstore_pb::RunState::Succeeded, "{ended:?}");
        assert_eq!(cluster.stdout(&run.id).await, ["got-go"]);
    }
}
