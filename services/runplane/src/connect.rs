//! What every command that calls a runplane service as an operator shares: where the
//! service is (`--endpoint`, else the config's endpoint), the operator token
//! (RUNPLANE_TOKEN, else `--token-file`, else `[auth].operator_token`), a channel through
//! the runplane transport (so a call whose outcome is unknown is retried only when its
//! proto options say it may be), and how a refusal is shown.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::bail;
use runplane_config::Config;
use runplane_grpc::client::Bearer;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_transport::{RetryConfig, RetryLayer, RunnerChannel};
use tonic::service::interceptor::InterceptedService;

/// Where to reach the run store and as whom.
#[derive(Debug, Clone, clap::Args)]
pub struct RunStoreConnect {
    /// Run store endpoint; defaults to [run_store].endpoint. Several, separated by
    /// commas, are replicas, and a name stands for every address it resolves to: a
    /// command starts at a random one, and a call that cannot connect or stalls moves
    /// to the next.
    #[arg(long, value_name = "URL")]
    pub endpoint: Option<String>,
    /// File holding the operator token (RUNPLANE_TOKEN overrides it).
    #[arg(long, value_name = "FILE", default_value = ".runplane/operator-token")]
    pub token_file: PathBuf,
    /// How long one call keeps retrying while the run store is unreachable or silent
    /// (a restart, a wedged replica), e.g. 30s, 2m; then the command fails.
    #[arg(long, value_name = "DUR", default_value = "30s", value_parser = crate::duration::parse_positive)]
    pub retry_for: Duration,
}

/// How long an operator call keeps retrying by default: long enough to ride out a
/// restart, short enough that a dead endpoint is an error, not a hang.
pub const RETRY_FOR: Duration = Duration::from_secs(30);

/// The transport's policy for a command: the runner's, with `retry_for` as the outage
/// budget of every call. Every attempt is still bounded by its deadline and the
/// handshake timeout, so a silent endpoint fails within the budget.
pub fn retry_config(retry_for: Duration) -> RetryConfig {
    RetryConfig {
        ordinary_budget: retry_for,
        terminal_budget: retry_for,
        ..RetryConfig::default()
    }
}

/// A channel that carries the operator token on every call.
pub type OperatorChannel = InterceptedService<RunnerChannel, Bearer>;

/// A run store client as an operator.
pub type RunStoreClient = RunServiceClient<OperatorChannel>;

/// The operator token: RUNPLANE_TOKEN, else the token file, else the config's.
pub fn token(file: &Path, config: &Config) -> anyhow::Result<String> {
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

/// Loads the config, installs its TLS client settings and opens a lazily connecting
/// channel to `endpoint` (or the endpoint `default_endpoint` picks from the config).
pub fn channel(
    config_file: Option<&Path>,
    endpoint: Option<&str>,
    token_file: &Path,
    default_endpoint: impl FnOnce(&Config) -> &str,
) -> anyhow::Result<OperatorChannel> {
    channel_retrying_for(
        config_file,
        endpoint,
        token_file,
        default_endpoint,
        RETRY_FOR,
    )
}

/// [`channel`] whose calls keep retrying for `retry_for` at most.
pub fn channel_retrying_for(
    config_file: Option<&Path>,
    endpoint: Option<&str>,
    token_file: &Path,
    default_endpoint: impl FnOnce(&Config) -> &str,
    retry_for: Duration,
) -> anyhow::Result<OperatorChannel> {
    let config = Config::load(config_file)?;
    runplane_grpc::tls::install(&config.tls)?;
    let (field, endpoint) = match endpoint {
        Some(endpoint) => ("--endpoint", endpoint.to_owned()),
        None => (
            "the config's endpoint",
            default_endpoint(&config).to_owned(),
        ),
    };
    let token = token(token_file, &config)?;
    // The CLI rides out a control-plane restart like the runner does, for `retry_for`.
    // A command starts at a random replica, so operators' calls spread over them.
    let layer = RetryLayer::new(retry_config(retry_for));
    let channel = runplane_transport::connect_lazy_spread(&endpoint, &layer)
        .map_err(|e| anyhow::anyhow!("{field}: {e}"))?;
    Ok(InterceptedService::new(channel, Bearer::new(token)))
}

/// A run store client per `connect`.
pub fn run_store(
    config_file: Option<&Path>,
    connect: &RunStoreConnect,
) -> anyhow::Result<RunStoreClient> {
    let channel = channel_retrying_for(
        config_file,
        connect.endpoint.as_deref(),
        &connect.token_file,
        |c| &c.run_store.endpoint,
        connect.retry_for,
    )?;
    Ok(RunServiceClient::new(channel))
}

/// A refusal as the operator sees it: `NOT_FOUND: run … not found (RUN_NOT_FOUND)`, the
/// gRPC code's canonical name, the server's message and its `ErrorInfo` reason.
#[derive(Debug)]
pub struct RpcError {
    pub code: tonic::Code,
    pub message: String,
    pub reason: Option<String>,
}

impl From<tonic::Status> for RpcError {
    fn from(status: tonic::Status) -> Self {
        Self {
            code: status.code(),
            message: status.message().to_owned(),
            reason: runplane_grpc::error::error_info(&status)
                .map(|info| info.reason)
                .filter(|r| !r.is_empty()),
        }
    }
}

impl fmt::Display for RpcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", code_name(self.code), self.message)?;
        if let Some(reason) = &self.reason {
            write!(f, " ({reason})")?;
        }
        Ok(())
    }
}

impl std::error::Error for RpcError {}

/// A failed call as an error for `main` to print.
pub fn rpc(status: tonic::Status) -> anyhow::Error {
    RpcError::from(status).into()
}

/// The canonical name of a gRPC code, as grpcurl and the gRPC spec print it.
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

/// A fresh idempotency key for one invocation: retries of this invocation (by the
/// transport) reuse it and are deduped; the next invocation is a new request.
pub fn idempotency_key(what: &str) -> String {
    format!("cli-{what}-{}", uuid::Uuid::new_v4().simple())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_shows_the_code_name_the_message_and_the_reason() {
        let status = runplane_grpc::error::status_with_reason(
            tonic::Code::NotFound,
            runplane_grpc::error::ErrorReason::RunNotFound,
            "run 0190 not found",
            [("run_id", "0190")],
        );
        assert_eq!(
            rpc(status).to_string(),
            "NOT_FOUND: run 0190 not found (RUN_NOT_FOUND)"
        );
        assert_eq!(
            rpc(tonic::Status::unimplemented("no CancelRun")).to_string(),
            "UNIMPLEMENTED: no CancelRun"
        );
    }

    #[test]
    fn idempotency_keys_are_fresh_and_within_the_bounds() {
        let a = idempotency_key("cancel");
        assert_ne!(a, idempotency_key("cancel"));
        assert!((16..=128).contains(&a.len()) && a.is_ascii(), "{a}");
    }
}
