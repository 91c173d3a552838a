//! `[sandbox_reconciler]`: the reconciler's database, route tokens, tick and how its
//! process driver contains agents.

use serde::Deserialize;

use crate::checks::in_range;
use crate::error::ConfigError;
use crate::secret::Secret;
use crate::server::default_endpoint;

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SandboxReconcilerConfig {
    pub database_url: String,
    pub endpoint: String,
    /// How long a sandbox must stay exited or lost before its run is failed.
    pub loss_grace_seconds: u32,
    /// How long the record of a deleted sandbox whose stop was acknowledged, a settled
    /// wake and a delivered outbox row are kept, in seconds (10 at least); then a round
    /// deletes them in bounded batches.
    pub ended_sandbox_retention_seconds: u32,
    /// Key that signs route tokens. Empty: one derived from `auth.service_token`. Node
    /// agents never see it, only a key derived from it for their own node id.
    pub route_token_key: Secret,
    /// Lifetime of a route token.
    pub route_token_ttl_seconds: u32,
    /// Where the process driver keeps each local sandbox's pid, exit status and log.
    pub state_dir: String,
    /// How often dispatch, the reconcile tick and outbox delivery run, in milliseconds.
    pub tick_interval_ms: u32,
    /// Idle time after which a node agent suspends a sandbox (0: never).
    pub idle_timeout_seconds: u32,
    /// Give queued runs sandboxes. Off for a reconciler that only serves routes and
    /// nodes, or to drive a run's runner protocol by hand.
    pub dispatch: bool,
    /// Run sandboxes as local processes of this reconciler when no node agent is ready
    /// (single-machine mode). Turn it off when several reconciler replicas run: local
    /// sandboxes live in one replica's process tree, which the others cannot probe or
    /// signal; queued runs then wait for a node agent (`runplane node`).
    pub local_sandboxes: bool,
    /// Let `runplane serve` run a reconciler with local sandboxes although the process
    /// holds control-plane secrets (the service token, its database URL, the operator
    /// token or its digest): an agent that escapes its containment reaches them. Off,
    /// such a reconciler refuses to start; run agents on node agents instead
    /// (`local_sandboxes = false`). `runplane dev` runs everything in one process and
    /// says so; it is for trying runplane, not for strangers' agents.
    pub local_sandboxes_beside_secrets: bool,
    /// What a sandbox is: `process` (the default: the agent as a host process under
    /// `isolation`) or `container` (the agent in a container of
    /// `[sandbox_reconciler.container]`'s image, through the Docker Engine API).
    pub driver: DriverKind,
    /// The container driver's engine and image.
    pub container: ContainerConfig,
    /// How the process driver (here and on `runplane node`) contains an agent. `bwrap`,
    /// the default, refuses to start where bubblewrap cannot create namespaces; `none`
    /// must be chosen explicitly.
    pub isolation: Isolation,
    /// A contained agent's network: `outbound` (the default: out to the world, never to
    /// the host or the control plane), `none` (loopback only) or `host` (the host's own,
    /// loopback included: an explicit choice, logged at start).
    pub network: SandboxNetwork,
    /// The uids sandboxes run as when the driver runs as root: each live sandbox gets its
    /// own from `[sandbox_uid_base, sandbox_uid_base + sandbox_uid_count)`.
    pub sandbox_uid_base: u32,
    pub sandbox_uid_count: u32,
    /// What each sandbox may use when its profile says nothing (`[sandbox_reconciler.limits]`).
    pub limits: SandboxLimits,
    /// Limits this host may leave unenforced (`"cpu"`, `"memory"`, `"pids"`, `"disk"`).
    /// Empty, the default: a driver that cannot enforce one refuses to start, naming it.
    pub unenforced_limits: Vec<Limit>,
}

/// What one sandbox may use: CPU, memory, processes and workspace disk.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SandboxLimits {
    /// CPUs' worth of time per period, as `docker run --cpus` takes it (1.5: one and a half).
    pub cpus: f64,
    /// Memory, swap included; an agent past it is killed and its run ends `out_of_memory`.
    pub memory_mib: u64,
    /// Processes and threads at once.
    pub pids: u32,
    /// The workspace's size.
    pub disk_mib: u64,
}

impl Default for SandboxLimits {
    fn default() -> Self {
        Self {
            cpus: 2.0,
            memory_mib: 4096,
            pids: 512,
            disk_mib: 10 * 1024,
        }
    }
}

/// The bounds every limit is checked against, wherever it is set.
pub const LIMIT_CPUS: std::ops::RangeInclusive<f64> = 0.01..=1024.0;
pub const LIMIT_MEMORY_MIB: std::ops::RangeInclusive<u64> = 16..=(1 << 30);
pub const LIMIT_PIDS: std::ops::RangeInclusive<u32> = 1..=4_194_304;
pub const LIMIT_DISK_MIB: std::ops::RangeInclusive<u64> = 16..=(1 << 30);

impl SandboxLimits {
    /// Checks every limit against its bounds, naming `field.<limit>` when one is out.
    pub fn validate(&self, field: &str) -> Result<(), ConfigError> {
        in_range(format!("{field}.cpus"), self.cpus, LIMIT_CPUS)?;
        in_range(
            format!("{field}.memory_mib"),
            self.memory_mib,
            LIMIT_MEMORY_MIB,
        )?;
        in_range(format!("{field}.pids"), self.pids, LIMIT_PIDS)?;
        in_range(format!("{field}.disk_mib"), self.disk_mib, LIMIT_DISK_MIB)?;
        Ok(())
    }
}

/// One kind of limit, as `unenforced_limits` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Limit {
    Cpu,
    Memory,
    Pids,
    Disk,
}

impl Limit {
    pub const ALL: [Limit; 4] = [Limit::Cpu, Limit::Memory, Limit::Pids, Limit::Disk];

    pub fn as_str(self) -> &'static str {
        match self {
            Limit::Cpu => "cpu",
            Limit::Memory => "memory",
            Limit::Pids => "pids",
            Limit::Disk => "disk",
        }
    }
}

impl std::fmt::Display for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `sandbox_reconciler.driver`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DriverKind {
    #[default]
    Process,
    Container,
}

/// `[sandbox_reconciler.container]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ContainerConfig {
    /// The Docker Engine API: `unix:///path` (Docker's or Podman's socket) or
    /// `http://host:port`.
    pub engine: String,
    /// The image every sandbox's container is made from.
    pub image: String,
    /// `never` (the image must be on the engine), `if_missing` or `always`.
    pub pull: PullPolicy,
    /// How many started containers of the image each driver keeps ready, so a sandbox
    /// with the default limits starts in one of them (0: none, every sandbox makes its
    /// own container).
    pub warm: u32,
    /// The static program a warm container waits in until a sandbox takes it, bound in
    /// from this host (its pause mode, `-P`: catatonit's). Empty: catatonit where this
    /// host has it, else no warm pool.
    pub holder: String,
}

impl Default for ContainerConfig {
    fn default() -> Self {
        Self {
            engine: "unix:///var/run/docker.sock".to_owned(),
            image: String::new(),
            pull: PullPolicy::IfMissing,
            warm: 2,
            holder: String::new(),
        }
    }
}

/// `sandbox_reconciler.container.pull`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PullPolicy {
    Never,
    #[default]
    IfMissing,
    Always,
}

impl PullPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            PullPolicy::Never => "never",
            PullPolicy::IfMissing => "if_missing",
            PullPolicy::Always => "always",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "never" => Some(PullPolicy::Never),
            "if_missing" => Some(PullPolicy::IfMissing),
            "always" => Some(PullPolicy::Always),
            _ => None,
        }
    }
}

/// `sandbox_reconciler.isolation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Isolation {
    /// Each agent under bubblewrap: its own pid, mount, ipc and uts namespaces, the system
    /// read-only, its workspace writable, an unprivileged uid, no new privileges.
    #[default]
    Bwrap,
    /// The agent runs as the driver's user, in its namespaces, seeing what it sees.
    None,
}

/// `sandbox_reconciler.network`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxNetwork {
    /// A network namespace of the sandbox's own with user-mode networking (slirp4netns):
    /// outbound connections work; the host's loopback, the host's own addresses and the
    /// control plane's are refused.
    #[default]
    Outbound,
    /// The host's network, loopback included: an agent reaches whatever the host does.
    Host,
    /// Loopback only.
    None,
}

impl Default for SandboxReconcilerConfig {
    fn default() -> Self {
        Self {
            database_url: "postgres://postgres@127.0.0.1:5432/runplane_sandbox_reconciler"
                .to_owned(),
            endpoint: default_endpoint(),
            loss_grace_seconds: 90,
            ended_sandbox_retention_seconds: 86_400,
            route_token_key: Secret::default(),
            route_token_ttl_seconds: 60,
            state_dir: ".runplane/sandboxes".to_owned(),
            tick_interval_ms: 2000,
            idle_timeout_seconds: 0,
            dispatch: true,
            local_sandboxes: true,
            local_sandboxes_beside_secrets: false,
            driver: DriverKind::Process,
            container: ContainerConfig::default(),
            isolation: Isolation::Bwrap,
            network: SandboxNetwork::Outbound,
            sandbox_uid_base: 200_000,
            sandbox_uid_count: 65_536,
            limits: SandboxLimits::default(),
            unenforced_limits: Vec::new(),
        }
    }
}

impl SandboxReconcilerConfig {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        in_range(
            "sandbox_reconciler.loss_grace_seconds",
            self.loss_grace_seconds,
            1..=3600,
        )?;
        in_range(
            "sandbox_reconciler.ended_sandbox_retention_seconds",
            self.ended_sandbox_retention_seconds,
            10..=u32::MAX,
        )?;
        if self.sandbox_uid_base < 1000
            || self.sandbox_uid_count == 0
            || self
                .sandbox_uid_base
                .checked_add(self.sandbox_uid_count)
                .is_none()
        {
            return Err(ConfigError::invalid(
                "sandbox_reconciler.sandbox_uid_base",
                "sandbox_uid_base must be at least 1000 and sandbox_uid_count at least 1, \
                 and the range must fit in a u32",
            ));
        }
        in_range(
            "sandbox_reconciler.tick_interval_ms",
            self.tick_interval_ms,
            100..=600_000,
        )?;
        in_range(
            "sandbox_reconciler.route_token_ttl_seconds",
            self.route_token_ttl_seconds,
            1..=3600,
        )?;
        self.limits.validate("sandbox_reconciler.limits")?;
        if self.driver == DriverKind::Container {
            if self.container.image.is_empty() {
                return Err(ConfigError::invalid(
                    "sandbox_reconciler.container.image",
                    "the container driver needs an image (runplane dev: --image IMAGE)",
                ));
            }
            if !crate::checks::is_image_reference(&self.container.image) {
                return Err(ConfigError::invalid(
                    "sandbox_reconciler.container.image",
                    format!(
                        "`{}` is not an image reference ([registry/]name[:tag][@digest])",
                        self.container.image
                    ),
                ));
            }
            in_range(
                "sandbox_reconciler.container.warm",
                self.container.warm,
                0..=64,
            )?;
            if self.container.engine.is_empty() {
                return Err(ConfigError::invalid(
                    "sandbox_reconciler.container.engine",
                    "the container driver needs the engine's address (unix:///path or http://host:port)",
                ));
            }
        }
        Ok(())
    }
}
