//! The command line.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(
    name = "runplane",
    version,
    about = "The control plane that keeps AI-agent runs alive",
    long_about = "The control plane that keeps AI-agent runs alive.\n\n\
        One binary serves any subset of runplane's four gRPC services (run store, sandbox \
        reconciler, stream recovery coordinator, credential health), runs all of them in \
        one process for development, and carries the operator commands."
)]
pub struct Cli {
    /// Config file (TOML). RUNPLANE_<SECTION>__<FIELD> variables override its values,
    /// e.g. RUNPLANE_SERVER__LISTEN=0.0.0.0:7070.
    #[arg(long, global = true, env = "RUNPLANE_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the named services on [server].listen, with health and reflection.
    Serve {
        /// Services to serve in this process.
        #[arg(required = true, value_enum)]
        services: Vec<ServiceName>,
    },
    /// Serve all four services in one process on one port: SQLite under the data
    /// directory, the in-process coordinator store, a generated operator token.
    Dev {
        /// Address to listen on; port 0 picks a free port.
        #[arg(long, default_value = "127.0.0.1:7070", value_name = "ADDR")]
        listen: String,
        /// Where the SQLite databases and the operator token are kept.
        #[arg(long, default_value = ".runplane", value_name = "DIR")]
        data_dir: PathBuf,
    },
    /// Create a run of CMD, follow its output live, print its verdict and receipt, and
    /// exit with its status (0 succeeded, the agent's exit code when it failed).
    Run(crate::run::RunArgs),
    /// Run a node agent of the direct substrate ([node] config): register with the
    /// reconciler at [sandbox_reconciler].endpoint, run, suspend and restore sandboxes.
    Node,
    /// Run inside a sandbox: say Hello, start the run's agent command, stream its output,
    /// apply steering and submit the verdict. Reads RUNPLANE_ENDPOINT, RUNPLANE_RUN_ID and
    /// RUNPLANE_RUN_KEY from the environment (never from arguments), and
    /// RUNPLANE_RECOVERY_ENDPOINT (the coordinator; default the run store's endpoint) and
    /// TRACEPARENT (the run's trace) when set.
    Runner,
    /// Print the fleet as credential health sees it: per credential and per profile,
    /// capacity, busy, free, cool-off and quarantine (in separate columns).
    Credentials(crate::credentials::CredentialsArgs),
    /// Follow a lead's notices (one per outage incident, one per quarantine), resuming
    /// from the last cursor when the stream breaks.
    Notices(crate::credentials::NoticesArgs),
    /// Print every RPC's replay-safety policy, as the proto method options declare it.
    Policies,
    /// Receipts: make a signing key, verify a receipt offline.
    #[command(subcommand)]
    Receipt(ReceiptCommand),
}

#[derive(Debug, Subcommand)]
pub enum ReceiptCommand {
    /// Print a new Ed25519 receipt signing key (for run_store.receipt_signing_key) and its
    /// public key.
    Keygen,
    /// Verify a receipt offline: its Ed25519 signature and the body it signs.
    Verify {
        /// The receipt as JSON: grpcurl's output of RunService/GetReceipt.
        file: PathBuf,
        /// The signer's public key, 64 hex digits or base64 (GetReceiptPublicKey prints it).
        #[arg(long, value_name = "KEY")]
        public_key: String,
    },
}

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

pub async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve { services } => crate::serve::serve(cli.config.as_deref(), &services).await,
        Command::Dev { listen, data_dir } => {
            crate::dev::dev(cli.config.as_deref(), &listen, &data_dir).await
        }
        Command::Runner => crate::runner::run(cli.config.as_deref()).await,
        Command::Node => crate::node::run(cli.config.as_deref()).await,
        Command::Run(args) => {
            let code = crate::run::run(cli.config.as_deref(), args).await?;
            if code != 0 {
                std::process::exit(code);
            }
            Ok(())
        }
        Command::Credentials(args) => {
            crate::credentials::credentials(
                cli.config.as_deref(),
                args,
                &mut std::io::stdout().lock(),
            )
            .await
        }
        Command::Notices(args) => {
            crate::credentials::notices(cli.config.as_deref(), args, &mut std::io::stdout()).await
        }
        Command::Policies => {
            crate::policies::print(&mut std::io::stdout().lock())?;
            Ok(())
        }
        Command::Receipt(ReceiptCommand::Keygen) => {
            crate::receipt::keygen(&mut std::io::stdout().lock())
        }
        Command::Receipt(ReceiptCommand::Verify { file, public_key }) => {
            crate::receipt::verify_file(&file, &public_key, &mut std::io::stdout().lock())
        }
    }
}
