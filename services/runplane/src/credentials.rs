//! `runplane credentials` (the fleet view as a table) and `runplane notices` (a lead's
//! notice stream, followed and resumed from its cursor across restarts).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use runplane_proto::credentials::v1 as credentials_pb;
use runplane_proto::credentials::v1::credential_health_service_client::CredentialHealthServiceClient;

use crate::output::table;

/// Where to reach credential health and as whom.
#[derive(Debug, clap::Args)]
pub struct Connect {
    /// Credential health endpoint; defaults to [credential_health].endpoint.
    #[arg(long, value_name = "URL")]
    endpoint: Option<String>,
    /// File holding the operator token (RUNPLANE_TOKEN overrides it).
    #[arg(long, value_name = "FILE", default_value = ".runplane/operator-token")]
    token_file: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct CredentialsArgs {
    #[command(flatten)]
    connect: Connect,
    /// Only this profile and its credentials.
    #[arg(long)]
    profile: Option<String>,
    /// Only this credential and its profiles.
    #[arg(long)]
    credential: Option<String>,
}

#[derive(Debug, clap::Args)]
pub struct NoticesArgs {
    #[command(flatten)]
    connect: Connect,
    /// Lead whose notices to follow.
    #[arg(long)]
    lead: String,
    /// Org of the lead (`runplane run --org`'s default too). An org token reads only its
    /// own org's notices.
    #[arg(long, default_value = "dev")]
    org: String,
    /// Cursor of the last notice already seen (printed with each notice); empty starts
    /// at the oldest notice kept.
    #[arg(long, value_name = "CURSOR", default_value = "")]
    after: String,
    /// Exit after this many notices instead of following until interrupted.
    #[arg(long, value_name = "N")]
    count: Option<u64>,
    /// How often the server is asked for a heartbeat while no notice comes, 1s to 60s.
    /// A stream silent for three heartbeats (a wedged replica, a proxy that stopped
    /// forwarding) is re-opened after the last cursor, on a new connection.
    #[arg(long, value_name = "DUR", default_value = "5s", value_parser = crate::watch::parse_heartbeat)]
    heartbeat: Duration,
}

type Client = CredentialHealthServiceClient<crate::connect::OperatorChannel>;

fn client(config_file: Option<&Path>, connect: &Connect) -> anyhow::Result<Client> {
    let channel = crate::connect::channel(
        config_file,
        connect.endpoint.as_deref(),
        &connect.token_file,
        |c| &c.credential_health.endpoint,
    )?;
    Ok(CredentialHealthServiceClient::new(channel))
}

/// Prints the fleet: one table per credential, one per profile.
pub async fn credentials(
    config_file: Option<&Path>,
    args: CredentialsArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let mut client = client(config_file, &args.connect)?;
    let fleet = client
        .get_fleet(credentials_pb::GetFleetRequest {
            profile: args.profile.unwrap_or_default(),
            credential_id: args.credential.unwrap_or_default(),
        })
        .await
        .map_err(crate::connect::rpc)?
        .into_inner();
    write_fleet(&fleet, out)?;
    Ok(())
}

fn seconds(s: u32) -> String {
    if s == 0 { "-".into() } else { format!("{s}s") }
}

/// The fleet as two aligned tables.
pub fn write_fleet(
    fleet: &credentials_pb::GetFleetResponse,
    out: &mut impl Write,
) -> std::io::Result<()> {
    let mut rows = vec![
        [
            "CREDENTIAL",
            "PROFILES",
            "CAPACITY",
            "BUSY",
            "FREE",
            "QUEUED",
            "COOLING OFF",
            "QUARANTINED",
            "OPEN INCIDENT",
        ]
        .map(String::from)
        .to_vec(),
    ];
    for c in &fleet.credentials {
        rows.push(vec![
            c.credential_id.clone(),
            c.profiles.join(","),
            c.capacity.to_string(),
            c.busy.to_string(),
            c.free.to_string(),
            c.queued.to_string(),
            seconds(c.cooling_off_for_seconds),
            seconds(c.quarantined_for_seconds),
            c.open_incident.as_ref().map_or("-".into(), |i| {
                format!("{} ({} runs)", i.id, i.opening_run_ids.len())
            }),
        ]);
    }
    table(out, &rows)?;
    writeln!(out)?;
    let mut rows = vec![
        [
            "PROFILE",
            "CREDENTIAL",
            "CAPACITY",
            "BUSY",
            "FREE",
            "COOLING OFF",
            "QUARANTINED",
        ]
        .map(String::from)
        .to_vec(),
    ];
    for p in &fleet.profiles {
        rows.push(vec![
            p.profile.clone(),
            p.credential_id.clone(),
            p.capacity.to_string(),
            p.busy.to_string(),
            p.free.to_string(),
            seconds(p.cooling_off_for_seconds),
            seconds(p.quarantined_for_seconds),
        ]);
    }
    table(out, &rows)?;
    // A shared credential out for some orgs on their own runs' evidence, not for all.
    let mut rows = vec![
        ["CREDENTIAL", "OUT FOR ORG", "COOLING OFF", "QUARANTINED"]
            .map(String::from)
            .to_vec(),
    ];
    for c in &fleet.credentials {
        for o in &c.orgs {
            rows.push(vec![
                c.credential_id.clone(),
                o.org_id.clone(),
                seconds(o.cooling_off_for_seconds),
                seconds(o.quarantined_for_seconds),
            ]);
        }
    }
    if rows.len() > 1 {
        writeln!(out)?;
        table(out, &rows)?;
    }
    Ok(())
}

/// Follows a lead's notices, one line each, resuming after the last cursor printed when
/// the stream breaks (a restart, a deploy).
pub async fn notices(
    config_file: Option<&Path>,
    args: NoticesArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let mut client = client(config_file, &args.connect)?;
    let mut cursor = args.after.clone();
    let mut printed = 0u64;
    if args.count == Some(0) {
        return Ok(());
    }
    loop {
        let stream = client
            .watch_notices(credentials_pb::WatchNoticesRequest {
                lead_id: args.lead.clone(),
                after_cursor: cursor.clone(),
                org_id: args.org.clone(),
                heartbeat_interval: Some(crate::duration::to_proto(args.heartbeat)),
            })
            .await;
        let mut stream = match stream {
            Ok(s) => runplane_transport::Watch::new(s, args.heartbeat),
            // A refusal (a bad cursor, a bad lead id) will not change on a retry.
            Err(status)
                if matches!(
                    status.code(),
                    tonic::Code::InvalidArgument
                        | tonic::Code::Unauthenticated
                        | tonic::Code::PermissionDenied
                ) =>
            {
                return Err(crate::connect::rpc(status));
            }
            Err(_) => {
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        loop {
            match stream.message().await {
                Ok(Some(item)) => match item.item {
                    Some(credentials_pb::watch_notices_response::Item::Notice(n)) => {
                        cursor = n.cursor.clone();
                        write_notice(&n, out).context("writing a notice")?;
                        printed += 1;
                        if args.count.is_some_and(|c| printed >= c) {
                            return Ok(());
                        }
                    }
                    Some(credentials_pb::watch_notices_response::Item::Gap(gap)) => {
                        writeln!(
                            out,
                            "({} older notices were removed by retention)",
                            gap.missed
                        )?;
                        out.flush()?;
                    }
                    // Where the stream is, past removed notices too.
                    Some(credentials_pb::watch_notices_response::Item::Heartbeat(h))
                        if !h.cursor.is_empty() =>
                    {
                        cursor = h.cursor;
                    }
                    Some(credentials_pb::watch_notices_response::Item::Heartbeat(_)) | None => {}
                },
                // Silent past its heartbeats: its connection is condemned, so the re-open
                // goes out on a new one at once.
                Err(silent @ runplane_transport::WatchError::Silent { .. }) => {
                    eprintln!(
                        "runplane: notice stream silent ({silent}); resuming after cursor {cursor} on a new connection"
                    );
                    break;
                }
                Ok(None) | Err(_) => {
                    eprintln!(
                        "runplane: notice stream interrupted; resuming after cursor {cursor}"
                    );
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    break;
                }
            }
        }
    }
}

fn write_notice(n: &credentials_pb::Notice, out: &mut impl Write) -> std::io::Result<()> {
    let at = n
        .created_at
        .as_ref()
        .and_then(|t| chrono::DateTime::from_timestamp(t.seconds, t.nanos.max(0) as u32))
        .map(|t| t.format("%Y-%m-%dT%H:%M:%SZ").to_string())
        .unwrap_or_default();
    let kind = n
        .kind()
        .as_str_name()
        .trim_start_matches("NOTICE_KIND_")
        .to_lowercase();
    writeln!(out, "{at}  {kind}  {}  (cursor {})", n.message, n.cursor)?;
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_credential_out_for_one_org_is_listed_under_that_org() {
        let fleet = credentials_pb::GetFleetResponse {
            credentials: vec![credentials_pb::CredentialHealth {
                credential_id: "shared".into(),
                capacity: 4,
                free: 4,
                orgs: vec![credentials_pb::OrgHealth {
                    org_id: "acme".into(),
                    cooling_off_for_seconds: 0,
                    quarantined_for_seconds: 1800,
                }],
                ..Default::default()
            }],
            ..Default::default()
        };
        let mut out = Vec::new();
        write_fleet(&fleet, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let row = text
            .lines()
            .skip_while(|l| !l.starts_with("CREDENTIAL  OUT FOR ORG"))
            .nth(1)
            .unwrap_or_default();
        assert!(
            row.starts_with("shared") && row.contains("acme") && row.contains("1800s"),
            "{text}"
        );
    }

    #[test]
    fn the_fleet_table_reports_cool_off_and_quarantine_in_separate_columns() {
        let fleet = credentials_pb::GetFleetResponse {
            credentials: vec![credentials_pb::CredentialHealth {
                credential_id: "cred-a".into(),
                profiles: vec!["sonnet".into()],
                capacity: 4,
                busy: 1,
                free: 0,
                cooling_off_for_seconds: 42,
                quarantined_for_seconds: 0,
                open_incident: None,
                ..Default::default()
            }],
            profiles: vec![credentials_pb::ProfileHealth {
                profile: "sonnet".into(),
                credential_id: "cred-a".into(),
                capacity: 4,
                busy: 1,
                free: 0,
                cooling_off_for_seconds: 42,
                quarantined_for_seconds: 0,
                open_incident_id: String::new(),
            }],
            ..Default::default()
        };
        let mut out = Vec::new();
        write_fleet(&fleet, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[0].starts_with(
                "CREDENTIAL  PROFILES  CAPACITY  BUSY  FREE  QUEUED  COOLING OFF  QUARANTINED"
            ),
            "{text}"
        );
        assert!(
            lines[1].contains("cred-a") && lines[1].contains("42s"),
            "{text}"
        );
        assert!(!text.contains("OUT FOR ORG"), "{text}");
        let cooling_col = lines[0].find("COOLING OFF").unwrap();
        let quarantined_col = lines[0].find("QUARANTINED").unwrap();
        assert_eq!(&lines[1][cooling_col..cooling_col + 3], "42s");
        assert_eq!(&lines[1][quarantined_col..quarantined_col + 1], "-");
    }
}
