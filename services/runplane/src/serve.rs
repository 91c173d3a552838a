//! `runplane serve`: the named services in one process, with the start-up it shares with
//! `runplane dev` (in `startup`).

use std::path::Path;

use clap::ValueEnum;
use runplane_config::{Config, ServiceRole};

use crate::startup::{Selection, bind, init_telemetry, open, run_until};

/// A runplane service that `runplane serve` can host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ServiceName {
    RunStore,
    SandboxReconciler,
    StreamRecovery,
    CredentialHealth,
    /// All four.
    All,
}

// What a `serve` command line names; `startup` knows no command, so this lives here.
impl Selection {
    fn from_names(names: &[ServiceName]) -> Self {
        let mut s = Self::default();
        for name in names {
            match name {
                ServiceName::RunStore => s.run_store = true,
                ServiceName::SandboxReconciler => s.sandbox_reconciler = true,
                ServiceName::StreamRecovery => s.stream_recovery = true,
                ServiceName::CredentialHealth => s.credential_health = true,
                ServiceName::All => s = Self::all(),
            }
        }
        s
    }

    /// The service roles selected, each calling the others with its own token.
    fn roles(&self) -> impl Iterator<Item = ServiceRole> {
        [
            (self.run_store, ServiceRole::RunStore),
            (self.sandbox_reconciler, ServiceRole::SandboxReconciler),
            (self.stream_recovery, ServiceRole::StreamRecovery),
            (self.credential_health, ServiceRole::CredentialHealth),
        ]
        .into_iter()
        .filter_map(|(selected, role)| selected.then_some(role))
    }
}

pub async fn serve(config_file: Option<&Path>, names: &[ServiceName]) -> anyhow::Result<()> {
    let config = Config::load(config_file)?;
    config.require_operator_token()?;
    let selection = Selection::from_names(names);
    // Each role hosted here calls the others with its own token, else the shared one.
    for role in selection.roles() {
        config.require_calling_token(role)?;
    }
    if selection.sandbox_reconciler {
        config.require_agents_apart_from_secrets()?;
    }
    let _telemetry = init_telemetry(&config, &telemetry_name(names))?;
    runplane_grpc::tls::install(&config.tls)?;
    let shutdown = runplane_grpc::shutdown_signal();
    let listener = bind(&config.server.listen).await?;
    let services = open(&config, selection, None).await?;
    run_until(listener, services, &config, shutdown).await
}

/// `service.name` of a `runplane serve` process (unless `OTEL_SERVICE_NAME` says
/// otherwise): `runplane-run-store` for a process serving only the run store, and so
/// on, so each service is told apart in a trace; `runplane` for several.
fn telemetry_name(names: &[ServiceName]) -> String {
    match names {
        [one] if *one != ServiceName::All => one.to_possible_value().map_or_else(
            || "runplane".to_owned(),
            |v| format!("runplane-{}", v.get_name()),
        ),
        _ => "runplane".to_owned(),
    }
}
