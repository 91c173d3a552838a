//! `runplane webhooks`: the lifecycle webhook endpoints and how their deliveries go.

use std::io::Write;
use std::path::Path;

use runplane_proto::runstore::v1 as runstore_pb;

use crate::output::{or_dash, rfc3339, table};

#[derive(Debug, clap::Args)]
pub struct WebhooksArgs {
    #[command(flatten)]
    connect: crate::connect::RunStoreConnect,
}

/// One row per endpoint: its id, URL and filters, its deliveries waiting, delivered and
/// given up, and the last delivery and failure.
pub async fn list(
    config_file: Option<&Path>,
    args: WebhooksArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let mut client = crate::connect::run_store(config_file, &args.connect)?;
    let endpoints = client
        .list_webhooks(runstore_pb::ListWebhooksRequest {})
        .await
        .map_err(crate::connect::rpc)?
        .into_inner()
        .endpoints;
    if endpoints.is_empty() {
        writeln!(out, "no webhooks configured ([[run_store.webhooks]])")?;
        return Ok(());
    }
    let all = |list: &[String]| {
        if list.is_empty() {
            "all".to_owned()
        } else {
            list.join(",")
        }
    };
    let mut rows = vec![
        [
            "ID",
            "URL",
            "EVENTS",
            "ORGS",
            "PENDING",
            "DELIVERED",
            "FAILED",
            "LAST DELIVERED",
            "LAST FAILURE",
        ]
        .map(str::to_owned)
        .to_vec(),
    ];
    for e in &endpoints {
        let failure = match &e.last_failed_at {
            Some(at) => format!("{} {}", rfc3339(at), e.last_error),
            None => String::new(),
        };
        rows.push(vec![
            e.id.clone(),
            e.url.clone(),
            all(&e.events),
            all(&e.orgs),
            e.pending.to_string(),
            e.delivered.to_string(),
            e.failed.to_string(),
            or_dash(
                &e.last_delivered_at
                    .as_ref()
                    .map(rfc3339)
                    .unwrap_or_default(),
            ),
            or_dash(&failure),
        ]);
    }
    table(out, &rows)?;
    Ok(())
}
