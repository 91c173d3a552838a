//! The warm pool: started containers of the driver's image, each with its workspace
//! mounted, waiting until a sandbox takes one, so a sandbox starts without the engine's
//! container creation and start.
//!
//! A warm container waits in the holder, a static program of the host's bound in
//! read-only (catatonit's pause mode: it sleeps as pid 1 and reaps), so nothing of the
//! image is needed beyond the agent's command, and with no network but its loopback. It
//! is made with the default limits, so only a sandbox with those takes one; a sandbox
//! with its own limits, or the host's network, makes its own container.
//!
//! Taking one renames it for the sandbox (`runplane-<sandbox id>`) and moves its
//! directory (`<state>/.warm/<id>`, which holds the workspace image and its mount) to
//! the sandbox's; the driver then brings the sandbox's network up in the container's
//! namespace, and the agent starts in it by exec. From there it is the sandbox's
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
use crate::process::Enforcer;

/// The label of a warm container not yet taken: its warm id.
pub const LABEL_WARM: &str = "dev.runplane.warm";
/// The name of a warm container not yet taken: this, then its warm id.
pub const PREFIX: &str = "runplane-warm-";
/// The directory, in the driver's state directory, of warm containers' directories.
pub const WARM_DIR: &str = ".warm";
/// Where the holder is bound in a warm container.
const HOLDER: &str = "/.runplane-holder";

/// The holders this host may have, first found first: catatonit, as Debian's and
/// Podman's packages install it.
const HOLDERS: &[&str] = &[
    "/usr/bin/catatonit",
    "/usr/libexec/podman/catatonit",
    "/usr/local/bin/catatonit",
];

/// The holder `configured` names (it must be there), or else the first of this host's.
pub fn find_holder(configured: &str) -> Result<Option<PathBuf>, String> {
    if !configured.is_empty() {
        let path = PathBuf::from(configured);
        return match path.is_file() {
            true => Ok(Some(path)),
            false => Err(format!(
                "sandbox_reconciler.container.holder: {configured} is not a file on this host \
                 (install catatonit, or set sandbox_reconciler.container.warm = 0)"
            )),
        };
    }
    Ok(HOLDERS
        .iter()
        .map(PathBuf::from)
        .find(|path| path.is_file()))
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
    ready: std::sync::Mutex<Vec<String>>,
    filling: AtomicBool,
}

/// A warm container a sandbox took: its holder's pid on this host, whose network
/// namespace is the sandbox's.
#[derive(Debug, Clone, Copy)]
pub struct Taken {
    pub holder_pid: u32,
}

impl WarmPool {
    pub fn new(engine: Arc<Engine>, spec: PoolSpec) -> Arc<Self> {
        Arc::new(Self {
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
        let bytes = (limits.memory_mib << 20) as i64;
        let name = format!("{PREFIX}{warm_id}");
        let body = ContainerCreateBody {
            image: Some(self.spec.image.clone()),
            entrypoint: Some(vec![HOLDER.to_owned(), "-P".to_owned()]),
            cmd: Some(Vec::new()),
            working_dir: Some(WORKSPACE.to_owned()),
            labels: Some(HashMap::from([
                (LABEL_OWNER.to_owned(), self.owner()),
                (LABEL_WARM.to_owned(), warm_id.to_owned()),
            ])),
            host_config: Some(HostConfig {
                binds: Some(vec![
                    format!("{}:{HOLDER}:ro", self.spec.holder.display()),
                    format!("{}:{WORKSPACE}", workspace.display()),
                    format!("{}:/etc/resolv.conf:ro", resolv_conf.display()),
                ]),
                memory: Some(bytes),
                memory_swap: Some(bytes),
                nano_cpus: Some((limits.cpus * 1e9) as i64),
                pids_limit: Some(i64::from(limits.pids)),
                // Loopback only until a sandbox takes it and brings its network up.
                network_mode: Some("none".to_owned()),
                security_opt: Some(vec!["no-new-privileges".to_owned()]),
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
            .map_err(|e| format!("creating {name}: {e}"))?;
        docker
            .start_container(&name, None)
            .await
            .map_err(|e| format!("starting {name}: {e}"))?;
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
        Ok(Taken { holder_pid })
    }

    /// Unmounts the workspace in warm directory `dir` and removes it.
    async fn discard_dir(&self, dir: &Path) {
        let id = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        self.spec.enforcer.release(&format!("warm-{id}"), dir).await;
        let _ = std::fs::remove_dir_all(dir);
    }
}
