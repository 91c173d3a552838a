//! The `process` driver: a sandbox is a local `runplane runner` process.
//!
//! Each sandbox runs as `sh -c '<runplane> runner; echo $? > <dir>/exit' runplane-sandbox-<id>`
//! in a session (and so a process group) of its own, so it outlives the control plane that
//! started it; suspend, resume and destroy signal every process group of that session (the
//! runner starts its agent in a group of its own). A
//! restarted reconciler re-adopts it by pid (checking the pid still names this sandbox,
//! since pids are reused) and learns its end from the exit file the shell writes. The
//! reconciler never waits on a process it did not start in this life; the ones it did
//! start are reaped by a waiter task.
//!
//! A suspended sandbox is SIGSTOPped processes of this host, found by the pid its state
//! directory recorded: only the driver on the same host (and state directory) can
//! restore it. Nothing restores it elsewhere; a host that is gone for good leaves its
//! suspended sandboxes to the loss grace, which ends them `sandbox_lost`.
//!
//! # Containment
//!
//! The agent is untrusted; its runner is not. So the boundary sits between them: the
//! shell and the runner run as the driver's user in the host's namespaces (the runner
//! holds the run key in its environment and talks to the control plane), and the runner
//! starts only the agent inside bubblewrap, through the wrapper this driver hands it in
//! `RUNPLANE_AGENT_WRAPPER`. In its own pid namespace with its own `/proc` the agent
//! cannot see the runner (nor its environ, nor any other process of the host), so no
//! file descriptor or key file is needed to keep the key from it. The agent's files live
//! in `<dir>/workspace` (its `/workspace`), and under root the uid it was given is kept in
//! `<dir>/uid`, so a re-created sandbox keeps both. See [`Containment`].
//!
//! The module's parts: [`containment`] (bubblewrap and what it shows an agent), [`env`]
//! (what of the launcher's environment a sandbox inherits), [`idle`] (reading `/proc`
//! to tell an agent waiting for input) and [`procfs`] (a sandbox's processes, found by
//! session).

pub mod containment;
pub mod env;
pub mod idle;
pub mod limits;
pub mod network;
mod procfs;
mod tools;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;

use futures::future::BoxFuture;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

pub use containment::{Containment, ContainmentError, IsolationUnavailable, Net};
pub use env::{ENV_SANDBOX_INHERIT, sandbox_env, sandbox_env_from};
pub use idle::agent_waits_for_input;
pub use limits::{Enforcer, LimitsUnavailable};

use runplane_config::SandboxNetwork;

use crate::container::Engine;
use crate::container::warm::{PoolSpec, Taken, WarmPool};
use crate::contract::{self, RunnerPolls};
use crate::driver::{Driver, DriverError, Launch, Probe, SandboxSpec};
pub use procfs::DESTROY_GRACE;
use procfs::{alive, session_members, stop_orphans};

#[derive(Debug, Clone)]
pub struct ProcessDriver {
    /// Where each sandbox keeps its pid, exit status and logs.
    state_dir: PathBuf,
    /// The `runplane` binary the runner runs from.
    runplane: PathBuf,
    /// How the runner contains its agent.
    containment: Containment,
    /// The container containment's engine, and its warm pool where it keeps one.
    engine: Option<Arc<Engine>>,
    warm: Option<Arc<WarmPool>>,
    /// Endpoints besides a launch's own whose addresses its agents' network refuses:
    /// the rest of the control plane, as this driver's host knows it.
    refused_endpoints: Vec<String>,
}

/// The pid of a warm container's `runplane-holder`, in its sandbox's directory.
const HOLDER_PID: &str = "holder.pid";

/// The label a sandbox's shell carries as `$0`, by which its pid is recognised.
fn label(sandbox_id: &str) -> String {
    format!("runplane-sandbox-{sandbox_id}")
}

impl ProcessDriver {
    /// A driver whose agents run uncontained; see [`ProcessDriver::contained`].
    pub fn new(state_dir: impl Into<PathBuf>, runplane: impl Into<PathBuf>) -> Self {
        Self {
            state_dir: state_dir.into(),
            runplane: runplane.into(),
            containment: Containment::None,
            engine: None,
            warm: None,
            refused_endpoints: Vec::new(),
        }
    }

    /// This driver with `endpoints`' addresses refused to its agents' outbound network,
    /// besides the run store and coordinator each launch names: a node's reconciler and
    /// the services it knows of, which a launch does not name. Empty ones are skipped.
    pub fn refusing(mut self, endpoints: impl IntoIterator<Item = String>) -> Self {
        self.refused_endpoints = endpoints.into_iter().filter(|e| !e.is_empty()).collect();
        self
    }

    /// This driver with its agents contained as [`Containment::probe`] found possible.
    ///
    /// For containers, in the background (on the runtime this is called in): removes
    /// the containers of this state directory that no live sandbox owns
    /// ([`crate::container::sweep`]), then fills the warm pool.
    pub fn contained(mut self, containment: Containment) -> Self {
        if let Containment::Container {
            engine,
            image,
            pull,
            limits,
            enforcer,
            warm,
            holder,
            ..
        } = &containment
        {
            let engine = Arc::new(Engine::new(engine.clone()));
            self.warm = holder.as_ref().filter(|_| *warm > 0).map(|holder| {
                WarmPool::new(
                    engine.clone(),
                    PoolSpec {
                        image: image.clone(),
                        pull: *pull,
                        holder: holder.clone(),
                        size: *warm,
                        limits: *limits,
                        enforcer: enforcer.clone(),
                        state_dir: self.state_dir.clone(),
                    },
                )
            });
            self.engine = Some(engine);
            if tokio::runtime::Handle::try_current().is_ok() {
                let this = self.clone();
                tokio::spawn(async move { this.sweep_containers().await });
            }
        }
        self.containment = containment;
        self
    }

    /// Removes the containers this driver made that no live sandbox owns, then fills
    /// its warm pool afresh.
    pub async fn sweep_containers(&self) {
        let Some(engine) = &self.engine else {
            return;
        };
        let owner = self.state_dir.display().to_string();
        let live = |sandbox_id: &str| self.recorded_live(sandbox_id).is_some();
        match crate::container::sweep(engine, &owner, live).await {
            Ok(removed) if !removed.is_empty() => {
                tracing::info!(?removed, "removed containers no live sandbox owns");
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "sweeping containers"),
        }
        if let Some(warm) = &self.warm {
            warm.restart().await;
        }
    }

    /// The warm pool, when this driver keeps one.
    pub fn warm_pool(&self) -> Option<&Arc<WarmPool>> {
        self.warm.as_ref()
    }

    /// A warm container for a new sandbox, when one waits and fits it: the driver's
    /// image, the default limits, and not the host's network (a warm container's
    /// namespace is its own).
    async fn take_warm(&self, sandbox: &SandboxSpec, dir: &Path) -> Option<Taken> {
        let pool = self.warm.as_ref()?;
        let fits = sandbox.limits.is_none_or(|limits| limits == *pool.limits())
            && sandbox
                .image
                .as_deref()
                .is_none_or(|image| image == pool.image())
            && (sandbox.offline || self.containment.network() != SandboxNetwork::Host);
        match fits && !dir.exists() {
            true => pool.take(&sandbox.id, dir).await,
            false => None,
        }
    }

    /// The sandbox's network as its containment and profile say, brought up: its own
    /// namespace (new, or the one process `join` is in) for outbound.
    async fn network(
        &self,
        dir: &Path,
        id: &str,
        offline: bool,
        launch: &Launch,
        join: Option<u32>,
    ) -> Result<Net, DriverError> {
        Ok(match (self.containment.network(), offline) {
            (SandboxNetwork::None, _) | (_, true) => Net::None,
            (SandboxNetwork::Host, false) => Net::Host,
            (SandboxNetwork::Outbound, false) => {
                // The control plane's addresses are refused wherever it runs, not only on
                // this host.
                let mut refused = network::endpoint_addresses(&launch.endpoint).await;
                refused.extend(network::endpoint_addresses(&launch.recovery_endpoint).await);
                for endpoint in &self.refused_endpoints {
                    refused.extend(network::endpoint_addresses(endpoint).await);
                }
                network::up(dir, id, &refused, join).await?;
                Net::Own {
                    netns: network::netns_path(id),
                    resolv_conf: dir.join(network::RESOLV_CONF),
                }
            }
        })
    }

    /// The uid of the sandbox in `dir`: the one it was given, or else the first in the
    /// range from a point its id picks that no other live sandbox of this driver holds.
    fn sandbox_uid(&self, dir: &Path, id: &str, (base, count): (u32, u32)) -> u32 {
        if let Some(uid) = std::fs::read_to_string(dir.join("uid"))
            .ok()
            .and_then(|u| u.trim().parse().ok())
        {
            return uid;
        }
        let taken: std::collections::HashSet<u32> = std::fs::read_dir(&self.state_dir)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|other| !other.join(contract::EXIT_FILE).exists())
            .filter_map(|other| std::fs::read_to_string(other.join("uid")).ok())
            .filter_map(|u| u.trim().parse().ok())
            .collect();
        // FNV-1a: stable across builds, unlike the std hasher.
        let start = id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        }) % u64::from(count);
        (0..u64::from(count))
            .map(|i| base + ((start + i) % u64::from(count)) as u32)
            .find(|uid| !taken.contains(uid))
            .unwrap_or(base + start as u32)
    }

    /// The workspace of the sandbox in `dir`, made writable by its agent and bounded by
    /// its limits, the wrapper its runner starts the agent under, and where the runner
    /// reads whether the agent was killed at its memory limit.
    async fn prepare_agent(
        &self,
        dir: &Path,
        sandbox: &SandboxSpec,
        launch: &Launch,
        warm: Option<Taken>,
    ) -> Result<(Vec<String>, Option<PathBuf>), DriverError> {
        let (id, offline, limits) = (sandbox.id.as_str(), sandbox.offline, sandbox.limits);
        if let (Some(image), false) = (
            &sandbox.image,
            matches!(self.containment, Containment::Container { .. }),
        ) {
            // A process sandbox has no image to run its agent in: running it on the host
            // instead would not be what its profile asked for.
            return Err(DriverError::Start(format!(
                "its profile names an image ({image}), which needs the container driver; \
                 this host runs sandboxes as processes (sandbox_reconciler.driver = \"process\")"
            )));
        }
        if self.containment == Containment::None {
            // Uncontained, the agent has the host's network; a profile that takes it away
            // cannot be honoured, so the sandbox is not started at all.
            if offline {
                return Err(DriverError::Start(
                    "its profile takes the network away (network = \"none\"), which needs \
                     contained sandboxes; this host runs them uncontained \
                     (sandbox_reconciler.isolation = \"none\")"
                        .into(),
                ));
            }
            return Ok((Vec::new(), None));
        }
        let start = |e: std::io::Error| DriverError::Start(e.to_string());
        let workspace = dir.join(contract::WORKSPACE_DIR);
        std::fs::create_dir_all(&workspace).map_err(start)?;
        if let Containment::Container { .. } = &self.containment {
            return self.prepare_container(dir, sandbox, launch, warm).await;
        }
        let applied = match self.containment.limits() {
            Some((defaults, enforcer)) => {
                let limits = limits.unwrap_or(*defaults);
                enforcer
                    .mount_workspace(dir, &workspace, limits.disk_mib)
                    .await?;
                enforcer.apply(id, &limits)?
            }
            None => limits::Applied::default(),
        };
        let uid = match self.containment.uid_range() {
            Some(range) => {
                let uid = self.sandbox_uid(dir, id, range);
                std::fs::write(dir.join("uid"), uid.to_string()).map_err(start)?;
                std::os::unix::fs::chown(&workspace, Some(uid), Some(uid)).map_err(start)?;
                Some(uid)
            }
            None => None,
        };
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&workspace, std::fs::Permissions::from_mode(0o700))
                .map_err(start)?;
        }
        if applied
            .join
            .iter()
            .any(|p| p.to_string_lossy().contains(['\'', '\n']))
        {
            return Err(DriverError::Start(
                "a cgroup path of this host holds a quote or a line break".into(),
            ));
        }
        // The deployment's network, unless the sandbox's profile takes it away.
        let net = self.network(dir, id, offline, launch, None).await?;
        let wrapper = self.containment.wrapper(&workspace, uid, &net, &applied);
        if wrapper.iter().any(|arg| arg.contains('\n')) {
            return Err(DriverError::Start(format!(
                "the sandbox path {} holds a line break",
                workspace.display()
            )));
        }
        Ok((wrapper, applied.memory_events))
    }

    /// [`Self::prepare_agent`] for the container containment: the workspace image, the
    /// sandbox's network, and the wrapper `runplane sandbox-container` that runs the agent
    /// in its container ([`crate::container::run_agent`]).
    async fn prepare_container(
        &self,
        dir: &Path,
        sandbox: &SandboxSpec,
        launch: &Launch,
        warm: Option<Taken>,
    ) -> Result<(Vec<String>, Option<PathBuf>), DriverError> {
        let (id, offline, limits) = (sandbox.id.as_str(), sandbox.offline, sandbox.limits);
        let workspace = &dir.join(contract::WORKSPACE_DIR);
        let Containment::Container {
            engine,
            image,
            pull,
            limits: defaults,
            enforcer,
            ..
        } = &self.containment
        else {
            return Err(DriverError::Start("not a container containment".into()));
        };
        let limits = limits.unwrap_or(*defaults);
        // A warm container's workspace is mounted already, and its limits are its own.
        enforcer
            .mount_workspace(dir, workspace, limits.disk_mib)
            .await?;
        let applied = match warm {
            Some(_) => limits::Applied::default(),
            None => enforcer.apply(id, &limits)?,
        };
        let join = warm.as_ref().map(|taken| taken.holder_pid);
        let network_mode = match self.network(dir, id, offline, launch, join).await? {
            Net::None => "none".to_owned(),
            Net::Host => "host".to_owned(),
            Net::Own { netns, .. } => format!("ns:{}", netns.display()),
        };
        let memory_events = dir.join("memory.events");
        let mut wrapper: Vec<String> = vec![
            self.runplane.display().to_string(),
            "sandbox-container".into(),
        ];
        for (flag, value) in [
            ("--engine", engine.clone()),
            (
                "--image",
                sandbox.image.clone().unwrap_or_else(|| image.clone()),
            ),
            ("--pull", pull.as_str().to_owned()),
            ("--sandbox-id", id.to_owned()),
            ("--run-id", launch.run_id.clone()),
            ("--owner", self.state_dir.display().to_string()),
            ("--workspace", workspace.display().to_string()),
            ("--cpus", limits.cpus.to_string()),
            ("--memory-mib", limits.memory_mib.to_string()),
            ("--pids", limits.pids.to_string()),
            ("--network-mode", network_mode),
            ("--memory-events", memory_events.display().to_string()),
            (
                "--ending",
                dir.join(contract::ENDING_FILE).display().to_string(),
            ),
        ] {
            wrapper.push(format!("{flag}={value}"));
        }
        if let Some(taken) = &warm {
            wrapper.push("--warm".into());
            if let Some(socket) = &taken.launch {
                // Where idleness reads the agent's processes from.
                std::fs::write(dir.join(HOLDER_PID), taken.holder_pid.to_string())
                    .map_err(|e| DriverError::Start(format!("recording the holder: {e}")))?;
                wrapper.push(format!("--launch={}", socket.display()));
                wrapper.push(format!("--holder-pid={}", taken.holder_pid));
            }
        } else if let Some(parent) = enforcer.cgroup_parent(id) {
            wrapper.push(format!("--cgroup-parent={parent}"));
        }
        if let Some(events) = &applied.memory_events {
            wrapper.push(format!("--cgroup-memory-events={}", events.display()));
        }
        wrapper.push("--".into());
        if wrapper.iter().any(|arg| arg.contains('\n')) {
            return Err(DriverError::Start(
                "a container argument holds a line break".into(),
            ));
        }
        Ok((wrapper, Some(memory_events)))
    }

    fn dir(&self, sandbox_id: &str) -> PathBuf {
        self.state_dir.join(sandbox_id)
    }

    /// Whether `sandbox`'s agent is parked: waiting for input (blocked reading its stdin,
    /// or saying so with its [`contract::PARK_MARK`]), with its runner holding no steering it has
    /// yet to write. See [`agent_waits_for_input`] and [`RunnerPolls`]. An agent in a
    /// container is found in the container's session when `runplane-holder` started it
    /// (it reads the runner's pipe itself); otherwise (made for it, or by the engine's
    /// exec, behind the engine's own pipes) only its mark says it waits.
    pub fn parked(&self, sandbox: &SandboxSpec) -> bool {
        let Some(leader) = Self::live_pid(&sandbox.driver_handle, &sandbox.id) else {
            return false;
        };
        let pending = self.runner_polls(sandbox).is_none_or(|p| p.pending > 0);
        let reading = match self.holder_of(sandbox) {
            Some(holder) => idle::launched_agent_waits_for_input(holder),
            None => agent_waits_for_input(leader),
        };
        !pending && (self.park_marked(sandbox) || reading)
    }

    /// The pid of the `runplane-holder` of `sandbox`'s warm container, while it lives and
    /// is still that holder.
    fn holder_of(&self, sandbox: &SandboxSpec) -> Option<i32> {
        let dir = self.dir(&sandbox.id);
        let pid: i32 = std::fs::read_to_string(dir.join(HOLDER_PID))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        (alive(pid) && String::from_utf8_lossy(&cmdline).contains("runplane-holder")).then_some(pid)
    }

    /// Whether the agent left its [`contract::PARK_MARK`]: a plain file (a link the
    /// agent made there is not followed, and counts as no mark).
    fn park_marked(&self, sandbox: &SandboxSpec) -> bool {
        std::fs::symlink_metadata(contract::park_mark(&self.dir(&sandbox.id)))
            .is_ok_and(|m| m.file_type().is_file())
    }

    /// What `sandbox`'s runner last said of its steering polls, None before its first.
    pub fn runner_polls(&self, sandbox: &SandboxSpec) -> Option<RunnerPolls> {
        RunnerPolls::parse(
            &std::fs::read_to_string(self.dir(&sandbox.id).join(contract::STEERING_MARK)).ok()?,
        )
    }

    /// The pid sandbox `sandbox_id`'s directory recorded, if that process is alive and
    /// still this sandbox's.
    fn recorded_live(&self, sandbox_id: &str) -> Option<i32> {
        let pid = std::fs::read_to_string(self.dir(sandbox_id).join("pid")).ok()?;
        Self::live_pid(&format!("pid:{}", pid.trim()), sandbox_id)
    }

    /// The pid in `handle` if that process is alive and still this sandbox's.
    fn live_pid(handle: &str, sandbox_id: &str) -> Option<i32> {
        let pid: i32 = handle.strip_prefix("pid:")?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Field 3, after the parenthesised command name: Z is a zombie, gone in all but name.
        let state = stat.rsplit_once(')')?.1.split_whitespace().next()?;
        if state == "Z" || state == "X" {
            return None;
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        String::from_utf8_lossy(&cmdline)
            .split('\0')
            .any(|arg| arg == label(sandbox_id))
            .then_some(pid)
    }

    fn exit_code(dir: &Path) -> Option<i32> {
        std::fs::read_to_string(dir.join(contract::EXIT_FILE))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Signals every process of the sandbox: its shell's process group and, when the shell
    /// leads a session of its own (setsid), every process group of that session, since the
    /// runner starts the agent in a group of its own.
    fn signal(sandbox: &SandboxSpec, signal: Signal) -> Result<(), DriverError> {
        match Self::live_pid(&sandbox.driver_handle, &sandbox.id) {
            Some(pid) => Self::signal_session(pid, signal),
            None => Ok(()),
        }
    }

    /// Signals the process group of `leader` and every group of the session it leads
    /// (whether or not the leader itself still lives).
    fn signal_session(leader: i32, signal: Signal) -> Result<(), DriverError> {
        let mut groups = vec![leader];
        for (pgrp, _) in session_members(leader) {
            if !groups.contains(&pgrp) {
                groups.push(pgrp);
            }
        }
        let mut failed = None;
        for group in groups {
            match killpg(Pid::from_raw(group), signal) {
                Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
                Err(e) => failed = Some(e),
            }
        }
        match failed {
            Some(e) => Err(DriverError::Signal(e.to_string())),
            None => Ok(()),
        }
    }
}

impl Driver for ProcessDriver {
    fn create(
        &self,
        sandbox: &SandboxSpec,
        launch: Launch,
    ) -> BoxFuture<'static, Result<String, DriverError>> {
        let dir = self.dir(&sandbox.id);
        let runplane = self.runplane.clone();
        let id = sandbox.id.clone();
        let existing = sandbox.driver_handle.clone();
        let spec = sandbox.clone();
        let this = self.clone();
        Box::pin(async move {
            // Idempotent: a sandbox whose process lives is adopted, not started twice.
            if let Some(pid) = Self::live_pid(&existing, &id) {
                return Ok(format!("pid:{pid}"));
            }
            if let Some(pid) = this.recorded_live(&id) {
                return Ok(format!("pid:{pid}"));
            }
            let warm = this.take_warm(&spec, &dir).await;
            std::fs::create_dir_all(&dir).map_err(|e| DriverError::Start(e.to_string()))?;
            // A previous runner's polls say nothing about the one started now.
            let _ = std::fs::remove_file(dir.join(contract::STEERING_MARK));
            let (wrapper, memory_events) = this.prepare_agent(&dir, &spec, &launch, warm).await?;
            let log = std::fs::File::create(dir.join("runner.log"))
                .map_err(|e| DriverError::Start(e.to_string()))?;
            let log_err = log
                .try_clone()
                .map_err(|e| DriverError::Start(e.to_string()))?;
            // A session of its own (setsid, from util-linux) detaches it from the control
            // plane's terminal and signals; without setsid, a process group of its own.
            let setsid = std::path::Path::new("/usr/bin/setsid").exists();
            let mut command = if setsid {
                let mut c = tokio::process::Command::new("/usr/bin/setsid");
                c.arg("sh");
                c
            } else {
                let mut c = tokio::process::Command::new("sh");
                c.process_group(0);
                c
            };
            let mut child = command
                .arg("-c")
                .arg(format!(
                    r#""${bin}" runner; echo $? > "${dir}/{exit}""#,
                    bin = contract::ENV_BIN,
                    dir = contract::ENV_SANDBOX_DIR,
                    exit = contract::EXIT_FILE,
                ))
                .arg(label(&id))
                // Nothing of the control plane's environment (its token, database URLs,
                // signing key) reaches a sandbox: only what a runner needs, below.
                .env_clear()
                // The runner reads no config file: this includes the TLS client side it
                // reaches https:// with (its CA; a client identity only if opted in).
                .envs(sandbox_env())
                .env(contract::ENV_BIN, &runplane)
                .env(contract::ENV_SANDBOX_DIR, &dir)
                .env(contract::ENV_ENDPOINT, &launch.endpoint)
                .env(contract::ENV_RECOVERY_ENDPOINT, &launch.recovery_endpoint)
                .env(contract::ENV_RUN_ID, &launch.run_id)
                .env(contract::ENV_RUN_KEY_ON_STDIN, "1")
                .env(contract::ENV_AGENT_WRAPPER, wrapper.join("\n"))
                .env(
                    contract::ENV_MEMORY_EVENTS,
                    memory_events.unwrap_or_default(),
                )
                // The OpenTelemetry convention for handing a trace to a child process.
                .env(contract::ENV_TRACEPARENT, &launch.traceparent)
                // The run key goes down this pipe, read once by the runner: in no
                // environment a process of the host (or the agent) could read.
                .stdin(Stdio::piped())
                .stdout(log)
                .stderr(log_err)
                .kill_on_drop(false)
                .spawn()
                .map_err(|e| DriverError::Start(e.to_string()))?;
            let pid = child
                .id()
                .ok_or_else(|| DriverError::Start("the sandbox exited at once".into()))?;
            if let Some(mut stdin) = child.stdin.take() {
                use tokio::io::AsyncWriteExt;
                // A key is far below a pipe's buffer: this never waits on the runner.
                stdin
                    .write_all(launch.run_key.expose().as_bytes())
                    .await
                    .map_err(|e| DriverError::Start(format!("handing the runner its key: {e}")))?;
            }
            std::fs::write(dir.join("pid"), pid.to_string())
                .map_err(|e| DriverError::Start(e.to_string()))?;
            // Reap it when it ends, while this process lives; after a restart init does.
            tokio::spawn(async move {
                let _ = child.wait().await;
            });
            Ok(format!("pid:{pid}"))
        })
    }

    fn status(&self, sandbox: &SandboxSpec) -> BoxFuture<'static, Probe> {
        let dir = self.dir(&sandbox.id);
        let handle = sandbox.driver_handle.clone();
        let id = sandbox.id.clone();
        Box::pin(async move {
            if let Some(code) = Self::exit_code(&dir) {
                return Probe::Exited(Some(code));
            }
            if Self::live_pid(&handle, &id).is_some() {
                return Probe::Alive;
            }
            // Gone without an exit record: killed, or the machine restarted.
            Probe::Lost
        })
    }

    /// Stops the sandbox's processes (SIGSTOP) and, for a container, pauses it in the
    /// engine (its processes are not the host session's).
    fn suspend(&self, sandbox: &SandboxSpec) -> BoxFuture<'static, Result<(), DriverError>> {
        let result = Self::signal(sandbox, Signal::SIGSTOP);
        let engine = self.engine.clone();
        let id = sandbox.id.clone();
        Box::pin(async move {
            if let Some(engine) = engine {
                engine.pause(&id, true).await.map_err(DriverError::Signal)?;
            }
            result
        })
    }

    fn resume(&self, sandbox: &SandboxSpec) -> BoxFuture<'static, Result<(), DriverError>> {
        let engine = self.engine.clone();
        let id = sandbox.id.clone();
        let sandbox = sandbox.clone();
        Box::pin(async move {
            if let Some(engine) = engine {
                engine
                    .pause(&id, false)
                    .await
                    .map_err(DriverError::Signal)?;
            }
            Self::signal(&sandbox, Signal::SIGCONT)
        })
    }

    /// SIGTERM then SIGCONT to the whole sandbox (a suspended one is stopped, and a
    /// stopped process only acts on SIGTERM once continued), then SIGKILL to whatever of
    /// its session is left after [`DESTROY_GRACE`]. Done when nothing of it is left.
    fn destroy(&self, sandbox: &SandboxSpec) -> BoxFuture<'static, Result<(), DriverError>> {
        let leader = Self::live_pid(&sandbox.driver_handle, &sandbox.id);
        let recorded: Option<i32> = sandbox
            .driver_handle
            .strip_prefix("pid:")
            .and_then(|p| p.parse().ok());
        let dir = self.dir(&sandbox.id);
        let id = sandbox.id.clone();
        let this = self.clone();
        Box::pin(async move {
            let stopped = this.stop(leader, recorded, &dir).await;
            // The container outlives a killed wrapper: stopped and removed in the engine.
            if let Some(engine) = &this.engine {
                engine
                    .remove(&crate::container::container_name(&id), DESTROY_GRACE)
                    .await
                    .map_err(DriverError::Signal)?;
            }
            // Nothing of the sandbox runs now: its cgroups, workspace image and network
            // can go.
            if stopped.is_ok()
                && let Some((_, enforcer)) = this.containment.limits()
            {
                enforcer.release(&id, &dir).await;
                limits::unmount(&dir.join(crate::container::warm::LAUNCH_HOST_DIR)).await;
                network::down(&dir, &id).await;
            }
            stopped
        })
    }

    fn waiting_for_input(&self, sandbox: &SandboxSpec) -> Option<bool> {
        Some(self.parked(sandbox))
    }
}

impl ProcessDriver {
    /// Stops every process of the sandbox led by `leader` (or, when that is gone, what
    /// its session `recorded` left).
    async fn stop(
        &self,
        leader: Option<i32>,
        recorded: Option<i32>,
        dir: &Path,
    ) -> Result<(), DriverError> {
        {
            let Some(leader) = leader else {
                // The shell and runner are gone (never started, a crash, an OOM kill), but
                // what they started may live on in their session: stop those too.
                return match recorded {
                    Some(sid) => stop_orphans(sid, dir).await,
                    None => Ok(()),
                };
            };
            let gone = || !alive(leader) && session_members(leader).is_empty();
            Self::signal_session(leader, Signal::SIGTERM)?;
            Self::signal_session(leader, Signal::SIGCONT)?;
            let deadline = tokio::time::Instant::now() + DESTROY_GRACE;
            while tokio::time::Instant::now() < deadline {
                if gone() {
                    return Ok(());
                }
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            Self::signal_session(leader, Signal::SIGKILL)?;
            for _ in 0..20 {
                if gone() {
                    return Ok(());
                }
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            Err(DriverError::Signal(format!(
                "sandbox process {leader} still runs after SIGKILL"
            )))
        }
    }
}
