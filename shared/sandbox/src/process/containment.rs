//! How agents are contained: bubblewrap, and what of the host it shows an agent.

use std::path::Path;
use std::process::Stdio;

use runplane_config::{
    DriverKind, Isolation, PullPolicy, SandboxLimits, SandboxNetwork, SandboxReconcilerConfig,
};

use super::env::sandbox_env;
use super::limits::{Applied, Enforcer, LimitsUnavailable};
use crate::contract::{ENV_PARK, PARK_MARK, WORKSPACE};

/// How agents are contained: `sandbox_reconciler.isolation`, checked against the host.
///
/// bubblewrap rather than namespaces made here through `nix`: the same kernel features,
/// but bwrap is the small, audited setuid-free tool the Linux agent sandboxes (Flatpak,
/// and the coding agents' own sandboxes) already rely on; it gets the ordering right
/// (mounts before the pivot, `/proc` of the new pid namespace, a reaping pid 1,
/// `PR_SET_NO_NEW_PRIVS` always, death with its parent), and it keeps `unsafe` fork/exec
/// code out of this crate, which forbids `unsafe`.
#[derive(Debug, Clone, PartialEq)]
pub enum Containment {
    /// The agent runs as the driver's user with its runner (`isolation = "none"`).
    None,
    Bwrap {
        /// The agent's network, unless its profile takes it away.
        network: SandboxNetwork,
        /// The uid range sandboxes get one uid each from; `None` when the driver does not
        /// run as root and so cannot give a sandbox a uid of its own (the agent then runs
        /// as the driver's uid, in a user namespace, contained by the namespaces alone).
        uids: Option<(u32, u32)>,
        /// What every sandbox may use, and how this host holds it to that.
        limits: SandboxLimits,
        enforcer: Enforcer,
    },
    /// The agent in a container of `image` ([`crate::container`]); its runner stays on
    /// the host.
    Container {
        engine: String,
        image: String,
        pull: PullPolicy,
        network: SandboxNetwork,
        limits: SandboxLimits,
        /// The sandbox's cgroups (the container's parent) and its workspace image.
        enforcer: Enforcer,
        /// How many warm containers wait ([`crate::container::warm`]), and the holder
        /// they wait in; no holder, no warm pool.
        warm: u32,
        holder: Option<std::path::PathBuf>,
    },
}

/// Why the host cannot contain agents as configured.
#[derive(Debug, thiserror::Error)]
pub enum ContainmentError {
    #[error(transparent)]
    Isolation(#[from] IsolationUnavailable),
    #[error(transparent)]
    Limits(#[from] LimitsUnavailable),
    #[error(
        "sandbox driver: {0}; start the engine (Podman: podman system service), or set \
         sandbox_reconciler.driver = \"process\""
    )]
    Engine(String),
    #[error(
        "sandbox network: this host cannot give agents their own outbound network ({0}); \
         install slirp4netns and nftables and run as root, or set \
         sandbox_reconciler.network = \"none\" (loopback only) or \"host\" (the host's \
         network: agents reach its loopback, its databases and the control plane)"
    )]
    Network(String),
}

/// What network one sandbox's agent gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Net {
    /// The host's.
    Host,
    /// Loopback only (`--unshare-net`).
    None,
    /// Its own namespace, made by [`super::network::up`]; the agent is started in it, with
    /// `resolv_conf` as its resolver.
    Own {
        netns: std::path::PathBuf,
        resolv_conf: std::path::PathBuf,
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
    /// can give it, with every limit enforced or allowed to go without
    /// (`sandbox_reconciler.unenforced_limits`).
    pub async fn probe(config: &SandboxReconcilerConfig) -> Result<Self, ContainmentError> {
        if config.driver == DriverKind::Container {
            return Self::probe_container(config).await;
        }
        if config.isolation == Isolation::None {
            return Ok(Containment::None);
        }
        let uids = nix::unistd::geteuid()
            .is_root()
            .then_some((config.sandbox_uid_base, config.sandbox_uid_count));
        // bubblewrap first: without it, limits and a network are moot.
        let mut containment = Containment::Bwrap {
            network: config.network,
            uids,
            limits: config.limits,
            enforcer: Enforcer::default(),
        };
        containment.probe_sandbox().await?;
        let enforcer = Enforcer::probe(uids.is_some()).await;
        enforcer.require(&config.unenforced_limits)?;
        if config.network == SandboxNetwork::Outbound {
            super::network::probe()
                .await
                .map_err(ContainmentError::Network)?;
        }
        if config.network == SandboxNetwork::Host {
            tracing::warn!(
                "sandbox_reconciler.network = \"host\": agents share this host's network and \
                 reach its loopback, its databases and the control plane"
            );
        }
        if let Containment::Bwrap { enforcer: e, .. } = &mut containment {
            *e = enforcer;
        }
        Ok(containment)
    }

    /// The container containment, once its engine answered and has the image (as the pull
    /// policy allows), the workspace disk can be bounded and the network given.
    async fn probe_container(config: &SandboxReconcilerConfig) -> Result<Self, ContainmentError> {
        let c = &config.container;
        let docker = crate::container::connect(&c.engine)
            .await
            .map_err(ContainmentError::Engine)?;
        crate::container::ensure_image(&docker, &c.image, c.pull)
            .await
            .map_err(ContainmentError::Engine)?;
        // The sandbox's own cgroups hold the container (and count its OOM kills); the
        // engine bounds it too, and the workspace is an image of ours.
        let enforcer = Enforcer::probe(false).await.for_containers();
        enforcer.require(&config.unenforced_limits)?;
        if config.network == SandboxNetwork::Outbound {
            super::network::probe()
                .await
                .map_err(ContainmentError::Network)?;
            let version = docker
                .version()
                .await
                .map_err(|e| ContainmentError::Engine(e.to_string()))?;
            let podman = version
                .components
                .unwrap_or_default()
                .iter()
                .any(|component| component.name.to_lowercase().contains("podman"));
            if !podman {
                return Err(ContainmentError::Network(
                    "an outbound network of the sandbox's own joins the container by \
                     namespace path, which Podman's engine offers and Docker's does not"
                        .into(),
                ));
            }
        }
        let holder = match c.warm {
            0 => None,
            _ => {
                crate::container::warm::find_holder(&c.holder).map_err(ContainmentError::Engine)?
            }
        };
        Ok(Containment::Container {
            warm: c.warm,
            holder,
            engine: c.engine.clone(),
            image: c.image.clone(),
            pull: c.pull,
            network: config.network,
            limits: config.limits,
            enforcer,
        })
    }

    /// Runs a probe sandbox: `Ok` when bwrap made it and the agent wrote its workspace.
    async fn probe_sandbox(&self) -> Result<(), IsolationUnavailable> {
        let containment = self;
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
        let mut argv = containment.wrapper(&workspace, uid, &Net::None, &Default::default());
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
            Ok(_) => Ok(()),
        }
    }

    /// The limits of every sandbox and how they are held, when agents are contained.
    pub fn limits(&self) -> Option<(&SandboxLimits, &Enforcer)> {
        match self {
            Containment::Bwrap {
                limits, enforcer, ..
            }
            | Containment::Container {
                limits, enforcer, ..
            } => Some((limits, enforcer)),
            Containment::None => None,
        }
    }

    /// The network of agents (before a profile takes it away); `Host` uncontained.
    pub fn network(&self) -> SandboxNetwork {
        match self {
            Containment::Bwrap { network, .. } | Containment::Container { network, .. } => *network,
            Containment::None => SandboxNetwork::Host,
        }
    }

    pub(super) fn uid_range(&self) -> Option<(u32, u32)> {
        match self {
            Containment::Bwrap { uids, .. } => *uids,
            Containment::None | Containment::Container { .. } => None,
        }
    }

    /// One line for `runplane dev`'s banner and the logs: what an agent gets.
    pub fn describe(&self) -> String {
        match self {
            Containment::Container {
                engine,
                image,
                pull,
                network,
                limits,
                enforcer,
                warm,
                holder,
            } => format!(
                "container: image {image} (pull {}) on the engine at {engine}, the runner \
                 on the host, {}; limits: {}; warm pool: {}",
                pull.as_str(),
                network_phrase(*network),
                enforcer.describe(limits),
                match (warm, holder) {
                    (0, _) => "off (sandbox_reconciler.container.warm = 0)".to_owned(),
                    (warm, Some(holder)) => format!("{warm} waiting in {}", holder.display()),
                    (_, None) => "off (no static holder on this host: put runplane-holder \
                                  beside runplane, or install catatonit)"
                        .to_owned(),
                },
            ),
            Containment::None => "none: agents run as this user and see what it sees \
                                  (sandbox_reconciler.isolation = \"none\")"
                .to_owned(),
            Containment::Bwrap {
                network,
                uids,
                limits,
                enforcer,
            } => format!(
                "bwrap: own pid, mount, ipc and uts namespaces, system read-only, \
                 {WORKSPACE} writable, {}, {}; limits: {}",
                match uids {
                    Some((base, count)) => {
                        format!("a uid of its own from {base}..{}", base + (count - 1))
                    }
                    None => "this user's uid (not root: no uid of its own)".to_owned(),
                },
                network_phrase(*network),
                enforcer.describe(limits),
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
    pub fn wrapper(
        &self,
        workspace: &Path,
        uid: Option<u32>,
        net: &Net,
        applied: &Applied,
    ) -> Vec<String> {
        let Containment::Bwrap { .. } = self else {
            return Vec::new();
        };
        // The shell joins the sandbox's cgroups before it becomes bwrap, so the agent and
        // all it starts are counted there, and never the runner.
        let joins: String = applied
            .join
            .iter()
            .map(|procs| {
                format!(
                    "echo $$ > '{}' || {{ echo 'runplane: could not join the sandbox cgroup {}' >&2; exit 125; }}; ",
                    procs.display(),
                    procs.display()
                )
            })
            .collect();
        let mut argv: Vec<String> = vec![
            "sh".to_owned(),
            "-c".to_owned(),
            format!(r#"trap "" INT TERM HUP QUIT; {joins}exec "$0" "$@""#),
        ];
        // Into the sandbox's own network namespace (as the runner's user, root) before
        // bwrap makes the others.
        if let Net::Own { netns, .. } = net {
            argv.extend([
                "nsenter".to_owned(),
                format!("--net={}", netns.display()),
                "--".to_owned(),
            ]);
        }
        argv.extend(
            [
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
            .map(str::to_owned),
        );
        if uid.is_none() {
            argv.push("--unshare-user".into());
        }
        if *net == Net::None {
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
        // bwrap makes the directories above a bound file 0700, root's: /etc must be
        // readable, or an agent with a uid of its own resolves no name and trusts no
        // server.
        argv.extend([
            "--perms".into(),
            "0755".into(),
            "--dir".into(),
            "/etc".into(),
        ]);
        for etc in ETC {
            let path = format!("/etc/{etc}");
            argv.extend(["--ro-bind-try".into(), path.clone(), path]);
        }
        if let Net::Own { resolv_conf, .. } = net {
            argv.extend([
                "--ro-bind".into(),
                resolv_conf.display().to_string(),
                "/etc/resolv.conf".into(),
            ]);
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
            // Processes also by the sandbox's own uid: the kernel counts them at fork, so
            // the bound holds even where the pids cgroup is missing.
            if let Some(nproc) = applied.nproc {
                argv.extend([
                    "prlimit".to_owned(),
                    format!("--nproc={nproc}:{nproc}"),
                    "--".to_owned(),
                ]);
            }
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

fn network_phrase(network: SandboxNetwork) -> &'static str {
    match network {
        SandboxNetwork::Outbound => {
            "outbound network (its own namespace through slirp4netns; the host and the \
             control plane refused)"
        }
        SandboxNetwork::None => "no network (loopback only)",
        SandboxNetwork::Host => "the HOST's network (its loopback included)",
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
