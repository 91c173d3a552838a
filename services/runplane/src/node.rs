//! `runplane node`: the node agent, and `runplane node token …`, its credentials.
//!
//! The agent authenticates to NodeService with its own credential, and with nothing else:
//! RUNPLANE_NODE_TOKEN, else `--token-file` (never an argument, so it stays out of `ps`).
//! Without one it does not start. The credential acts for `[node].id` only (NodeService
//! refuses it for any other node id, and every other service refuses it outright); the
//! operator and service tokens are refused by NodeService, so a node host holds neither.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use runplane_config::{Config, Secret};
use runplane_node_agent::{AgentConfig, run as run_agent};
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::reconciler::v1::node_credential_service_client::NodeCredentialServiceClient;
use runplane_sandbox::Containment;

use crate::exit_status::EXIT_STATUS;

#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct NodeArgs {
    /// File holding this node's own credential (`runplane node token create` prints
    /// it); RUNPLANE_NODE_TOKEN overrides it. One of the two is required.
    #[arg(long, value_name = "FILE")]
    token_file: Option<PathBuf>,

    #[command(subcommand)]
    command: Option<NodeCommand>,
}

impl NodeArgs {
    /// True for the agent itself; false for the operator's `token` commands.
    pub fn is_agent(&self) -> bool {
        self.command.is_none()
    }
}

#[derive(Debug, clap::Subcommand)]
enum NodeCommand {
    /// Node credentials: make, revoke and list them (with the operator token).
    #[command(subcommand)]
    Token(TokenCommand),
}

#[derive(Debug, clap::Subcommand)]
enum TokenCommand {
    /// Make a credential for node NODE and print it once (it is stored only as a hash).
    /// Give it to that node's `runplane node` as RUNPLANE_NODE_TOKEN or --token-file.
    #[command(after_help = EXIT_STATUS)]
    Create {
        /// The node id ([node].id of the node that will use it).
        node: String,
        /// The most capacity the node may register with ([node].capacity); a
        /// registration above it is refused, so a stolen credential cannot claim more
        /// room. 0: no ceiling of its own (10000).
        #[arg(long, value_name = "N", default_value_t = 0)]
        max_capacity: u32,
        #[command(flatten)]
        connect: Connect,
    },
    /// Revoke every credential of node NODE and fence it: its agent is refused from now on
    /// and stops, it gets no placement, and its sandboxes are lost at once (no loss grace),
    /// their runs' attempts retried on other nodes. A new credential makes it a fresh node.
    #[command(after_help = EXIT_STATUS)]
    Revoke {
        node: String,
        #[command(flatten)]
        connect: Connect,
    },
    /// List credentials (of NODE, or all): id, node, created, revoked; never secrets.
    #[command(after_help = EXIT_STATUS)]
    List {
        node: Option<String>,
        #[command(flatten)]
        connect: Connect,
    },
}

/// Where the reconciler is and the operator token.
#[derive(Debug, clap::Args)]
struct Connect {
    /// Reconciler endpoint; defaults to [sandbox_reconciler].endpoint.
    #[arg(long, value_name = "URL")]
    endpoint: Option<String>,
    /// File holding the operator token (RUNPLANE_TOKEN overrides it).
    #[arg(long, value_name = "FILE", default_value = ".runplane/operator-token")]
    token_file: PathBuf,
}

pub async fn node(
    config_file: Option<&Path>,
    args: NodeArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    match args.command {
        None => run(config_file, args.token_file.as_deref()).await,
        Some(NodeCommand::Token(command)) => token(config_file, command, out).await,
    }
}

/// This node's own credential, if it was given one.
fn node_credential(token_file: Option<&Path>) -> anyhow::Result<Option<Secret>> {
    if let Ok(token) = std::env::var("RUNPLANE_NODE_TOKEN")
        && !token.trim().is_empty()
    {
        return Ok(Some(Secret::new(token.trim().to_owned())));
    }
    let Some(file) = token_file else {
        return Ok(None);
    };
    let token = std::fs::read_to_string(file)
        .with_context(|| format!("reading the node credential from {}", file.display()))?;
    if token.trim().is_empty() {
        bail!("{} holds no node credential", file.display());
    }
    Ok(Some(Secret::new(token.trim().to_owned())))
}

async fn run(config_file: Option<&Path>, token_file: Option<&Path>) -> anyhow::Result<()> {
    let config = Config::load(config_file)?;
    // A node acts only as itself: the operator and service tokens are refused by
    // NodeService, and a node host never needs them.
    let Some(token) = node_credential(token_file)? else {
        bail!(
            "runplane node needs this node's own credential: create one with `runplane node token create {}` (operator token) and give it as RUNPLANE_NODE_TOKEN or --token-file",
            if config.node.id.is_empty() {
                "NODE"
            } else {
                &config.node.id
            }
        );
    };
    let _telemetry = crate::startup::init_telemetry(&config, "runplane-node")?;
    runplane_grpc::tls::install(&config.tls)?;
    let shutdown = runplane_grpc::shutdown_signal();
    // Refused at start when the host cannot contain agents as configured.
    let containment = Containment::probe(&config.sandbox_reconciler).await?;
    tracing::info!(isolation = %containment.describe(), "sandboxes of this node");
    run_agent(
        AgentConfig {
            node_id: config.node.id.clone(),
            endpoint: config.node.endpoint.clone(),
            listen: match config.node.listen.as_str() {
                "" => config.node.endpoint.clone(),
                listen => listen.to_owned(),
            },
            capacity: config.node.capacity,
            reconciler_endpoint: config.sandbox_reconciler.endpoint.clone(),
            recovery_endpoint: config.stream_recovery.endpoint.clone(),
            control_plane_endpoints: vec![
                config.run_store.endpoint.clone(),
                config.credential_health.endpoint.clone(),
            ],
            token,
            state_dir: config.node.state_dir.clone().into(),
            clock: runplane_clock::SystemClock::shared(),
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

async fn token(
    config_file: Option<&Path>,
    command: TokenCommand,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let connect = match &command {
        TokenCommand::Create { connect, .. }
        | TokenCommand::Revoke { connect, .. }
        | TokenCommand::List { connect, .. } => connect,
    };
    let channel = crate::connect::channel(
        config_file,
        connect.endpoint.as_deref(),
        &connect.token_file,
        |c| &c.sandbox_reconciler.endpoint,
    )?;
    let mut client = NodeCredentialServiceClient::new(channel);
    match command {
        TokenCommand::Create {
            node, max_capacity, ..
        } => {
            let answer = client
                .create_node_credential(reconciler_pb::CreateNodeCredentialRequest {
                    node_id: node,
                    max_capacity,
                })
                .await
                .map_err(crate::connect::rpc)?
                .into_inner();
            // The secret alone on stdout (for a file or a secret store); the rest on stderr.
            writeln!(out, "{}", answer.token)?;
            if let Some(c) = answer.credential {
                eprintln!(
                    "node credential {} for node {}: shown only now; give it to that node's `runplane node` as RUNPLANE_NODE_TOKEN or --token-file",
                    c.id, c.node_id
                );
            }
        }
        TokenCommand::Revoke { node, .. } => {
            let answer = client
                .revoke_node_credentials(reconciler_pb::RevokeNodeCredentialsRequest {
                    node_id: node.clone(),
                })
                .await
                .map_err(crate::connect::rpc)?
                .into_inner();
            let credentials = match answer.revoked {
                1 => "credential",
                _ => "credentials",
            };
            writeln!(
                out,
                "revoked {} {credentials} of node {node}",
                answer.revoked
            )?;
            if answer.fenced {
                match answer.fenced_sandboxes {
                    0 => writeln!(out, "fenced node {node}: it held no live sandbox")?,
                    1 => writeln!(
                        out,
                        "fenced node {node}: 1 sandbox lost, its attempt retried elsewhere"
                    )?,
                    n => writeln!(
                        out,
                        "fenced node {node}: {n} sandboxes lost, their attempts retried elsewhere"
                    )?,
                }
            }
        }
        TokenCommand::List { node, .. } => {
            let answer = client
                .list_node_credentials(reconciler_pb::ListNodeCredentialsRequest {
                    node_id: node.unwrap_or_default(),
                })
                .await
                .map_err(crate::connect::rpc)?
                .into_inner();
            writeln!(
                out,
                "{:<36}  {:<24}  {:<20}  {:<12}  REVOKED",
                "ID", "NODE", "CREATED", "MAX CAPACITY"
            )?;
            for c in answer.credentials {
                let ceiling = match c.max_capacity {
                    0 => "-".to_owned(),
                    n => n.to_string(),
                };
                writeln!(
                    out,
                    "{:<36}  {:<24}  {:<20}  {:<12}  {}",
                    c.id,
                    c.node_id,
                    c.created_at.map(rfc3339).unwrap_or_default(),
                    ceiling,
                    c.revoked_at.map(rfc3339).unwrap_or_else(|| "-".into())
                )?;
            }
        }
    }
    Ok(())
}

fn rfc3339(t: prost_types::Timestamp) -> String {
    chrono::DateTime::from_timestamp(t.seconds, 0)
        .map(|d| d.format("%Y-%m-%dT%H:%M:%SZ").to_string())
        .unwrap_or_default()
}
