//! `runplane runner`.

use std::path::Path;

use anyhow::bail;
use runplane_config::Config;
use runplane_runner::RunnerEnv;
use runplane_transport::RetryConfig;

pub async fn run(config_file: Option<&Path>) -> anyhow::Result<()> {
    let config = Config::load(config_file)?;
    let _telemetry = crate::serve::init_telemetry(&config, "runplane-runner")?;
    let env = RunnerEnv::from_env()?;
    let outcome = runplane_runner::run(env, RetryConfig::default()).await?;
    tracing::info!(
        outcome = ?outcome.verdict.outcome(),
        reason = %outcome.verdict.reason,
        recorded = outcome.recorded,
        events_lost = outcome.events_lost,
        "runner done"
    );
    if !outcome.recorded {
        bail!("the run store holds a different verdict for this run; ours was discarded");
    }
    Ok(())
}
