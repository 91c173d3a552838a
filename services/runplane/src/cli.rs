//! The command line.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::exit_status::{ALL_EXIT_STATUS, EXIT_STATUS, RUN_EXIT_STATUS};
use crate::serve::ServiceName;

#[derive(Debug, Parser)]
#[command(
    name = "runplane",
    version,
    about = "The control plane that keeps AI-agent runs alive",
    long_about = "The control plane that keeps AI-agent runs alive.\n\n\
        One binary serves any subset of runplane's four gRPC services (run store, sandbox \
        reconciler, stream recovery coordinator, credential health), runs all of them in \
        one process for development, and carries the operator commands.",
    after_help = ALL_EXIT_STATUS
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
    /// directory, the in-process coordinator store, a generated operator token. Agents
    /// run under bubblewrap, or in containers with --driver container; the banner says
    /// how they are contained, and what of that this host cannot give.
    Dev {
        /// Address to listen on; port 0 picks a free port.
        #[arg(long, default_value = "127.0.0.1:7070", value_name = "ADDR")]
        listen: String,
        /// Where the SQLite databases and the operator token are kept.
        #[arg(long, default_value = ".runplane", value_name = "DIR")]
        data_dir: PathBuf,
        /// What a sandbox is: `process` (bubblewrap) or `container` (an image, through
        /// the Docker Engine API at [sandbox_reconciler.container] engine).
        #[arg(long, value_name = "DRIVER", value_parser = ["process", "container"])]
        driver: Option<String>,
        /// The image of the container driver's sandboxes.
        #[arg(long, value_name = "IMAGE")]
        image: Option<String>,
    },
    /// Inside a container sandbox's runner: run the agent's command in its container,
    /// attached to this process's stdio (the container driver's wrapper; not for people).
    #[command(hide = true)]
    SandboxContainer(crate::sandbox_container::Args),
    /// Create a run of CMD, follow its output live, print its verdict and receipt, and
    /// exit with its status (0 succeeded, the agent's exit code when it failed, 1 when it
    /// failed without one, 130 cancelled).
    #[command(after_help = RUN_EXIT_STATUS)]
    Run(crate::run::RunArgs),
    /// List runs, newest first: id, state, lead, credential, age and reason (every page,
    /// or --limit).
    #[command(after_help = EXIT_STATUS)]
    Runs(crate::operator::RunsArgs),
    /// Show one run: state, verdict, reason, credential and profile, sandbox, last
    /// sequence, times, deadline, labels.
    #[command(after_help = EXIT_STATUS)]
    Get(crate::operator::GetArgs),
    /// Print a run's output: its stdout lines on stdout, stderr lines and notes on stderr.
    /// Without --follow, the events stored now; with it, until the run ends.
    #[command(after_help = EXIT_STATUS)]
    Logs(crate::operator::LogsArgs),
    /// Cancel a run: it ends CANCELLED (reason cancelled) and its agent is stopped.
    #[command(after_help = EXIT_STATUS)]
    Cancel(crate::operator::CancelArgs),
    /// Send a line to a running agent's stdin.
    #[command(after_help = EXIT_STATUS)]
    Steer(crate::operator::SteerArgs),
    /// Interrupt a run's agent: SIGINT, then SIGTERM and SIGKILL after the grace (a run
    /// still queued is cancelled at once).
    #[command(after_help = EXIT_STATUS)]
    Interrupt(crate::operator::InterruptArgs),
    /// Pause a live run: its sandbox is suspended whatever its agent is doing (its output
    /// stops, nothing is lost), it keeps its slot, and steers and interrupts wait for the
    /// resume. Its deadline keeps counting unless its profile says otherwise; a pause past
    /// the profile's max_pause_seconds (default 24h) ends it FAILED paused_too_long.
    #[command(after_help = EXIT_STATUS)]
    Pause(crate::operator::PauseArgs),
    /// Resume a paused run: its sandbox is restored where it was and the run goes on.
    #[command(after_help = EXIT_STATUS)]
    Resume(crate::operator::PauseArgs),
    /// Run a node agent of the direct substrate ([node] config): register with the
    /// reconciler at [sandbox_reconciler].endpoint, run, suspend and restore sandboxes,
    /// their agents under bubblewrap ([sandbox_reconciler] isolation). It authenticates
    /// with its own credential (RUNPLANE_NODE_TOKEN or --token-file; required: the
    /// operator token does not act as a node). `runplane node token create|revoke|list`
    /// manage node credentials.
    Node(crate::node::NodeArgs),
    /// Run inside a sandbox: say Hello, start the run's agent command, stream its output,
    /// apply steering and submit the verdict. Reads RUNPLANE_ENDPOINT and RUNPLANE_RUN_ID
    /// from the environment and the run key from RUNPLANE_RUN_KEY, or from stdin when
    /// RUNPLANE_RUN_KEY_ON_STDIN=1 (as drivers hand it; never from arguments), and
    /// RUNPLANE_RECOVERY_ENDPOINT (the coordinator; default the run store's endpoint),
    /// TRACEPARENT (the run's trace) and RUNPLANE_AGENT_WRAPPER (the sandbox's bubblewrap
    /// containment of the agent, one argument a line) when set.
    Runner,
    /// Print the fleet as credential health sees it: per credential and per profile,
    /// capacity, busy, free, cool-off and quarantine (in separate columns).
    Credentials(crate::credentials::CredentialsArgs),
    /// Follow a lead's notices (one per outage incident, one per quarantine), resuming
    /// from the last cursor when the stream breaks.
    Notices(crate::credentials::NoticesArgs),
    /// Print every RPC's replay-safety policy, as the proto method options declare it.
    Policies,
    /// List the lifecycle webhook endpoints ([[run_store.webhooks]]): their filters, how
    /// many deliveries wait, were delivered and were given up, and the last delivery and
    /// failure. With the operator token; secrets are never shown.
    #[command(after_help = EXIT_STATUS)]
    Webhooks(crate::webhooks::WebhooksArgs),
    /// Receipts: fetch one, make a signing key, verify a receipt offline.
    #[command(subcommand)]
    Receipt(ReceiptCommand),
    /// The stream recovery coordinator: run its orphan sweep by hand.
    #[command(subcommand)]
    Recovery(RecoveryCommand),
}

#[derive(Debug, Subcommand)]
pub enum RecoveryCommand {
    /// One full pass of the orphan sweep (the coordinator also runs it by itself): keys of
    /// terminal and unknown runs deleted, runs with a spent budget ended; parked and
    /// owned runs left alone. --dry-run changes nothing.
    #[command(after_help = EXIT_STATUS)]
    Sweep(crate::recovery::SweepArgs),
}

#[derive(Debug, Subcommand)]
pub enum ReceiptCommand {
    /// Print a run's signed receipt as JSON (grpcurl's JSON of GetReceipt, what `verify`
    /// reads); the signer's public key goes to stderr.
    #[command(after_help = EXIT_STATUS)]
    Get(crate::receipt::ReceiptGetArgs),
    /// Print a new Ed25519 receipt signing key (for run_store.receipt_signing_key) and its
    /// public key.
    Keygen,
    /// Verify a receipt: its Ed25519 signature and the body it signs. With --public-key
    /// it is checked offline; without, the signer's public key is fetched from the run
    /// store by the receipt's key id (the current key's or a retired one's).
    #[command(after_help = EXIT_STATUS)]
    Verify(crate::receipt::ReceiptVerifyArgs),
}

impl Command {
    /// Long-running processes log their failure as `runplane: …`; the commands an
    /// operator types answer like clap's usage errors, `error: …`.
    pub fn is_daemon(&self) -> bool {
        matches!(self, Self::Serve { .. } | Self::Dev { .. } | Self::Runner)
            || matches!(self, Self::Node(args) if args.is_agent())
    }
}

/// Runs the command; the exit status to end with (see [`ALL_EXIT_STATUS`]).
pub async fn run(cli: Cli) -> anyhow::Result<u8> {
    let config = cli.config.as_deref();
    let mut stdout = std::io::stdout();
    match cli.command {
        Command::Serve { services } => crate::serve::serve(config, &services).await?,
        Command::Dev {
            listen,
            data_dir,
            driver,
            image,
        } => {
            let driver = crate::dev::DriverChoice { driver, image };
            crate::dev::dev(config, &listen, &data_dir, driver).await?
        }
        Command::SandboxContainer(args) => {
            let code = crate::sandbox_container::run(args).await?;
            // At once: the read of stdin the agent no longer needs holds a blocking
            // thread the runtime would wait for on its way out.
            std::process::exit(code);
        }
        Command::Runner => crate::runner::run(config).await?,
        Command::Node(args) => crate::node::node(config, args, &mut stdout).await?,
        Command::Run(args) => {
            // The run's status, 0..=255 by construction.
            let code = crate::run::run(config, args).await?;
            return Ok(u8::try_from(code).unwrap_or(1));
        }
        Command::Runs(args) => crate::operator::runs(config, args, &mut stdout).await?,
        Command::Get(args) => crate::operator::get(config, args, &mut stdout).await?,
        Command::Logs(args) => crate::operator::logs(config, args).await?,
        Command::Cancel(args) => crate::operator::cancel(config, args, &mut stdout).await?,
        Command::Steer(args) => crate::operator::steer(config, args, &mut stdout).await?,
        Command::Interrupt(args) => crate::operator::interrupt(config, args, &mut stdout).await?,
        Command::Pause(args) => crate::operator::pause(config, args, true, &mut stdout).await?,
        Command::Resume(args) => crate::operator::pause(config, args, false, &mut stdout).await?,
        Command::Credentials(args) => {
            crate::credentials::credentials(config, args, &mut stdout).await?
        }
        Command::Notices(args) => crate::credentials::notices(config, args, &mut stdout).await?,
        Command::Policies => crate::policies::print(&mut stdout)?,
        Command::Webhooks(args) => crate::webhooks::list(config, args, &mut stdout).await?,
        Command::Receipt(ReceiptCommand::Get(args)) => {
            crate::receipt::get(config, args, &mut stdout).await?
        }
        Command::Receipt(ReceiptCommand::Keygen) => crate::receipt::keygen(&mut stdout)?,
        Command::Recovery(RecoveryCommand::Sweep(args)) => {
            crate::recovery::sweep(config, args, &mut stdout).await?
        }
        Command::Receipt(ReceiptCommand::Verify(args)) => {
            crate::receipt::verify(config, args, &mut stdout).await?
        }
    }
    Ok(0)
}
