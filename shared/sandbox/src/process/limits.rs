//! What the host bounds a process sandbox's agent to: CPU, memory and processes through
//! cgroups (v2, or v1's separate hierarchies), processes also through an rlimit on the
//! sandbox's own uid, and its workspace through a loop-mounted ext4 image of the limit's
//! size.
//!
//! Only the agent is bounded, not its runner: the wrapper's shell joins the sandbox's
//! cgroups before it becomes bubblewrap, so everything the agent starts is counted, and
//! the runner (trusted, and bounded by its own reading) is never the one the kernel's
//! OOM killer picks. The runner learns that its agent was killed at the memory limit
//! from the cgroup's `oom_kill` count, through [`contract::ENV_MEMORY_EVENTS`].
//!
//! [`contract::ENV_MEMORY_EVENTS`]: crate::contract::ENV_MEMORY_EVENTS

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use runplane_config::{Limit, SandboxLimits};

use super::tools::run;
use crate::driver::DriverError;

/// The directory under each cgroup hierarchy that holds one cgroup per sandbox.
const PARENT: &str = "runplane";
/// The workspace image in a sandbox's state directory.
const WORKSPACE_IMAGE: &str = "workspace.img";

/// How this host enforces limits, found once at start by [`Enforcer::probe`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Enforcer {
    cgroups: Option<Cgroups>,
    /// `RLIMIT_NPROC` on the sandbox's own uid (root only: otherwise the uid is shared).
    nproc: bool,
    /// A loop-mounted image per workspace (root, `mkfs.ext4` and `mount` only).
    disk: bool,
    /// Why each limit this host cannot enforce is not, for the start-up refusal.
    missing: BTreeMap<Limit, String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Cgroups {
    /// One unified hierarchy whose root offers the controllers.
    V2 { root: PathBuf },
    /// One hierarchy per controller, each where the host mounted it.
    V1 {
        cpu: Option<PathBuf>,
        memory: Option<PathBuf>,
        pids: Option<PathBuf>,
    },
}

/// What a sandbox's wrapper needs of its limits: the cgroups its shell joins and where
/// its runner reads the memory cgroup's OOM kills.
#[derive(Debug, Clone, Default)]
pub struct Applied {
    pub join: Vec<PathBuf>,
    pub memory_events: Option<PathBuf>,
    /// `RLIMIT_NPROC` for the agent's own uid, where that bound applies.
    pub nproc: Option<u32>,
}

/// A limit the host cannot enforce, named, with why.
#[derive(Debug, thiserror::Error)]
#[error(
    "sandbox limits: this host cannot enforce {}; run as root on a host with cgroups \
     (v1 or v2) and loop devices, or name them in \
     sandbox_reconciler.unenforced_limits to run sandboxes without them",
    describe_missing(.0)
)]
pub struct LimitsUnavailable(pub BTreeMap<Limit, String>);

/// `limit (why), …` for each limit in `missing`.
pub fn describe_missing(missing: &BTreeMap<Limit, String>) -> String {
    missing
        .iter()
        .map(|(limit, why)| format!("{limit} ({why})"))
        .collect::<Vec<_>>()
        .join(", ")
}

impl Enforcer {
    /// What this host can enforce, found by making (and removing) a probe cgroup and a
    /// probe workspace image. `own_uids` is whether sandboxes get a uid of their own.
    pub async fn probe(own_uids: bool) -> Self {
        let root = nix::unistd::geteuid().is_root();
        let mut missing = BTreeMap::new();
        let cgroups = Cgroups::find();
        let probe_id = format!("probe-{}", uuid::Uuid::new_v4().simple());
        let offered = match &cgroups {
            Some(c) => {
                let offered = c.offers(&probe_id);
                c.remove(&probe_id);
                offered
            }
            None => Vec::new(),
        };
        for limit in [Limit::Cpu, Limit::Memory, Limit::Pids] {
            if !offered.contains(&limit) {
                let why = match (&cgroups, root) {
                    (None, _) => "no cgroup hierarchy is mounted".to_owned(),
                    (Some(_), false) => "cgroups need root".to_owned(),
                    (Some(_), true) => format!("the {limit} cgroup controller is not writable"),
                };
                missing.insert(limit, why);
            }
        }
        let nproc = root && own_uids;
        let disk = match root {
            false => Err("a workspace image is mounted as root".to_owned()),
            true => probe_disk().await,
        };
        if let Err(why) = &disk {
            missing.insert(Limit::Disk, why.clone());
        }
        Self {
            cgroups: cgroups.filter(|_| !offered.is_empty()),
            nproc,
            disk: disk.is_ok(),
            missing,
        }
    }

    /// This enforcer for a container's sandbox: its cgroups become the container's
    /// parent (the engine makes the container's own under them), and no rlimit applies
    /// (the container's uids are the image's).
    pub fn for_containers(mut self) -> Self {
        self.nproc = false;
        self
    }

    /// The cgroup path (from each hierarchy's root) a sandbox's container is made
    /// under, when this host gives sandboxes cgroups of their own.
    pub fn cgroup_parent(&self, sandbox_id: &str) -> Option<String> {
        self.cgroups
            .as_ref()
            .map(|_| format!("/{PARENT}/{sandbox_id}"))
    }

    /// `Ok` when every limit is enforced or allowed to go without.
    pub fn require(&self, allowed: &[Limit]) -> Result<(), LimitsUnavailable> {
        let refused: BTreeMap<Limit, String> = self
            .missing
            .iter()
            .filter(|(limit, _)| !allowed.contains(limit))
            .map(|(l, why)| (*l, why.clone()))
            .collect();
        if refused.is_empty() {
            Ok(())
        } else {
            Err(LimitsUnavailable(refused))
        }
    }

    /// One phrase for the banner and the logs: what is enforced, and what is not.
    pub fn describe(&self, limits: &SandboxLimits) -> String {
        let mut enforced = Vec::new();
        if !self.missing.contains_key(&Limit::Cpu) {
            enforced.push(format!("{} cpus", limits.cpus));
        }
        if !self.missing.contains_key(&Limit::Memory) {
            enforced.push(format!("{} MiB memory", limits.memory_mib));
        }
        if !self.missing.contains_key(&Limit::Pids) {
            enforced.push(format!("{} processes", limits.pids));
        }
        if !self.missing.contains_key(&Limit::Disk) {
            enforced.push(format!("{} MiB workspace", limits.disk_mib));
        }
        let mut out = match enforced.is_empty() {
            true => "no limits".to_owned(),
            false => enforced.join(", "),
        };
        if !self.missing.is_empty() {
            out.push_str(&format!(
                "; NOT enforced: {}",
                describe_missing(&self.missing)
            ));
        }
        out
    }

    /// Makes `sandbox_id`'s cgroups with `limits` written, and says what its wrapper joins.
    pub fn apply(&self, sandbox_id: &str, limits: &SandboxLimits) -> Result<Applied, DriverError> {
        let mut applied = match &self.cgroups {
            Some(cgroups) => cgroups
                .make(sandbox_id, limits)
                .map_err(|e| DriverError::Start(format!("setting the sandbox's limits: {e}")))?,
            None => Applied::default(),
        };
        applied.nproc = self.nproc.then_some(limits.pids);
        Ok(applied)
    }

    /// Removes `sandbox_id`'s cgroups (once nothing runs in them) and unmounts its
    /// workspace image from `dir`. Safe to call for a sandbox that never had either.
    pub async fn release(&self, sandbox_id: &str, dir: &Path) {
        if let Some(cgroups) = &self.cgroups {
            cgroups.remove(sandbox_id);
        }
        if self.disk {
            unmount_workspace(dir).await;
        }
    }

    /// Mounts a workspace of `disk_mib` at `workspace`: an ext4 image in `dir`, made on
    /// first use and kept, so a sandbox started again finds its files. A mounted one is
    /// left as it is.
    pub async fn mount_workspace(
        &self,
        dir: &Path,
        workspace: &Path,
        disk_mib: u64,
    ) -> Result<(), DriverError> {
        if !self.disk || mounted(workspace) {
            return Ok(());
        }
        let image = dir.join(WORKSPACE_IMAGE);
        make_image(&image, disk_mib)
            .await
            .map_err(DriverError::Start)?;
        run(
            "mount",
            &[
                "-o".as_ref(),
                "loop,nosuid,nodev".as_ref(),
                image.as_os_str(),
                workspace.as_os_str(),
            ],
            None,
        )
        .await
        .map_err(|e| DriverError::Start(format!("mounting the sandbox's workspace: {e}")))?;
        // mkfs leaves lost+found, root's: nothing of the agent's.
        let _ = std::fs::remove_dir(workspace.join("lost+found"));
        Ok(())
    }
}

impl Cgroups {
    /// The hierarchies this host mounted, from `/proc/self/mountinfo`: v1's per-controller
    /// ones where they are (a hybrid host's unified tree then has no controllers), else
    /// the unified one.
    fn find() -> Option<Self> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
        let (mut cpu, mut memory, mut pids, mut unified) = (None, None, None, None);
        for line in mountinfo.lines() {
            let Some((left, right)) = line.split_once(" - ") else {
                continue;
            };
            let Some(mount_point) = left.split(' ').nth(4) else {
                continue;
            };
            let mut right = right.split(' ');
            let fstype = right.next().unwrap_or_default();
            let options = right.nth(1).unwrap_or_default();
            let path = PathBuf::from(mount_point);
            match fstype {
                "cgroup2" => unified = Some(path),
                "cgroup" => {
                    for option in options.split(',') {
                        match option {
                            "cpu" => cpu = Some(path.clone()),
                            "memory" => memory = Some(path.clone()),
                            "pids" => pids = Some(path.clone()),
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        if cpu.is_some() || memory.is_some() || pids.is_some() {
            return Some(Cgroups::V1 { cpu, memory, pids });
        }
        unified.map(|root| Cgroups::V2 { root })
    }

    /// The limits a probe cgroup named `id` took.
    fn offers(&self, id: &str) -> Vec<Limit> {
        let limits = SandboxLimits::default();
        let mut offered = Vec::new();
        match self {
            Cgroups::V2 { root } => {
                let _ = enable_v2(root);
                for (limit, file, value) in v2_files(&limits) {
                    let dir = root.join(PARENT).join(id);
                    if std::fs::create_dir_all(&dir).is_ok()
                        && std::fs::write(dir.join(file), value).is_ok()
                    {
                        offered.push(limit);
                    }
                }
            }
            Cgroups::V1 { .. } => {
                for (limit, root, files) in self.v1_files(&limits) {
                    let dir = root.join(PARENT).join(id);
                    if std::fs::create_dir_all(&dir).is_ok()
                        && files
                            .iter()
                            .all(|(file, value)| std::fs::write(dir.join(file), value).is_ok())
                    {
                        offered.push(limit);
                    }
                }
            }
        }
        offered
    }

    fn make(&self, id: &str, limits: &SandboxLimits) -> std::io::Result<Applied> {
        let mut applied = Applied::default();
        match self {
            Cgroups::V2 { root } => {
                enable_v2(root)?;
                let dir = root.join(PARENT).join(id);
                std::fs::create_dir_all(&dir)?;
                for (_, file, value) in v2_files(limits) {
                    if file == "memory.swap.max" && !dir.join(file).exists() {
                        continue; // a host without swap accounting has no swap to bound
                    }
                    std::fs::write(dir.join(file), value)?;
                }
                applied.memory_events = Some(dir.join("memory.events"));
                applied.join.push(dir.join("cgroup.procs"));
            }
            Cgroups::V1 { .. } => {
                for (limit, root, files) in self.v1_files(limits) {
                    let dir = root.join(PARENT).join(id);
                    std::fs::create_dir_all(&dir)?;
                    for (file, value) in files {
                        std::fs::write(dir.join(file), value)?;
                    }
                    if limit == Limit::Memory {
                        applied.memory_events = Some(dir.join("memory.oom_control"));
                    }
                    applied.join.push(dir.join("cgroup.procs"));
                }
            }
        }
        Ok(applied)
    }

    /// Removes the sandbox's cgroups; one that still holds a process stays (and a later
    /// release removes it).
    fn remove(&self, id: &str) {
        let roots: Vec<&PathBuf> = match self {
            Cgroups::V2 { root } => vec![root],
            Cgroups::V1 { cpu, memory, pids } => {
                [cpu, memory, pids].into_iter().flatten().collect()
            }
        };
        for root in roots {
            let _ = std::fs::remove_dir(root.join(PARENT).join(id));
        }
    }

    /// Per v1 controller: its limit, its hierarchy and the files that set it, in order
    /// (memory before memory+swap, which may not be below it).
    fn v1_files(&self, limits: &SandboxLimits) -> Vec<(Limit, PathBuf, Vec<LimitFile>)> {
        let Cgroups::V1 { cpu, memory, pids } = self else {
            return Vec::new();
        };
        let bytes = (limits.memory_mib << 20).to_string();
        let mut out = Vec::new();
        if let Some(root) = cpu {
            out.push((
                Limit::Cpu,
                root.clone(),
                vec![
                    ("cpu.cfs_period_us", CPU_PERIOD_US.to_string()),
                    ("cpu.cfs_quota_us", cpu_quota_us(limits.cpus).to_string()),
                ],
            ));
        }
        if let Some(root) = memory {
            let mut files = vec![("memory.limit_in_bytes", bytes.clone())];
            // Swap counts too where the host accounts it, or the limit is only on RAM.
            if root.join("memory.memsw.limit_in_bytes").exists() {
                files.push(("memory.memsw.limit_in_bytes", bytes));
            }
            out.push((Limit::Memory, root.clone(), files));
        }
        if let Some(root) = pids {
            out.push((
                Limit::Pids,
                root.clone(),
                vec![("pids.max", limits.pids.to_string())],
            ));
        }
        out
    }
}

/// A cgroup file and the value that sets a limit in it.
type LimitFile = (&'static str, String);

const CPU_PERIOD_US: u64 = 100_000;

fn cpu_quota_us(cpus: f64) -> u64 {
    ((cpus * CPU_PERIOD_US as f64).round() as u64).max(1_000)
}

fn v2_files(limits: &SandboxLimits) -> [(Limit, &'static str, String); 4] {
    let bytes = (limits.memory_mib << 20).to_string();
    [
        (
            Limit::Cpu,
            "cpu.max",
            format!("{} {CPU_PERIOD_US}", cpu_quota_us(limits.cpus)),
        ),
        (Limit::Memory, "memory.max", bytes),
        // No swap past the limit: it is the sandbox's memory, not its RAM.
        (Limit::Memory, "memory.swap.max", "0".to_owned()),
        (Limit::Pids, "pids.max", limits.pids.to_string()),
    ]
}

/// Hands the controllers down to runplane's cgroups (v2 gives a child only what its
/// parent's `cgroup.subtree_control` lists).
fn enable_v2(root: &Path) -> std::io::Result<()> {
    let parent = root.join(PARENT);
    std::fs::create_dir_all(&parent)?;
    for dir in [root, parent.as_path()] {
        for controller in ["+cpu", "+memory", "+pids"] {
            // One at a time: a controller the host lacks must not stop the others.
            let _ = std::fs::write(dir.join("cgroup.subtree_control"), controller);
        }
    }
    Ok(())
}

/// Whether `path` is a mount point of this mount namespace.
fn mounted(path: &Path) -> bool {
    let Ok(mountinfo) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = path.to_string_lossy();
    mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        // mountinfo escapes spaces and the like as octal; a path with them never matches,
        // and is mounted again on top, which is only wasteful.
        .any(|mount_point| mount_point == want)
}

/// A sparse file of `disk_mib` with an ext4 filesystem in it, unless it exists already.
async fn make_image(image: &Path, disk_mib: u64) -> Result<(), String> {
    if image.exists() {
        return Ok(());
    }
    let partial = image.with_extension("img.partial");
    let file = std::fs::File::create(&partial)
        .map_err(|e| format!("creating {}: {e}", partial.display()))?;
    file.set_len(disk_mib << 20)
        .map_err(|e| format!("sizing {}: {e}", partial.display()))?;
    drop(file);
    run(
        "mkfs.ext4",
        &[
            "-q".as_ref(),
            "-F".as_ref(),
            "-m".as_ref(),
            "0".as_ref(),
            "-E".as_ref(),
            "lazy_itable_init=1,lazy_journal_init=1".as_ref(),
            partial.as_os_str(),
        ],
        None,
    )
    .await
    .map_err(|e| format!("making the workspace's filesystem: {e}"))?;
    std::fs::rename(&partial, image).map_err(|e| format!("keeping {}: {e}", image.display()))
}

/// Mounts a tmpfs of `kib` KiB at `path` (made when missing), unless something is
/// mounted there already: a directory bound writable into a container whose size must
/// not be the host disk's.
pub async fn mount_tmpfs(path: &Path, kib: u32) -> Result<(), String> {
    std::fs::create_dir_all(path).map_err(|e| format!("making {}: {e}", path.display()))?;
    if mounted(path) {
        return Ok(());
    }
    let options = format!("size={kib}k,mode=0700,nosuid,nodev,noexec");
    run(
        "mount",
        &[
            "-t".as_ref(),
            "tmpfs".as_ref(),
            "-o".as_ref(),
            options.as_ref(),
            "tmpfs".as_ref(),
            path.as_os_str(),
        ],
        None,
    )
    .await
    .map_err(|e| format!("mounting a tmpfs at {}: {e}", path.display()))
}

/// Unmounts what is mounted at `path` (lazily), if anything is.
pub async fn unmount(path: &Path) {
    if mounted(path) {
        let _ = run("umount", &["-l".as_ref(), path.as_os_str()], None).await;
    }
}

async fn unmount_workspace(dir: &Path) {
    let workspace = dir.join(crate::contract::WORKSPACE_DIR);
    if mounted(&workspace) {
        // Lazy: a process of the sandbox that outlived it must not keep the image busy.
        let _ = run("umount", &["-l".as_ref(), workspace.as_os_str()], None).await;
    }
    let _ = std::fs::remove_file(dir.join(WORKSPACE_IMAGE));
}

/// Whether a workspace image can be made and mounted here: a 16 MiB one, at once removed.
async fn probe_disk() -> Result<(), String> {
    let dir = std::env::temp_dir().join(format!(
        "runplane-disk-probe-{}",
        uuid::Uuid::new_v4().simple()
    ));
    let workspace = dir.join(crate::contract::WORKSPACE_DIR);
    std::fs::create_dir_all(&workspace).map_err(|e| e.to_string())?;
    let image = dir.join(WORKSPACE_IMAGE);
    let result = async {
        make_image(&image, 16).await?;
        run(
            "mount",
            &[
                "-o".as_ref(),
                "loop".as_ref(),
                image.as_os_str(),
                workspace.as_os_str(),
            ],
            None,
        )
        .await
        .map_err(|e| format!("mounting a workspace image: {e}"))
    }
    .await;
    unmount_workspace(&dir).await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Whether the memory cgroup whose events file is `path` killed a process for memory
/// (`oom_kill N` with N > 0, in v2's `memory.events` and v1's `memory.oom_control`).
pub fn oom_killed(path: &Path) -> bool {
    std::fs::read_to_string(path).is_ok_and(|events| {
        events.lines().any(|line| {
            line.strip_prefix("oom_kill ")
                .and_then(|n| n.trim().parse::<u64>().ok())
                .is_some_and(|n| n > 0)
        })
    })
}

/// The memory events file (v2 `memory.events`, v1 `memory.oom_control`) of the memory
/// cgroup process `pid` is in, where this host mounted it: a warm container's, which
/// lives as long as its holder.
pub fn memory_events_of(pid: u32) -> Option<PathBuf> {
    let membership = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    match Cgroups::find()? {
        Cgroups::V2 { root } => {
            let path = membership
                .lines()
                .find_map(|line| line.strip_prefix("0::"))?;
            Some(
                root.join(path.trim_start_matches('/'))
                    .join("memory.events"),
            )
        }
        Cgroups::V1 { memory, .. } => {
            let path = membership.lines().find_map(|line| {
                let mut fields = line.splitn(3, ':');
                let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
                controllers
                    .split(',')
                    .any(|c| c == "memory")
                    .then_some(path)
            })?;
            Some(
                memory?
                    .join(path.trim_start_matches('/'))
                    .join("memory.oom_control"),
            )
        }
    }
}
