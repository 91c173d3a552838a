//! `runplane node`.

use std::path::Path;

use anyhow::Context;
use runplane_config::Config;
use runplane_sandbox_reconciler::agent::{AgentConfig, run as run_agent};
use runplane_sandbox_reconciler::drivers::process::Containment;

pub async fn run(config_file: Option<&Path>) -> anyhow::Result<()> {
    let config = Config::load(config_file)?;
    let token = config.require_operator_token()?.clone();
    let _telemetry = crate::serve::init_telemetry(&config, "runplane-node")?;
    runplane_grpc::tls::install(&config.tls)?;
    let shutdown = runplane_grpc::shutdown_signal();
    // Refused at start when the host cannot contain agents as configured.
    let containment = Containment::probe(&config.sandbox_reconciler).await?;
    tracing::info!(isolation = %containment.describe(), "sandboxes of this node");
    run_agent(
        AgentConfig {
            node_id: config.node.id.clone(),
            endpoint: config.node.endpoint.clone(),
            capacity: config.node.capacity,
            reconciler_endpoint: config.sandbox_reconciler.endpoint.clone(),
            recovery_endpoint: config.stream_recovery.endpoint.clone(),
            token,
            state_dir: config.node.state_dir.clone().into(),
            runplane_binary: std::env::current_exe()
                .context("locating the runplane binary for sandboxes")?,
            containment,
        },
        shutdown,
    )
    .await?;
    tracing::info!("node agent stopped");
    Ok(())
}
