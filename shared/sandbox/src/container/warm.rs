//! The warm pool: started containers of the driver's image, each with its workspace
//! mounted, waiting until a sandbox takes one, so a sandbox starts without the engine's
//! container creation and start.
//!
//! A warm container waits in the holder, a static program of the host's bound in
//! read-only as its pid 1, so nothing of the image is needed beyond the agent's command,
//! and with no network but its loopback: `runplane-holder`, which starts the agent itself
//! when the wrapper hands it the agent's command on its socket ([`super::launch`]), or
//! catatonit in its pause mode, in which the agent starts by the engine's exec. It is
//! made with the deployment's image and default limits, so only a sandbox with those
//! takes one; a sandbox with its own image or limits, or the host's network, makes its
//! own container.
//!
//! Taking one renames it for the sandbox (`runplane-<sandbox id>`) and moves its
//! directory (`<state>/.warm/<id>`, which holds the workspace image and its mount) to
//! the sandbox's; the driver then brings the sandbox's network up in the container's
//! namespace, and the agent starts in it. From there it is the sandbox's
//! container: paused, unpaused and removed as any. The pool fills again in the
//! background. A driver that starts removes the warm containers of its earlier life
//! ([`super::sweep`]) and their directories.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bollard::models::{ContainerCreateBody, HostConfig};
use bollard::query_parameters::{CreateContainerOptionsBuilder, RenameContainerOptionsBuilder};
use runplane_config::{PullPolicy, SandboxLimits};

use super::{Engine, LABEL_OWNER, container_name, ensure_image};
use crate::contract::{WORKSPACE, WORKSPACE_DIR};
use crate::process::limits::Enforcer;

/// The label of a warm container not yet taken: its warm id.
pub const LABEL_WARM: &str = "dev.runplane.warm";
/// The name of a warm container not yet taken: this, then its warm id.
pub const PREFIX: &str = "runplane-warm-";
/// The directory, in the driver's state directory, of warm containers' directories.
pub const WARM_DIR: &str = ".warm";
/// Where the holder is bound in a warm container.
const HOLDER: &str = "/.runplane-holder";
/// Where `runplane-holder` listens in a warm container, and the directory of the warm
/// container's (then the sandbox's) state directory bound there.
const LAUNCH_DIR: &str = "/.runplane";
const LAUNCH_SOCKET: &str = "launch.sock";
pub const LAUNCH_HOST_DIR: &str = "launch";

/// Whether `holder` is runplane's own, which starts agents through its socket (else, as
/// catatonit, it only waits, and agents start by the engine's exec).
fn is_launcher(holder: &Path) -> bool {
    holder
        .file_name()
        .is_some_and(|name| name.to_string_lossy().starts_with("runplane-holder"))
}

/// The holders this host may have after runplane's own, first found first: catatonit,
/// as Debian's and Podman's packages install it.
const HOLDERS: &[&str] = &[
    "/usr/bin/catatonit",
    "/usr/libexec/podman/catatonit",
    "/usr/local/bin/catatonit",
];

/// The holder `configured` names (it must be there), or else `runplane-holder` beside
/// this binary, or else the first of this host's [`HOLDERS`].
pub fn find_holder(configured: &str) -> Result<Option<PathBuf>, String> {
    if !configured.is_empty() {
        let path = PathBuf::from(configured);
        return match (path.is_file(), is_static(&path)) {
            (true, true) => Ok(Some(path)),
            (false, _) => Err(format!(
                "sandbox_reconciler.container.holder: {configured} is not a file on this host \
                 (build runplane-holder, install catatonit, or set \
                 sandbox_reconciler.container.warm = 0)"
            )),
            (true, false) => Err(format!(
                "sandbox_reconciler.container.holder: {configured} is not a static binary, \
                 so it cannot run in any image (build runplane-holder with \
                 --target x86_64-unknown-linux-musl)"
            )),
        };
    }
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.join("runplane-holder")));
    Ok(beside
        .into_iter()
        .chain(HOLDERS.iter().map(PathBuf::from))
        .find(|path| path.is_file() && is_static(path)))
}

/// Whether the ELF binary at `path` runs without a dynamic loader (it has no
/// `PT_INTERP` program header), as a holder must to run in an image with no libc.
pub fn is_static(path: &Path) -> bool {
    let Ok(elf) = std::fs::read(path) else {
        return false;
    };
    let u16_at = |at: usize| {
        elf.get(at..at + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
    };
    let u32_at = |at: usize| {
        elf.get(at..at + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let u64_at = |at: usize| {
        elf.get(at..at + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    };
    // 64-bit little-endian ELF only: the hosts runplane's drivers run on.
    if elf.get(..6) != Some(&[0x7f, b'E', b'L', b'F', 2, 1][..]) {
        return false;
    }
    let (Some(phoff), Some(phentsize), Some(phnum)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38))
    else {
        return false;
    };
    (0..usize::from(phnum)).all(|i| {
        let at = phoff as usize + i * usize::from(phentsize);
        elf.len() >= at + usize::from(phentsize) && u32_at(at).is_some_and(|kind| kind != 3)
    })
}

/// What a warm container is made of.
#[derive(Debug, Clone)]
pub struct PoolSpec {
    pub image: String,
    pub pull: PullPolicy,
    pub holder: PathBuf,
    /// How many wait.
    pub size: u32,
    /// The default limits: the only ones a warm container serves.
    pub limits: SandboxLimits,
    pub enforcer: Enforcer,
    /// The driver's state directory, which holds [`WARM_DIR`]; also the owner label.
    pub state_dir: PathBuf,
}

/// A driver's warm containers.
#[derive(Debug)]
pub struct WarmPool {
    engine: Arc<Engine>,
    spec: PoolSpec,
    /// Its holder is `runplane-holder`, which starts agents itself.
    launcher: bool,
    ready: std::sync::Mutex<Vec<String>>,
    filling: AtomicBool,
}

/// A warm container a sandbox took: its holder's pid on this host, whose network
/// namespace is the sandbox's, and the holder's socket when it is `runplane-holder`.
#[derive(Debug, Clone)]
pub struct Taken {
    pub holder_pid: u32,
    pub launch: Option<PathBuf>,
}

impl WarmPool {
    pub fn new(engine: Arc<Engine>, spec: PoolSpec) -> Arc<Self> {
        Arc::new(Self {
            launcher: is_launcher(&spec.holder),
            engine,
            spec,
            ready: Default::default(),
            filling: AtomicBool::new(false),
        })
    }

    /// How many wait now.
    pub fn ready(&self) -> usize {
        self.ready.lock().map(|r| r.len()).unwrap_or(0)
    }

    pub fn limits(&self) -> &SandboxLimits {
        &self.spec.limits
    }

    pub fn image(&self) -> &str {
        &self.spec.image
    }

    fn owner(&self) -> String {
        self.spec.state_dir.display().to_string()
    }

    fn dir(&self, warm_id: &str) -> PathBuf {
        self.spec.state_dir.join(WARM_DIR).join(warm_id)
    }

    /// Removes the directories of warm containers an earlier life left (their
    /// containers went with [`super::sweep`]), then fills the pool.
    pub async fn restart(self: &Arc<Self>) {
        if let Ok(entries) = std::fs::read_dir(self.spec.state_dir.join(WARM_DIR)) {
            for entry in entries.flatten() {
                self.discard_dir(&entry.path()).await;
            }
        }
        self.refill();
    }

    /// Fills the pool in the background, unless that is under way.
    pub fn refill(self: &Arc<Self>) {
        if self.filling.swap(true, Ordering::AcqRel) {
            return;
        }
        let this = self.clone();
        tokio::spawn(async move {
            this.fill().await;
            this.filling.store(false, Ordering::Release);
        });
    }

    async fn fill(&self) {
        let Ok(docker) = self.engine.docker().await else {
            return;
        };
        // Once per round: `always` pulls again for the containers made now.
        if let Err(e) = ensure_image(docker, &self.spec.image, self.spec.pull).await {
            tracing::warn!(error = %e, "warm pool: the image is not there");
            return;
        }
        while self.ready() < self.spec.size as usize {
            match self.make().await {
                Ok(warm_id) => {
                    if let Ok(mut ready) = self.ready.lock() {
                        ready.push(warm_id);
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "warm pool: making a warm container");
                    return;
                }
            }
        }
    }

    /// Makes and starts one warm container; its warm id.
    async fn make(&self) -> Result<String, String> {
        let warm_id = uuid::Uuid::new_v4().simple().to_string()[..16].to_owned();
        let dir = self.dir(&warm_id);
        let workspace = dir.join(WORKSPACE_DIR);
        std::fs::create_dir_all(&workspace)
            .map_err(|e| format!("making {}: {e}", workspace.display()))?;
        let made = self.make_in(&warm_id, &dir, &workspace).await;
        if made.is_err() {
            let _ = self
                .engine
                .remove(&format!("{PREFIX}{warm_id}"), std::time::Duration::ZERO)
                .await;
            self.discard_dir(&dir).await;
        }
        made.map(|()| warm_id)
    }

    async fn make_in(&self, warm_id: &str, dir: &Path, workspace: &Path) -> Result<(), String> {
        let docker = self.engine.docker().await?;
        let limits = &self.spec.limits;
        self.spec
            .enforcer
            .mount_workspace(dir, workspace, limits.disk_mib)
            .await
            .map_err(|e| e.to_string())?;
        // The resolver its network gets once taken, written in place then
        // ([`crate::process::network::up`]); none until.
        let resolv_conf = dir.join(crate::process::network::RESOLV_CONF);
        std::fs::write(&resolv_conf, "")
            .map_err(|e| format!("writing {}: {e}", resolv_conf.display()))?;
        let name = format!("{PREFIX}{warm_id}");
        let launcher = self.launcher;
        let mut binds = vec![
            format!("{}:{HOLDER}:ro", self.spec.holder.display()),
            format!("{}:{WORKSPACE}", workspace.display()),
            format!("{}:/etc/resolv.conf:ro", resolv_conf.display()),
        ];
        let entrypoint = match launcher {
            true => {
                // Writable by the container's root: a small tmpfs, not the host's disk.
                let launch = dir.join(LAUNCH_HOST_DIR);
                crate::process::limits::mount_tmpfs(&launch, 64).await?;
                binds.push(format!("{}:{LAUNCH_DIR}", launch.display()));
                vec![HOLDER.to_owned(), format!("{LAUNCH_DIR}/{LAUNCH_SOCKET}")]
            }
            false => vec![HOLDER.to_owned(), "-P".to_owned()],
        };
        let body = ContainerCreateBody {
            image: Some(self.spec.image.clone()),
            entrypoint: Some(entrypoint),
            cmd: Some(Vec::new()),
            working_dir: Some(WORKSPACE.to_owned()),
            labels: Some(HashMap::from([
                (LABEL_OWNER.to_owned(), self.owner()),
                (LABEL_WARM.to_owned(), warm_id.to_owned()),
            ])),
            host_config: Some(HostConfig {
                binds: Some(binds),
                // Loopback only until a sandbox takes it and brings its network up.
                network_mode: Some("none".to_owned()),
                ..super::bounded(limits)
            }),
            ..Default::default()
        };
        docker
            .create_container(
                Some(CreateContainerOptionsBuilder::new().name(&name).build()),
                body,
            )
            .await
            .map_err(|e| format!("creating {name}: {e}"))?;
        docker
            .start_container(&name, None)
            .await
            .map_err(|e| format!("starting {name}: {e}"))?;
        if launcher {
            // Ready once its holder listens.
            let socket = dir.join(LAUNCH_HOST_DIR).join(LAUNCH_SOCKET);
            for _ in 0..250 {
                if socket.exists() {
                    return Ok(());
                }
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            return Err(format!("the holder of {name} did not listen within 5 s"));
        }
        Ok(())
    }

    /// Gives sandbox `sandbox_id` a warm container, when one waits: renamed for it, its
    /// directory moved to `dir` (which must not exist yet). None when none waits or it
    /// could not be taken (the sandbox then makes its own).
    pub async fn take(self: &Arc<Self>, sandbox_id: &str, dir: &Path) -> Option<Taken> {
        let warm_id = self.ready.lock().ok()?.pop()?;
        self.refill();
        let taken = self.take_one(&warm_id, sandbox_id, dir).await;
        if let Err(e) = &taken {
            tracing::warn!(error = %e, "warm pool: a warm container could not be taken");
            let _ = self
                .engine
                .remove(&format!("{PREFIX}{warm_id}"), std::time::Duration::ZERO)
                .await;
            let _ = self
                .engine
                .remove(&container_name(sandbox_id), std::time::Duration::ZERO)
                .await;
            self.discard_dir(&self.dir(&warm_id)).await;
        }
        taken.ok()
    }

    async fn take_one(&self, warm_id: &str, sandbox_id: &str, dir: &Path) -> Result<Taken, String> {
        let docker = self.engine.docker().await?;
        let name = format!("{PREFIX}{warm_id}");
        let state = docker
            .inspect_container(&name, None)
            .await
            .map_err(|e| format!("inspecting {name}: {e}"))?
            .state
            .unwrap_or_default();
        let holder_pid = state
            .pid
            .filter(|pid| state.running == Some(true) && *pid > 0)
            .and_then(|pid| u32::try_from(pid).ok())
            .ok_or_else(|| format!("{name} is not running"))?;
        docker
            .rename_container(
                &name,
                RenameContainerOptionsBuilder::new()
                    .name(&container_name(sandbox_id))
                    .build(),
            )
            .await
            .map_err(|e| format!("renaming {name}: {e}"))?;
        std::fs::rename(self.dir(warm_id), dir)
            .map_err(|e| format!("moving {name}'s directory to {}: {e}", dir.display()))?;
        let launch = self
            .launcher
            .then(|| dir.join(LAUNCH_HOST_DIR).join(LAUNCH_SOCKET));
        Ok(Taken { holder_pid, launch })
    }

    /// Unmounts the workspace in warm directory `dir` and removes it.
    async fn discard_dir(&self, dir: &Path) {
        let id = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        self.spec.enforcer.release(&format!("warm-{id}"), dir).await;
        crate::process::limits::unmount(&dir.join(LAUNCH_HOST_DIR)).await;
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[cfg(test)]
mod tests {
    use super::is_static;

    /// A 64-bit little-endian ELF header with program headers of `kinds`.
    fn elf(kinds: &[u32]) -> Vec<u8> {
        let mut bytes = vec![0u8; 64];
        bytes[..6].copy_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1]);
        bytes[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
        bytes[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        bytes[0x38..0x3a].copy_from_slice(&(kinds.len() as u16).to_le_bytes());
        for kind in kinds {
            let mut header = vec![0u8; 56];
            header[..4].copy_from_slice(&kind.to_le_bytes());
            bytes.extend(header);
        }
        bytes
    }

    #[test]
    fn only_a_binary_with_no_loader_is_static() {
        let dir = std::env::temp_dir().join(format!("runplane-elf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |name: &str, bytes: &[u8]| {
            let path = dir.join(name);
            std::fs::write(&path, bytes).unwrap();
            path
        };
        assert!(is_static(&write("static", &elf(&[6, 1, 1, 2]))));
        assert!(!is_static(&write("dynamic", &elf(&[6, 3, 1, 2]))));
        assert!(!is_static(&write("script", b"#!/bin/sh\necho hi\n")));
        assert!(!is_static(&write("short", &elf(&[1])[..70])));
        // This test's own binary has a loader.
        assert!(!is_static(&std::env::current_exe().unwrap()));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
