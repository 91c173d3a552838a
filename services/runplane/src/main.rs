//! `runplane`: serve services, run everything for development, operator commands.

mod cli;
mod connect;
mod credentials;
mod dev;
mod duration;
mod exit_status;
mod node;
mod operator;
mod output;
mod policies;
mod protojson;
mod receipt;
mod recovery;
mod run;
mod runner;
mod serve;
mod startup;
mod watch;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // A usage error exits 2 here (clap's rule); everything else below.
    let cli = cli::Cli::parse();
    let daemon = cli.command.is_daemon();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("runplane: could not start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(cli::run(cli)) {
        Ok(code) => ExitCode::from(code),
        Err(e) if daemon => {
            eprintln!("runplane: {e:#}");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
