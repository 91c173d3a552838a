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

use std::path::{Path, PathBuf};
use std::process::Stdio;

use futures::future::BoxFuture;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use runplane_config::{Isolation, SandboxNetwork, SandboxReconcilerConfig};

use super::{Driver, DriverError, Launch};
use crate::domain::loss::Probe;
use crate::domain::sandbox::SandboxSpec;

#[derive(Debug, Clone)]
pub struct ProcessDriver {
    /// Where each sandbox keeps its pid, exit status and logs.
    state_dir: PathBuf,
    /// The `runplane` binary the runner runs from.
    runplane: PathBuf,
    /// How the runner contains its agent.
    containment: Containment,
}

/// The variable that hands the runner the wrapper its agent command runs under: the
/// arguments put before the command, one a line (`runplane_runner::ENV_AGENT_WRAPPER`);
/// empty for none.
pub const ENV_AGENT_WRAPPER: &str = "RUNPLANE_AGENT_WRAPPER";

/// Where a contained agent's workspace appears, and its home.
pub const WORKSPACE: &str = "/workspace";

/// The park mark: a file an agent creates in its workspace (`$RUNPLANE_PARK`,
/// `/workspace/.runplane-park`) to say it is waiting for input however it waits (an
/// event loop polling its stdin, say, which the syscall rule counts as working), and
/// removes when it resumes work. The runner removes it before it writes a steer, so input
/// always ends a park. Only the agent can hurt itself by it: a false park freezes its own
/// sandbox until something is sent to it or a session attaches.
pub const PARK_MARK: &str = ".runplane-park";

/// How agents are contained: `sandbox_reconciler.isolation`, checked against the host.
///
/// bubblewrap rather than namespaces made here through `nix`: the same kernel features,
/// but bwrap is the small, audited setuid-free tool the Linux agent sandboxes (Flatpak,
/// and the coding agents' own sandboxes) already rely on; it gets the ordering right
/// (mounts before the pivot, `/proc` of the new pid namespace, a reaping pid 1,
/// `PR_SET_NO_NEW_PRIVS` always, death with its parent), and it keeps `unsafe` fork/exec
/// code out of this crate, which forbids `unsafe`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Containment {
    /// The agent runs as the driver's user with its runner (`isolation = "none"`).
    None,
    Bwrap {
        /// `--unshare-net`: no network at all.
        no_network: bool,
        /// The uid range sandboxes get one uid each from; `None` when the driver does not
        /// run as root and so cannot give a sandbox a uid of its own (the agent then runs
        /// as the driver's uid, in a user namespace, contained by the namespaces alone).
        uids: Option<(u32, u32)>,
    },
}

/// The host cannot contain agents as configured.
#[derive(Debug, thiserror::Error)]
#[error(
    "sandbox isolation: bubblewrap cannot contain agents on this host ({0}); install \
     bubblewrap (Debian: apt-get install bubblewrap) and allow it to create namespaces, or \
     set sandbox_reconciler.isolation = \"none\" to run agents uncontained"
)]
pub struct IsolationUnavailable(pub String);

impl Containment {
    /// The containment `config` asks for, once a probe sandbox has shown that this host
    /// can give it.
    pub async fn probe(config: &SandboxReconcilerConfig) -> Result<Self, IsolationUnavailable> {
        let containment = match config.isolation {
            Isolation::None => return Ok(Containment::None),
            Isolation::Bwrap => Containment::Bwrap {
                no_network: config.network == SandboxNetwork::None,
                uids: nix::unistd::geteuid()
                    .is_root()
                    .then_some((config.sandbox_uid_base, config.sandbox_uid_count)),
            },
        };
        let workspace = std::env::temp_dir().join(format!(
            "runplane-isolation-probe-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir(&workspace)
            .map_err(|e| IsolationUnavailable(format!("creating a probe workspace: {e}")))?;
        let uid = containment.uid_range().map(|(base, _)| base);
        if let Some(uid) = uid {
            let _ = std::os::unix::fs::chown(&workspace, Some(uid), Some(uid));
        }
        let mut argv = containment.wrapper(&workspace, uid, false);
        argv.extend(["sh".into(), "-c".into(), format!("touch {WORKSPACE}/probe")]);
        let probed = tokio::process::Command::new(&argv[0])
            .args(&argv[1..])
            // The environment a runner gets, so the probe finds bwrap where a launch does.
            .env_clear()
            .envs(sandbox_env())
            .stdin(Stdio::null())
            .output()
            .await;
        let wrote = workspace.join("probe").exists();
        let _ = std::fs::remove_dir_all(&workspace);
        match probed {
            Err(e) => Err(IsolationUnavailable(format!("running bwrap: {e}"))),
            Ok(out) if !out.status.success() || !wrote => Err(IsolationUnavailable(format!(
                "a probe sandbox failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ))),
            Ok(_) => Ok(containment),
        }
    }

    fn uid_range(&self) -> Option<(u32, u32)> {
        match self {
            Containment::Bwrap { uids, .. } => *uids,
            Containment::None => None,
        }
    }

    /// One line for `runplane dev`'s banner and the logs: what an agent gets.
    pub fn describe(&self) -> String {
        match self {
            Containment::None => "none: agents run as this user and see what it sees \
                                  (sandbox_reconciler.isolation = \"none\")"
                .to_owned(),
            Containment::Bwrap { no_network, uids } => format!(
                "bwrap: own pid, mount, ipc and uts namespaces, system read-only, \
                 {WORKSPACE} writable, {}, {}",
                match uids {
                    Some((base, count)) => {
                        format!("a uid of its own from {base}..{}", base + (count - 1))
                    }
                    None => "this user's uid (not root: no uid of its own)".to_owned(),
                },
                if *no_network {
                    "no network"
                } else {
                    "host network"
                }
            ),
        }
    }

    /// The argv the agent's command is appended to, for a sandbox whose workspace is
    /// `workspace` and whose uid is `uid` (root only); empty for no containment.
    ///
    /// - `sh -c 'trap "" INT TERM HUP QUIT; exec …'`: the runner signals the agent's
    ///   process group, which holds bwrap's outer process too; were it killed by SIGINT
    ///   it would take the sandbox down (`--die-with-parent`) before the agent could
    ///   handle the signal, and report 130 for an agent that exited 3. Ignored, it waits
    ///   for the agent, and `env --default-signal` gives the agent the default handling
    ///   back. SIGKILL still kills it, and with it the whole sandbox.
    /// - `--die-with-parent`: bwrap's parent is the runner, not the control plane (the
    ///   sandbox's shell and runner outlive `runplane dev` and are re-adopted by pid), and
    ///   an agent whose runner died has nobody to read it or stop it.
    /// - No `--new-session`: the agent stays in the sandbox's session, which suspend and
    ///   destroy signal group by group; that session is already detached from any
    ///   terminal (setsid) and stdin is /dev/null.
    /// - As root, bwrap makes the namespaces without a user namespace and `setpriv`
    ///   then drops to the sandbox's own host uid with no capabilities, so the agent is an
    ///   unprivileged user of the host, not root of a user namespace (whose files would be
    ///   root's). Not as root, `--unshare-user` keeps the driver's uid.
    pub fn wrapper(&self, workspace: &Path, uid: Option<u32>, offline: bool) -> Vec<String> {
        let Containment::Bwrap { no_network, .. } = self else {
            return Vec::new();
        };
        // The deployment's network, unless the sandbox's profile takes it away.
        let no_network = *no_network || offline;
        let mut argv: Vec<String> = [
            "sh",
            "-c",
            r#"trap "" INT TERM HUP QUIT; exec "$0" "$@""#,
            "bwrap",
            "--die-with-parent",
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--hostname",
            "runplane-sandbox",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            // Private and, like the host's, writable by everyone (sticky): the agent's uid
            // is not the one that mounts them.
            "--perms",
            "1777",
            "--tmpfs",
            "/tmp",
            "--perms",
            "1777",
            "--tmpfs",
            "/var/tmp",
            "--perms",
            "1777",
            "--tmpfs",
            "/dev/shm",
            "--ro-bind",
            "/usr",
            "/usr",
            "--ro-bind-try",
            "/opt",
            "/opt",
        ]
        .map(str::to_owned)
        .into();
        if uid.is_none() {
            argv.push("--unshare-user".into());
        }
        if no_network {
            argv.push("--unshare-net".into());
        }
        // Merged-/usr systems link these into /usr; older ones have them as directories.
        for top in ["bin", "sbin", "lib", "lib32", "lib64", "libx32"] {
            let host = Path::new("/").join(top);
            match std::fs::read_link(&host) {
                Ok(target) => argv.extend([
                    "--symlink".into(),
                    target.display().to_string(),
                    host.display().to_string(),
                ]),
                Err(_) if host.is_dir() => argv.extend([
                    "--ro-bind".into(),
                    host.display().to_string(),
                    host.display().to_string(),
                ]),
                Err(_) => {}
            }
        }
        // Of /etc only what programs need to run, resolve names and trust servers: the
        // rest may hold the host's own credentials (a deployment's TLS keys, for one).
        for etc in ETC {
            let path = format!("/etc/{etc}");
            argv.extend(["--ro-bind-try".into(), path.clone(), path]);
        }
        argv.extend([
            "--ro-bind-try".into(),
            "/run/systemd/resolve".into(),
            "/run/systemd/resolve".into(),
            "--bind".into(),
            workspace.display().to_string(),
            WORKSPACE.into(),
            "--chdir".into(),
            WORKSPACE.into(),
            "--setenv".into(),
            "HOME".into(),
            WORKSPACE.into(),
            "--setenv".into(),
            "TMPDIR".into(),
            "/tmp".into(),
            "--setenv".into(),
            "RUNPLANE_PARK".into(),
            format!("{WORKSPACE}/{PARK_MARK}"),
            "--".into(),
            "env".into(),
            "--default-signal=INT,TERM,HUP,QUIT".into(),
        ]);
        if let Some(uid) = uid {
            argv.extend([
                "setpriv".to_owned(),
                format!("--reuid={uid}"),
                format!("--regid={uid}"),
                "--clear-groups".into(),
                "--inh-caps=-all".into(),
                "--bounding-set=-all".into(),
                "--".into(),
            ]);
        }
        argv
    }
}

/// What of /etc a contained agent sees (each only where the host has it).
const ETC: &[&str] = &[
    "passwd",
    "group",
    "hosts",
    "host.conf",
    "resolv.conf",
    "nsswitch.conf",
    "gai.conf",
    "protocols",
    "services",
    "localtime",
    "timezone",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "alternatives",
    "ssl",
    "ca-certificates",
    "ca-certificates.conf",
    "pki",
    "mime.types",
    "os-release",
    "debian_version",
    "profile",
    "bash.bashrc",
    "inputrc",
    "gitconfig",
];

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
    /// A driver whose agents run uncontained; see [`ProcessDriver::contained`].
    pub fn new(state_dir: impl Into<PathBuf>, runplane: impl Into<PathBuf>) -> Self {
        Self {
            state_dir: state_dir.into(),
            runplane: runplane.into(),
            containment: Containment::None,
        }
    }

    /// This driver with its agents contained as [`Containment::probe`] found possible.
    pub fn contained(mut self, containment: Containment) -> Self {
        self.containment = containment;
        self
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
            .filter(|other| !other.join("exit").exists())
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

    /// The workspace of the sandbox in `dir`, made writable by its agent, and the
    /// wrapper its runner starts the agent under.
    fn prepare_agent(
        &self,
        dir: &Path,
        id: &str,
        offline: bool,
    ) -> Result<Vec<String>, DriverError> {
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
            return Ok(Vec::new());
        }
        let start = |e: std::io::Error| DriverError::Start(e.to_string());
        let workspace = dir.join("workspace");
        std::fs::create_dir_all(&workspace).map_err(start)?;
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
        let wrapper = self.containment.wrapper(&workspace, uid, offline);
        if wrapper.iter().any(|arg| arg.contains('\n')) {
            return Err(DriverError::Start(format!(
                "the sandbox path {} holds a line break",
                workspace.display()
            )));
        }
        Ok(wrapper)
    }

    fn dir(&self, sandbox_id: &str) -> PathBuf {
        self.state_dir.join(sandbox_id)
    }

    /// Whether `sandbox`'s agent is parked: waiting for input (blocked reading its stdin,
    /// or saying so with its [`PARK_MARK`]), with its runner holding no steering it has
    /// yet to write. See [`agent_waits_for_input`] and [`RunnerPolls`].
    pub fn parked(&self, sandbox: &SandboxSpec) -> bool {
        let Some(leader) = Self::live_pid(&sandbox.driver_handle, &sandbox.id) else {
            return false;
        };
        let pending = self.runner_polls(sandbox).is_none_or(|p| p.pending > 0);
        !pending && (self.park_marked(sandbox) || agent_waits_for_input(leader))
    }

    /// Whether the agent left its [`PARK_MARK`]: a plain file (a link the agent made
    /// there is not followed, and counts as no mark).
    fn park_marked(&self, sandbox: &SandboxSpec) -> bool {
        std::fs::symlink_metadata(self.dir(&sandbox.id).join("workspace").join(PARK_MARK))
            .is_ok_and(|m| m.file_type().is_file())
    }

    /// What `sandbox`'s runner last said of its steering polls, None before its first.
    pub fn runner_polls(&self, sandbox: &SandboxSpec) -> Option<RunnerPolls> {
        RunnerPolls::parse(
            &std::fs::read_to_string(self.dir(&sandbox.id).join(STEERING_MARK)).ok()?,
        )
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

/// The file in a sandbox's directory its runner keeps its steering polls in
/// (`runplane_runner::STEERING_MARK`): `<answered polls> <messages not yet applied>`.
pub const STEERING_MARK: &str = "steering";

/// A runner's steering polls, as its [`STEERING_MARK`] says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunnerPolls {
    /// PollSteering answers it has had.
    pub answered: u64,
    /// Messages it was served and has not applied yet (a steer still to be written).
    pub pending: u64,
}

impl RunnerPolls {
    fn parse(mark: &str) -> Option<Self> {
        let mut fields = mark.split_whitespace().map(str::parse::<u64>);
        Some(Self {
            answered: fields.next()?.ok()?,
            pending: fields.next()?.ok()?,
        })
    }
}

/// Whether the agent of the sandbox whose session `leader` leads is waiting for input:
/// every thread of every process of its tree is blocked either reading its stdin (the
/// pipe its runner writes steering to) or waiting for a child, and at least one reads.
///
/// Why the syscall each thread is blocked in (`/proc/<pid>/task/<tid>/syscall`) rather
/// than silence or `wchan`: an agent that thinks, waits on a model call (a socket read,
/// `poll`, `epoll_wait`) or sleeps is working, and only the syscall and its fd tell a read
/// of stdin from those; `wchan` says "a pipe read" without saying which pipe. Anything
/// unreadable or unknown counts as working, so the rule errs towards never freezing an
/// agent mid-work: an agent that waits for input some other way (an event loop polling
/// its stdin) is suspended only when it says so with its [`PARK_MARK`]. The agent runs in bubblewrap's pid namespace, but
/// its processes stay in the sandbox's session, so they are found from the host by
/// session, with host pids: the agent's tree is every process of the session outside the
/// leader's process group (the sandbox's shell and its runner), less bubblewrap's own
/// monitor and pid 1, which only wait.
pub fn agent_waits_for_input(leader: i32) -> bool {
    let agent: Vec<(i32, i32)> = session_members(leader)
        .into_iter()
        .filter(|(pgrp, _)| *pgrp != leader)
        .collect();
    // The agent's group leader (bwrap, or the agent itself) holds the runner's pipe as
    // its stdin.
    let Some(stdin) = agent
        .iter()
        .find(|(pgrp, pid)| pgrp == pid)
        .and_then(|(_, pid)| stdin_of(*pid))
    else {
        return false;
    };
    let mut reading = false;
    for (_, pid) in agent {
        if is_bwrap(pid) {
            continue;
        }
        let Some(threads) = threads_of(pid) else {
            return false;
        };
        for tid in threads {
            match blocked_in(pid, tid) {
                Some(Blocked::ReadingStdin) if stdin_of(pid).as_ref() == Some(&stdin) => {
                    reading = true
                }
                Some(Blocked::WaitingForChild) => {}
                _ => return false,
            }
        }
    }
    reading
}

/// What a blocked thread waits for, of what [`agent_waits_for_input`] tells apart.
#[derive(Debug, PartialEq, Eq)]
enum Blocked {
    ReadingStdin,
    WaitingForChild,
    Other,
}

/// The syscall numbers of `read`, `wait4` and `waitid` on this architecture.
#[cfg(target_arch = "x86_64")]
const SYSCALLS: (u64, u64, u64) = (0, 61, 247);
#[cfg(target_arch = "aarch64")]
const SYSCALLS: (u64, u64, u64) = (63, 260, 95);
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const SYSCALLS: (u64, u64, u64) = (u64::MAX, u64::MAX, u64::MAX);

/// The syscall thread `tid` of `pid` is blocked in; None when it runs or is unreadable.
fn blocked_in(pid: i32, tid: i32) -> Option<Blocked> {
    let line = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/syscall")).ok()?;
    let mut fields = line.split_whitespace();
    // "running", or "-1 <sp> <pc>" for a thread blocked outside any syscall.
    let number: u64 = fields.next()?.parse().ok()?;
    let first_arg = u64::from_str_radix(fields.next()?.trim_start_matches("0x"), 16).ok()?;
    let (read, wait4, waitid) = SYSCALLS;
    Some(match number {
        n if n == read && first_arg == 0 => Blocked::ReadingStdin,
        n if n == wait4 || n == waitid => Blocked::WaitingForChild,
        _ => Blocked::Other,
    })
}

fn threads_of(pid: i32) -> Option<Vec<i32>> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    Some(
        tasks
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect(),
    )
}

/// What fd 0 of `pid` is (`pipe:[inode]` for a pipe).
fn stdin_of(pid: i32) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/fd/0")).ok()
}

fn is_bwrap(pid: i32) -> bool {
    std::fs::read_link(format!("/proc/{pid}/exe"))
        .is_ok_and(|exe| exe.file_name().is_some_and(|name| name == "bwrap"))
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
        sandbox: &SandboxSpec,
        launch: Launch,
    ) -> BoxFuture<'static, Result<String, DriverError>> {
        let dir = self.dir(&sandbox.id);
        let runplane = self.runplane.clone();
        let id = sandbox.id.clone();
        let existing = sandbox.driver_handle.clone();
        let offline = sandbox.network == "none";
        let this = self.clone();
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
            // A previous runner's polls say nothing about the one started now.
            let _ = std::fs::remove_file(dir.join(STEERING_MARK));
            let wrapper = this.prepare_agent(&dir, &id, offline)?;
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
                .env(ENV_AGENT_WRAPPER, wrapper.join("\n"))
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

    fn suspend(&self, sandbox: &SandboxSpec) -> BoxFuture<'static, Result<(), DriverError>> {
        let result = Self::signal(sandbox, Signal::SIGSTOP);
        Box::pin(async move { result })
    }

    fn resume(&self, sandbox: &SandboxSpec) -> BoxFuture<'static, Result<(), DriverError>> {
        let result = Self::signal(sandbox, Signal::SIGCONT);
        Box::pin(async move { result })
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

#[cfg(test)]
mod tests {
    use std::os::unix::process::CommandExt as _;
    use std::process::{Command, Stdio};

    use super::*;

    /// Whether `pid`'s main thread comes to be blocked in `expected` within 2 s (a process
    /// passes through other syscalls on its way to its first blocking one).
    fn settles_in(pid: i32, expected: Blocked) -> bool {
        (0..100).any(|_| {
            let blocked = blocked_in(pid, pid);
            std::thread::sleep(std::time::Duration::from_millis(20));
            blocked.as_ref() == Some(&expected)
        })
    }

    #[test]
    fn a_read_of_stdin_a_wait_for_a_child_and_a_sleep_are_told_apart() {
        let mut reading = Command::new("sh")
            .args(["-c", "read line"])
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        let mut waiting = Command::new("sh")
            .args(["-c", "sleep 30; true"])
            .stdin(Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap();
        let mut sleeping = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = |c: &std::process::Child| c.id() as i32;
        let blocked = [
            settles_in(pid(&reading), Blocked::ReadingStdin),
            settles_in(pid(&waiting), Blocked::WaitingForChild),
            // Settled in its sleep, it is never taken for either.
            settles_in(pid(&sleeping), Blocked::Other)
                && (0..5).all(|_| {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                    blocked_in(pid(&sleeping), pid(&sleeping)) == Some(Blocked::Other)
                }),
        ];
        // The waiting shell's sleep too.
        let _ = killpg(Pid::from_raw(waiting.id() as i32), Signal::SIGKILL);
        for child in [&mut reading, &mut waiting, &mut sleeping] {
            let _ = child.kill();
            let _ = child.wait();
        }
        assert_eq!(blocked, [true; 3], "reading, waiting, sleeping");
    }

    #[test]
    fn a_runners_steering_mark_is_read_whole_or_not_at_all() {
        assert_eq!(
            RunnerPolls::parse("3 1\n"),
            Some(RunnerPolls {
                answered: 3,
                pending: 1
            })
        );
        assert_eq!(RunnerPolls::parse("3"), None);
        assert_eq!(RunnerPolls::parse(""), None);
        assert_eq!(RunnerPolls::parse("x 0"), None);
    }
}
