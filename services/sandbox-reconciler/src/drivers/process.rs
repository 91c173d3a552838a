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

use std::path::{Path, PathBuf};
use std::process::Stdio;

use futures::future::BoxFuture;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

use super::{Driver, DriverError, Launch};
use crate::domain::loss::Probe;
use crate::store::entities::sandbox;

#[derive(Debug, Clone)]
pub struct ProcessDriver {
    /// Where each sandbox keeps its pid, exit status and logs.
    state_dir: PathBuf,
    /// The `runplane` binary the runner runs from.
    runplane: PathBuf,
}

/// Names the launcher's operator lists in `RUNPLANE_SANDBOX_INHERIT` (comma-separated)
/// to let sandboxes inherit a credential they otherwise do not get.
pub const ENV_SANDBOX_INHERIT: &str = "RUNPLANE_SANDBOX_INHERIT";

/// The part of this process's environment a sandbox inherits: the platform basics
/// (PATH, HOME, locale, time zone, temp dir), log and OpenTelemetry exporter settings
/// (but not `OTEL_SERVICE_NAME`: the runner names itself), and the CA its runner trusts
/// servers by. Everything else, runplane's own configuration included, stays out; the
/// launch adds what the runner needs. See [`sandbox_env_from`] for the credentials.
pub fn sandbox_env() -> Vec<(String, String)> {
    let tls = runplane_grpc::tls::child_env()
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v));
    sandbox_env_from(std::env::vars(), tls)
}

/// [`sandbox_env`] of `vars` (a launcher's environment) and `tls` (its TLS client side,
/// as `runplane_grpc::tls::child_env` gives it to a child). The agent is untrusted and
/// shares what its runner inherits, so credentials of the launcher stay out unless the
/// operator opts in by listing them in `RUNPLANE_SANDBOX_INHERIT`:
/// - `tls_client_identity`: the launcher's TLS client certificate and key
///   (`RUNPLANE_TLS__CERT_FILE`/`KEY_FILE`, which a runner needs only where servers
///   require mutual TLS, and `OTEL_EXPORTER_OTLP_*CLIENT_KEY`/`CLIENT_CERTIFICATE`);
/// - `otlp_headers`: `OTEL_EXPORTER_OTLP_HEADERS` and its per-signal forms, which
///   usually carry a collector's API key.
pub fn sandbox_env_from(
    vars: impl IntoIterator<Item = (String, String)>,
    tls: impl IntoIterator<Item = (String, String)>,
) -> Vec<(String, String)> {
    const KEEP: &[&str] = &[
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "TERM",
        "RUST_LOG",
        "RUST_BACKTRACE",
    ];
    let vars: Vec<(String, String)> = vars.into_iter().collect();
    let opted_in = |what: &str| {
        vars.iter()
            .filter(|(k, _)| k == ENV_SANDBOX_INHERIT)
            .any(|(_, v)| v.split(',').any(|item| item.trim() == what))
    };
    let (identity, headers) = (opted_in("tls_client_identity"), opted_in("otlp_headers"));
    let otel = |k: &str| {
        let client_identity = k.ends_with("_CLIENT_KEY") || k.ends_with("_CLIENT_CERTIFICATE");
        k.starts_with("OTEL_")
            && k != "OTEL_SERVICE_NAME"
            && (identity || !client_identity)
            && (headers || !k.ends_with("_HEADERS"))
    };
    let mut env: Vec<(String, String)> = vars
        .iter()
        .filter(|(k, _)| KEEP.contains(&k.as_str()) || k.starts_with("LC_") || otel(k))
        .cloned()
        .collect();
    use runplane_grpc::tls::{ENV_CERT_FILE, ENV_KEY_FILE};
    env.extend(
        tls.into_iter()
            .filter(|(k, _)| identity || (k != ENV_CERT_FILE && k != ENV_KEY_FILE)),
    );
    env
}

/// The label a sandbox's shell carries as `$0`, by which its pid is recognised.
fn label(sandbox_id: &str) -> String {
    format!("runplane-sandbox-{sandbox_id}")
}

impl ProcessDriver {
    pub fn new(state_dir: impl Into<PathBuf>, runplane: impl Into<PathBuf>) -> Self {
        Self {
            state_dir: state_dir.into(),
            runplane: runplane.into(),
        }
    }

    fn dir(&self, sandbox_id: &str) -> PathBuf {
        self.state_dir.join(sandbox_id)
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
        std::fs::read_to_string(dir.join("exit"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Signals every process of the sandbox: its shell's process group and, when the shell
    /// leads a session of its own (setsid), every process group of that session, since the
    /// runner starts the agent in a group of its own.
    fn signal(sandbox: &sandbox::Model, signal: Signal) -> Result<(), DriverError> {
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

/// How long a destroyed sandbox gets between SIGTERM and SIGKILL.
pub const DESTROY_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// Whether `pid` names a process that has not exited (a zombie has, in all but name).
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let state = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .next()?
                .to_owned();
            Some(state != "Z" && state != "X")
        })
        .unwrap_or(false)
}

/// `(process group, pid)` of every live process in the session `sid` (a session's id is
/// its leader's pid).
fn session_members(sid: i32) -> Vec<(i32, i32)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // After the parenthesised command name: state, ppid, pgrp, session, …
            let mut fields = stat.rsplit_once(')')?.1.split_whitespace();
            let state = fields.next()?;
            let pgrp: i32 = fields.nth(1)?.parse().ok()?;
            let session: i32 = fields.next()?.parse().ok()?;
            (session == sid && state != "Z" && state != "X").then_some((pgrp, pid))
        })
        .collect()
}

/// Live processes of the session `sid` that belong to the sandbox in `dir`: they carry
/// its directory in their environment (`RUNPLANE_SANDBOX_DIR`, which the agent inherits
/// from its runner), so a session id reused by something else is never hit.
fn orphans(sid: i32, dir: &Path) -> Vec<i32> {
    let mut marker = format!("RUNPLANE_SANDBOX_DIR={}", dir.display()).into_bytes();
    marker.push(0);
    session_members(sid)
        .into_iter()
        .map(|(_, pid)| pid)
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.windows(marker.len()).any(|w| w == marker.as_slice()))
        })
        .collect()
}

/// Stops what is left of a sandbox whose session leader died: SIGTERM (and SIGCONT, should
/// it be frozen), the grace, then SIGKILL.
async fn stop_orphans(sid: i32, dir: &Path) -> Result<(), DriverError> {
    let signal_all = |signal: Signal| {
        for pid in orphans(sid, dir) {
            let _ = nix::sys::signal::kill(Pid::from_raw(pid), signal);
        }
    };
    if orphans(sid, dir).is_empty() {
        return Ok(());
    }
    tracing::info!(sid, "stopping the processes its dead sandbox left behind");
    signal_all(Signal::SIGTERM);
    signal_all(Signal::SIGCONT);
    let deadline = tokio::time::Instant::now() + DESTROY_GRACE;
    while tokio::time::Instant::now() < deadline {
        if orphans(sid, dir).is_empty() {
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    signal_all(Signal::SIGKILL);
    for _ in 0..20 {
        if orphans(sid, dir).is_empty() {
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    Err(DriverError::Signal(format!(
        "processes of dead sandbox session {sid} still run after SIGKILL"
    )))
}

impl Driver for ProcessDriver {
    fn create(
        &self,
        sandbox: &sandbox::Model,
        launch: Launch,
    ) -> BoxFuture<'static, Result<String, DriverError>> {
        let dir = self.dir(&sandbox.id);
        let runplane = self.runplane.clone();
        let id = sandbox.id.clone();
        let existing = sandbox.driver_handle.clone();
        Box::pin(async move {
            // Idempotent: a sandbox whose process lives is adopted, not started twice.
            if let Some(pid) = Self::live_pid(&existing, &id) {
                return Ok(format!("pid:{pid}"));
            }
            if let Ok(pid) = std::fs::read_to_string(dir.join("pid")) {
                let handle = format!("pid:{}", pid.trim());
                if Self::live_pid(&handle, &id).is_some() {
                    return Ok(handle);
                }
            }
            std::fs::create_dir_all(&dir).map_err(|e| DriverError::Start(e.to_string()))?;
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
                .arg(r#""$RUNPLANE_BIN" runner; echo $? > "$RUNPLANE_SANDBOX_DIR/exit""#)
                .arg(label(&id))
                // Nothing of the control plane's environment (its token, database URLs,
                // signing key) reaches a sandbox: only what a runner needs, below.
                .env_clear()
                // The runner reads no config file: this includes the TLS client side it
                // reaches https:// with (its CA; a client identity only if opted in).
                .envs(sandbox_env())
                .env("RUNPLANE_BIN", &runplane)
                .env("RUNPLANE_SANDBOX_DIR", &dir)
                .env("RUNPLANE_ENDPOINT", &launch.endpoint)
                .env("RUNPLANE_RECOVERY_ENDPOINT", &launch.recovery_endpoint)
                .env("RUNPLANE_RUN_ID", &launch.run_id)
                .env("RUNPLANE_RUN_KEY", launch.run_key.expose())
                // The OpenTelemetry convention for handing a trace to a child process.
                .env("TRACEPARENT", &launch.traceparent)
                .stdin(Stdio::null())
                .stdout(log)
                .stderr(log_err)
                .kill_on_drop(false)
                .spawn()
                .map_err(|e| DriverError::Start(e.to_string()))?;
            let pid = child
                .id()
                .ok_or_else(|| DriverError::Start("the sandbox exited at once".into()))?;
            std::fs::write(dir.join("pid"), pid.to_string())
                .map_err(|e| DriverError::Start(e.to_string()))?;
            // Reap it when it ends, while this process lives; after a restart init does.
            tokio::spawn(async move {
                let _ = child.wait().await;
            });
            Ok(format!("pid:{pid}"))
        })
    }

    fn status(&self, sandbox: &sandbox::Model) -> BoxFuture<'static, Probe> {
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

    fn suspend(&self, sandbox: &sandbox::Model) -> BoxFuture<'static, Result<(), DriverError>> {
        let result = Self::signal(sandbox, Signal::SIGSTOP);
        Box::pin(async move { result })
    }

    fn resume(&self, sandbox: &sandbox::Model) -> BoxFuture<'static, Result<(), DriverError>> {
        let result = Self::signal(sandbox, Signal::SIGCONT);
        Box::pin(async move { result })
    }

    /// SIGTERM then SIGCONT to the whole sandbox (a suspended one is stopped, and a
    /// stopped process only acts on SIGTERM once continued), then SIGKILL to whatever of
    /// its session is left after [`DESTROY_GRACE`]. Done when nothing of it is left.
    fn destroy(&self, sandbox: &sandbox::Model) -> BoxFuture<'static, Result<(), DriverError>> {
        let leader = Self::live_pid(&sandbox.driver_handle, &sandbox.id);
        let recorded: Option<i32> = sandbox
            .driver_handle
            .strip_prefix("pid:")
            .and_then(|p| p.parse().ok());
        let dir = self.dir(&sandbox.id);
        Box::pin(async move {
            let Some(leader) = leader else {
                // The shell and runner are gone (never started, a crash, an OOM kill), but
                // what they started may live on in their session: stop those too.
                return match recorded {
                    Some(sid) => stop_orphans(sid, &dir).await,
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
        })
    }
}
