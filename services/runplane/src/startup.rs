//! The start-up the long-running commands share: telemetry (`serve`, `dev`, `node`,
//! `runner`), and opening the selected services and serving them until shutdown (`serve`,
//! `dev`). A leaf: it knows no command.

use anyhow::Context;
use runplane_config::Config;
use runplane_credential_health::CredentialHealth;
use runplane_grpc::ServiceSet;
use runplane_run_store::RunStore;
use runplane_sandbox::Containment;
use runplane_sandbox_reconciler::SandboxReconciler;
use runplane_stream_recovery::StreamRecovery;
use tokio::net::TcpListener;

/// `[stream_recovery].redis_url` of `runplane dev`: the in-process store.
pub const EMBEDDED_STORE: &str = "memory://";

/// The services one process hosts.
#[derive(Debug, Clone, Copy, Default)]
pub struct Selection {
    pub run_store: bool,
    pub sandbox_reconciler: bool,
    pub stream_recovery: bool,
    pub credential_health: bool,
}

impl Selection {
    pub fn all() -> Self {
        Self {
            run_store: true,
            sandbox_reconciler: true,
            stream_recovery: true,
            credential_health: true,
        }
    }
}

pub fn init_telemetry(
    config: &Config,
    service_name: &str,
) -> anyhow::Result<runplane_telemetry::Telemetry> {
    Ok(runplane_telemetry::init(
        &runplane_telemetry::TelemetryOptions {
            service_name: service_name.to_owned(),
            log_format: config.telemetry.log_format,
        },
    )?)
}

pub async fn bind(listen: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(listen).await.with_context(|| {
        format!(
            "cannot listen on {listen} (is another runplane running there? choose another address)"
        )
    })
}

/// How this process contains the agents of its local sandboxes: refused here, at start,
/// when the host cannot contain them as `sandbox_reconciler.isolation` asks.
pub async fn local_containment(config: &Config) -> anyhow::Result<Containment> {
    if !config.sandbox_reconciler.local_sandboxes {
        return Ok(Containment::None);
    }
    let containment = Containment::probe(&config.sandbox_reconciler).await?;
    tracing::info!(isolation = %containment.describe(), "local sandboxes");
    Ok(containment)
}

/// Opens the selected services (databases migrated) and collects their gRPC services;
/// local agents are contained as `containment` says, or as [`local_containment`] finds.
pub async fn open(
    config: &Config,
    selection: Selection,
    containment: Option<Containment>,
) -> anyhow::Result<ServiceSet> {
    let mut services = ServiceSet::new();
    if selection.run_store {
        let run_store = RunStore::open(config, runplane_clock::SystemClock::shared())
            .await
            .context("starting the run store")?;
        run_store.register(&mut services);
        // Runs past their deadline end; failed turns go to credential health.
        run_store.start();
    }
    if selection.sandbox_reconciler {
        // Sandboxes go to registered node agents, or run here when none is ready.
        let binary =
            std::env::current_exe().context("locating the runplane binary for sandboxes")?;
        let containment = match containment {
            Some(containment) => containment,
            None => local_containment(config).await?,
        };
        let reconciler = SandboxReconciler::open(config, runplane_clock::SystemClock::shared())
            .await
            .context("starting the sandbox reconciler")?
            .with_local_sandboxes(binary, containment);
        reconciler.register(&mut services);
        reconciler.start();
    }
    if selection.stream_recovery {
        let coordinator = if config.stream_recovery.redis_url == EMBEDDED_STORE {
            StreamRecovery::embedded(config, runplane_clock::SystemClock::shared())?
        } else {
            StreamRecovery::open(config, runplane_clock::SystemClock::shared())
                .await
                .context("starting the stream recovery coordinator")?
        };
        coordinator.register(&mut services);
        // Orphaned streams' leases and buffers are swept.
        coordinator.start();
    }
    if selection.credential_health {
        let health = CredentialHealth::open(config, runplane_clock::SystemClock::shared())
            .await
            .context("starting credential health")?;
        health.register(&mut services);
        // Backend-error outcomes go to the run store; old notices are pruned.
        health.start();
    }
    Ok(services)
}

pub async fn run_until(
    listener: TcpListener,
    mut services: ServiceSet,
    config: &Config,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    services.limits(runplane_grpc::ServerLimits::from(&config.server));
    let stopped =
        runplane_grpc::serve(listener, services, shutdown, config.shutdown_grace()).await?;
    tracing::info!(?stopped, "stopped");
    Ok(())
}
