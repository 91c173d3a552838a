//! `runplane run -- CMD...`: create a run, follow it live, print its verdict and receipt.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use runplane_proto::runstore::v1 as runstore_pb;

use crate::connect::RunStoreConnect;
use crate::output::ending;
use crate::watch::{Until, print_events};

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    connect: RunStoreConnect,
    /// Org the run belongs to.
    #[arg(long, default_value = "dev")]
    org: String,
    /// Lead that starts the run.
    #[arg(long, default_value = "cli")]
    lead: String,
    /// Profile to run on (credential health picks a credential).
    #[arg(long, conflicts_with = "credential")]
    profile: Option<String>,
    /// Credential to run on.
    #[arg(long, default_value = "local")]
    credential: String,
    /// Longest the run may live, counted from its creation (queue time included), e.g.
    /// 90s, 10m, 2h, 1h30m; past it the run fails with reason deadline_exceeded. Default:
    /// the profile's max_run_seconds, if any.
    #[arg(long, value_name = "DUR", value_parser = crate::duration::parse_positive)]
    max_duration: Option<Duration>,
    /// Where the run stands among this org's queued runs on its credential, 0 to 9:
    /// higher starts first. Default: the profile's priority (0 for a credential).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(i32).range(0..=9))]
    priority: Option<i32>,
    /// A label, `key=value` (repeatable): keys 1–63 of a-z 0-9 . - /, values 0–63 of
    /// A-Z a-z 0-9 . _ -. `runplane runs --label` and the bulk actions select by them.
    #[arg(long = "label", value_name = "K=V", value_parser = parse_label)]
    labels: Vec<(String, String)>,
    /// How often the server is asked for a heartbeat while the run is quiet, 1s to 60s.
    /// A stream silent for three heartbeats (a wedged replica, a proxy that stopped
    /// forwarding) is re-opened after the last event printed, on a new connection.
    #[arg(long, value_name = "DUR", default_value = "5s", value_parser = crate::watch::parse_heartbeat)]
    heartbeat: Duration,
    /// The agent command and its arguments.
    #[arg(required = true, last = true, value_name = "CMD")]
    command: Vec<String>,
}

/// Runs `args.command` and returns the process exit status to end with.
pub async fn run(config_file: Option<&Path>, args: RunArgs) -> anyhow::Result<i32> {
    let mut client = crate::connect::run_store(config_file, &args.connect)?;

    let (command, rest) = args
        .command
        .split_first()
        .context("a command is required")?;
    let target = match &args.profile {
        Some(p) => runstore_pb::create_run_request::Target::Profile(p.clone()),
        None => runstore_pb::create_run_request::Target::CredentialId(args.credential.clone()),
    };
    let run = client
        .create_run(runstore_pb::CreateRunRequest {
            client_request_id: format!("cli-{}", uuid::Uuid::new_v4().simple()),
            org_id: args.org.clone(),
            lead_id: args.lead.clone(),
            target: Some(target),
            command: command.clone(),
            args: rest.to_vec(),
            labels: args.labels.iter().cloned().collect(),
            max_duration: args.max_duration.map(crate::duration::to_proto),
            priority: args.priority,
        })
        .await
        .map_err(crate::connect::rpc)?
        .into_inner()
        .run
        .context("the run store answered without a run")?;
    eprintln!("runplane: run {} created", run.id);

    let final_run = print_events(&mut client, &run.id, 0, Until::End, args.heartbeat).await?;
    let verdict = final_run.verdict.clone().unwrap_or_default();
    let outcome = verdict.outcome();
    eprintln!("runplane: {}", ending(&final_run));
    if let Ok(receipt) = client
        .get_receipt(runstore_pb::GetReceiptRequest {
            run_id: run.id.clone(),
        })
        .await
        && let Some(body) = receipt.into_inner().receipt.and_then(|r| r.body)
    {
        let head: String = body
            .chain_head
            .iter()
            .take(8)
            .map(|b| format!("{b:02x}"))
            .collect();
        eprintln!(
            "runplane: receipt: {} events, {} checks, chain {head}…, signed by {}",
            body.event_count,
            body.check_events.len(),
            body.key_id
        );
    }
    Ok(match (final_run.state(), outcome) {
        (runstore_pb::RunState::Succeeded, _) => 0,
        (_, runstore_pb::VerdictOutcome::Cancelled) => 130,
        _ => verdict
            .exit_code
            .filter(|c| (1..=255).contains(c))
            .unwrap_or(1),
    })
}

/// `--label key=value`; the run store checks the key's and value's characters.
fn parse_label(text: &str) -> Result<(String, String), String> {
    let (key, value) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not key=value"))?;
    Ok((key.to_owned(), value.to_owned()))
}
