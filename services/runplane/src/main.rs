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
mod sandbox_container;
mod serve;
mod startup;
mod watch;
mod webhooks;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // A usage error exits 2 here (clap's rule); everything else below.
    let cli = cli::Cli::parse();
    let daemon = cli.command.is_daemon();
    if daemon {
        // Services hold tokens and keys, node agents their credential, runners a run key:
        // a process of the same uid must not read them from /proc/<pid>/{environ,mem}
        // nor ptrace them out, and a crash must not dump them to a core file.
        if let Err(e) = nix::sys::prctl::set_dumpable(false) {
            eprintln!("runplane: could not mark this process non-dumpable: {e}");
            return ExitCode::FAILURE;
        }
    }
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
