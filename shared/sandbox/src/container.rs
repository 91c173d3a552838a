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

/// One agent container, as [`run_agent`] makes it.
#[derive(Debug, Clone)]
pub struct AgentContainer {
    pub engine: String,
    pub image: String,
    pub pull: PullPolicy,
    pub sandbox_id: String,
    pub run_id: String,
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
    /// The agent's command.
    pub argv: Vec<String>,
}

/// Runs the agent in its container, attached to this process's stdio, and returns the
/// exit status to end with: the agent's, 128 + N for a signal, or
/// [`EXIT_IMAGE_UNAVAILABLE`] with the reason on stderr.
pub async fn run_agent(spec: AgentContainer) -> i32 {
    if let Some(ending) = &spec.ending {
        let _ = std::fs::remove_file(ending);
    }
    match run(&spec).await {
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

async fn run(spec: &AgentContainer) -> Result<i32, Failure> {
    use crate::contract::{ENDING_CONTAINER_LOST, ENDING_IMAGE_UNAVAILABLE};
    let engine = |e: String| (EXIT_IMAGE_UNAVAILABLE, None, e);
    let docker = connect(&spec.engine).await.map_err(engine)?;
    ensure_image(&docker, &spec.image, spec.pull)
        .await
        .map_err(|e| {
            (
                EXIT_IMAGE_UNAVAILABLE,
                Some(ENDING_IMAGE_UNAVAILABLE),
                format!("image_unavailable: {e}"),
            )
        })?;
    let name = container_name(&spec.sandbox_id);
    // A container of an earlier runner of this sandbox is that runner's: this one starts
    // the agent afresh.
    let _ = docker
        .remove_container(
            &name,
            Some(RemoveContainerOptionsBuilder::new().force(true).build()),
        )
        .await;
    if let Some(events) = &spec.memory_events {
        let _ = std::fs::remove_file(events);
    }
    let bytes = (spec.limits.memory_mib << 20) as i64;
    let body = ContainerCreateBody {
        image: Some(spec.image.clone()),
        cmd: Some(spec.argv.clone()),
        // The image's entrypoint would stand between the runner and its agent.
        entrypoint: Some(Vec::new()),
        env: Some(vec![
            format!("HOME={}", crate::contract::WORKSPACE),
            format!(
                "{}={}/{}",
                crate::contract::ENV_PARK,
                crate::contract::WORKSPACE,
                crate::contract::PARK_MARK
            ),
        ]),
        working_dir: Some(crate::contract::WORKSPACE.to_owned()),
        labels: Some(HashMap::from([
            (LABEL_SANDBOX.to_owned(), spec.sandbox_id.clone()),
            (LABEL_RUN.to_owned(), spec.run_id.clone()),
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
            nano_cpus: Some((spec.limits.cpus * 1e9) as i64),
            pids_limit: Some(i64::from(spec.limits.pids)),
            network_mode: Some(spec.network_mode.clone()),
            security_opt: Some(vec!["no-new-privileges".to_owned()]),
            // A reaping pid 1, as bubblewrap gives the process driver's agents.
            init: Some(true),
            ..Default::default()
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
            bollard::errors::Error::DockerResponseServerError {
                status_code: 404, ..
            } => (
                EXIT_IMAGE_UNAVAILABLE,
                Some(ENDING_IMAGE_UNAVAILABLE),
                format!("image_unavailable: creating container {name}: {e}"),
            ),
            e => engine(format!("creating container {name}: {e}")),
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
        Err(e) => return Err(lost_or(&docker, e, &name, "attaching").await),
    };
    // cgroup v1 counts an OOM kill in the container's own cgroup, which the engine
    // removes with it: the sandbox's cgroup, over its limit, notifies an eventfd instead.
    let oom_watch = spec
        .cgroup_memory_events
        .as_deref()
        .filter(|path| path.ends_with("memory.oom_control"))
        .and_then(watch_oom_v1);
    if let Err(e) = docker.start_container(&name, None).await {
        return Err(lost_or(&docker, e, &name, "starting").await);
    }

    let mut input = attached.input;
    let stdin = tokio::spawn(async move {
        let mut stdin = tokio::io::stdin();
        let mut buf = vec![0u8; 8192];
        loop {
            match stdin.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if input.write_all(&buf[..n]).await.is_err() || input.flush().await.is_err() {
                        break;
                    }
                }
            }
        }
        let _ = input.shutdown().await;
    });
    let mut output = attached.output;
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
    let signals = forward_signals(docker.clone(), name.clone());

    let mut waiting = docker.wait_container(&name, None);
    let status = match waiting.next().await {
        Some(Ok(exit)) => exit.status_code as i32,
        // A non-zero exit arrives as an error carrying its code.
        Some(Err(bollard::errors::Error::DockerContainerWaitError { code, .. })) => code as i32,
        Some(Err(e)) => {
            signals.abort();
            stdin.abort();
            // Gone while it ran: removed from outside, not an exit of the agent's.
            let gone = docker.inspect_container(&name, None).await.is_err();
            return Err(match gone {
                true => (
                    EXIT_IMAGE_UNAVAILABLE,
                    Some(ENDING_CONTAINER_LOST),
                    format!("container {name} was removed while its agent ran"),
                ),
                false => engine(format!("waiting for container {name}: {e}")),
            });
        }
        None => {
            signals.abort();
            stdin.abort();
            return Err((
                EXIT_IMAGE_UNAVAILABLE,
                Some(ENDING_CONTAINER_LOST),
                format!("container {name} was removed while its agent ran"),
            ));
        }
    };
    signals.abort();
    stdin.abort();
    let _ = copy.await;
    // The engine's record of the exit is the word: a wait on a container removed under
    // it may answer 0. Nothing of ours removes it before this point, so a container that
    // is gone was removed from outside.
    let inspected = docker.inspect_container(&name, None).await;
    let state = match inspected {
        Ok(inspected) => inspected.state.unwrap_or_default(),
        Err(bollard::errors::Error::DockerResponseServerError {
            status_code: 404, ..
        }) => {
            return Err((
                EXIT_IMAGE_UNAVAILABLE,
                Some(ENDING_CONTAINER_LOST),
                format!("container {name} was removed while its agent ran"),
            ));
        }
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
        if let Some(events) = &spec.memory_events {
            let _ = std::fs::write(events, "oom_kill 1\n");
        }
    } else if status == 128 + 9 && removed_soon(&docker, &name).await {
        // SIGKILLed by nobody of ours and gone with it: removed from outside (a forced
        // remove kills first), which is the sandbox lost, not an exit of its agent's.
        return Err((
            EXIT_IMAGE_UNAVAILABLE,
            Some(ENDING_CONTAINER_LOST),
            format!("container {name} was removed while its agent ran"),
        ));
    }
    let _ = docker
        .remove_container(
            &name,
            Some(RemoveContainerOptionsBuilder::new().force(true).build()),
        )
        .await;
    Ok(status)
}

/// The failure of `what` (attaching, starting) container `name`: lost when the engine no
/// longer has it (removed from outside before its agent began; engines answer that with
/// 404 or 500), else the engine's.
async fn lost_or(docker: &Docker, e: bollard::errors::Error, name: &str, what: &str) -> Failure {
    use crate::contract::ENDING_CONTAINER_LOST;
    if let Err(bollard::errors::Error::DockerResponseServerError {
        status_code: 404, ..
    }) = docker.inspect_container(name, None).await
    {
        return (
            EXIT_IMAGE_UNAVAILABLE,
            Some(ENDING_CONTAINER_LOST),
            format!("container {name} was removed before its agent began"),
        );
    }
    (
        EXIT_IMAGE_UNAVAILABLE,
        None,
        format!("{what} container {name}: {e}"),
    )
}

/// Whether container `name` is gone within two seconds: a forced remove kills the
/// container and removes it at once after.
async fn removed_soon(docker: &Docker, name: &str) -> bool {
    for _ in 0..20 {
        if let Err(bollard::errors::Error::DockerResponseServerError {
            status_code: 404, ..
        }) = docker.inspect_container(name, None).await
        {
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

/// Forwards the runner's signals to the container: an interrupt is the agent's to handle,
/// a stop its to obey. SIGKILL cannot be caught; the driver's destroy removes the
/// container for it.
fn forward_signals(docker: Docker, name: String) -> tokio::task::JoinHandle<()> {
    use tokio::signal::unix::{SignalKind, signal};
    tokio::spawn(async move {
        let kinds = [
            (SignalKind::interrupt(), "SIGINT"),
            (SignalKind::terminate(), "SIGTERM"),
            (SignalKind::hangup(), "SIGHUP"),
            (SignalKind::quit(), "SIGQUIT"),
        ];
        let mut streams = Vec::new();
        for (kind, name) in kinds {
            if let Ok(stream) = signal(kind) {
                streams.push((stream, name));
            }
        }
        loop {
            let next = futures::future::select_all(
                streams
                    .iter_mut()
                    .map(|(s, n)| Box::pin(async move { s.recv().await.map(|_| *n) })),
            )
            .await;
            match next.0 {
                Some(signal_name) => {
                    let _ = docker
                        .kill_container(
                            &name,
                            Some(
                                KillContainerOptionsBuilder::new()
                                    .signal(signal_name)
                                    .build(),
                            ),
                        )
                        .await;
                }
                None => return,
            }
        }
    })
}

/// Pauses (`true`) or unpauses sandbox `sandbox_id`'s container; one that is not there
/// has nothing to pause.
pub async fn pause(engine: &str, sandbox_id: &str, paused: bool) -> Result<(), String> {
    let docker = connect(engine).await?;
    let name = container_name(sandbox_id);
    let result = if paused {
        docker.pause_container(&name).await
    } else {
        docker.unpause_container(&name).await
    };
    match result {
        Ok(()) => Ok(()),
        Err(bollard::errors::Error::DockerResponseServerError {
            status_code: 404, ..
        }) => Ok(()),
        Err(e) => Err(format!("container {name}: {e}")),
    }
}

/// Stops sandbox `sandbox_id`'s container within `grace`, then removes it; done when it
/// is gone.
pub async fn remove(
    engine: &str,
    sandbox_id: &str,
    grace: std::time::Duration,
) -> Result<(), String> {
    let docker = connect(engine).await?;
    let name = container_name(sandbox_id);
    // A paused container takes no signal: continued first.
    let _ = docker.unpause_container(&name).await;
    let _ = docker
        .stop_container(
            &name,
            Some(
                StopContainerOptionsBuilder::new()
                    .t(grace.as_secs() as i32)
                    .build(),
            ),
        )
        .await;
    match docker
        .remove_container(
            &name,
            Some(RemoveContainerOptionsBuilder::new().force(true).build()),
        )
        .await
    {
        Ok(()) => Ok(()),
        Err(bollard::errors::Error::DockerResponseServerError {
            status_code: 404, ..
        }) => Ok(()),
        Err(e) => Err(format!("removing container {name}: {e}")),
    }
}
