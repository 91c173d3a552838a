//! The operator's daily commands on runs, on the model of `temporal workflow
//! list/describe/cancel` and `nomad alloc logs -f`: `runs`, `get`, `logs`, `cancel`,
//! `steer`, `interrupt`. Each writing call carries a fresh idempotency key, so the
//! transport's retries of one invocation are deduped by the run store while a second
//! invocation is a second request.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, Utc};
use clap::ValueEnum;
use runplane_clock::{Clock, SystemClock};
use runplane_proto::runstore::v1 as runstore_pb;

use crate::connect::{RunStoreConnect, idempotency_key, rpc};
use crate::output::{self, or_dash, rfc3339, state_name};
use crate::watch::{Until, print_events};

/// ListRuns' largest page.
const MAX_PAGE: u32 = 500;

/// A run state as `--state` takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum StateArg {
    Queued,
    Starting,
    Running,
    Succeeded,
    Failed,
    Cancelled,
    BackendError,
}

impl From<StateArg> for runstore_pb::RunState {
    fn from(state: StateArg) -> Self {
        match state {
            StateArg::Queued => Self::Queued,
            StateArg::Starting => Self::Starting,
            StateArg::Running => Self::Running,
            StateArg::Succeeded => Self::Succeeded,
            StateArg::Failed => Self::Failed,
            StateArg::Cancelled => Self::Cancelled,
            StateArg::BackendError => Self::BackendError,
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct RunsArgs {
    #[command(flatten)]
    connect: RunStoreConnect,
    /// Only runs in these states (repeat or separate with commas).
    #[arg(
        long,
        value_name = "STATE",
        value_enum,
        ignore_case = true,
        value_delimiter = ','
    )]
    state: Vec<StateArg>,
    /// Only runs of this lead.
    #[arg(long, value_name = "LEAD")]
    lead: Option<String>,
    /// Only runs of this org (required with a token confined to one org).
    #[arg(long, value_name = "ORG")]
    org: Option<String>,
    /// Only runs on this credential.
    #[arg(long, value_name = "CREDENTIAL")]
    credential: Option<String>,
    /// Only runs of this profile.
    #[arg(long, value_name = "PROFILE")]
    profile: Option<String>,
    /// Only runs these labels select: `k=v`, `k!=v`, `k`, `!k`, comma = and.
    #[arg(long = "label", value_name = "SELECTOR")]
    label: Option<String>,
    /// Only paused runs (`runplane pause`).
    #[arg(long)]
    paused: bool,
    /// At most this many runs, newest first (default: every page).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    limit: Option<u32>,
    /// Print a JSON array of the runs (grpcurl's JSON of each Run) instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
pub struct GetArgs {
    #[command(flatten)]
    connect: RunStoreConnect,
    /// Run id.
    run: String,
    /// Print the run as JSON (grpcurl's JSON of the Run).
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
pub struct LogsArgs {
    #[command(flatten)]
    connect: RunStoreConnect,
    /// Run id.
    run: String,
    /// Keep printing until the run ends (resuming after a dropped stream), instead of
    /// exiting after the events stored now.
    #[arg(long, short = 'f')]
    follow: bool,
    /// Print only the events after this sequence.
    #[arg(long, value_name = "SEQ", default_value_t = 0)]
    after: u64,
    /// How often the server is asked for a heartbeat while the run is quiet, 1s to 60s.
    /// A stream silent for three heartbeats (a wedged replica, a proxy that stopped
    /// forwarding) is re-opened after the last event printed, on a new connection.
    #[arg(long, value_name = "DUR", default_value = "5s", value_parser = crate::watch::parse_heartbeat)]
    heartbeat: Duration,
}

#[derive(Debug, clap::Args)]
pub struct CancelArgs {
    #[command(flatten)]
    connect: RunStoreConnect,
    #[command(flatten)]
    target: Target,
    /// Why, recorded as the verdict message (default "cancelled by an operator").
    #[arg(long, value_name = "R")]
    reason: Option<String>,
}

#[derive(Debug, clap::Args)]
pub struct SteerArgs {
    #[command(flatten)]
    connect: RunStoreConnect,
    /// RUN TEXT: the run and the line written to its agent's stdin; with --label, TEXT
    /// alone.
    #[arg(value_name = "RUN TEXT", required = true, num_args = 1..=2)]
    words: Vec<String>,
    #[command(flatten)]
    bulk: Bulk,
}

/// One run by id, or every live run a label selector picks (`--label`).
#[derive(Debug, clap::Args)]
pub struct Target {
    /// Run id, or none with --label.
    #[arg(required_unless_present = "label", conflicts_with = "label")]
    run: Option<String>,
    #[command(flatten)]
    bulk: Bulk,
}

/// `runplane pause|resume RUN`, or `--label SELECTOR` for every live run it selects.
#[derive(Debug, clap::Args)]
pub struct PauseArgs {
    #[command(flatten)]
    connect: RunStoreConnect,
    #[command(flatten)]
    target: Target,
}

/// What a bulk action acts on and how far it may go.
#[derive(Debug, clap::Args)]
pub struct Bulk {
    /// Act on every live run (queued, starting or running) these labels select, within
    /// the org: `k=v`, `k!=v`, `k`, `!k`, comma = and. Each run is one keyed call, keyed
    /// by the action, the selector, what it sends and the run, so the same command again
    /// acts on no run twice.
    #[arg(long, value_name = "SELECTOR")]
    label: Option<String>,
    /// Only the org's runs (required with an operator token that acts for every org).
    #[arg(long, value_name = "ORG", requires = "label")]
    org: Option<String>,
    /// List the runs that match without acting.
    #[arg(long, requires = "label")]
    dry_run: bool,
    /// Refuse to act when more runs than this match.
    #[arg(long, value_name = "N", default_value_t = 1000, requires = "label",
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    max: u32,
}

#[derive(Debug, clap::Args)]
pub struct InterruptArgs {
    #[command(flatten)]
    connect: RunStoreConnect,
    #[command(flatten)]
    target: Target,
    /// Why, recorded in the verdict message.
    #[arg(long, value_name = "R")]
    reason: Option<String>,
    /// Wait after SIGINT before SIGTERM, and again before SIGKILL, e.g. 5s (server
    /// default 10s, at most 5m).
    #[arg(long, value_name = "DUR", value_parser = crate::duration::parse_positive)]
    grace: Option<Duration>,
}

/// `runplane runs`: a table of runs, newest first.
pub async fn runs(
    config_file: Option<&Path>,
    args: RunsArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let mut client = crate::connect::run_store(config_file, &args.connect)?;
    let mut runs = Vec::new();
    let mut page_token = String::new();
    loop {
        let remaining = args.limit.map(|l| l - runs.len() as u32);
        let page = client
            .list_runs(runstore_pb::ListRunsRequest {
                org_id: args.org.clone().unwrap_or_default(),
                lead_id: args.lead.clone().unwrap_or_default(),
                credential_id: args.credential.clone().unwrap_or_default(),
                profile: args.profile.clone().unwrap_or_default(),
                states: args
                    .state
                    .iter()
                    .map(|s| runstore_pb::RunState::from(*s) as i32)
                    .collect(),
                page_size: remaining.unwrap_or(MAX_PAGE).min(MAX_PAGE),
                page_token: page_token.clone(),
                run_ids: Vec::new(),
                with_pending_messages: false,
                label_selector: args.label.clone().unwrap_or_default(),
                paused_only: args.paused,
                // The table shows no spec; --json shows every field.
                view: match args.json {
                    true => runstore_pb::RunView::Full,
                    false => runstore_pb::RunView::Basic,
                } as i32,
            })
            .await
            .map_err(rpc)?
            .into_inner();
        runs.extend(page.runs);
        if let Some(limit) = args.limit {
            runs.truncate(limit as usize);
        }
        page_token = page.next_page_token;
        if page_token.is_empty() || args.limit.is_some_and(|l| runs.len() >= l as usize) {
            break;
        }
    }
    if args.json {
        let runs: Vec<_> = runs
            .iter()
            .map(|r| crate::protojson::to_value(r, "runplane.runstore.v1.Run"))
            .collect();
        writeln!(out, "{}", serde_json::to_string_pretty(&runs)?)?;
    } else {
        write_runs(&runs, SystemClock::new().now(), out)?;
    }
    Ok(())
}

/// The roster as an aligned table; `now` dates the AGE column.
pub fn write_runs(
    runs: &[runstore_pb::Run],
    now: DateTime<Utc>,
    out: &mut impl Write,
) -> std::io::Result<()> {
    let mut rows = vec![
        [
            "ID",
            "STATE",
            "LEAD",
            "CREDENTIAL",
            "AGE",
            "ATTEMPT",
            "REASON",
        ]
        .map(String::from)
        .to_vec(),
    ];
    for run in runs {
        let age = run
            .created_at
            .as_ref()
            .and_then(output::time)
            .map_or_else(|| "-".into(), |t| crate::duration::short(now - t));
        rows.push(vec![
            run.id.clone(),
            output::state_of(run),
            or_dash(&run.lead_id),
            or_dash(&run.credential_id),
            age,
            run.attempt.max(1).to_string(),
            or_dash(output::reason(run)),
        ]);
    }
    output::table(out, &rows)
}

/// `runplane get RUN`.
pub async fn get(
    config_file: Option<&Path>,
    args: GetArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let mut client = crate::connect::run_store(config_file, &args.connect)?;
    let run = client
        .get_run(runstore_pb::GetRunRequest {
            run_id: args.run.clone(),
        })
        .await
        .map_err(rpc)?
        .into_inner()
        .run
        .context("the run store answered without a run")?;
    if args.json {
        let json = crate::protojson::to_value(&run, "runplane.runstore.v1.Run");
        writeln!(out, "{}", serde_json::to_string_pretty(&json)?)?;
    } else {
        write_run(&run, SystemClock::new().now(), out)?;
    }
    Ok(())
}

/// One run, a field a line; `now` says how long ago and how soon.
pub fn write_run(
    run: &runstore_pb::Run,
    now: DateTime<Utc>,
    out: &mut impl Write,
) -> std::io::Result<()> {
    let when = |t: &Option<prost_types::Timestamp>| -> String {
        let Some(t) = t else { return "-".into() };
        match output::time(t) {
            Some(at) if at <= now => {
                format!("{} ({} ago)", rfc3339(t), crate::duration::short(now - at))
            }
            Some(at) => format!("{} (in {})", rfc3339(t), crate::duration::short(at - now)),
            None => "-".into(),
        }
    };
    let mut labels: Vec<_> = run.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    labels.sort();
    let mut rows: Vec<(&str, String)> = vec![
        ("id", run.id.clone()),
        ("org", or_dash(&run.org_id)),
        ("lead", or_dash(&run.lead_id)),
        ("state", output::state_of(run)),
        ("waiting_for_input", when(&run.waiting_for_input_since)),
        ("paused", when(&run.paused_since)),
        (
            "verdict",
            run.verdict.as_ref().map_or("-".into(), |v| {
                output::verdict(&runstore_pb::Verdict {
                    message: String::new(),
                    ..v.clone()
                })
            }),
        ),
        (
            "message",
            or_dash(run.verdict.as_ref().map_or("", |v| v.message.as_str())),
        ),
        ("reason", or_dash(output::reason(run))),
        ("credential", or_dash(&run.credential_id)),
        ("profile", or_dash(&run.profile)),
        ("command", output::command_line(&run.command, &run.args)),
        ("attempt", attempt_line(run, &when)),
        ("sandbox_id", or_dash(&run.sandbox_id)),
        ("sandbox_generation", run.sandbox_generation.to_string()),
        ("last_sequence", run.last_sequence.to_string()),
        ("created", when(&run.created_at)),
        ("started", when(&run.started_at)),
        ("ended", when(&run.ended_at)),
        ("deadline", when(&run.deadline)),
        ("labels", or_dash(&labels.join(", "))),
    ];
    if let Some(b) = &run.backend_error {
        let kind = b
            .kind()
            .as_str_name()
            .trim_start_matches("BACKEND_ERROR_KIND_")
            .to_lowercase();
        let incident = if b.incident_id.is_empty() {
            String::new()
        } else {
            format!(", incident {}", b.incident_id)
        };
        rows.push((
            "backend_error",
            format!("{kind} on {}{incident}: {}", b.credential_id, b.reason),
        ));
    }
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (key, value) in rows {
        writeln!(out, "{key:<width$}  {value}")?;
    }
    // One attempt says nothing the rows above do not; from two on, each one's sandbox,
    // node and end.
    if run.attempts.len() > 1 {
        writeln!(out, "attempts:")?;
        let mut table = vec![
            ["#", "SANDBOX", "NODE", "STARTED", "ENDED", "REASON"]
                .map(String::from)
                .to_vec(),
        ];
        for a in &run.attempts {
            let ended = match (&a.end_reason, &a.end_message) {
                (reason, _) if reason.is_empty() => "-".to_owned(),
                (reason, message) if message.is_empty() => reason.clone(),
                (reason, message) => format!("{reason}: {message}"),
            };
            let ended = match a.superseded_verdict.as_str() {
                "" => ended,
                late => format!("{ended} (a late verdict was refused: {late})"),
            };
            table.push(vec![
                a.number.to_string(),
                or_dash(&a.sandbox_id),
                or_dash(&a.node_id),
                a.started_at.as_ref().map_or("-".into(), rfc3339),
                a.ended_at.as_ref().map_or("-".into(), rfc3339),
                ended,
            ]);
        }
        let mut text = Vec::new();
        output::table(&mut text, &table)?;
        for line in String::from_utf8_lossy(&text).lines() {
            writeln!(out, "  {line}")?;
        }
    }
    Ok(())
}

/// `2`, or `2 (retry due 2026-… (in 3s))` while the run waits out its backoff.
fn attempt_line(
    run: &runstore_pb::Run,
    when: &dyn Fn(&Option<prost_types::Timestamp>) -> String,
) -> String {
    let number = run.attempt.max(1);
    match &run.retry_at {
        Some(_) => format!("{number} (starts {})", when(&run.retry_at)),
        None => number.to_string(),
    }
}

/// `runplane logs RUN`: the stored events, or with `--follow` every event to the run's
/// end. Status notes go to stderr, so stdout holds the agent's stdout only.
pub async fn logs(config_file: Option<&Path>, args: LogsArgs) -> anyhow::Result<()> {
    let mut client = crate::connect::run_store(config_file, &args.connect)?;
    let until = if args.follow { Until::End } else { Until::Now };
    let run = print_events(&mut client, &args.run, args.after, until, args.heartbeat).await?;
    if run.state().is_terminal() {
        eprintln!("runplane: {}", output::ending(&run));
    }
    Ok(())
}

/// `runplane cancel RUN`, or `runplane cancel --label SELECTOR`.
pub async fn cancel(
    config_file: Option<&Path>,
    args: CancelArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let client = crate::connect::run_store(config_file, &args.connect)?;
    let reason = args.reason.unwrap_or_default();
    let one = |mut client: RunStoreClient, run_id: String, key: String| {
        let reason = reason.clone();
        async move {
            let run = client
                .cancel_run(runstore_pb::CancelRunRequest {
                    run_id,
                    reason,
                    idempotency_key: key,
                })
                .await
                .map_err(rpc)?
                .into_inner()
                .run
                .context("the run store answered without a run")?;
            Ok(run
                .verdict
                .as_ref()
                .map_or_else(|| state_name(run.state()), output::verdict))
        }
    };
    match args.target.run {
        Some(run_id) => {
            let ending = one(client, run_id.clone(), idempotency_key("cancel")).await?;
            writeln!(out, "run {run_id}: {ending}")?;
            Ok(())
        }
        None => bulk(out, client, &args.target.bulk, "cancel", &reason, one).await,
    }
}

/// `runplane steer RUN TEXT`, or `runplane steer --label SELECTOR TEXT`.
pub async fn steer(
    config_file: Option<&Path>,
    args: SteerArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let (run, text) = match (&args.bulk.label, args.words.as_slice()) {
        (None, [run, text]) => (Some(run.clone()), text.clone()),
        (Some(_), [text]) => (None, text.clone()),
        // A usage error, as clap's own (exit status 2), before anything is called.
        (None, _) => usage(
            "the following required arguments were not provided: <RUN> <TEXT> \
             (runplane steer RUN TEXT)",
        ),
        (Some(_), _) => {
            usage("with --label, the one argument is <TEXT> (runplane steer --label SELECTOR TEXT)")
        }
    };
    let client = crate::connect::run_store(config_file, &args.connect)?;
    let one = |mut client: RunStoreClient, run_id: String, key: String| {
        let text = text.clone();
        async move {
            let message = client
                .steer(runstore_pb::SteerRequest {
                    run_id,
                    text,
                    idempotency_key: key,
                })
                .await
                .map_err(rpc)?
                .into_inner()
                .message
                .context("the run store answered without a message")?;
            Ok(format!("steer {} queued", message.id))
        }
    };
    match run {
        Some(run_id) => {
            let done = one(client, run_id.clone(), idempotency_key("steer")).await?;
            writeln!(out, "{done} for run {run_id}")?;
            Ok(())
        }
        None => bulk(out, client, &args.bulk, "steer", &text, one).await,
    }
}

/// `runplane interrupt RUN`, or `runplane interrupt --label SELECTOR`.
pub async fn interrupt(
    config_file: Option<&Path>,
    args: InterruptArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let client = crate::connect::run_store(config_file, &args.connect)?;
    let reason = args.reason.unwrap_or_default();
    let grace = args.grace;
    let one = |mut client: RunStoreClient, run_id: String, key: String| {
        let reason = reason.clone();
        async move {
            let answer = client
                .interrupt(runstore_pb::InterruptRequest {
                    run_id,
                    reason,
                    grace: grace.map(crate::duration::to_proto),
                    idempotency_key: key,
                })
                .await
                .map_err(rpc)?
                .into_inner();
            Ok(match (answer.message, answer.run) {
                (Some(message), _) => format!("interrupt {} queued", message.id),
                // A queued run has no agent to signal: the run store cancelled it directly.
                (None, Some(run)) => format!(
                    "was still queued: {} before it started",
                    state_name(run.state())
                ),
                (None, None) => "interrupt accepted".to_owned(),
            })
        }
    };
    match args.target.run {
        Some(run_id) => {
            let done = one(client, run_id.clone(), idempotency_key("interrupt")).await?;
            match done.strip_prefix("was still queued") {
                Some(_) => writeln!(out, "run {run_id} {done}")?,
                None => writeln!(out, "{done} for run {run_id}")?,
            }
            Ok(())
        }
        None => {
            let payload = format!("{reason}|{grace:?}");
            bulk(out, client, &args.target.bulk, "interrupt", &payload, one).await
        }
    }
}

type RunStoreClient = crate::connect::RunStoreClient;

/// Ends the process as clap does for a usage error: the message, exit status 2.
fn usage(message: &str) -> ! {
    clap::Error::raw(
        clap::error::ErrorKind::WrongNumberOfValues,
        format!("{message}\n"),
    )
    .exit()
}

/// The live runs (queued, starting, running) `bulk`'s selector picks, read page by page;
/// refused, naming the count, when more than `--max` match.
async fn live_runs(
    client: &mut RunStoreClient,
    bulk: &Bulk,
) -> anyhow::Result<Vec<runstore_pb::Run>> {
    let selector = bulk.label.clone().unwrap_or_default();
    let mut runs = Vec::new();
    let mut page_token = String::new();
    loop {
        let page = client
            .list_runs(runstore_pb::ListRunsRequest {
                org_id: bulk.org.clone().unwrap_or_default(),
                states: [
                    runstore_pb::RunState::Queued,
                    runstore_pb::RunState::Starting,
                    runstore_pb::RunState::Running,
                ]
                .map(|s| s as i32)
                .to_vec(),
                page_size: MAX_PAGE,
                page_token,
                label_selector: selector.clone(),
                view: runstore_pb::RunView::Basic as i32,
                ..Default::default()
            })
            .await
            .map_err(rpc)?
            .into_inner();
        runs.extend(page.runs);
        if runs.len() > bulk.max as usize {
            anyhow::bail!(
                "more than {} live runs match {selector:?} (--max {}): nothing was done; \
                 narrow the selector or raise --max",
                bulk.max,
                bulk.max
            );
        }
        page_token = page.next_page_token;
        if page_token.is_empty() {
            break;
        }
    }
    // A token that acts for every org sees every org's runs: a bulk action stays within
    // one org, so one named with --org.
    let orgs: std::collections::BTreeSet<&str> = runs.iter().map(|r| r.org_id.as_str()).collect();
    if bulk.org.is_none() && orgs.len() > 1 {
        anyhow::bail!(
            "live runs of {} orgs match {selector:?} ({}): nothing was done; name one with --org",
            orgs.len(),
            orgs.into_iter().collect::<Vec<_>>().join(", ")
        );
    }
    Ok(runs)
}

/// `runplane pause RUN` (`pause`) or `runplane resume RUN` (`!pause`), or either with
/// `--label SELECTOR`: one keyed PauseRun or ResumeRun per run.
pub async fn pause(
    config_file: Option<&Path>,
    args: PauseArgs,
    pause: bool,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let client = crate::connect::run_store(config_file, &args.connect)?;
    let action = if pause { "pause" } else { "resume" };
    let one = |mut client: RunStoreClient, run_id: String, key: String| async move {
        let run = if pause {
            client
                .pause_run(runstore_pb::PauseRunRequest {
                    run_id,
                    idempotency_key: key,
                })
                .await
                .map_err(rpc)?
                .into_inner()
                .run
        } else {
            client
                .resume_run(runstore_pb::ResumeRunRequest {
                    run_id,
                    idempotency_key: key,
                })
                .await
                .map_err(rpc)?
                .into_inner()
                .run
        }
        .context("the run store answered without a run")?;
        let now = SystemClock::new().now();
        Ok(match run.paused_since.as_ref().and_then(output::time) {
            Some(at) => format!(
                "{}, paused since {} ({} ago)",
                output::state_of(&run),
                rfc3339(run.paused_since.as_ref().expect("set")),
                crate::duration::short(now - at)
            ),
            None => output::state_of(&run),
        })
    };
    match args.target.run {
        Some(run_id) => {
            let done = one(client, run_id.clone(), idempotency_key(action)).await?;
            writeln!(out, "run {run_id}: {done}")?;
            Ok(())
        }
        None => bulk(out, client, &args.target.bulk, action, "", one).await,
    }
}

/// Acts on each live run `bulk` selects with `act(client, run_id, key)`, one keyed call each: the key is the
/// action's, the selector's, the payload's and the run's digest, so the same command
/// again replays rather than acts twice. Prints how many matched and what happened to
/// each; fails when any call failed. `--dry-run` lists them and does nothing.
async fn bulk<F, Fut>(
    out: &mut impl Write,
    mut client: RunStoreClient,
    bulk: &Bulk,
    action: &str,
    payload: &str,
    act: F,
) -> anyhow::Result<()>
where
    F: Fn(RunStoreClient, String, String) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<String>>,
{
    let runs = live_runs(&mut client, bulk).await?;
    let selector = bulk.label.as_deref().unwrap_or_default();
    if bulk.dry_run {
        writeln!(
            out,
            "{} live runs match {selector:?}; dry run, nothing was done:",
            runs.len()
        )?;
        write_runs(&runs, SystemClock::new().now(), out)?;
        return Ok(());
    }
    writeln!(out, "{} live runs match {selector:?}", runs.len())?;
    let mut failed = 0;
    for run in &runs {
        let key = bulk_key(action, selector, payload, &run.id);
        match act(client.clone(), run.id.clone(), key).await {
            Ok(done) => writeln!(out, "run {}: {done}", run.id)?,
            Err(e) => {
                failed += 1;
                writeln!(out, "run {}: failed: {e:#}", run.id)?;
            }
        }
    }
    if failed > 0 {
        anyhow::bail!("{action}: {failed} of {} runs failed", runs.len());
    }
    Ok(())
}

/// The idempotency key of one run's call in a bulk action.
fn bulk_key(action: &str, selector: &str, payload: &str, run_id: &str) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(format!("{action}\n{selector}\n{payload}\n{run_id}"));
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("cli-bulk-{action}-{hex}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: i64) -> prost_types::Timestamp {
        prost_types::Timestamp { seconds, nanos: 0 }
    }

    #[test]
    fn the_roster_has_the_columns_an_operator_scans() {
        let now = DateTime::from_timestamp(1_800_000_600, 0).unwrap();
        let runs = [
            runstore_pb::Run {
                id: "0190-a".into(),
                state: runstore_pb::RunState::Running as i32,
                lead_id: "alice".into(),
                credential_id: "local".into(),
                created_at: Some(at(1_800_000_000)),
                ..Default::default()
            },
            runstore_pb::Run {
                id: "0190-b".into(),
                state: runstore_pb::RunState::BackendError as i32,
                lead_id: "bob".into(),
                credential_id: "cred-b".into(),
                failure_reason: "rate limited".into(),
                created_at: Some(at(1_800_000_590)),
                ..Default::default()
            },
        ];
        let mut out = Vec::new();
        write_runs(&runs, now, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0], "ID      STATE          LEAD   CREDENTIAL  AGE  ATTEMPT  REASON",
            "{text}"
        );
        assert_eq!(
            lines[1], "0190-a  running        alice  local       10m  1        -",
            "{text}"
        );
        assert_eq!(
            lines[2], "0190-b  backend_error  bob    cred-b      10s  1        rate limited",
            "{text}"
        );
    }

    #[test]
    fn a_run_shows_every_field_that_matters() {
        let now = DateTime::from_timestamp(1_800_000_060, 0).unwrap();
        let run = runstore_pb::Run {
            id: "0190-a".into(),
            org_id: "acme".into(),
            state: runstore_pb::RunState::Cancelled as i32,
            verdict: Some(runstore_pb::Verdict {
                outcome: runstore_pb::VerdictOutcome::Cancelled as i32,
                reason: "cancelled".into(),
                message: "not needed".into(),
                ..Default::default()
            }),
            failure_reason: "cancelled".into(),
            credential_id: "local".into(),
            profile: "default".into(),
            command: "sleep".into(),
            args: vec!["300".into()],
            sandbox_generation: 1,
            sandbox_id: "sbx-1".into(),
            last_sequence: 2,
            created_at: Some(at(1_800_000_000)),
            deadline: Some(at(1_800_000_120)),
            labels: [("team".into(), "infra".into())].into(),
            ..Default::default()
        };
        let mut out = Vec::new();
        write_run(&run, now, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        for line in [
            "state               cancelled",
            "waiting_for_input   -",
            "paused              -",
            "verdict             cancelled (cancelled)",
            "message             not needed",
            "reason              cancelled",
            "credential          local",
            "profile             default",
            "command             sleep 300",
            "sandbox_id          sbx-1",
            "sandbox_generation  1",
            "last_sequence       2",
            "created             2027-01-15T08:00:00Z (1m ago)",
            "started             -",
            "deadline            2027-01-15T08:02:00Z (in 1m)",
            "labels              team=infra",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
    }

    #[test]
    fn a_run_whose_agent_waits_for_input_says_so_and_since_when() {
        let at = |seconds| prost_types::Timestamp { seconds, nanos: 0 };
        let now = chrono::DateTime::from_timestamp(1_800_000_060, 0).unwrap();
        let run = runstore_pb::Run {
            id: "r-2".into(),
            state: runstore_pb::RunState::Running as i32,
            waiting_for_input_since: Some(at(1_800_000_030)),
            ..Default::default()
        };
        let mut out = Vec::new();
        write_run(&run, now, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        for line in [
            "state               running (waiting_for_input)",
            "waiting_for_input   2027-01-15T08:00:30Z (30s ago)",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
    }
}
