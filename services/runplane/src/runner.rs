//! `runplane runner`.

use std::path::Path;

use anyhow::bail;
use runplane_config::Config;
use runplane_runner::RunnerEnv;
use runplane_transport::RetryConfig;
use tracing::Instrument;

pub async fn run(config_file: Option<&Path>) -> anyhow::Result<()> {
    let config = Config::load(config_file)?;
    let _telemetry = crate::startup::init_telemetry(&config, "runplane-runner")?;
    // From RUNPLANE_TLS__*: the sandbox driver passes its own client side on.
    runplane_grpc::tls::install(&config.tls)?;
    let env = RunnerEnv::from_env()?;
    // The run's trace, handed over by whoever started this sandbox (OpenTelemetry's
    // TRACEPARENT convention); every call below is part of it.
    let span = tracing::info_span!("runner.run", run_id = %env.run_id);
    if let Ok(traceparent) = std::env::var("TRACEPARENT") {
        runplane_grpc::trace_context::continue_trace(&span, &traceparent);
    }
    let outcome = runplane_runner::run(
        env,
        RetryConfig::default(),
        runplane_clock::SystemClock::shared(),
    )
    .instrument(span)
    .await?;
    tracing::info!(
        outcome = ?outcome.verdict.outcome(),
        reason = %outcome.verdict.reason,
        recorded = outcome.recorded,
        events_lost = outcome.events_lost,
        "runner done"
    );
    if outcome.ended_elsewhere {
        tracing::info!("the run ended in the control plane; its agent was stopped");
        return Ok(());
    }
    if !outcome.recorded {
        bail!("the run store holds a different verdict for this run; ours was discarded");
    }
    Ok(())
}
