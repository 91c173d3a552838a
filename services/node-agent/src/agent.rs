//! `runplane node`: a node agent of the direct substrate.
//!
//! It registers (endpoint, capacity; a new boot gets a new epoch), heartbeats, long-polls
//! its assignments and acts on them with the process driver: it launches sandboxes
//! placed on it (claiming their run key), restores the ones a wake assigned to it and
//! reports the restore, suspends a sandbox parked longer than its idle timeout and
//! publishes it unplaced (its route identity still names this node, which a reattach must
//! not follow), suspends the same way a sandbox whose run was paused (a SUSPEND
//! assignment, whatever its agent is doing), publishes exits, and stops every deleted sandbox it is handed a DESTROY
//! for, suspended ones included, acknowledging each stop with a DELETED publication.
//! Idle means parked, not silent: its agent waits for input and no session reached it for
//! the whole timeout ([`Local::idle_past_timeout`]). Sessions reach a sandbox at the
//! node's own endpoint with the route token ResolveRoute gave them ([`crate::session`],
//! which verifies it); each attach restarts the sandbox's idle clock, as do its launch, its
//! restore and every round that finds its agent working. A suspend is preceded by
//! parking the run's stream (a frozen runner renews nothing, and its lapsed lease must
//! not look like a lost controller) and a restore followed by unparking it, both through
//! the reconciler (NodeService.ParkSandboxStream and UnparkSandboxStream): the node holds
//! only its own credential, which no other service takes. Only this node can restore
//! what it suspended (its processes are on this host), so the reconciler hands it the
//! wakes of its own sandboxes; a restore that finds the process gone publishes it exited
//! or lost, and the loss grace ends it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use runplane_config::Secret;
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::reconciler::v1::node_service_client::NodeServiceClient;
use tokio::time::Instant;
use tonic::service::interceptor::InterceptedService;

use runplane_sandbox::{Containment, Driver, Launch, Probe, ProcessDriver, SandboxSpec};

use crate::error::AgentError;
use crate::refusals::LaunchRefusals;
use crate::session::Sessions;

/// What a node agent needs.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub node_id: String,
    /// Where sessions reach it, as the reconciler tells them (host:port).
    pub endpoint: String,
    /// Where its session endpoint listens (host:port).
    pub listen: String,
    pub capacity: u32,
    pub reconciler_endpoint: String,
    /// The stream recovery coordinator its sandboxes' runners talk to.
    pub recovery_endpoint: String,
    /// The control plane's other endpoints this node knows of (the run store, credential
    /// health); with the reconciler's and the coordinator's, their addresses are refused
    /// to its agents' outbound network.
    pub control_plane_endpoints: Vec<String>,
    /// NodeService's bearer: this node's own credential (`runplane node token create`).
    pub token: Secret,
    pub state_dir: PathBuf,
    pub runplane_binary: PathBuf,
    /// How its agents are contained ([`Containment::probe`], at start).
    pub containment: Containment,
    /// Route tokens expire, and observations are numbered and stamped, on this clock.
    pub clock: runplane_clock::SharedClock,
}

type Client = NodeServiceClient<
    InterceptedService<runplane_transport::RunnerChannel, runplane_grpc::client::Bearer>,
>;

/// The lease time a restored runner gets before its next renewal (the runner's own).
const UNPARK_TTL: Duration = Duration::from_secs(30);

/// A sandbox this node runs.
struct Local {
    row: SandboxSpec,
    /// Since when it has been idle: its launch or restore, the last session attach at
    /// this node's session endpoint, or the last round that found its agent working,
    /// whichever is latest.
    idle_since: Instant,
    /// Its runner's answered steering polls when this node took it on (launch, restore or
    /// adoption); None while its steering loop has not started.
    polls_at_start: Option<u64>,
    suspended: bool,
    /// Whether its agent waits for input, as last published; None before the first.
    waiting_published: Option<bool>,
}

impl Local {
    /// A sandbox running here from now on, whose runner had `polls_at_start` answered
    /// (read before it was resumed, for a restore).
    fn active(row: SandboxSpec, polls_at_start: Option<u64>) -> Self {
        Self {
            polls_at_start,
            row,
            idle_since: Instant::now(),
            suspended: false,
            waiting_published: None,
        }
    }

    /// Whether it may be suspended for idleness now: idle suspend is on for it, its agent
    /// is parked (waiting for input with no steering pending, [`ProcessDriver::parked`]),
    /// and has been for its whole idle timeout since a session last reached it, and its
    /// runner's steering loop moved on since this node took it on (started, after a
    /// launch; one more poll answered, after a restore or an adoption). The last rule keeps
    /// a restored sandbox from being frozen again before its runner heard what was sent to
    /// it while it was frozen (the steer its reattach was for). A working agent restarts
    /// the idle clock, so silence alone never suspends one.
    /// `parked` is [`ProcessDriver::parked`] as this round read it.
    fn idle_past_timeout(
        &mut self,
        driver: &ProcessDriver,
        sessions: &Sessions,
        parked: bool,
    ) -> bool {
        let timeout = Duration::from_millis(self.row.idle_timeout_ms.max(0) as u64);
        if timeout.is_zero() {
            return false;
        }
        if let Some(attached) = sessions.last_attach(&self.row.id) {
            self.idle_since = self.idle_since.max(attached);
        }
        if !parked {
            self.idle_since = Instant::now();
            return false;
        }
        let polled = answered_polls(driver, &self.row) > self.polls_at_start;
        polled && self.idle_since.elapsed() >= timeout
    }
}

/// Runs the agent until `shutdown`.
pub async fn run(
    config: AgentConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), AgentError> {
    // The agent rides out reconciler restarts like the runner does.
    let layer = runplane_transport::RetryLayer::new(runplane_transport::RetryConfig::default());
    let channel = runplane_transport::connect_lazy(&config.reconciler_endpoint, &layer)?;
    let client: Client = NodeServiceClient::with_interceptor(
        channel,
        runplane_grpc::client::Bearer::new(config.token.expose()),
    );
    let driver = ProcessDriver::new(&config.state_dir, &config.runplane_binary)
        .refusing(
            [&config.reconciler_endpoint, &config.recovery_endpoint]
                .into_iter()
                .chain(&config.control_plane_endpoints)
                .cloned(),
        )
        .contained(config.containment.clone());
    // Sessions reach this node's sandboxes here, with the route tokens ResolveRoute signs
    // for this node; it refuses to start where it cannot listen.
    let sessions = Sessions::new(&config.node_id, config.clock.clone());
    let listener = tokio::net::TcpListener::bind(&config.listen)
        .await
        .map_err(|e| AgentError::Listen(config.listen.clone(), e.to_string()))?;
    // Cancelled when the agent returns, for whatever reason; an endpoint that fails while
    // the agent runs is an error, one cut short by the agent's own exit is not.
    let tasks = runplane_grpc::Tasks::new();
    let _stop_sessions_on_return = runplane_grpc::tasks::CancelOnDrop(tasks.clone());
    let listener = std::sync::Mutex::new(Some(listener));
    let service = sessions.service();
    tasks.spawn(SESSIONS_TASK, move |cancelled| {
        let listener = listener
            .lock()
            .expect("listener lock")
            .take()
            .expect("the session endpoint starts once: a panic stops the agent");
        let mut set = runplane_grpc::ServiceSet::new();
        set.add(service.clone());
        async move {
            let stopped = runplane_grpc::serve(
                listener,
                set,
                cancelled.clone().cancelled(),
                Duration::from_secs(1),
            )
            .await;
            if let Err(e) = stopped
                && !cancelled.is_cancelled()
            {
                tracing::error!(error = %e, "the session endpoint stopped");
            }
        }
    });
    let boot_id = format!("boot-{}", uuid::Uuid::new_v4().simple());

    let registered = client
        .clone()
        .register_node(reconciler_pb::RegisterNodeRequest {
            node_id: config.node_id.clone(),
            boot_id,
            endpoint: config.endpoint.clone(),
            capacity: config.capacity,
            labels: Default::default(),
            agent_version: env!("CARGO_PKG_VERSION").into(),
        })
        .await
        .map_err(|s| AgentError::Register(format!("{}: {}", s.code(), s.message())))?
        .into_inner();
    let epoch = registered.epoch;
    tracing::info!(node_id = %config.node_id, epoch, "node registered");
    sessions.set_key(registered.route_key);

    let mut locals: HashMap<String, Local> = HashMap::new();
    let mut refusals = LaunchRefusals::default();
    let mut stops = Stops::default();
    let mut revision = 0;
    let mut last_heartbeat = Instant::now();
    tokio::pin!(shutdown);
    loop {
        let mut poller = client.clone();
        let request = reconciler_pb::ListAssignedSandboxesRequest {
            node_id: config.node_id.clone(),
            epoch,
            known_revision: revision,
            wait: Some(prost_types::Duration {
                seconds: 1,
                nanos: 0,
            }),
        };
        let assigned = tokio::select! {
            () = &mut shutdown => {
                tasks.shutdown(tokio::time::Instant::now() + Duration::from_secs(1)).await;
                return Ok(());
            }
            name = tasks.failed() => return Err(AgentError::Task(name)),
            answer = poller.list_assigned_sandboxes(request) => answer,
        };
        match assigned {
            Ok(answer) => {
                let answer = answer.into_inner();
                revision = answer.revision;
                let (destroys, assignments): (Vec<_>, Vec<_>) = answer
                    .assignments
                    .into_iter()
                    .partition(|a| a.intent() == reconciler_pb::AssignmentIntent::Destroy);
                // A deleted sandbox is stopped, suspended or not, whether or not this boot
                // launched it (its pid is in the state directory), then acknowledged.
                for a in destroys {
                    if stops.in_flight(&a.sandbox_id) {
                        continue;
                    }
                    let row = match locals.remove(&a.sandbox_id) {
                        Some(local) => local.row,
                        None => row_of(&a, recorded_handle(&config, &a.sandbox_id)),
                    };
                    tracing::info!(sandbox_id = %row.id, "sandbox deleted; stopping it");
                    stops.start(&client, &config, epoch, &driver, row, true);
                }
                // A running sandbox no longer assigned here moved away: stop this copy.
                let kept: std::collections::HashSet<String> =
                    assignments.iter().map(|a| a.sandbox_id.clone()).collect();
                let gone: Vec<String> = locals
                    .iter()
                    .filter(|(id, l)| !l.suspended && !kept.contains(*id))
                    .map(|(id, _)| id.clone())
                    .collect();
                for id in gone {
                    if let Some(local) = locals.remove(&id) {
                        tracing::info!(sandbox_id = %id, "no longer assigned here; stopping it");
                        stops.start(&client, &config, epoch, &driver, local.row, false);
                    }
                }
                refusals.keep_listed(&assignments);
                for a in assignments {
                    let launch = (a.sandbox_id.clone(), a.execution_generation);
                    if a.intent() == reconciler_pb::AssignmentIntent::Run
                        && !refusals.may_claim(&launch)
                    {
                        continue;
                    }
                    if let Some(refused) =
                        act(&client, &config, epoch, &driver, &mut locals, a).await
                    {
                        refusals.record(launch, &refused);
                    }
                }
            }
            // A revoked credential (or another node's) is refused on every call: stop
            // instead of spinning on refusals. Its sandboxes outlive the agent.
            Err(status)
                if matches!(
                    status.code(),
                    tonic::Code::Unauthenticated | tonic::Code::PermissionDenied
                ) =>
            {
                return Err(AgentError::Refused(format!("{:?}", status.code())));
            }
            Err(status) => {
                tracing::warn!(code = ?status.code(), "assignments unavailable; retrying")
            }
        }
        stops.reap();
        look_after(&client, &config, epoch, &driver, &sessions, &mut locals).await;
        sessions.set_running(
            locals
                .values()
                .filter(|l| !l.suspended)
                .map(|l| (l.row.id.clone(), l.row.execution_generation as u64)),
        );
        if last_heartbeat.elapsed() >= Duration::from_secs(2) {
            let used = locals.values().filter(|l| !l.suspended).count() as u32;
            if let Err(status) = client
                .clone()
                .heartbeat(reconciler_pb::HeartbeatRequest {
                    node_id: config.node_id.clone(),
                    epoch,
                    used,
                })
                .await
            {
                tracing::warn!(code = ?status.code(), "heartbeat failed");
            }
            last_heartbeat = Instant::now();
        }
    }
}

/// Stops the session endpoint when the agent's `run` returns.
/// The node's session endpoint. At the agent's shutdown it gets 1 s to finish its calls;
/// when the agent returns otherwise it is cancelled. A panic, or its server stopping
/// while the agent runs, stops the agent, which its supervisor restarts: without the
/// endpoint no session reaches this node's sandboxes.
const SESSIONS_TASK: runplane_grpc::Task = runplane_grpc::Task {
    name: "node-agent.sessions",
    on_cancel: runplane_grpc::OnCancel::Finish,
    on_panic: runplane_grpc::OnPanic::Stop,
};

/// Sandbox stops in flight: each runs as a task (a stop waits out its grace), at most one
/// per sandbox, and every failure is logged when the task is reaped.
#[derive(Default)]
struct Stops {
    tasks: tokio::task::JoinSet<(String, Result<(), String>)>,
    in_flight: std::collections::HashSet<String>,
}

impl Stops {
    fn in_flight(&self, sandbox_id: &str) -> bool {
        self.in_flight.contains(sandbox_id)
    }

    /// Stops `row`'s process; with `acknowledge`, publishes it DELETED once stopped, which
    /// takes the DESTROY assignment away.
    fn start(
        &mut self,
        client: &Client,
        config: &AgentConfig,
        epoch: u64,
        driver: &ProcessDriver,
        row: SandboxSpec,
        acknowledge: bool,
    ) {
        self.in_flight.insert(row.id.clone());
        let stop = driver.destroy(&row);
        let (client, config) = (client.clone(), config.clone());
        self.tasks.spawn(async move {
            let result = stop.await.map_err(|e| e.to_string());
            if result.is_ok() && acknowledge {
                publish(
                    &client,
                    &config,
                    epoch,
                    &row,
                    reconciler_pb::SandboxStatus::Deleted,
                    false,
                    None,
                )
                .await;
            }
            (row.id, result)
        });
    }

    /// Collects finished stops, logging the ones that failed (a DESTROY assignment is
    /// still listed, so the next list retries it).
    fn reap(&mut self) {
        while let Some(done) = self.tasks.try_join_next() {
            match done {
                Ok((id, result)) => {
                    self.in_flight.remove(&id);
                    match result {
                        Ok(()) => tracing::info!(sandbox_id = %id, "sandbox stopped"),
                        Err(error) => {
                            tracing::warn!(sandbox_id = %id, %error, "sandbox not stopped; retrying")
                        }
                    }
                }
                Err(e) => tracing::error!(error = %e, "a sandbox stop task failed"),
            }
        }
    }
}

/// The handle of the process this node recorded for `sandbox_id`, empty if none.
fn recorded_handle(config: &AgentConfig, sandbox_id: &str) -> String {
    std::fs::read_to_string(config.state_dir.join(sandbox_id).join("pid"))
        .map(|pid| format!("pid:{}", pid.trim()))
        .unwrap_or_default()
}

/// The next observation number of this process: strictly increasing even when the wall
/// clock steps back (an observation numbered below the last one stored is ignored), and
/// starting from the clock's microseconds, so a restarted agent numbers ahead of its
/// previous boot unless the wall clock stepped back across the restart by more than the
/// restart took.
fn observation_seq(clock: &dyn runplane_clock::Clock) -> u64 {
    static LAST: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let now = u64::try_from(clock.now_us()).unwrap_or_default();
    let next = |last: u64| now.max(last.saturating_add(1));
    let last = LAST
        .fetch_update(
            std::sync::atomic::Ordering::SeqCst,
            std::sync::atomic::Ordering::SeqCst,
            |last| Some(next(last)),
        )
        .unwrap_or_else(|last| last);
    next(last)
}

async fn publish(
    client: &Client,
    config: &AgentConfig,
    epoch: u64,
    row: &SandboxSpec,
    status: reconciler_pb::SandboxStatus,
    placed: bool,
    exit_code: Option<i32>,
) {
    publish_observed(client, config, epoch, row, status, placed, exit_code, None).await;
}

/// [`publish`], saying whether the agent waits for input when `waiting` is set; whether
/// the reconciler took it.
#[allow(clippy::too_many_arguments)]
async fn publish_observed(
    client: &Client,
    config: &AgentConfig,
    epoch: u64,
    row: &SandboxSpec,
    status: reconciler_pb::SandboxStatus,
    placed: bool,
    exit_code: Option<i32>,
    waiting: Option<bool>,
) -> bool {
    let result = client
        .clone()
        .publish_sandbox_state(reconciler_pb::PublishSandboxStateRequest {
            node_id: config.node_id.clone(),
            epoch,
            sandbox_id: row.id.clone(),
            execution_generation: row.execution_generation as u64,
            observation_seq: observation_seq(config.clock.as_ref()),
            status: status as i32,
            placed,
            exit_code,
            observed_at: Some(runplane_clock::to_timestamp(config.clock.now_us())),
            waiting_for_input: waiting,
        })
        .await;
    if let Err(s) = &result {
        tracing::warn!(sandbox_id = %row.id, code = ?s.code(), "publication refused");
    }
    result.is_ok()
}

/// The spec of the sandbox `a` assigns, found again by `handle` (empty: not started).
fn row_of(a: &reconciler_pb::Assignment, handle: String) -> SandboxSpec {
    SandboxSpec {
        id: a.sandbox_id.clone(),
        run_id: a.run_id.clone(),
        active_node_id: None,
        execution_generation: a.execution_generation as i64,
        idle_timeout_ms: a
            .idle_timeout
            .as_ref()
            .map(|d| d.seconds * 1000 + i64::from(d.nanos / 1_000_000))
            .unwrap_or_default(),
        driver_handle: handle,
        offline: a.no_network,
        image: Some(a.image.clone()).filter(|image| !image.is_empty()),
        limits: a.limits.as_ref().and_then(|l| {
            let limits = runplane_config::SandboxLimits {
                cpus: l.cpus,
                memory_mib: l.memory_mib,
                pids: l.pids,
                disk_mib: l.disk_mib,
            };
            // Out of bounds is the reconciler's mistake, never a reason to write a
            // cgroup a value that kills every agent: the node's own limits hold.
            match limits.validate("assignment.limits") {
                Ok(()) => Some(limits),
                Err(e) => {
                    tracing::warn!(sandbox_id = %a.sandbox_id, error = %e, "assignment limits out of bounds; this node's own apply");
                    None
                }
            }
        }),
    }
}

/// Publishes `row` started and placed here, and keeps it among this node's sandboxes;
/// its runner had `polls_at_start` answered ([`Local::polls_at_start`]).
async fn take_on(
    client: &Client,
    config: &AgentConfig,
    epoch: u64,
    locals: &mut HashMap<String, Local>,
    row: SandboxSpec,
    polls_at_start: Option<u64>,
) {
    publish(
        client,
        config,
        epoch,
        &row,
        reconciler_pb::SandboxStatus::Started,
        true,
        None,
    )
    .await;
    locals.insert(row.id.clone(), Local::active(row, polls_at_start));
}

fn answered_polls(driver: &ProcessDriver, row: &SandboxSpec) -> Option<u64> {
    driver.runner_polls(row).map(|p| p.answered)
}

/// A sandbox this node launched before a restart: re-adopted by the pid it recorded
/// when that process is still this sandbox's, published lost otherwise.
async fn adopt_or_report_lost(
    client: &Client,
    config: &AgentConfig,
    epoch: u64,
    driver: &ProcessDriver,
    locals: &mut HashMap<String, Local>,
    a: &reconciler_pb::Assignment,
) {
    let row = row_of(a, recorded_handle(config, &a.sandbox_id));
    if !row.driver_handle.is_empty() && driver.status(&row).await == Probe::Alive {
        tracing::info!(sandbox_id = %row.id, "sandbox re-adopted after a restart");
        let polls = answered_polls(driver, &row);
        take_on(client, config, epoch, locals, row, polls).await;
    } else {
        publish(
            client,
            config,
            epoch,
            &row,
            reconciler_pb::SandboxStatus::Lost,
            true,
            None,
        )
        .await;
        tracing::warn!(sandbox_id = %row.id, "a sandbox launched before a restart is gone; reported lost");
    }
}

/// Acts on one assignment; the ClaimLaunch refusal of a RUN assignment, if any (the
/// caller decides when it is asked again).
async fn act(
    client: &Client,
    config: &AgentConfig,
    epoch: u64,
    driver: &ProcessDriver,
    locals: &mut HashMap<String, Local>,
    a: reconciler_pb::Assignment,
) -> Option<tonic::Status> {
    match a.intent() {
        reconciler_pb::AssignmentIntent::Run if !locals.contains_key(&a.sandbox_id) => {
            let claim = client
                .clone()
                .claim_launch(reconciler_pb::ClaimLaunchRequest {
                    node_id: config.node_id.clone(),
                    epoch,
                    sandbox_id: a.sandbox_id.clone(),
                    execution_generation: a.execution_generation,
                    idempotency_key: format!("{}:{}", a.sandbox_id, a.execution_generation),
                })
                .await;
            let launch = match claim {
                Ok(c) => {
                    let c = c.into_inner();
                    Launch {
                        endpoint: c.run_store_endpoint,
                        recovery_endpoint: c.recovery_endpoint,
                        run_id: c.run_id,
                        run_key: Secret::new(c.run_key),
                        traceparent: c.traceparent,
                    }
                }
                Err(s) => {
                    let reason = runplane_grpc::error_info(&s)
                        .map(|i| i.reason)
                        .unwrap_or_default();
                    if reason == runplane_grpc::ErrorReason::RunKeyClaimed.as_str_name() {
                        // A runner of this generation already said Hello: this node
                        // launched it before it restarted. Adopt it if it still runs,
                        // otherwise say it is lost, so the loss grace can end its run
                        // instead of the assignment repeating for ever.
                        adopt_or_report_lost(client, config, epoch, driver, locals, &a).await;
                        return None;
                    }
                    return Some(s);
                }
            };
            match driver.create(&row_of(&a, String::new()), launch).await {
                Ok(handle) => {
                    tracing::info!(sandbox_id = %a.sandbox_id, "sandbox launched");
                    // A new runner: its steering loop has not started.
                    take_on(client, config, epoch, locals, row_of(&a, handle), None).await;
                }
                Err(e) => {
                    tracing::error!(sandbox_id = %a.sandbox_id, error = %e, "sandbox not started")
                }
            }
        }
        reconciler_pb::AssignmentIntent::Restore => {
            // The sandbox's process is found by its label wherever this node can see it.
            let row = row_of(&a, recorded_handle(config, &a.sandbox_id));
            let polls = answered_polls(driver, &row);
            let resumed = driver.resume(&row).await.is_ok();
            let probe = driver.status(&row).await;
            if resumed && probe == Probe::Alive {
                unpark(client, config, epoch, &row).await;
                let report = client
                    .clone()
                    .report_restored(reconciler_pb::ReportRestoredRequest {
                        node_id: config.node_id.clone(),
                        epoch,
                        wake_id: a.wake_id.clone(),
                        sandbox_id: a.sandbox_id.clone(),
                        execution_generation: a.execution_generation,
                        wake_attempt: a.wake_attempt,
                    })
                    .await;
                match report {
                    Ok(_) => {
                        tracing::info!(sandbox_id = %row.id, "sandbox restored");
                        locals.insert(row.id.clone(), Local::active(row, polls));
                    }
                    // Refused (SANDBOX_ENDED for a deleted sandbox: its DESTROY assignment
                    // follows and stops the process resumed here).
                    Err(s) => tracing::warn!(
                        sandbox_id = %row.id,
                        code = ?s.code(),
                        reason = runplane_grpc::error_info(&s).map(|i| i.reason).unwrap_or_default(),
                        "restore refused"
                    ),
                }
            } else {
                // Its process is gone: say so, so the loss grace ends it instead of wakes
                // being queued for a sandbox nothing can restore.
                let gone = match probe {
                    Probe::Exited(code) => Some((reconciler_pb::SandboxStatus::Exited, code)),
                    Probe::Lost => Some((reconciler_pb::SandboxStatus::Lost, None)),
                    Probe::Alive => None,
                };
                if let Some((status, code)) = gone {
                    publish(client, config, epoch, &row, status, false, code).await;
                }
                tracing::warn!(sandbox_id = %row.id, probe = ?probe, attempt = a.wake_attempt, "sandbox not restored");
                if let Err(s) = client
                    .clone()
                    .report_wake_failed(reconciler_pb::ReportWakeFailedRequest {
                        node_id: config.node_id.clone(),
                        epoch,
                        wake_id: a.wake_id.clone(),
                        wake_attempt: a.wake_attempt,
                        error: "the sandbox cannot be restored on this node".into(),
                    })
                    .await
                {
                    tracing::warn!(sandbox_id = %row.id, code = ?s.code(), "wake failure not reported");
                }
            }
        }
        reconciler_pb::AssignmentIntent::Suspend => {
            // Its run is paused: suspended now, whatever its agent is doing. One this
            // boot has not taken on (it restarted) is adopted first.
            if !locals.contains_key(&a.sandbox_id) {
                adopt_or_report_lost(client, config, epoch, driver, locals, &a).await;
            }
            if let Some(local) = locals.get_mut(&a.sandbox_id) {
                if !local.suspended {
                    // Not suspended this time (its stream could not be parked): the
                    // assignment stays listed, and the next list tries again.
                    if suspend_here(client, config, epoch, driver, local).await {
                        tracing::info!(sandbox_id = %a.sandbox_id, "paused: suspended and published unplaced");
                    }
                } else {
                    // Suspended here, but the reconciler still lists it running: the
                    // publication was lost. Say it again (an observation is idempotent).
                    publish_suspended(client, config, epoch, &local.row).await;
                }
            }
        }
        _ => {}
    }
    None
}

/// Suspends sandboxes parked past their idle timeout ([`Local::idle_past_timeout`]),
/// publishes exits and whether each agent waits for input.
async fn look_after(
    client: &Client,
    config: &AgentConfig,
    epoch: u64,
    driver: &ProcessDriver,
    sessions: &Sessions,
    locals: &mut HashMap<String, Local>,
) {
    let mut ended = Vec::new();
    for local in locals.values_mut() {
        if local.suspended {
            continue;
        }
        if let Probe::Exited(code) = driver.status(&local.row).await {
            publish(
                client,
                config,
                epoch,
                &local.row,
                reconciler_pb::SandboxStatus::Exited,
                true,
                code,
            )
            .await;
            ended.push(local.row.id.clone());
            continue;
        }
        // Whether the agent waits for input, published as it changes (and once after a
        // launch or restore), so the run shows it whether or not it is suspended later.
        let waiting = driver.parked(&local.row);
        if local.waiting_published != Some(waiting)
            && publish_observed(
                client,
                config,
                epoch,
                &local.row,
                reconciler_pb::SandboxStatus::Started,
                true,
                None,
                Some(waiting),
            )
            .await
        {
            local.waiting_published = Some(waiting);
        }
        // A stream that could not be parked stays running this time: suspended, its
        // runner would stop renewing and the lapsed lease be taken over as if lost.
        // The next round tries again.
        if local.idle_past_timeout(driver, sessions, waiting)
            && suspend_here(client, config, epoch, driver, local).await
        {
            tracing::info!(sandbox_id = %local.row.id, "idle: suspended and published unplaced");
        }
    }
    for id in ended {
        locals.remove(&id);
    }
}

/// Parks `local`'s stream, suspends it and publishes it SUSPENDED and unplaced; whether
/// it did. A stream that could not be parked leaves it running (the caller tries again
/// later): frozen, its runner would stop renewing and the lapsed lease be taken over.
async fn suspend_here(
    client: &Client,
    config: &AgentConfig,
    epoch: u64,
    driver: &ProcessDriver,
    local: &mut Local,
) -> bool {
    if !park(client, config, epoch, &local.row).await {
        return false;
    }
    if let Err(e) = driver.suspend(&local.row).await {
        tracing::warn!(sandbox_id = %local.row.id, error = %e, "sandbox not suspended");
        return false;
    }
    local.suspended = true;
    publish_suspended(client, config, epoch, &local.row).await;
    true
}

/// Publishes `row` SUSPENDED and unplaced: its route identity still names this node,
/// the only one that can restore it.
async fn publish_suspended(client: &Client, config: &AgentConfig, epoch: u64, row: &SandboxSpec) {
    publish(
        client,
        config,
        epoch,
        row,
        reconciler_pb::SandboxStatus::Suspended,
        false,
        None,
    )
    .await;
}

/// How long a park or unpark may take before the agent moves on.
const PARK_TIMEOUT: Duration = Duration::from_secs(5);

/// Parks `row`'s run's stream for a suspend, through the reconciler (which checks this
/// node holds the sandbox and asks the coordinator with the service token); false when
/// it did not answer that it did (a run whose lease was never granted has nothing to
/// park, which is fine).
async fn park(client: &Client, config: &AgentConfig, epoch: u64, row: &SandboxSpec) -> bool {
    // Bounded: an unreachable reconciler or coordinator must not hold up the agent's loop
    // (its heartbeats, launches and destroys) for a whole outage budget.
    let parked = tokio::time::timeout(
        PARK_TIMEOUT,
        client
            .clone()
            .park_sandbox_stream(reconciler_pb::ParkSandboxStreamRequest {
                node_id: config.node_id.clone(),
                epoch,
                sandbox_id: row.id.clone(),
                execution_generation: row.execution_generation as u64,
            }),
    )
    .await
    .unwrap_or_else(|_| {
        Err(tonic::Status::deadline_exceeded(
            "ParkSandboxStream did not answer in time",
        ))
    });
    match parked {
        Ok(answer) => {
            tracing::debug!(sandbox_id = %row.id, parked = answer.get_ref().parked, "stream parked");
            true
        }
        Err(s) => {
            tracing::warn!(sandbox_id = %row.id, code = ?s.code(), "stream not parked; not suspending this time");
            false
        }
    }
}

/// Hands a restored sandbox's stream back to its runner. Should this fail, the lease stays
/// parked (never taken over) until the runner's next renewal or append takes it back.
async fn unpark(client: &Client, config: &AgentConfig, epoch: u64, row: &SandboxSpec) {
    let unparked = tokio::time::timeout(
        PARK_TIMEOUT,
        client
            .clone()
            .unpark_sandbox_stream(reconciler_pb::UnparkSandboxStreamRequest {
                node_id: config.node_id.clone(),
                epoch,
                sandbox_id: row.id.clone(),
                execution_generation: row.execution_generation as u64,
                ttl: Some(runplane_grpc::proto_duration(UNPARK_TTL)),
            }),
    )
    .await
    .unwrap_or_else(|_| {
        Err(tonic::Status::deadline_exceeded(
            "UnparkSandboxStream did not answer in time",
        ))
    });
    if let Err(s) = unparked {
        tracing::warn!(sandbox_id = %row.id, code = ?s.code(), "stream not unparked");
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use runplane_clock::ManualClock;

    use super::observation_seq;

    /// Observations stay strictly increasing when the wall clock steps back (an NTP step):
    /// numbered from the wall clock alone, every observation after the step would be older
    /// than the stored one and ignored until the clock caught up.
    #[test]
    fn observation_numbers_keep_increasing_when_the_wall_clock_steps_back() {
        let start = chrono::DateTime::from_timestamp(1_900_000_000, 0).unwrap();
        let clock = ManualClock::new(start);
        let first = observation_seq(&clock);
        assert!(first >= 1_900_000_000_000_000, "{first}");
        clock.set_wall(start - chrono::Duration::minutes(10));
        let second = observation_seq(&clock);
        assert!(second > first, "{second} after {first}");
        clock.advance(Duration::from_secs(1));
        assert!(observation_seq(&clock) > second);
    }
}
