//! `runplane run -- CMD...`: create a run, follow it live, print its verdict and receipt.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use runplane_config::Config;
use runplane_grpc::client::Bearer;
use runplane_proto::runstore::v1 as pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_transport::{RetryConfig, RetryLayer};

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// Run store endpoint; defaults to [run_store].endpoint.
    #[arg(long, value_name = "URL")]
    endpoint: Option<String>,
    /// File holding the operator token (RUNPLANE_TOKEN overrides it).
    #[arg(long, value_name = "FILE", default_value = ".runplane/operator-token")]
    token_file: PathBuf,
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
    /// The agent command and its arguments.
    #[arg(required = true, last = true, value_name = "CMD")]
    command: Vec<String>,
}

pub(crate) fn token(file: &Path, config: &Config) -> anyhow::Result<String> {
    if let Ok(token) = std::env::var("RUNPLANE_TOKEN")
        && !token.trim().is_empty()
    {
        return Ok(token.trim().to_owned());
    }
    if let Ok(token) = std::fs::read_to_string(file) {
        return Ok(token.trim().to_owned());
    }
    if !config.auth.operator_token.is_empty() {
        return Ok(config.auth.operator_token.expose().to_owned());
    }
    bail!(
        "no operator token: set RUNPLANE_TOKEN, or run from the directory where `runplane dev` keeps {}",
        file.display()
    )
}

/// Runs `args.command` and returns the process exit status to end with.
pub async fn run(config_file: Option<&Path>, args: RunArgs) -> anyhow::Result<i32> {
    let config = Config::load(config_file)?;
    runplane_grpc::tls::install(&config.tls)?;
    let endpoint = args
        .endpoint
        .clone()
        .unwrap_or_else(|| config.run_store.endpoint.clone());
    let token = token(&args.token_file, &config)?;
    // The CLI rides out a control-plane restart like the runner does.
    let layer = RetryLayer::new(RetryConfig::default());
    let channel = runplane_transport::connect_lazy(&endpoint, &layer)?;
    let mut client = RunServiceClient::with_interceptor(channel, Bearer::new(token));

    let (command, rest) = args
        .command
        .split_first()
        .context("a command is required")?;
    let target = match &args.profile {
        Some(p) => pb::create_run_request::Target::Profile(p.clone()),
        None => pb::create_run_request::Target::CredentialId(args.credential.clone()),
    };
    let run = client
        .create_run(pb::CreateRunRequest {
            client_request_id: format!("cli-{}", uuid::Uuid::new_v4().simple()),
            org_id: args.org.clone(),
            lead_id: args.lead.clone(),
            target: Some(target),
            command: command.clone(),
            args: rest.to_vec(),
            labels: Default::default(),
        })
        .await
        .map_err(|s| anyhow::anyhow!("creating the run failed: {:?}: {}", s.code(), s.message()))?
        .into_inner()
        .run
        .context("the run store answered without a run")?;
    eprintln!("runplane: run {} created", run.id);

    let final_run = follow(&mut client, &run.id).await?;
    let verdict = final_run.verdict.clone().unwrap_or_default();
    let outcome = verdict.outcome();
    let exit = verdict
        .exit_code
        .map(|c| format!(", exit code {c}"))
        .unwrap_or_default();
    eprintln!(
        "runplane: {} ({}{exit})",
        state_name(final_run.state()),
        verdict.reason
    );
    if let Ok(receipt) = client
        .get_receipt(pb::GetReceiptRequest {
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
        (pb::RunState::Succeeded, _) => 0,
        (_, pb::VerdictOutcome::Cancelled) => 130,
        _ => verdict
            .exit_code
            .filter(|c| (1..=255).contains(c))
            .unwrap_or(1),
    })
}

fn state_name(state: pb::RunState) -> String {
    state
        .as_str_name()
        .trim_start_matches("RUN_STATE_")
        .to_lowercase()
}

/// Streams the run's output until it is terminal, resuming after a broken stream from
/// the last sequence seen.
async fn follow<T>(client: &mut RunServiceClient<T>, run_id: &str) -> anyhow::Result<pb::Run>
where
    T: tonic::client::GrpcService<tonic::body::Body> + Clone,
    T::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    T::ResponseBody: tonic::codegen::Body<Data = bytes::Bytes> + Send + 'static,
    <T::ResponseBody as tonic::codegen::Body>::Error:
        Into<Box<dyn std::error::Error + Send + Sync>> + Send,
{
    use pb::watch_run_response::Update;
    let mut after = 0;
    let mut last_state = pb::RunState::Unspecified;
    let mut last_run: Option<pb::Run> = None;
    let mut broken_since: Option<tokio::time::Instant> = None;
    loop {
        let stream = client
            .watch_run(pb::WatchRunRequest {
                run_id: run_id.to_owned(),
                after_sequence: after,
                states_only: false,
            })
            .await;
        let mut stream = match stream {
            Ok(s) => s.into_inner(),
            Err(status) => {
                let since = *broken_since.get_or_insert_with(tokio::time::Instant::now);
                if since.elapsed() > Duration::from_secs(300) {
                    bail!(
                        "lost the run's stream: {}: {}",
                        status.code(),
                        status.message()
                    );
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        loop {
            match stream.message().await {
                Ok(Some(item)) => {
                    broken_since = None;
                    match item.update {
                        Some(Update::Run(run)) => {
                            if run.state() != last_state {
                                last_state = run.state();
                                eprintln!("runplane: {}", state_name(last_state));
                            }
                            last_run = Some(run);
                        }
                        Some(Update::Event(event)) => {
                            after = event.sequence;
                            match event.kind() {
                                pb::EventKind::Stdout => {
                                    let mut out = std::io::stdout().lock();
                                    let _ = writeln!(out, "{}", event.text);
                                    let _ = out.flush();
                                }
                                pb::EventKind::Stderr => eprintln!("{}", event.text),
                                kind => eprintln!(
                                    "runplane: [{}] {} {}",
                                    kind.as_str_name()
                                        .trim_start_matches("EVENT_KIND_")
                                        .to_lowercase(),
                                    event.name,
                                    event.text
                                ),
                            }
                        }
                        Some(Update::Gap(gap)) => {
                            eprintln!(
                                "runplane: events {}..{} are no longer stored",
                                gap.from_sequence, gap.to_sequence
                            );
                            after = gap.to_sequence;
                        }
                        None => {}
                    }
                }
                // The stream ends after the terminal snapshot and every event before it.
                Ok(None) => {
                    if let Some(run) = last_run.as_ref().filter(|r| r.state().is_terminal()) {
                        return Ok(run.clone());
                    }
                    break;
                }
                Err(_) => {
                    broken_since.get_or_insert_with(tokio::time::Instant::now);
                    eprintln!("runplane: stream interrupted; resuming after event {after}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    break;
                }
            }
        }
    }
}
