//! `runplane`: serve services, run everything for development, operator commands.

mod cli;
mod credentials;
mod dev;
mod node;
mod policies;
mod receipt;
mod run;
mod runner;
mod serve;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
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
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("runplane: {e:#}");
            ExitCode::FAILURE
        }
    }
}
