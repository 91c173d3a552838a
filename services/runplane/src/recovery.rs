//! `runplane recovery …`: the stream recovery coordinator as an operator sees it.
//!
//! `sweep` runs one pass of the orphan sweep by hand (the coordinator also runs it by
//! itself, a batch every 30 s): it pages SweepOrphans by cursor until the pass is
//! complete and prints one line per run it would settle or settled. `--dry-run` changes
//! nothing.

use std::io::Write;
use std::path::{Path, PathBuf};

use runplane_proto::recovery::v1 as recovery_pb;
use runplane_proto::recovery::v1::stream_recovery_service_client::StreamRecoveryServiceClient;

#[derive(Debug, clap::Args)]
pub struct SweepArgs {
    /// Coordinator endpoint; defaults to [stream_recovery].endpoint.
    #[arg(long, value_name = "URL")]
    endpoint: Option<String>,
    /// File holding the operator token (RUNPLANE_TOKEN overrides it).
    #[arg(long, value_name = "FILE", default_value = ".runplane/operator-token")]
    token_file: PathBuf,
    /// Report what the sweep would do without doing it.
    #[arg(long)]
    dry_run: bool,
    /// Runs examined per call, 1 to 500.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=500))]
    batch: u32,
}

pub async fn sweep(
    config_file: Option<&Path>,
    args: SweepArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let channel = crate::connect::channel(
        config_file,
        args.endpoint.as_deref(),
        &args.token_file,
        |c| &c.stream_recovery.endpoint,
    )?;
    let mut client = StreamRecoveryServiceClient::new(channel);
    let mut cursor = String::new();
    let (mut examined, mut deleted, mut ended, mut planned) = (0, 0, 0, 0);
    loop {
        let answer = client
            .sweep_orphans(recovery_pb::SweepOrphansRequest {
                cursor: cursor.clone(),
                limit: args.batch,
                dry_run: args.dry_run,
            })
            .await
            .map_err(crate::connect::rpc)?
            .into_inner();
        for r in &answer.results {
            examined += 1;
            let what = match r.action() {
                recovery_pb::OrphanAction::KeysDeleted => {
                    deleted += 1;
                    "keys deleted (run terminal or unknown)"
                }
                recovery_pb::OrphanAction::RunEnded => {
                    ended += 1;
                    "run ended (stream_recovery_exhausted)"
                }
                recovery_pb::OrphanAction::TakeoverPlanned => {
                    planned += 1;
                    "taken over (its controller's lease lapsed; resume_stream sent)"
                }
                _ => continue,
            };
            let would = if args.dry_run { "would be " } else { "" };
            writeln!(out, "{}  {would}{what}", r.run_id)?;
        }
        if answer.next_cursor.is_empty() {
            break;
        }
        cursor = answer.next_cursor;
    }
    let mode = if args.dry_run { " (dry run)" } else { "" };
    writeln!(
        out,
        "swept {examined} runs{mode}: {deleted} keys deleted, {ended} runs ended, {planned} taken over"
    )?;
    Ok(())
}
