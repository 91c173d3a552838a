//! How agents are contained: bubblewrap, and what of the host it shows an agent.

use std::path::Path;
use std::process::Stdio;

use runplane_config::{Isolation, SandboxNetwork, SandboxReconcilerConfig};

use super::env::sandbox_env;
use crate::contract::{ENV_PARK, PARK_MARK, WORKSPACE};

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

    pub(super) fn uid_range(&self) -> Option<(u32, u32)> {
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
            ENV_PARK.into(),
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
