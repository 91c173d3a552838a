//! Idle suspend and restore with the container driver (docs/architecture.md "Sandbox
//! reconciler"), over a real node agent whose agents run in containers of a real engine
//! (Podman's Docker-compatible socket and the busybox-only image of `scripts/podman`), with
//! a 3 s idle timeout. An agent that is quiet but working is never suspended and finishes;
//! an agent that says it waits for input (its park mark, `/workspace/.runplane-park`: the
//! node cannot see a container's syscalls) is suspended and its container paused in the
//! engine, and once woken (by the steer that gives it its line, or by a reattach) its
//! container is unpaused and the agent takes its line and finishes. Each test runs with a
//! container made for the sandbox (`::cold`) and one taken from the warm pool (`::warm`),
//! and leaves no container behind, failing or not. A run paused while its agent works
//! (PauseRun) has its container paused in the engine too, prints nothing while paused, and
//! after ResumeRun ends with every line once.

use std::path::PathBuf;
use std::time::Duration;

use runplane_integration_tests::engine::{self, Start, WARM, engine_and_image};
use runplane_integration_tests::sandboxes::{
    ControlPlane, ReapSession, eventually, mint_node_credential, node_ready, parked,
};
use runplane_integration_tests::{channel, runplane_bin, wait_for};
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::reconciler::v1::sandbox_service_client::SandboxServiceClient;
use runplane_proto::runstore::v1 as runstore_pb;

const TOKEN: &str = "container-idle-operator-token-0123456789abc";
const IDLE_TIMEOUT: Duration = Duration::from_secs(3);
/// What a node's log says each time it suspends a sandbox for idleness.
const SUSPENDED: &str = "idle: suspended";
/// The node of these tests.
const NODE: &str = "node-c";

/// An agent that says it started, leaves its park mark (it waits for input), reads a line,
/// takes the mark away (it works again) and says what it got.
const PARKING_AGENT: &str = "echo started; touch /workspace/.runplane-park; read line; \
     rm -f /workspace/.runplane-park; echo \"got $line\"";

runplane_integration_tests::on_both_starts!(
    a_quiet_but_working_container_agent_is_never_suspended_and_finishes,
    a_parked_container_agent_is_paused_and_a_steer_unpauses_it_to_its_end,
    a_reattach_unpauses_a_parked_container_and_a_steer_ends_it,
    a_paused_working_container_agent_is_paused_in_the_engine_and_resumes_to_its_end,
);

/// Removes, when dropped, everything the node's driver made and a test's end may have
/// left: the containers labelled with its state directory (`dev.runplane.owner`; its warm
/// pool's too), then its sandboxes' workspace mounts, cgroups and networks
/// ([`runplane_integration_tests::release_sandboxes`], which takes the directory above
/// the driver's state directory, `<home>/sandboxes`).
struct Release {
    home: PathBuf,
    engine: String,
}

impl Drop for Release {
    fn drop(&mut self) {
        engine::remove_containers_of(&self.engine, &self.home.join("sandboxes"));
        runplane_integration_tests::release_sandboxes(&self.home);
    }
}

/// A control plane with a 3 s idle timeout and one node agent, [`NODE`], whose driver
/// runs agents in containers and which holds every sandbox; the agent's log is kept to
/// count its suspends.
struct Cluster {
    api: SandboxServiceClient<tonic::transport::Channel>,
    engine: String,
    /// The node driver's state directory: its sandboxes' directories, and the owner label
    /// of its containers.
    node_dir: PathBuf,
    node_log: PathBuf,
    /// Killed first (on drop), so nothing makes containers while they are removed.
    _node: tokio::process::Child,
    _release: Release,
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
    async fn start(start: Start) -> Self {
        let (engine, _) = engine_and_image();
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
        let home = control_plane.state.path().join(NODE);
        let node_dir = home.join("sandboxes");
        let node_log = control_plane.state.path().join(format!("{NODE}.log"));
        // Guarded before the node starts: its warm pool fills as soon as it does.
        let release = Release {
            home,
            engine: engine.clone(),
        };
        let node_endpoint = runplane_testkit::free_local_addr().to_string();
        let node = tokio::process::Command::new(runplane_bin())
            .arg("node")
            .env("RUNPLANE_NODE__ID", NODE)
            .env("RUNPLANE_NODE__ENDPOINT", &node_endpoint)
            .env("RUNPLANE_NODE__STATE_DIR", &node_dir)
            .env("RUNPLANE_SANDBOX_RECONCILER__ENDPOINT", &endpoint)
            .env("RUNPLANE_STREAM_RECOVERY__ENDPOINT", &endpoint)
            .envs(engine::container_env(start))
            .env("RUNPLANE_SANDBOX_RECONCILER__CONTAINER__PULL", "never")
            .env(
                "RUNPLANE_NODE_TOKEN",
                mint_node_credential(&endpoint, TOKEN, NODE),
            )
            .env_remove("RUNPLANE_AUTH__OPERATOR_TOKEN")
            .env_remove("RUNPLANE_CONFIG")
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&node_log).expect("create the node's log"))
            .kill_on_drop(true)
            .spawn()
            .expect("start runplane node");
        let cluster = Self {
            api: SandboxServiceClient::new(channel(&endpoint).await),
            engine,
            node_dir,
            node_log,
            _node: node,
            _release: release,
            control_plane,
        };
        node_ready(&cluster.api, TOKEN, NODE).await;
        let log = cluster.log();
        let isolation = log.lines().find(|l| l.contains("container: image "));
        assert!(
            isolation.is_some_and(|l| !l.contains("NOT")),
            "the node does not run agents in containers as configured:\n{log}"
        );
        if start.is_warm() {
            wait_for(
                "the warm pool to fill",
                Duration::from_secs(60),
                async || cluster.warm_waiting() == WARM,
            )
            .await;
        }
        cluster
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.node_log).unwrap_or_default()
    }

    fn suspends(&self) -> usize {
        self.log().matches(SUSPENDED).count()
    }

    /// The `State` the engine shows of sandbox `sandbox_id`'s container, None when it has
    /// no such container.
    fn container_state(&self, sandbox_id: &str) -> Option<serde_json::Value> {
        let inspected = engine::get(
            &self.engine,
            &format!("/containers/runplane-{sandbox_id}/json"),
        );
        if inspected.is_empty() {
            return None;
        }
        let json: serde_json::Value = serde_json::from_str(&inspected)
            .unwrap_or_else(|e| panic!("the engine's inspect data ({e}): {inspected}"));
        Some(json["State"].clone())
    }

    /// Warm containers of the node's pool, waiting for a sandbox.
    fn warm_waiting(&self) -> usize {
        engine::warm_waiting(&self.engine, &self.node_dir).len()
    }

    /// Whether sandbox `sandbox_id` took a warm container: it still carries its warm label.
    fn started_as(&self, sandbox_id: &str) -> Start {
        let inspected = engine::get(
            &self.engine,
            &format!("/containers/runplane-{sandbox_id}/json"),
        );
        assert!(!inspected.is_empty(), "no container runplane-{sandbox_id}");
        Start::of(&inspected)
    }

    async fn create_run(&self, request_id: &str, script: &str) -> runstore_pb::Run {
        self.control_plane
            .create_script_run(request_id, script)
            .await
    }

    /// The sandbox's session leader on the host (its runner and the container wrapper),
    /// whose session is killed whole when the guard drops.
    async fn reap(&self, sandbox_id: &str) -> ReapSession {
        let pid_file = self.node_dir.join(sandbox_id).join("pid");
        let pid: u32 = eventually(Duration::from_secs(30), "the sandbox's pid", || async {
            std::fs::read_to_string(&pid_file).ok()?.trim().parse().ok()
        })
        .await;
        assert!(pid > 1);
        ReapSession(pid)
    }

    /// Steers the line `go` to `run_id`, keyed `key`.
    async fn steer_go(&self, run_id: &str, key: &str) {
        self.control_plane.steer(run_id, "go", key).await
    }

    /// Waits until sandbox `sandbox_id`'s container is gone from the engine (its sandbox
    /// destroyed at its run's end).
    async fn container_gone(&self, sandbox_id: &str) {
        wait_for(
            "the sandbox's container to be removed",
            Duration::from_secs(60),
            async || self.container_state(sandbox_id).is_none(),
        )
        .await;
    }
}

/// Started and placed on its node.
fn running_on_its_node(s: &reconciler_pb::Sandbox) -> bool {
    s.status() == reconciler_pb::SandboxStatus::Started && s.active_node_id == NODE
}

/// Whether an engine `State` is that of a paused container.
fn is_paused(state: &serde_json::Value) -> bool {
    state["Paused"] == true || state["Status"] == "paused"
}

/// Whether an engine `State` is that of a running container that is not paused.
fn is_running_unpaused(state: &serde_json::Value) -> bool {
    state["Running"] == true && state["Paused"] == false && state["Status"] == "running"
}

/// Waits for the parking agent of `run_id` to be suspended; returns its sandbox, the
/// guard reaping its host processes, and checks that it was suspended once, that its
/// container is paused in the engine and that its agent still waits for its line (its park
/// mark is there).
async fn suspended_and_paused(
    cluster: &Cluster,
    start: Start,
    run_id: &str,
) -> (reconciler_pb::Sandbox, ReapSession) {
    // Reaped from its start, so a failing test leaves none of it running.
    let started = cluster
        .sandbox_when(run_id, "the agent's sandbox", |s| {
            matches!(
                s.status(),
                reconciler_pb::SandboxStatus::Started | reconciler_pb::SandboxStatus::Suspended
            )
        })
        .await;
    let reap = cluster.reap(&started.id).await;
    let sandbox = cluster
        .sandbox_when(run_id, "the idle suspend", parked)
        .await;
    assert_eq!(sandbox.id, started.id);
    // The node logs its suspend once it published it.
    wait_for(
        "the node's log of the suspend",
        Duration::from_secs(10),
        async || cluster.suspends() > 0,
    )
    .await;
    assert_eq!(cluster.suspends(), 1, "{}", cluster.log());
    assert_eq!(cluster.started_as(&sandbox.id), start);
    // The node publishes the suspend once the engine paused the container.
    let state = cluster
        .container_state(&sandbox.id)
        .expect("the suspended sandbox's container");
    assert!(is_paused(&state), "not paused: {state}");
    assert!(
        cluster
            .node_dir
            .join(&sandbox.id)
            .join("workspace/.runplane-park")
            .is_file(),
        "the agent's park mark is gone while it is suspended"
    );
    (sandbox, reap)
}

/// Silent for 8 s, over two idle timeouts, but never waiting for input: its container is
/// never paused and the agent finishes; its container goes with its sandbox.
async fn a_quiet_but_working_container_agent_is_never_suspended_and_finishes(start: Start) {
    let cluster = Cluster::start(start).await;
    let run = cluster
        .create_run("cidle-working-request-01", "sleep 8; echo done")
        .await;
    let sandbox = cluster
        .sandbox_when(&run.id, "the sandbox on the node", running_on_its_node)
        .await;
    let _reap = cluster.reap(&sandbox.id).await;
    let state = eventually(
        Duration::from_secs(60),
        "the agent's container running",
        || async {
            cluster
                .container_state(&sandbox.id)
                .filter(is_running_unpaused)
        },
    )
    .await;
    assert!(!is_paused(&state), "{state}");
    assert_eq!(cluster.started_as(&sandbox.id), start);

    let ended = cluster.ended(&run.id).await;
    assert_eq!(ended.state(), runstore_pb::RunState::Succeeded, "{ended:?}");
    assert_eq!(cluster.stdout(&run.id).await, ["done"]);
    assert_eq!(
        cluster.suspends(),
        0,
        "a working agent was frozen:\n{}",
        cluster.log()
    );
    cluster.container_gone(&sandbox.id).await;
}

/// An agent that leaves its park mark and reads its stdin is suspended past the idle
/// timeout: the engine shows its container paused. A steer alone wakes it: its container
/// is unpaused, the agent takes its line and the run succeeds; its container goes with its
/// sandbox.
async fn a_parked_container_agent_is_paused_and_a_steer_unpauses_it_to_its_end(start: Start) {
    let cluster = Cluster::start(start).await;
    let run = cluster
        .create_run("cidle-parked-request-001", PARKING_AGENT)
        .await;
    let (sandbox, _reap) = suspended_and_paused(&cluster, start, &run.id).await;

    cluster.steer_go(&run.id, "cidle-parked-steer-00001").await;
    let ended = cluster.ended(&run.id).await;
    assert_eq!(
        ended.state(),
        runstore_pb::RunState::Succeeded,
        "{ended:?}\n{}",
        cluster.log()
    );
    // What it printed after its line came: its container ran again, to its end.
    assert_eq!(cluster.stdout(&run.id).await, ["started", "got go"]);
    assert_eq!(cluster.suspends(), 1, "{}", cluster.log());
    cluster.container_gone(&sandbox.id).await;
}

/// A parked agent's suspended sandbox woken by a reattach (ResolveRoute, which finds it
/// unplaced and queues a wake): once restored on its node its container is running and
/// unpaused in the engine while its agent still waits for its line; a steer then gives it
/// the line and the run succeeds.
async fn a_reattach_unpauses_a_parked_container_and_a_steer_ends_it(start: Start) {
    let cluster = Cluster::start(start).await;
    let run = cluster
        .create_run("cidle-reattach-request-1", PARKING_AGENT)
        .await;
    let (sandbox, _reap) = suspended_and_paused(&cluster, start, &run.id).await;

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
    // The node reports the restore once the engine unpaused the container; its runner
    // has had no poll answered since, so the node does not freeze it again before the
    // steer below reaches it.
    let state = cluster
        .container_state(&sandbox.id)
        .expect("the restored sandbox's container");
    assert!(is_running_unpaused(&state), "not running unpaused: {state}");
    let route = cluster
        .resolve_route(&sandbox.id, "session-1")
        .await
        .unwrap();
    assert_eq!(route.node_id, NODE);

    cluster.steer_go(&run.id, "cidle-reattach-steer-001").await;
    let ended = cluster.ended(&run.id).await;
    assert_eq!(
        ended.state(),
        runstore_pb::RunState::Succeeded,
        "{ended:?}\n{}",
        cluster.log()
    );
    assert_eq!(cluster.stdout(&run.id).await, ["started", "got go"]);
    assert_eq!(cluster.suspends(), 1, "{}", cluster.log());
    cluster.container_gone(&sandbox.id).await;
}

/// An agent that `runplane-holder` started holds the runner's own pipe as its stdin, so a
/// node reads that it waits for input as it does a process sandbox's agent: blocked
/// reading its stdin, with no mark, it is suspended and its container paused; the steer
/// that gives it its line unpauses it, and it finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launched_container_agent_blocked_reading_its_stdin_is_paused_and_a_steer_ends_it() {
    let cluster = Cluster::start(Start::Warm).await;
    let run = cluster
        .create_run(
            "cidle-stdin-request-0001",
            // head reads its stdin with read(2), as most agents do (busybox's own `read`
            // polls first, which counts as working: only a mark parks a poller), and the
            // shell waits for it.
            "echo started; head -n 1; echo done",
        )
        .await;
    let started = cluster
        .sandbox_when(&run.id, "the agent's sandbox", |s| {
            matches!(
                s.status(),
                reconciler_pb::SandboxStatus::Started | reconciler_pb::SandboxStatus::Suspended
            )
        })
        .await;
    let _reap = cluster.reap(&started.id).await;
    let sandbox = cluster
        .sandbox_when(&run.id, "the idle suspend", parked)
        .await;
    assert_eq!(cluster.started_as(&sandbox.id), Start::Warm);
    let state = cluster
        .container_state(&sandbox.id)
        .expect("the suspended sandbox's container");
    assert!(is_paused(&state), "not paused: {state}");

    cluster.steer_go(&run.id, "cidle-stdin-steer-000001").await;
    let ended = cluster.ended(&run.id).await;
    assert_eq!(
        ended.state(),
        runstore_pb::RunState::Succeeded,
        "{ended:?}\n{}",
        cluster.log()
    );
    assert_eq!(cluster.stdout(&run.id).await, ["started", "go", "done"]);
    cluster.container_gone(&sandbox.id).await;
}

async fn a_paused_working_container_agent_is_paused_in_the_engine_and_resumes_to_its_end(
    start: Start,
) {
    use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
    let cluster = Cluster::start(start).await;
    let run = cluster
        .create_run(
            "cidle-pausing-request-01",
            "i=0; while [ $i -lt 60 ]; do i=$((i+1)); echo line $i; sleep 0.1; done",
        )
        .await;
    let sandbox = cluster
        .sandbox_when(&run.id, "the sandbox on the node", running_on_its_node)
        .await;
    let _reap = cluster.reap(&sandbox.id).await;
    cluster
        .run_when(&run.id, "the agent to print", |r| r.last_sequence >= 3)
        .await;
    let lines = async || {
        cluster
            .events(&run.id)
            .await
            .iter()
            .filter(|e| e.kind() == runstore_pb::EventKind::Stdout)
            .count()
    };
    let mut runs = RunServiceClient::new(channel(&cluster.endpoint).await);
    runs.pause_run(runplane_testkit::authed(
        runstore_pb::PauseRunRequest {
            run_id: run.id.clone(),
            idempotency_key: "cidle-pausing-pause-0001".into(),
        },
        TOKEN,
    ))
    .await
    .expect("PauseRun");
    cluster
        .sandbox_when(&run.id, "the paused run's sandbox suspended", parked)
        .await;
    let state = cluster.container_state(&sandbox.id).expect("its container");
    assert!(is_paused(&state), "{state}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = lines().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(lines().await, before, "a paused run printed");
    assert!(before < 60, "the run ended before it was paused");

    runs.resume_run(runplane_testkit::authed(
        runstore_pb::ResumeRunRequest {
            run_id: run.id.clone(),
            idempotency_key: "cidle-pausing-resume-001".into(),
        },
        TOKEN,
    ))
    .await
    .expect("ResumeRun");
    let ended = cluster.ended(&run.id).await;
    assert_eq!(ended.state(), runstore_pb::RunState::Succeeded, "{ended:?}");
    let expected: Vec<String> = (1..=60).map(|i| format!("line {i}")).collect();
    assert_eq!(cluster.stdout(&run.id).await, expected);
    assert_eq!(cluster.suspends(), 0, "the pause is not an idle suspend");
    cluster.container_gone(&sandbox.id).await;
}
