//! `runplane sandbox-container`: the container driver's wrapper. A runner on the host
//! starts its agent through it; it runs the agent in the sandbox's container, attached to
//! its own stdio, and exits with the agent's status ([`runplane_sandbox::container`]).

use std::path::PathBuf;

use runplane_config::{PullPolicy, SandboxLimits};
use runplane_sandbox::container::{AgentContainer, WarmStart, run_agent};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[arg(long)]
    engine: String,
    #[arg(long)]
    image: String,
    #[arg(long, value_parser = ["never", "if_missing", "always"])]
    pull: String,
    #[arg(long)]
    sandbox_id: String,
    #[arg(long)]
    run_id: String,
    /// The state directory of the driver that starts it (the containers' owner label).
    #[arg(long, default_value = "")]
    owner: String,
    #[arg(long)]
    workspace: PathBuf,
    #[arg(long)]
    cpus: f64,
    #[arg(long)]
    memory_mib: u64,
    #[arg(long)]
    pids: u32,
    #[arg(long)]
    disk_mib: Option<u64>,
    #[arg(long)]
    network_mode: String,
    #[arg(long)]
    memory_events: Option<PathBuf>,
    #[arg(long)]
    ending: Option<PathBuf>,
    #[arg(long)]
    cgroup_parent: Option<String>,
    #[arg(long)]
    cgroup_memory_events: Option<PathBuf>,
    /// Start the agent by exec in the sandbox's container, a warm one the driver gave it.
    #[arg(long)]
    warm: bool,
    /// The warm container's holder socket: start the agent through it, not by exec.
    #[arg(long)]
    launch: Option<PathBuf>,
    /// The pid of the warm container's holder on this host.
    #[arg(long)]
    holder_pid: Option<u32>,
    /// The agent's command.
    #[arg(last = true, required = true)]
    argv: Vec<String>,
}

pub async fn run(args: Args) -> anyhow::Result<i32> {
    let limits = SandboxLimits {
        cpus: args.cpus,
        memory_mib: args.memory_mib,
        pids: args.pids,
        disk_mib: args.disk_mib.unwrap_or(SandboxLimits::default().disk_mib),
    };
    limits.validate("sandbox-container")?;
    Ok(run_agent(AgentContainer {
        engine: args.engine,
        image: args.image,
        pull: PullPolicy::parse(&args.pull).unwrap_or_default(),
        sandbox_id: args.sandbox_id,
        run_id: args.run_id,
        owner: args.owner,
        workspace: args.workspace,
        limits,
        network_mode: args.network_mode,
        memory_events: args.memory_events,
        ending: args.ending,
        cgroup_parent: args.cgroup_parent,
        cgroup_memory_events: args.cgroup_memory_events,
        warm: match (args.warm, args.launch, args.holder_pid) {
            (false, _, _) => None,
            (true, Some(socket), Some(holder_pid)) => {
                Some(WarmStart::Launch { socket, holder_pid })
            }
            (true, _, _) => Some(WarmStart::Exec),
        },
        argv: args.argv,
    })
    .await)
}
