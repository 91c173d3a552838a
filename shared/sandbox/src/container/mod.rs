//! The `container` containment: the agent runs in a container of an image, through the
//! Docker Engine API (Docker itself, or Podman's compatible socket), with bollard.
//!
//! Only the agent goes into the container. The sandbox's shell and runner stay on the
//! host, as under bubblewrap, so the run key never enters the container by any path: no
//! environment, no mounted file, nothing in the engine's inspect data. The runner starts
//! the agent through [`run_agent`] (`runplane sandbox-container`, its wrapper), which
//! creates the container with the agent's command, attaches it to its own stdio (so the
//! runner reads the agent's lines and writes its steers exactly as for a process),
//! forwards the runner's signals to it, and exits with its status once it ends, after
//! noting an OOM kill where the runner reads it ([`crate::contract::ENV_MEMORY_EVENTS`]).
//!
//! Limits are the engine's (memory with swap, CPUs, pids); the workspace is the same
//! loop-mounted image the process driver uses, bound at `/workspace`. The network is the
//! sandbox's own namespace ([`crate::process::network`]), joined by path (Podman's
//! `ns:` network mode), or none, or the host's.
//!
//! A sandbox with the default limits may instead take a container of the driver's warm
//! pool ([`warm`]): started ahead, waiting in a static holder of the host's, its
//! workspace mounted and its network brought up in its namespace once taken. The agent
//! then starts in it by exec, which skips the engine's container creation and start.
//!
//! Every container carries [`LABEL_OWNER`], the state directory of the driver that made
//! it, so a restarted driver removes the ones it no longer owns ([`sweep`]).

mod launch;
pub mod warm;

use std::collections::HashMap;
use std::path::PathBuf;

use bollard::Docker;
use bollard::models::{ContainerCreateBody, HostConfig};
use bollard::query_parameters::{
    AttachContainerOptionsBuilder, CreateContainerOptionsBuilder, CreateImageOptionsBuilder,
    KillContainerOptionsBuilder, RemoveContainerOptionsBuilder, StopContainerOptionsBuilder,
};
use futures::StreamExt;
use runplane_config::{PullPolicy, SandboxLimits};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The labels every sandbox container carries, by which it is found again.
pub const LABEL_SANDBOX: &str = "dev.runplane.sandbox-id";
pub const LABEL_RUN: &str = "dev.runplane.run-id";
/// The state directory of the driver that made the container (a warm one too).
pub const LABEL_OWNER: &str = "dev.runplane.owner";

/// The exit status of the wrapper when the image could not be had, as `docker run` uses
/// 125 for the engine's own failures.
pub const EXIT_IMAGE_UNAVAILABLE: i32 = 125;

/// The container of sandbox `sandbox_id`.
pub fn container_name(sandbox_id: &str) -> String {
    format!("runplane-{sandbox_id}")
}

/// Connects to the engine at `address` (`unix:///path`, a socket path, or
/// `http://host:port`) and checks it answers.
pub async fn connect(address: &str) -> Result<Docker, String> {
    let docker = if let Some(path) = address.strip_prefix("unix://") {
        Docker::connect_with_unix(path, 120, bollard::API_DEFAULT_VERSION)
    } else if address.starts_with('/') {
        Docker::connect_with_unix(address, 120, bollard::API_DEFAULT_VERSION)
    } else {
        Docker::connect_with_http(address, 120, bollard::API_DEFAULT_VERSION)
    }
    .map_err(|e| format!("container engine at {address}: {e}"))?;
    docker
        .ping()
        .await
        .map_err(|e| format!("container engine at {address} does not answer: {e}"))?;
    Ok(docker)
}

/// One engine, connected on first use and kept: the driver's pause, unpause, remove
/// and warm pool share it.
#[derive(Debug)]
pub struct Engine {
    address: String,
    docker: tokio::sync::OnceCell<Docker>,
}

impl Engine {
    pub fn new(address: impl Into<String>) -> Self {
        Self {
            address: address.into(),
            docker: tokio::sync::OnceCell::new(),
        }
    }

    pub async fn docker(&self) -> Result<&Docker, String> {
        self.docker.get_or_try_init(|| connect(&self.address)).await
    }

    /// Pauses (`true`) or unpauses sandbox `sandbox_id`'s container; one that is not
    /// there has nothing to pause.
    pub async fn pause(&self, sandbox_id: &str, paused: bool) -> Result<(), String> {
        let docker = self.docker().await?;
        let name = container_name(sandbox_id);
        let result = if paused {
            docker.pause_container(&name).await
        } else {
            docker.unpause_container(&name).await
        };
        match result {
            Ok(()) => Ok(()),
            Err(e) if not_found(&e) => Ok(()),
            Err(e) => Err(format!("container {name}: {e}")),
        }
    }

    /// Stops container `name` within `grace`, then removes it; done when it is gone.
    pub async fn remove(&self, name: &str, grace: std::time::Duration) -> Result<(), String> {
        let docker = self.docker().await?;
        // A paused container takes no signal: continued first.
        let _ = docker.unpause_container(name).await;
        let _ = docker
            .stop_container(
                name,
                Some(
                    StopContainerOptionsBuilder::new()
                        .t(grace.as_secs() as i32)
                        .build(),
                ),
            )
            .await;
        // Podman may refuse a removal that races the container's own end ("container
        // state improper"): the container is then exited, and a second removal takes it.
        let mut failed = None;
        for _ in 0..3 {
            match force_remove(docker, name).await {
                Ok(()) => return Ok(()),
                Err(e) if not_found(&e) => return Ok(()),
                Err(e) => failed = Some(e),
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
        match failed {
            Some(e) if !gone(docker, name).await => Err(format!("removing container {name}: {e}")),
            _ => Ok(()),
        }
    }
}

/// Removes every container `owner` made that it no longer owns: a warm one of an earlier
/// life (its pool starts afresh), or a sandbox's whose shell `live` says is gone (its
/// runner ended; a new runner starts its agent afresh). Returns the names removed.
pub async fn sweep(
    engine: &Engine,
    owner: &str,
    live: impl Fn(&str) -> bool,
) -> Result<Vec<String>, String> {
    let docker = engine.docker().await?;
    let options = bollard::query_parameters::ListContainersOptionsBuilder::new()
        .all(true)
        .filters(&HashMap::from([(
            "label",
            vec![format!("{LABEL_OWNER}={owner}")],
        )]))
        .build();
    let found = docker
        .list_containers(Some(options))
        .await
        .map_err(|e| format!("listing containers: {e}"))?;
    let mut removed = Vec::new();
    for container in found {
        let labels = container.labels.unwrap_or_default();
        let name = container
            .names
            .unwrap_or_default()
            .first()
            .map(|n| n.trim_start_matches('/').to_owned())
            .unwrap_or_default();
        // A warm container not taken belongs to no sandbox; a taken one carries its
        // sandbox only in its name.
        let sandbox = match name.starts_with(warm::PREFIX) {
            true => None,
            false => labels
                .get(LABEL_SANDBOX)
                .cloned()
                .or_else(|| name.strip_prefix("runplane-").map(str::to_owned)),
        };
        let owned = sandbox.as_deref().is_some_and(&live);
        if !owned && let Some(id) = container.id {
            let _ = force_remove(docker, &id).await;
            removed.push(name);
        }
    }
    Ok(removed)
}

/// Removes container `name` (or id) whatever it is doing: killed first if it runs.
async fn force_remove(docker: &Docker, name: &str) -> Result<(), bollard::errors::Error> {
    docker
        .remove_container(
            name,
            Some(RemoveContainerOptionsBuilder::new().force(true).build()),
        )
        .await
}

/// Whether the engine answered that what was asked for is not there.
fn not_found(e: &bollard::errors::Error) -> bool {
    matches!(
        e,
        bollard::errors::Error::DockerResponseServerError {
            status_code: 404,
            ..
        }
    )
}

/// Makes sure `image` is there as `pull` says: `never` only looks, `if_missing` pulls
/// when absent, `always` pulls.
pub async fn ensure_image(docker: &Docker, image: &str, pull: PullPolicy) -> Result<(), String> {
    let present = docker.inspect_image(image).await.is_ok();
    match (pull, present) {
        (PullPolicy::Never, true) | (PullPolicy::IfMissing, true) => return Ok(()),
        (PullPolicy::Never, false) => {
            return Err(format!(
                "image {image} is not on this engine and the pull policy is never"
            ));
        }
        _ => {}
    }
    let options = CreateImageOptionsBuilder::new().from_image(image).build();
    let mut pulling = docker.create_image(Some(options), None, None);
    while let Some(step) = pulling.next().await {
        step.map_err(|e| format!("pulling {image}: {e}"))?;
    }
    Ok(())
}

/// One agent container, as [`run_agent`] makes it (or, [`AgentContainer::warm`], finds).
#[derive(Debug, Clone)]
pub struct AgentContainer {
    pub engine: String,
    pub image: String,
    pub pull: PullPolicy,
    pub sandbox_id: String,
    pub run_id: String,
    /// The state directory of the driver ([`LABEL_OWNER`]).
    pub owner: String,
    /// The host directory bound at `/workspace`.
    pub workspace: PathBuf,
    pub limits: SandboxLimits,
    /// The engine's network mode: `none`, `host`, or `ns:<path>` for the sandbox's own.
    pub network_mode: String,
    /// Where the runner reads an OOM kill (`oom_kill 1`); none when unset.
    pub memory_events: Option<PathBuf>,
    /// Where the runner reads why the agent ended when its status cannot say
    /// ([`crate::contract::ENDING_FILE`]).
    pub ending: Option<PathBuf>,
    /// The sandbox's own cgroup the container is made under (`/runplane/<sandbox id>`),
    /// which holds its limits, and that cgroup's memory events file (v2 `memory.events`,
    /// v1 `memory.oom_control`).
    pub cgroup_parent: Option<String>,
    pub cgroup_memory_events: Option<PathBuf>,
    /// The sandbox took a warm container ([`warm`]), already named for it, with its
    /// limits, workspace and network; None: the wrapper makes the sandbox's container.
    pub warm: Option<WarmStart>,
    /// The agent's command.
    pub argv: Vec<String>,
}

/// What the runner tells the agent of its run (its labels, which attempt it is and why
/// the previous one ended), passed from the wrapper's environment into the container as
/// is. Nothing else of the host's environment enters it.
const RUN_ENV: [&str; 3] = [
    "RUNPLANE_LABELS",
    "RUNPLANE_ATTEMPT",
    "RUNPLANE_PREVIOUS_ATTEMPT",
];

impl AgentContainer {
    /// What the agent finds in its environment: its home, where it parks, and what the
    /// runner says of its run ([`RUN_ENV`]).
    fn env(&self) -> Vec<String> {
        let mut env = vec![
            format!("HOME={}", crate::contract::WORKSPACE),
            format!(
                "{}={}/{}",
                crate::contract::ENV_PARK,
                crate::contract::WORKSPACE,
                crate::contract::PARK_MARK
            ),
        ];
        env.extend(
            RUN_ENV
                .iter()
                .filter_map(|name| Some(format!("{name}={}", std::env::var(name).ok()?))),
        );
        env
    }
}

/// How the agent starts in a warm container.
#[derive(Debug, Clone, PartialEq)]
pub enum WarmStart {
    /// By the engine's exec (its holder only waits).
    Exec,
    /// Through `runplane-holder`'s socket, the holder's pid on this host being
    /// `holder_pid` ([`launch`]).
    Launch { socket: PathBuf, holder_pid: u32 },
}

/// Runs the agent in its container, attached to this process's stdio, and returns the
/// exit status to end with: the agent's, 128 + N for a signal, or
/// [`EXIT_IMAGE_UNAVAILABLE`] with the reason on stderr.
pub async fn run_agent(spec: AgentContainer) -> i32 {
    if let Some(ending) = &spec.ending {
        let _ = std::fs::remove_file(ending);
    }
    if let Some(events) = &spec.memory_events {
        let _ = std::fs::remove_file(events);
    }
    let ran = match &spec.warm {
        Some(WarmStart::Launch { socket, holder_pid }) => {
            launch::run_launched(&spec, socket, *holder_pid).await
        }
        warm => match connect(&spec.engine).await {
            Err(e) => Err(engine_failure(e)),
            Ok(docker) if warm.is_some() => run_warm(&docker, &spec).await,
            Ok(docker) => run(&docker, &spec).await,
        },
    };
    match ran {
        Ok(code) => code,
        Err((code, ending, why)) => {
            eprintln!("runplane: {why}");
            if let (Some(ending), Some(path)) = (ending, &spec.ending) {
                let _ = std::fs::write(path, ending);
            }
            code
        }
    }
}

/// Why the wrapper gave up: its exit status, the ending it records (if one), and what to
/// print.
type Failure = (i32, Option<&'static str>, String);

/// The engine failed the wrapper: no ending of its own, the sandbox's loss decides.
fn engine_failure(why: String) -> Failure {
    (EXIT_IMAGE_UNAVAILABLE, None, why)
}

/// Container `name` was removed from outside (`when`: before its agent began, or while
/// it ran): the sandbox is lost, not ended by its agent.
fn lost(name: &str, when: &str) -> Failure {
    (
        EXIT_IMAGE_UNAVAILABLE,
        Some(crate::contract::ENDING_CONTAINER_LOST),
        format!("container {name} was removed {when}"),
    )
}

fn image_unavailable(why: String) -> Failure {
    (
        EXIT_IMAGE_UNAVAILABLE,
        Some(crate::contract::ENDING_IMAGE_UNAVAILABLE),
        format!("image_unavailable: {why}"),
    )
}

/// The cold path: the sandbox's own container, made for this agent.
async fn run(docker: &Docker, spec: &AgentContainer) -> Result<i32, Failure> {
    ensure_image(docker, &spec.image, spec.pull)
        .await
        .map_err(image_unavailable)?;
    let name = container_name(&spec.sandbox_id);
    // A container of an earlier runner of this sandbox is that runner's: this one starts
    // the agent afresh.
    let _ = force_remove(docker, &name).await;
    let bytes = (spec.limits.memory_mib << 20) as i64;
    let body = ContainerCreateBody {
        image: Some(spec.image.clone()),
        cmd: Some(spec.argv.clone()),
        // The image's entrypoint would stand between the runner and its agent.
        entrypoint: Some(Vec::new()),
        env: Some(spec.env()),
        working_dir: Some(crate::contract::WORKSPACE.to_owned()),
        labels: Some(HashMap::from([
            (LABEL_SANDBOX.to_owned(), spec.sandbox_id.clone()),
            (LABEL_RUN.to_owned(), spec.run_id.clone()),
            (LABEL_OWNER.to_owned(), spec.owner.clone()),
        ])),
        attach_stdin: Some(true),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        open_stdin: Some(true),
        stdin_once: Some(true),
        tty: Some(false),
        host_config: Some(HostConfig {
            binds: Some(vec![format!(
                "{}:{}",
                spec.workspace.display(),
                crate::contract::WORKSPACE
            )]),
            // Under the sandbox's own cgroup, which bounds memory (swap included) and
            // counts its OOM kills where this process reads them once the container is
            // gone; without one, the engine bounds it.
            cgroup_parent: spec.cgroup_parent.clone(),
            memory: spec.cgroup_parent.is_none().then_some(bytes),
            memory_swap: spec.cgroup_parent.is_none().then_some(bytes),
            network_mode: Some(spec.network_mode.clone()),
            // A reaping pid 1, as bubblewrap gives the process driver's agents.
            init: Some(true),
            ..bounded(&spec.limits)
        }),
        ..Default::default()
    };
    docker
        .create_container(
            Some(CreateContainerOptionsBuilder::new().name(&name).build()),
            body,
        )
        .await
        .map_err(|e| match e {
            // The image went between the check and the create.
            e if not_found(&e) => image_unavailable(format!("creating container {name}: {e}")),
            e => engine_failure(format!("creating container {name}: {e}")),
        })?;
    // Attached before it starts, so not a line of its output is missed.
    let attached = match docker
        .attach_container(
            &name,
            Some(
                AttachContainerOptionsBuilder::new()
                    .stdin(true)
                    .stdout(true)
                    .stderr(true)
                    .stream(true)
                    .build(),
            ),
        )
        .await
    {
        Ok(attached) => attached,
        Err(e) => return Err(lost_or(docker, e, &name, "attaching").await),
    };
    // cgroup v1 counts an OOM kill in the container's own cgroup, which the engine
    // removes with it: the sandbox's cgroup, over its limit, notifies an eventfd instead.
    let oom_watch = spec
        .cgroup_memory_events
        .as_deref()
        .filter(|path| path.ends_with("memory.oom_control"))
        .and_then(watch_oom_v1);
    if let Err(e) = docker.start_container(&name, None).await {
        return Err(lost_or(docker, e, &name, "starting").await);
    }

    let piped = Piped::start(attached.output, attached.input);
    let signals = forward_signals(docker.clone(), Target::Container(name.clone()));

    let mut waiting = docker.wait_container(&name, None);
    let waited = waiting.next().await;
    signals.abort();
    let status = match waited {
        Some(Ok(exit)) => exit.status_code as i32,
        // A non-zero exit arrives as an error carrying its code.
        Some(Err(bollard::errors::Error::DockerContainerWaitError { code, .. })) => code as i32,
        Some(Err(e)) => {
            piped.abort();
            // Gone while it ran: removed from outside, not an exit of the agent's.
            return Err(match gone(docker, &name).await {
                true => lost(&name, "while its agent ran"),
                false => engine_failure(format!("waiting for container {name}: {e}")),
            });
        }
        None => {
            piped.abort();
            return Err(lost(&name, "while its agent ran"));
        }
    };
    piped.ended().await;
    // The engine's record of the exit is the word: a wait on a container removed under
    // it may answer 0. Nothing of ours removes it before this point, so a container that
    // is gone was removed from outside.
    let state = match docker.inspect_container(&name, None).await {
        Ok(inspected) => inspected.state.unwrap_or_default(),
        Err(e) if not_found(&e) => return Err(lost(&name, "while its agent ran")),
        Err(_) => Default::default(),
    };
    let status = state.exit_code.map_or(status, |code| code as i32);
    let engine_says_oom = state.oom_killed == Some(true);
    let cgroup_says_oom = spec
        .cgroup_memory_events
        .as_deref()
        .is_some_and(crate::process::limits::oom_killed)
        || oom_watch
            .as_ref()
            .is_some_and(|(fd, _)| fd.read().is_ok_and(|n| n > 0));
    if engine_says_oom || cgroup_says_oom {
        note_oom(spec);
    } else if status == 128 + 9 && removed_soon(docker, &name).await {
        // SIGKILLed by nobody of ours and gone with it: removed from outside (a forced
        // remove kills first), which is the sandbox lost, not an exit of its agent's.
        return Err(lost(&name, "while its agent ran"));
    }
    let _ = force_remove(docker, &name).await;
    Ok(status)
}

/// What every sandbox container is held to: its limits (memory with swap, CPUs, pids)
/// and no new privileges.
fn bounded(limits: &SandboxLimits) -> HostConfig {
    let bytes = (limits.memory_mib << 20) as i64;
    HostConfig {
        memory: Some(bytes),
        memory_swap: Some(bytes),
        nano_cpus: Some((limits.cpus * 1e9) as i64),
        pids_limit: Some(i64::from(limits.pids)),
        security_opt: Some(vec!["no-new-privileges".to_owned()]),
        ..Default::default()
    }
}

/// The warm path: the agent starts by exec in the warm container the driver gave the
/// sandbox ([`warm`]), named for it, which its destroy removes.
async fn run_warm(docker: &Docker, spec: &AgentContainer) -> Result<i32, Failure> {
    use bollard::exec::{StartExecOptions, StartExecResults};
    let name = container_name(&spec.sandbox_id);
    let holder = match docker.inspect_container(&name, None).await {
        Ok(inspected) => inspected.state.unwrap_or_default(),
        Err(e) => return Err(lost_unless_running(docker, e, &name, "inspecting").await),
    };
    // Its memory cgroup lives as long as the container: the holder's.
    let memory_events = holder
        .pid
        .and_then(|pid| u32::try_from(pid).ok())
        .filter(|pid| *pid > 0)
        .and_then(crate::process::limits::memory_events_of);
    let exec = docker
        .create_exec(
            &name,
            bollard::models::ExecConfig {
                cmd: Some(spec.argv.clone()),
                env: Some(spec.env()),
                working_dir: Some(crate::contract::WORKSPACE.to_owned()),
                attach_stdin: Some(true),
                attach_stdout: Some(true),
                attach_stderr: Some(true),
                tty: Some(false),
                ..Default::default()
            },
        )
        .await;
    let exec = match exec {
        Ok(exec) => exec,
        Err(e) => {
            return Err(lost_unless_running(docker, e, &name, "starting the agent in").await);
        }
    };
    let started = docker
        .start_exec(
            &exec.id,
            Some(StartExecOptions {
                detach: false,
                tty: false,
                output_capacity: None,
            }),
        )
        .await;
    let (output, input) = match started {
        Ok(StartExecResults::Attached { output, input }) => (output, input),
        Ok(StartExecResults::Detached) => {
            return Err(engine_failure(format!(
                "the agent in container {name} started detached"
            )));
        }
        Err(e) => {
            return Err(lost_unless_running(docker, e, &name, "starting the agent in").await);
        }
    };
    let piped = Piped::start(output, input);
    let signals = forward_signals(docker.clone(), Target::Exec(exec.id.clone()));
    // The output ends when the agent does (or its container goes).
    piped.ended().await;
    signals.abort();
    if gone(docker, &name).await {
        return Err(lost(&name, "while its agent ran"));
    }
    let inspected = match docker.inspect_exec(&exec.id).await {
        Ok(inspected) => inspected,
        // No exec session: its container went with it.
        Err(e) => {
            return Err(match running(docker, &name).await {
                false => lost(&name, "while its agent ran"),
                true => engine_failure(format!("inspecting the agent in {name}: {e}")),
            });
        }
    };
    let Some(status) = inspected.exit_code.map(|code| code as i32) else {
        return Err(lost(&name, "while its agent ran"));
    };
    if memory_events
        .as_deref()
        .is_some_and(crate::process::limits::oom_killed)
    {
        note_oom(spec);
    } else if status == 128 + 9 && !running(docker, &name).await {
        // Killed with its container (the holder too), which was stopped or removed from
        // outside: an agent that kills itself leaves its container running.
        return Err(lost(&name, "while its agent ran"));
    }
    Ok(status)
}

/// Notes for the runner that the agent was killed at its memory limit.
fn note_oom(spec: &AgentContainer) {
    if let Some(events) = &spec.memory_events {
        let _ = std::fs::write(events, "oom_kill 1\n");
    }
}

type Output = std::pin::Pin<
    Box<
        dyn futures::Stream<Item = Result<bollard::container::LogOutput, bollard::errors::Error>>
            + Send,
    >,
>;
type Input = std::pin::Pin<Box<dyn tokio::io::AsyncWrite + Send>>;

/// The agent's stdio joined to this process's: stdin copied in, stdout and stderr out.
struct Piped {
    stdin: tokio::task::JoinHandle<()>,
    copy: tokio::task::JoinHandle<()>,
}

impl Piped {
    fn start(mut output: Output, mut input: Input) -> Self {
        let stdin = tokio::spawn(async move {
            let mut stdin = tokio::io::stdin();
            let mut buf = vec![0u8; 8192];
            loop {
                match stdin.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if input.write_all(&buf[..n]).await.is_err() || input.flush().await.is_err()
                        {
                            break;
                        }
                    }
                }
            }
            let _ = input.shutdown().await;
        });
        let copy = tokio::spawn(async move {
            let (mut out, mut err) = (tokio::io::stdout(), tokio::io::stderr());
            while let Some(Ok(frame)) = output.next().await {
                let _ = match frame {
                    bollard::container::LogOutput::StdErr { message } => {
                        err.write_all(&message).await.and(err.flush().await)
                    }
                    other => out
                        .write_all(&other.into_bytes())
                        .await
                        .and(out.flush().await),
                };
            }
        });
        Self { stdin, copy }
    }

    /// The agent ended (its output ends with it): the rest of its output copied out,
    /// stdin no longer read.
    async fn ended(self) {
        let _ = self.copy.await;
        self.stdin.abort();
    }

    fn abort(self) {
        self.stdin.abort();
        self.copy.abort();
    }
}

/// The failure of `what` (attaching, starting) container `name`: lost when the engine no
/// longer has it (removed from outside before its agent began; engines answer that with
/// 404 or 500), else the engine's.
async fn lost_or(docker: &Docker, e: bollard::errors::Error, name: &str, what: &str) -> Failure {
    match gone(docker, name).await {
        true => lost(name, "before its agent began"),
        false => engine_failure(format!("{what} container {name}: {e}")),
    }
}

/// Whether the engine no longer lists container `name` (in a state a container of a
/// live sandbox can be in). A listing, not an inspect: Podman answers an inspect of a
/// container being removed with a 500, or with a state (`stopped`) the API does not have.
async fn gone(docker: &Docker, name: &str) -> bool {
    let states = ["created", "running", "paused", "restarting", "exited"];
    listed(docker, name, &states).await == Some(false)
}

/// Whether container `name` runs; false when it is gone or going, or the engine cannot
/// say.
async fn running(docker: &Docker, name: &str) -> bool {
    listed(docker, name, &["running"]).await == Some(true)
}

/// Whether the engine lists container `name` in one of `states`; None when it cannot say.
async fn listed(docker: &Docker, name: &str, states: &[&str]) -> Option<bool> {
    let options = bollard::query_parameters::ListContainersOptionsBuilder::new()
        .all(true)
        .filters(&HashMap::from([
            ("name", vec![name.to_owned()]),
            ("status", states.iter().map(|s| (*s).to_owned()).collect()),
        ]))
        .build();
    let found = docker.list_containers(Some(options)).await.ok()?;
    Some(found.iter().any(|c| {
        c.names
            .iter()
            .flatten()
            .any(|n| n.trim_start_matches('/') == name)
    }))
}

/// The failure of `what` a warm container `name`, before its agent began: the driver
/// made and started it, so one that no longer runs was stopped or removed from outside,
/// and the sandbox is lost.
async fn lost_unless_running(
    docker: &Docker,
    e: bollard::errors::Error,
    name: &str,
    what: &str,
) -> Failure {
    match running(docker, name).await {
        false => lost(name, "before its agent began"),
        true => engine_failure(format!("{what} container {name}: {e}")),
    }
}

/// Whether container `name` is gone within five seconds: a forced remove kills the
/// container and removes it soon after.
async fn removed_soon(docker: &Docker, name: &str) -> bool {
    for _ in 0..50 {
        if gone(docker, name).await {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    false
}

/// An eventfd the memory cgroup whose `memory.oom_control` is `oom_control` signals when
/// it runs out of memory (cgroup v1's notification), and the control file it watches.
fn watch_oom_v1(
    oom_control: &std::path::Path,
) -> Option<(nix::sys::eventfd::EventFd, std::fs::File)> {
    use std::os::fd::AsRawFd;
    let control = std::fs::File::open(oom_control).ok()?;
    let fd = nix::sys::eventfd::EventFd::from_flags(
        nix::sys::eventfd::EfdFlags::EFD_NONBLOCK | nix::sys::eventfd::EfdFlags::EFD_CLOEXEC,
    )
    .ok()?;
    std::fs::write(
        oom_control.with_file_name("cgroup.event_control"),
        format!("{} {}", fd.as_raw_fd(), control.as_raw_fd()),
    )
    .ok()?;
    Some((fd, control))
}

/// What the runner's signals go to: the container (its init hands them to the agent), or
/// the agent's exec in a warm container, by its pid on this host.
enum Target {
    Container(String),
    Exec(String),
}

/// Forwards the runner's signals to the agent: an interrupt is the agent's to handle, a
/// stop its to obey. SIGKILL cannot be caught; the driver's destroy removes the container
/// for it.
fn forward_signals(docker: Docker, target: Target) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut signals = RunnerSignals::new();
        while let Some(sig) = signals.next().await {
            match &target {
                Target::Container(name) => {
                    let _ = docker
                        .kill_container(
                            name,
                            Some(
                                KillContainerOptionsBuilder::new()
                                    .signal(sig.as_str())
                                    .build(),
                            ),
                        )
                        .await;
                }
                Target::Exec(id) => {
                    if let Ok(pid) = docker.inspect_exec(id).await.map(|e| e.pid.unwrap_or(0))
                        && pid > 0
                    {
                        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig);
                    }
                }
            }
        }
    })
}

/// The signals a runner sends its agent's wrapper, which the wrapper passes on: an
/// interrupt is the agent's to handle, a stop its to obey.
struct RunnerSignals {
    streams: Vec<(tokio::signal::unix::Signal, nix::sys::signal::Signal)>,
}

impl RunnerSignals {
    fn new() -> Self {
        use nix::sys::signal::Signal;
        use tokio::signal::unix::{SignalKind, signal};
        let kinds = [
            (SignalKind::interrupt(), Signal::SIGINT),
            (SignalKind::terminate(), Signal::SIGTERM),
            (SignalKind::hangup(), Signal::SIGHUP),
            (SignalKind::quit(), Signal::SIGQUIT),
        ];
        let streams = kinds
            .into_iter()
            .filter_map(|(kind, sig)| Some((signal(kind).ok()?, sig)))
            .collect();
        Self { streams }
    }

    /// The next signal received; None once none can come.
    async fn next(&mut self) -> Option<nix::sys::signal::Signal> {
        if self.streams.is_empty() {
            return None;
        }
        let next = futures::future::select_all(
            self.streams
                .iter_mut()
                .map(|(s, n)| Box::pin(async move { s.recv().await.map(|_| *n) })),
        )
        .await;
        next.0
    }
}
