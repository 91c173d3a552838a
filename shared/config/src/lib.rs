//! runplane's configuration.
//!
//! Sources, later wins: built-in defaults, a TOML file, then environment variables named
//! `RUNPLANE_<SECTION>__<FIELD>` (double underscore between section and field, e.g.
//! `RUNPLANE_SERVER__LISTEN=0.0.0.0:7070`). [`Config::load`] validates the result and
//! every error names the field it is about; secrets never appear in an error.

use std::fmt;
use std::net::SocketAddr;
use std::path::Path;

use figment::Figment;
use figment::providers::{Env, Format, Toml};
use serde::Deserialize;

/// The rule for ids of orgs, leads, credentials and profiles, everywhere runplane takes
/// one: 1–128 bytes of `[A-Za-z0-9._:-]`.
pub fn is_name(value: &str) -> bool {
    (1..=128).contains(&value.len())
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b))
}

/// Prefix of every environment override.
pub const ENV_PREFIX: &str = "RUNPLANE_";
/// Default address the services listen on.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7070";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {path} does not exist")]
    MissingFile { path: String },
    #[error("invalid config: {0}")]
    Parse(String),
    #[error("invalid config: {field}: {reason}")]
    Invalid {
        field: std::borrow::Cow<'static, str>,
        reason: String,
    },
}

/// `Ok` when `value` lies in `range`; otherwise `field` is invalid and "must be between"
/// the range's ends, which is how every bounded number of the config is checked.
fn in_range<T: PartialOrd + std::fmt::Display>(
    field: impl Into<std::borrow::Cow<'static, str>>,
    value: T,
    range: std::ops::RangeInclusive<T>,
) -> Result<(), ConfigError> {
    if range.contains(&value) {
        Ok(())
    } else {
        Err(ConfigError::invalid(field, between(&range)))
    }
}

/// "must be between LO and HI".
fn between<T: std::fmt::Display>(range: &std::ops::RangeInclusive<T>) -> String {
    format!("must be between {} and {}", range.start(), range.end())
}

impl ConfigError {
    fn invalid(
        field: impl Into<std::borrow::Cow<'static, str>>,
        reason: impl Into<String>,
    ) -> Self {
        ConfigError::Invalid {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// A secret string (token, key). Its `Debug` and `Display` never show it.
#[derive(Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The secret itself, for comparing or sending; never log it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_empty() {
            "<unset>"
        } else {
            "<redacted>"
        })
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub server: ServerConfig,
    pub auth: AuthConfig,
    pub telemetry: TelemetryConfig,
    pub run_store: RunStoreConfig,
    pub sandbox_reconciler: SandboxReconcilerConfig,
    pub stream_recovery: StreamRecoveryConfig,
    pub credential_health: CredentialHealthConfig,
    pub node: NodeConfig,
    pub tls: TlsConfig,
}

/// TLS of every gRPC server and client of this process (rustls). All fields are paths
/// to PEM files; empty means unset. Files are read once at start-up
/// (`runplane_grpc::tls::install`), where an unreadable or unparsable one is an error
/// naming its field.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsConfig {
    /// Certificate chain this process serves with, and presents as a client when a
    /// server asks for one (mutual TLS). Set: servers speak TLS only.
    pub cert_file: String,
    /// Private key of `cert_file`.
    pub key_file: String,
    /// Servers require a client certificate signed by this CA (mutual TLS). Empty: no
    /// client certificate is asked for.
    pub client_ca_file: String,
    /// Clients trust servers of `https://` endpoints signed by this CA. Required for any
    /// `https://` endpoint (no system roots are used).
    pub ca_file: String,
}

impl TlsConfig {
    /// Whether servers speak TLS.
    pub fn serves_tls(&self) -> bool {
        !self.cert_file.is_empty()
    }

    /// Whether servers require client certificates.
    pub fn requires_client_certificates(&self) -> bool {
        !self.client_ca_file.is_empty()
    }
}

/// A node agent (`runplane node`) of the direct substrate.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeConfig {
    /// The node's id; stable across restarts.
    pub id: String,
    /// `host:port` where sessions reach this node, as registered.
    pub endpoint: String,
    /// `host:port` its session endpoint listens on; empty: `endpoint`'s.
    pub listen: String,
    /// Sandboxes this node runs at once.
    pub capacity: u32,
    /// Where the node keeps its sandboxes' pid, exit status and runner log.
    pub state_dir: String,
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            id: "node-1".to_owned(),
            endpoint: "127.0.0.1:7443".to_owned(),
            listen: String::new(),
            capacity: 8,
            state_dir: ".runplane/node-sandboxes".to_owned(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Address the gRPC server listens on.
    pub listen: String,
    /// How long in-flight calls get to finish after SIGTERM/SIGINT.
    pub shutdown_grace_seconds: u64,
    /// HTTP/2 streams one connection may have open at once; a well-behaved client
    /// queues past it, a stream opened anyway is refused (REFUSED_STREAM).
    pub max_concurrent_streams: u32,
    /// Streams of one connection the server may reset for the client's errors
    /// (refused, malformed) before it closes the connection with ENHANCE_YOUR_CALM:
    /// the reset-flood guard (RUSTSEC-2024-0003).
    pub max_local_error_reset_streams: u32,
    /// An HTTP/2 PING after this many idle seconds on a connection; 0 for none.
    pub keepalive_interval_seconds: u64,
    /// A connection whose PING is unanswered this many seconds is closed.
    pub keepalive_timeout_seconds: u64,
    /// A connection older than this many seconds is sent GOAWAY, so clients behind an L4
    /// balancer spread out again; 0 for no limit.
    pub max_connection_age_seconds: u64,
    /// How long calls on an aged-out connection get to finish before it is closed.
    pub max_connection_age_grace_seconds: u64,
    /// The largest request message a service decodes, in bytes; a larger one is refused
    /// (INVALID_ARGUMENT, MESSAGE_TOO_LARGE) before its handler runs.
    pub max_decoding_message_bytes: u32,
    /// Per-service overrides of `max_decoding_message_bytes`, by full service name
    /// (e.g. `"runplane.runstore.v1.RunnerService" = 2097152`).
    pub max_decoding_message_bytes_by_service: std::collections::BTreeMap<String, u32>,
    /// Ordinary calls (not long polls or streams) one service handles at once; past it a
    /// call waits up to `overload_queue_ms` for a slot, then is refused with
    /// RESOURCE_EXHAUSTED (RATE_LIMITED) and pushback. 0 for no limit.
    pub max_concurrent_requests: u32,
    /// Per-service overrides of `max_concurrent_requests`, by full service name.
    pub max_concurrent_requests_by_service: std::collections::BTreeMap<String, u32>,
    /// The pushback a shed call is told to wait, in milliseconds.
    pub overload_pushback_ms: u64,
    /// How long a call over the limit waits for a slot, in arrival order, before it is
    /// shed, in milliseconds: a burst is served in order instead of refused and retried
    /// at random. 0 sheds at once.
    pub overload_queue_ms: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: DEFAULT_LISTEN.to_owned(),
            shutdown_grace_seconds: 10,
            max_concurrent_streams: 256,
            max_local_error_reset_streams: 1024,
            keepalive_interval_seconds: 30,
            keepalive_timeout_seconds: 10,
            max_connection_age_seconds: 0,
            max_connection_age_grace_seconds: 60,
            max_decoding_message_bytes: 4 * 1024 * 1024,
            max_decoding_message_bytes_by_service: Default::default(),
            max_concurrent_requests: 512,
            max_concurrent_requests_by_service: Default::default(),
            overload_pushback_ms: 250,
            overload_queue_ms: 100,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// Bearer token of operators (humans, the CLI, grpcurl) acting in any org. Required
    /// to serve; at least 32 characters.
    pub operator_token: Secret,
    /// Bearer token runplane's services call each other with, any org. Required to
    /// serve; at least 32 characters, and not the operator token. It cannot reach what
    /// only operators may do (CreateRun, steering, node credentials), and node agents
    /// never hold it: each has its own node credential.
    pub service_token: Secret,
    /// Org-scoped operator tokens: org id to token (each at least 32 characters). A call
    /// with one of these acts only in its org.
    pub org_tokens: std::collections::BTreeMap<String, Secret>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// `text` for people, `json` for log pipelines.
    pub log_format: LogFormat,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunStoreConfig {
    /// `postgres://…` or `sqlite://path`.
    pub database_url: String,
    /// Where other services and runners reach the run store.
    pub endpoint: String,
    /// Ed25519 seed (64 hex digits) that signs receipts; required to serve the run store.
    /// `runplane receipt keygen` makes one.
    pub receipt_signing_key: Secret,
    /// Most events in one AppendEvents batch.
    pub max_batch_events: u32,
    /// Most bytes of events in one batch.
    pub max_batch_bytes: u32,
    /// Longest PollSteering wait honoured, in seconds.
    pub max_poll_wait_seconds: u32,
    /// Ask credential health ([credential_health].endpoint) for admission before a run
    /// is created, and report failed turns to it for classification. Turn it off only
    /// where no credential health runs: runs are then created on the credential or
    /// profile as named and failures are not classified.
    pub admission: bool,
    /// The longest deadline a run may ask for (CreateRun's max_duration, a profile's
    /// max_run_seconds), in seconds.
    pub max_run_duration_seconds: u32,
    /// How often a replica looks for runs past their deadline, in milliseconds.
    pub deadline_sweep_interval_ms: u32,
}

impl Default for RunStoreConfig {
    fn default() -> Self {
        Self {
            database_url: "postgres://postgres@127.0.0.1:5432/runplane_run_store".to_owned(),
            endpoint: default_endpoint(),
            receipt_signing_key: Secret::default(),
            max_batch_events: 1000,
            max_batch_bytes: 1 << 20,
            max_poll_wait_seconds: 30,
            admission: true,
            max_run_duration_seconds: 7 * 24 * 3600,
            deadline_sweep_interval_ms: 1000,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SandboxReconcilerConfig {
    pub database_url: String,
    pub endpoint: String,
    /// How long a sandbox must stay exited or lost before its run is failed.
    pub loss_grace_seconds: u32,
    /// Key that signs route tokens. Empty: one derived from `auth.service_token`. Node
    /// agents never see it, only a key derived from it for their own node id.
    pub route_token_key: Secret,
    /// Lifetime of a route token.
    pub route_token_ttl_seconds: u32,
    /// Where the process driver keeps each local sandbox's pid, exit status and log.
    pub state_dir: String,
    /// How often dispatch, the reconcile tick and outbox delivery run, in milliseconds.
    pub tick_interval_ms: u32,
    /// Idle time after which a node agent suspends a sandbox (0: never).
    pub idle_timeout_seconds: u32,
    /// Give queued runs sandboxes. Off for a reconciler that only serves routes and
    /// nodes, or to drive a run's runner protocol by hand.
    pub dispatch: bool,
    /// Run sandboxes as local processes of this reconciler when no node agent is ready
    /// (single-machine mode). Turn it off when several reconciler replicas run: local
    /// sandboxes live in one replica's process tree, which the others cannot probe or
    /// signal; queued runs then wait for a node agent (`runplane node`).
    pub local_sandboxes: bool,
    /// How the process driver (here and on `runplane node`) contains an agent. `bwrap`,
    /// the default, refuses to start where bubblewrap cannot create namespaces; `none`
    /// must be chosen explicitly.
    pub isolation: Isolation,
    /// Whether a contained agent has the host's network (`host`, the default: agents call
    /// model APIs) or none at all (`none`).
    pub network: SandboxNetwork,
    /// The uids sandboxes run as when the driver runs as root: each live sandbox gets its
    /// own from `[sandbox_uid_base, sandbox_uid_base + sandbox_uid_count)`.
    pub sandbox_uid_base: u32,
    pub sandbox_uid_count: u32,
}

/// `sandbox_reconciler.isolation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Isolation {
    /// Each agent under bubblewrap: its own pid, mount, ipc and uts namespaces, the system
    /// read-only, its workspace writable, an unprivileged uid, no new privileges.
    #[default]
    Bwrap,
    /// The agent runs as the driver's user, in its namespaces, seeing what it sees.
    None,
}

/// `sandbox_reconciler.network`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxNetwork {
    #[default]
    Host,
    None,
}

impl Default for SandboxReconcilerConfig {
    fn default() -> Self {
        Self {
            database_url: "postgres://postgres@127.0.0.1:5432/runplane_sandbox_reconciler"
                .to_owned(),
            endpoint: default_endpoint(),
            loss_grace_seconds: 90,
            route_token_key: Secret::default(),
            route_token_ttl_seconds: 60,
            state_dir: ".runplane/sandboxes".to_owned(),
            tick_interval_ms: 2000,
            idle_timeout_seconds: 0,
            dispatch: true,
            local_sandboxes: true,
            isolation: Isolation::Bwrap,
            network: SandboxNetwork::Host,
            sandbox_uid_base: 200_000,
            sandbox_uid_count: 65_536,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StreamRecoveryConfig {
    /// One Redis, `redis://[user:password@]host:port[/db]` (`rediss://` for TLS); or a
    /// Redis Cluster, `redis+cluster://[user:password@]host:port,host:port,...` or a
    /// comma-separated list of `redis://` seed nodes; or `memory://`, the in-process store.
    pub redis_url: String,
    /// Prefix of every Redis key the coordinator writes (no `{` or `}`: a run's keys are
    /// hash-tagged `{run:<id>}` so each run's keys share one cluster slot).
    pub key_prefix: String,
    pub endpoint: String,
}

/// `url` with any password replaced, safe to log or put in an error; a comma-separated
/// list (cluster seeds) has each element's replaced.
pub fn redact_url(url: &str) -> String {
    url.split(',').map(redact_one).collect::<Vec<_>>().join(",")
}

fn redact_one(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let userinfo = &url[scheme_end + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme_end + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

/// Where the stream recovery coordinator keeps its state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// The in-process store (`memory://`).
    Memory,
    /// One Redis server.
    Single(String),
    /// A Redis Cluster, by its seed nodes (each a `redis://` or `rediss://` URL).
    Cluster(Vec<String>),
}

impl StreamRecoveryConfig {
    /// `redis_url`, parsed (see [`RedisTarget::parse`]).
    pub fn target(&self) -> Result<RedisTarget, &'static str> {
        RedisTarget::parse(&self.redis_url)
    }
}

const REDIS_URL_FORMS: &str = "must be redis://host:port, rediss://host:port, \
     redis+cluster://host:port,host:port,..., a comma-separated list of redis:// seed nodes, \
     or memory:// for the in-process store";

impl RedisTarget {
    /// A `[stream_recovery].redis_url`, in any of its forms; the reason is safe to show
    /// (it never repeats the URL, which may hold a password).
    pub fn parse(url: &str) -> Result<Self, &'static str> {
        let single = |u: &str| u.starts_with("redis://") || u.starts_with("rediss://");
        if url == "memory://" {
            return Ok(RedisTarget::Memory);
        }
        for (scheme, node_scheme) in [
            ("redis+cluster://", "redis://"),
            ("rediss+cluster://", "rediss://"),
        ] {
            if let Some(rest) = url.strip_prefix(scheme) {
                let rest = rest.trim_end_matches('/');
                // Credentials, if any, are written once before the first host and apply to all.
                let (userinfo, hosts) = match rest.rsplit_once('@') {
                    Some((u, h)) => (format!("{u}@"), h),
                    None => (String::new(), rest),
                };
                let seeds: Vec<String> = hosts
                    .split(',')
                    .map(|h| format!("{node_scheme}{userinfo}{}", h.trim()))
                    .collect();
                if hosts
                    .split(',')
                    .any(|h| h.trim().is_empty() || h.contains('/'))
                {
                    return Err("a redis+cluster:// URL lists host:port seeds separated by commas");
                }
                return Ok(RedisTarget::Cluster(seeds));
            }
        }
        if url.contains(',') {
            let seeds: Vec<String> = url.split(',').map(|s| s.trim().to_owned()).collect();
            if seeds
                .iter()
                .all(|s| single(s) && s.len() > "redis://".len())
            {
                return Ok(RedisTarget::Cluster(seeds));
            }
            return Err(REDIS_URL_FORMS);
        }
        if single(url) {
            return Ok(RedisTarget::Single(url.to_owned()));
        }
        Err(REDIS_URL_FORMS)
    }
}

impl Default for StreamRecoveryConfig {
    fn default() -> Self {
        Self {
            redis_url: "redis://127.0.0.1:6379".to_owned(),
            key_prefix: "runplane:".to_owned(),
            endpoint: default_endpoint(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CredentialHealthConfig {
    pub database_url: String,
    pub endpoint: String,
    /// Distinct runs whose backend errors on one credential open an outage incident.
    /// At least 2: one failing run is one bad turn, not an outage.
    pub outage_threshold: u32,
    /// How far apart (inclusive) those failures may be, in seconds.
    pub outage_window_seconds: u32,
    /// How long an incident keeps its credential out of admission, in seconds.
    pub cool_off_seconds: u32,
    /// How long an exhausted credential is quarantined, in seconds.
    pub quarantine_seconds: u32,
    /// How long lead notices are kept for WatchNotices, in hours.
    pub notice_retention_hours: u32,
    /// Profiles runs are admitted through. A profile name may appear with several
    /// credentials; admission then picks a healthy one.
    pub profiles: Vec<ProfileConfig>,
}

impl Default for CredentialHealthConfig {
    fn default() -> Self {
        Self {
            database_url: "postgres://postgres@127.0.0.1:5432/runplane_credential_health"
                .to_owned(),
            endpoint: default_endpoint(),
            outage_threshold: 2,
            outage_window_seconds: 60,
            cool_off_seconds: 60,
            quarantine_seconds: 1800,
            notice_retention_hours: 168,
            profiles: vec![ProfileConfig::default()],
        }
    }
}

/// A profile: a credential runs execute under, how many at once, and how its agents'
/// failure output reads. The patterns are regular expressions (Rust `regex` syntax),
/// compiled once when credential health starts; an invalid one stops the start.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileConfig {
    pub name: String,
    #[serde(alias = "credentialId")]
    pub credential_id: String,
    /// Runs this profile may carry on the credential at once.
    pub capacity: u32,
    /// A failure tail matching it is a transient backend error.
    #[serde(alias = "errorPattern")]
    pub error_pattern: String,
    /// A failure tail matching it means the credential is spent; checked first.
    #[serde(alias = "exhaustedPattern")]
    pub exhausted_pattern: String,
    /// The deadline of a run created through this profile without one of its own, in
    /// seconds; 0 for none.
    #[serde(default, alias = "maxRunSeconds")]
    pub max_run_seconds: u32,
    /// The orgs whose runs may use this profile's credential through it. Empty: every
    /// org (a shared credential, as the embedded default is); list the orgs on every
    /// profile of a deployment with org tokens, or one org's failures cool off another's
    /// runs.
    #[serde(default)]
    pub orgs: Vec<String>,
    /// The network of this profile's sandboxes: `none` takes it away (bubblewrap's
    /// `--unshare-net`: only loopback), for runs that must not reach anything; unset, the
    /// deployment's `sandbox_reconciler.network`. It can only take the network away: a
    /// profile cannot give one to sandboxes of a deployment whose network is `none`.
    #[serde(default)]
    pub network: Option<SandboxNetwork>,
}

impl CredentialHealthConfig {
    /// The profiles whose sandboxes have no network (`network = "none"`).
    pub fn offline_profiles(&self) -> std::collections::BTreeSet<String> {
        self.profiles
            .iter()
            .filter(|p| p.network == Some(SandboxNetwork::None))
            .map(|p| p.name.clone())
            .collect()
    }
}

impl Default for ProfileConfig {
    /// The embedded default: profile `default` on credential `local`, with the wording
    /// common model backends use for a failed request and for a spent quota.
    fn default() -> Self {
        Self {
            name: "default".to_owned(),
            credential_id: "local".to_owned(),
            capacity: 8,
            error_pattern: r"(?i)API Error:|No response from API|overloaded_error|\b(502|503|504|529)\b.*(Bad Gateway|Unavailable|Timeout|Overloaded)".to_owned(),
            exhausted_pattern: r"(?i)credit balance is too low|insufficient_quota|quota exceeded|usage limit reached".to_owned(),
            max_run_seconds: 0,
            orgs: Vec::new(),
            network: None,
        }
    }
}

/// An endpoint field is one `http://` or `https://` URL or several separated by commas
/// (replicas). The full parse happens where the client is built
/// (`runplane_grpc::endpoints`); this catches a bad list at start-up, naming the field
/// and the entry, and never echoing an entry that could hold a secret.
fn validate_endpoint_list(field: &str, list: &str, has_ca: bool) -> Result<(), ConfigError> {
    for (i, entry) in list.split(',').map(str::trim).enumerate() {
        let which = format!("entry {} of the list", i + 1);
        if entry.is_empty() {
            return Err(ConfigError::invalid(
                field.to_owned(),
                format!(
                    "{which} is empty: give one http:// or https:// URL, or several separated by commas"
                ),
            ));
        }
        if entry.contains(['@', '?']) {
            return Err(ConfigError::invalid(
                field.to_owned(),
                format!(
                    "{which} (not shown) has userinfo or a query: credentials do not belong in an endpoint"
                ),
            ));
        }
        let rest = entry
            .strip_prefix("http://")
            .or_else(|| entry.strip_prefix("https://"));
        match rest {
            None => {
                return Err(ConfigError::invalid(
                    field.to_owned(),
                    format!("{which} (`{entry}`) must be an http:// or https:// URL"),
                ));
            }
            Some(rest)
                if rest.trim_end_matches('/').is_empty()
                    || rest.trim_end_matches('/').contains('/') =>
            {
                return Err(ConfigError::invalid(
                    field.to_owned(),
                    format!("{which} (`{entry}`) must be a host and port, with no path"),
                ));
            }
            Some(_) => {}
        }
        if entry.starts_with("https://") && !has_ca {
            return Err(ConfigError::invalid(
                "tls.ca_file",
                format!(
                    "required by the https:// endpoint in {field}: the CA that signed its server certificate"
                ),
            ));
        }
    }
    Ok(())
}

fn default_endpoint() -> String {
    format!("http://{DEFAULT_LISTEN}")
}

impl Config {
    /// Defaults, then `file` (when given), then `RUNPLANE_*` variables; validated.
    pub fn load(file: Option<&Path>) -> Result<Config, ConfigError> {
        refuse_unreadable_env()?;
        Self::from_figment(Self::figment(file)?)
    }

    /// The layered sources, before extraction. Exposed so tests can add their own.
    pub fn figment(file: Option<&Path>) -> Result<Figment, ConfigError> {
        let mut figment = Figment::new();
        if let Some(path) = file {
            if !path.is_file() {
                return Err(ConfigError::MissingFile {
                    path: path.display().to_string(),
                });
            }
            figment = figment.merge(Toml::file_exact(path));
        }
        // Only `SECTION__FIELD` variables are configuration; others with the prefix
        // (`RUNPLANE_CONFIG`, the runner's `RUNPLANE_RUN_KEY`) belong to someone else.
        Ok(figment.merge(
            Env::prefixed(ENV_PREFIX)
                .filter(|key| key.as_str().contains("__"))
                .split("__"),
        ))
    }

    pub fn from_figment(figment: Figment) -> Result<Config, ConfigError> {
        let config: Config = figment
            .extract()
            .map_err(|e| ConfigError::Parse(describe(e)))?;
        config.validate()?;
        Ok(config)
    }

    /// Checks what serde cannot. Requirements that depend on the role (tokens to serve)
    /// are checked by [`Config::require_operator_token`] and
    /// [`Config::require_service_token`].
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.listen_addr()?;
        in_range(
            "server.shutdown_grace_seconds",
            self.server.shutdown_grace_seconds,
            1..=600,
        )?;
        self.validate_server_limits()?;
        if !self.auth.operator_token.is_empty() && self.auth.operator_token.expose().len() < 32 {
            return Err(ConfigError::invalid(
                "auth.operator_token",
                "must be at least 32 characters",
            ));
        }
        if !self.auth.service_token.is_empty() && self.auth.service_token.expose().len() < 32 {
            return Err(ConfigError::invalid(
                "auth.service_token",
                "must be at least 32 characters",
            ));
        }
        if !self.auth.service_token.is_empty()
            && self.auth.service_token.expose() == self.auth.operator_token.expose()
        {
            return Err(ConfigError::invalid(
                "auth.service_token",
                "must differ from auth.operator_token: services and operators hold different secrets",
            ));
        }
        if self
            .auth
            .org_tokens
            .iter()
            .any(|(org, token)| org.is_empty() || token.expose().len() < 32)
        {
            return Err(ConfigError::invalid(
                "auth.org_tokens",
                "every entry needs a non-empty org id and a token of at least 32 characters",
            ));
        }
        let key = self.run_store.receipt_signing_key.expose();
        if !key.is_empty() && (key.len() != 64 || !key.bytes().all(|b| b.is_ascii_hexdigit())) {
            return Err(ConfigError::invalid(
                "run_store.receipt_signing_key",
                "must be 64 hex digits (an Ed25519 seed; `runplane receipt keygen` makes one)",
            ));
        }
        in_range(
            "run_store.max_batch_events",
            self.run_store.max_batch_events,
            1..=10_000,
        )?;
        in_range(
            "run_store.max_batch_bytes",
            self.run_store.max_batch_bytes,
            1024..=(16 << 20),
        )?;
        in_range(
            "sandbox_reconciler.loss_grace_seconds",
            self.sandbox_reconciler.loss_grace_seconds,
            1..=3600,
        )?;
        let uids = &self.sandbox_reconciler;
        if uids.sandbox_uid_base < 1000
            || uids.sandbox_uid_count == 0
            || uids
                .sandbox_uid_base
                .checked_add(uids.sandbox_uid_count)
                .is_none()
        {
            return Err(ConfigError::invalid(
                "sandbox_reconciler.sandbox_uid_base",
                "sandbox_uid_base must be at least 1000 and sandbox_uid_count at least 1, \
                 and the range must fit in a u32",
            ));
        }
        in_range(
            "sandbox_reconciler.tick_interval_ms",
            self.sandbox_reconciler.tick_interval_ms,
            100..=600_000,
        )?;
        in_range(
            "sandbox_reconciler.route_token_ttl_seconds",
            self.sandbox_reconciler.route_token_ttl_seconds,
            1..=3600,
        )?;
        self.validate_credential_health()?;
        self.validate_tls()?;
        if self.run_store.max_run_duration_seconds == 0 {
            return Err(ConfigError::invalid(
                "run_store.max_run_duration_seconds",
                "must be at least 1",
            ));
        }
        in_range(
            "run_store.deadline_sweep_interval_ms",
            self.run_store.deadline_sweep_interval_ms,
            10..=600_000,
        )?;
        in_range(
            "run_store.max_poll_wait_seconds",
            self.run_store.max_poll_wait_seconds,
            1..=300,
        )?;
        for (field, url) in [
            ("run_store.database_url", &self.run_store.database_url),
            (
                "sandbox_reconciler.database_url",
                &self.sandbox_reconciler.database_url,
            ),
            (
                "credential_health.database_url",
                &self.credential_health.database_url,
            ),
        ] {
            if !(url.starts_with("postgres://")
                || url.starts_with("postgresql://")
                || url.starts_with("sqlite:"))
            {
                return Err(ConfigError::invalid(
                    field,
                    "must start with postgres:// or sqlite:",
                ));
            }
        }
        if let Err(reason) = self.stream_recovery.target() {
            return Err(ConfigError::invalid("stream_recovery.redis_url", reason));
        }
        // A brace in the prefix would become every key's hash tag: all runs in one slot.
        if self.stream_recovery.key_prefix.contains(['{', '}']) {
            return Err(ConfigError::invalid(
                "stream_recovery.key_prefix",
                "must not contain { or } (they would make every key share one cluster slot)",
            ));
        }
        for (field, endpoint) in [
            ("run_store.endpoint", &self.run_store.endpoint),
            (
                "sandbox_reconciler.endpoint",
                &self.sandbox_reconciler.endpoint,
            ),
            ("stream_recovery.endpoint", &self.stream_recovery.endpoint),
            (
                "credential_health.endpoint",
                &self.credential_health.endpoint,
            ),
        ] {
            validate_endpoint_list(field, endpoint, !self.tls.ca_file.is_empty())?;
        }
        Ok(())
    }

    /// Pairs the TLS fields must come in; that the files are readable PEM is checked
    /// when they are read (`runplane_grpc::tls::install`).
    fn validate_server_limits(&self) -> Result<(), ConfigError> {
        let server = &self.server;
        if server.max_concurrent_streams == 0 {
            return Err(ConfigError::invalid(
                "server.max_concurrent_streams",
                "must be at least 1",
            ));
        }
        if server.max_local_error_reset_streams == 0 {
            return Err(ConfigError::invalid(
                "server.max_local_error_reset_streams",
                "must be at least 1",
            ));
        }
        if server.keepalive_interval_seconds > 0 && server.keepalive_timeout_seconds == 0 {
            return Err(ConfigError::invalid(
                "server.keepalive_timeout_seconds",
                "must be at least 1 when keepalive_interval_seconds is set",
            ));
        }
        const MESSAGE_BYTES: std::ops::RangeInclusive<u32> = 1024..=(64 * 1024 * 1024);
        in_range(
            "server.max_decoding_message_bytes",
            server.max_decoding_message_bytes,
            MESSAGE_BYTES,
        )?;
        for (service, bytes) in &server.max_decoding_message_bytes_by_service {
            if !MESSAGE_BYTES.contains(bytes) {
                return Err(ConfigError::invalid(
                    "server.max_decoding_message_bytes_by_service",
                    format!("{service}: {}", between(&MESSAGE_BYTES)),
                ));
            }
        }
        in_range(
            "server.overload_pushback_ms",
            server.overload_pushback_ms,
            1..=60_000,
        )?;
        in_range(
            "server.overload_queue_ms",
            server.overload_queue_ms,
            0..=10_000,
        )?;
        Ok(())
    }

    fn validate_tls(&self) -> Result<(), ConfigError> {
        let t = &self.tls;
        if !t.cert_file.is_empty() && t.key_file.is_empty() {
            return Err(ConfigError::invalid(
                "tls.key_file",
                "required when tls.cert_file is set: the private key of that certificate",
            ));
        }
        if !t.key_file.is_empty() && t.cert_file.is_empty() {
            return Err(ConfigError::invalid(
                "tls.cert_file",
                "required when tls.key_file is set: the certificate of that key",
            ));
        }
        if !t.client_ca_file.is_empty() && t.cert_file.is_empty() {
            return Err(ConfigError::invalid(
                "tls.cert_file",
                "required when tls.client_ca_file is set: asking for client certificates \
                 needs a TLS server, which needs a certificate and key",
            ));
        }
        Ok(())
    }

    fn validate_credential_health(&self) -> Result<(), ConfigError> {
        let c = &self.credential_health;
        if !(2..=1000).contains(&c.outage_threshold) {
            return Err(ConfigError::invalid(
                "credential_health.outage_threshold",
                "must be between 2 and 1000 (one failing run is not an outage)",
            ));
        }
        for (field, value, max) in [
            (
                "credential_health.outage_window_seconds",
                c.outage_window_seconds,
                3600,
            ),
            (
                "credential_health.cool_off_seconds",
                c.cool_off_seconds,
                3600,
            ),
            (
                "credential_health.quarantine_seconds",
                c.quarantine_seconds,
                7 * 86_400,
            ),
            (
                "credential_health.notice_retention_hours",
                c.notice_retention_hours,
                24 * 365,
            ),
        ] {
            in_range(field, value, 1..=max)?;
        }
        let mut seen = std::collections::BTreeSet::new();
        for (i, p) in c.profiles.iter().enumerate() {
            let field = format!("credential_health.profiles[{i}]");
            for (what, value) in [("name", &p.name), ("credential_id", &p.credential_id)] {
                if !is_name(value) {
                    return Err(ConfigError::invalid(
                        format!("{field}.{what}"),
                        "must be 1-128 characters of A-Z a-z 0-9 . _ : -",
                    ));
                }
            }
            if let Some(j) = p.orgs.iter().position(|org| !is_name(org)) {
                return Err(ConfigError::invalid(
                    format!("{field}.orgs[{j}]"),
                    "must be 1-128 characters of A-Z a-z 0-9 . _ : -",
                ));
            }
            in_range(format!("{field}.capacity"), p.capacity, 1..=100_000)?;
            if !seen.insert((p.name.as_str(), p.credential_id.as_str())) {
                return Err(ConfigError::invalid(
                    field,
                    format!(
                        "profile `{}` names credential `{}` twice",
                        p.name, p.credential_id
                    ),
                ));
            }
            // A profile's sandboxes have one network, whichever credential carries them.
            if let Some(other) = c
                .profiles
                .iter()
                .find(|o| o.name == p.name && o.network != p.network)
            {
                return Err(ConfigError::invalid(
                    format!("{field}.network"),
                    format!(
                        "profile `{}` gives its sandboxes two networks (on credentials `{}` and `{}`); say it once, the same on every entry",
                        p.name, other.credential_id, p.credential_id
                    ),
                ));
            }
        }
        Ok(())
    }

    pub fn listen_addr(&self) -> Result<SocketAddr, ConfigError> {
        self.server.listen.parse().map_err(|_| {
            ConfigError::invalid(
                "server.listen",
                format!(
                    "`{}` is not a socket address such as 127.0.0.1:7070",
                    self.server.listen
                ),
            )
        })
    }

    /// Serving needs an operator token; the error says how to set one.
    pub fn require_operator_token(&self) -> Result<&Secret, ConfigError> {
        if self.auth.operator_token.is_empty() {
            return Err(ConfigError::invalid(
                "auth.operator_token",
                "required to serve; set it in the config file or RUNPLANE_AUTH__OPERATOR_TOKEN",
            ));
        }
        Ok(&self.auth.operator_token)
    }

    /// Serving needs the service token too; the error says how to set one.
    pub fn require_service_token(&self) -> Result<&Secret, ConfigError> {
        if self.auth.service_token.is_empty() {
            return Err(ConfigError::invalid(
                "auth.service_token",
                "required to serve: the token runplane's services call each other with; set it in the config file or RUNPLANE_AUTH__SERVICE_TOKEN (at least 32 characters, not the operator token)",
            ));
        }
        Ok(&self.auth.service_token)
    }

    pub fn shutdown_grace(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.server.shutdown_grace_seconds)
    }
}

/// figment 0.10 reads a backslash escape in an environment value by character index as
/// if it were a byte index: after a non-ASCII character it panics (or garbles the value).
/// Such a variable is refused, naming its field, before figment sees it (found by
/// fuzzing).
fn refuse_unreadable_env() -> Result<(), ConfigError> {
    for (key, value) in std::env::vars_os() {
        let (Some(key), Some(value)) = (key.to_str(), value.to_str()) else {
            continue;
        };
        let Some(field) = key.strip_prefix(ENV_PREFIX).filter(|f| f.contains("__")) else {
            continue;
        };
        let before_escape = value.split('\\').next().unwrap_or_default();
        if value.contains('\\') && !before_escape.is_ascii() {
            return Err(ConfigError::invalid(
                field.to_lowercase().replace("__", "."),
                "a backslash after a non-ASCII character cannot be read from the environment; set it in the config file",
            ));
        }
    }
    Ok(())
}

/// Fields whose values are secrets, by key name.
const SECRET_KEYS: &[&str] = &[
    "operator_token",
    "service_token",
    "receipt_signing_key",
    "route_token_key",
];

/// Figment's message plus where the bad value came from; never the value of a secret,
/// because figment only quotes values for type errors and secrets are plain strings.
fn describe(error: figment::Error) -> String {
    error
        .into_iter()
        .map(|e| {
            // serde's messages quote the value they could not take; for a secret (an
            // unquoted numeric token, say) that would print it.
            let secret = e.path.last().is_some_and(|key| {
                SECRET_KEYS.iter().any(|s| key.eq_ignore_ascii_case(s))
            }) || e.path.iter().any(|key| key.eq_ignore_ascii_case("org_tokens"));
            if secret {
                format!(
                    "key \"{}\" holds a value of the wrong type (a secret: not shown); expected a string",
                    e.path.join(".")
                )
            } else {
                e.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    // `figment::Error` is large and Jail's closure signature is figment's, not ours.
    #[allow(clippy::result_large_err)]
    fn load_with(toml: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let mut result = None;
        figment::Jail::expect_with(|jail| {
            jail.create_file("runplane.toml", toml)?;
            for (k, v) in env {
                jail.set_env(k, v);
            }
            result = Some(Config::load(Some(Path::new("runplane.toml"))));
            Ok(())
        });
        result.expect("jail ran")
    }

    #[test]
    fn defaults_are_valid_and_listen_locally() {
        let config = load_with("", &[]).expect("defaults load");
        assert_eq!(config.listen_addr().unwrap().to_string(), DEFAULT_LISTEN);
        assert_eq!(config.telemetry.log_format, LogFormat::Text);
        assert!(config.require_operator_token().is_err());
    }

    #[test]
    fn environment_overrides_the_file_and_foreign_variables_are_ignored() {
        let config = load_with(
            "[server]\nlisten = \"127.0.0.1:9000\"\n[telemetry]\nlog_format = \"json\"\n",
            &[
                ("RUNPLANE_SERVER__LISTEN", "0.0.0.0:7171"),
                ("RUNPLANE_RUN_KEY", "not-config"),
                ("RUNPLANE_CONFIG", "runplane.toml"),
            ],
        )
        .expect("loads");
        assert_eq!(config.server.listen, "0.0.0.0:7171");
        assert_eq!(config.telemetry.log_format, LogFormat::Json);
    }

    #[test]
    fn errors_name_the_field() {
        let err = load_with("[server]\nlisten = \"nowhere\"\n", &[]).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("invalid config: server.listen:"),
            "{err}"
        );

        let err =
            load_with("", &[("RUNPLANE_SERVER__SHUTDOWN_GRACE_SECONDS", "soon")]).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.to_lowercase().contains("server.shutdown_grace_seconds"),
            "{msg}"
        );
        assert!(msg.contains("RUNPLANE_"), "{msg}");

        let err = load_with("[server]\nlisten_addr = \"x\"\n", &[]).unwrap_err();
        assert!(err.to_string().contains("listen_addr"), "{err}");

        let err = load_with("[run_store]\ndatabase_url = \"mysql://x\"\n", &[]).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("invalid config: run_store.database_url:"),
            "{err}"
        );
    }

    #[test]
    fn a_short_operator_token_is_refused_without_echoing_it() {
        let err = load_with("[auth]\noperator_token = \"hunter2\"\n", &[]).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.starts_with("invalid config: auth.operator_token:"),
            "{msg}"
        );
        assert!(!msg.contains("hunter2"), "{msg}");
    }

    #[test]
    fn a_profile_may_take_the_network_away_and_says_so_once() {
        let entry = |credential: &str, network: &str| {
            format!(
                "[[credential_health.profiles]]\nname = \"p\"\ncredential_id = \"{credential}\"\ncapacity = 1\nerror_pattern = \"e\"\nexhausted_pattern = \"x\"\n{network}"
            )
        };
        let offline = load_with(
            &(entry("a", "network = \"none\"\n") + &entry("b", "network = \"none\"\n")),
            &[],
        )
        .unwrap();
        assert_eq!(
            offline.credential_health.offline_profiles(),
            ["p".to_owned()].into()
        );
        let default = load_with(&entry("a", ""), &[]).unwrap();
        assert!(default.credential_health.offline_profiles().is_empty());
        let mixed = load_with(&(entry("a", "network = \"none\"\n") + &entry("b", "")), &[])
            .unwrap_err()
            .to_string();
        assert!(
            mixed.contains("profile `p` gives its sandboxes two networks"),
            "{mixed}"
        );
        assert!(load_with(&entry("a", "network = \"off\"\n"), &[]).is_err());
    }

    #[test]
    fn the_service_token_is_required_to_serve_and_is_not_the_operator_token() {
        let operator = "o".repeat(32);
        let none = load_with(&format!("[auth]\noperator_token = \"{operator}\"\n"), &[]).unwrap();
        let missing = none.require_service_token().unwrap_err().to_string();
        assert!(
            missing.starts_with("invalid config: auth.service_token: required to serve"),
            "{missing}"
        );
        let same = load_with(
            &format!("[auth]\noperator_token = \"{operator}\"\nservice_token = \"{operator}\"\n"),
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(
            same.contains("auth.service_token: must differ from auth.operator_token"),
            "{same}"
        );
        assert!(!same.contains(&operator), "{same}");
        let short = load_with("[auth]\nservice_token = \"hunter2\"\n", &[])
            .unwrap_err()
            .to_string();
        assert!(
            short.starts_with("invalid config: auth.service_token:"),
            "{short}"
        );
        assert!(!short.contains("hunter2"), "{short}");
        let both = load_with(
            &format!(
                "[auth]\noperator_token = \"{operator}\"\nservice_token = \"{}\"\n",
                "s".repeat(32)
            ),
            &[],
        )
        .unwrap();
        assert!(both.require_service_token().is_ok());
    }

    #[test]
    fn secrets_do_not_debug_print() {
        let config = load_with(
            "[auth]\noperator_token = \"0123456789abcdef0123456789abcdef\"\n",
            &[],
        )
        .unwrap();
        let debug = format!("{config:?}");
        assert!(!debug.contains("0123456789abcdef"), "{debug}");
        assert!(debug.contains("<redacted>"));
    }

    #[test]
    fn tls_fields_come_in_pairs_and_errors_name_the_missing_field() {
        let err = load_with("[tls]\ncert_file = \"server.pem\"\n", &[]).unwrap_err();
        assert!(
            err.to_string().starts_with("invalid config: tls.key_file:"),
            "{err}"
        );

        let err = load_with("", &[("RUNPLANE_TLS__KEY_FILE", "server.key")]).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("invalid config: tls.cert_file:"),
            "{err}"
        );

        let err = load_with("[tls]\nclient_ca_file = \"ca.pem\"\n", &[]).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("invalid config: tls.cert_file:"),
            "{err}"
        );

        let err =
            load_with("[run_store]\nendpoint = \"https://run-store:7070\"\n", &[]).unwrap_err();
        let msg = err.to_string();
        assert!(msg.starts_with("invalid config: tls.ca_file:"), "{msg}");
        assert!(msg.contains("run_store.endpoint"), "{msg}");

        let err = load_with("[tls]\ncertfile = \"x\"\n", &[]).unwrap_err();
        assert!(err.to_string().contains("certfile"), "{err}");

        let config = load_with(
            "[tls]\ncert_file = \"s.pem\"\nkey_file = \"s.key\"\nclient_ca_file = \"ca.pem\"\n",
            &[("RUNPLANE_TLS__CA_FILE", "ca.pem")],
        )
        .expect("a complete [tls] loads; the files are read later");
        assert!(config.tls.serves_tls());
        assert!(config.tls.requires_client_certificates());
        assert_eq!(config.tls.ca_file, "ca.pem");
    }

    #[test]
    fn an_endpoint_list_is_checked_entry_by_entry_without_echoing_secrets() {
        let config = load_with(
            "[run_store]\nendpoint = \"http://run-store-0:7070, http://run-store-1:7070\"\n",
            &[],
        )
        .expect("a list of replicas loads");
        assert!(config.run_store.endpoint.contains("run-store-1"));
        for (list, says) in [
            (
                "http://a:1,run-store:7070",
                "entry 2 of the list (`run-store:7070`)",
            ),
            ("http://a:1,,http://b:1", "entry 2 of the list is empty"),
            ("http://a:1/v1", "no path"),
        ] {
            let err = load_with(&format!("[run_store]\nendpoint = \"{list}\"\n"), &[])
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("run_store.endpoint") && err.contains(says),
                "{err}"
            );
        }
        let err = load_with(
            "[credential_health]\nendpoint = \"http://a:1,http://u:hunter2-secret@b:1\"\n",
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("credential_health.endpoint"), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
        // An https:// entry anywhere in the list needs a CA.
        let err = load_with("[run_store]\nendpoint = \"http://a:1,https://b:1\"\n", &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("tls.ca_file"), "{err}");
    }

    #[test]
    fn isolation_is_bwrap_unless_none_is_chosen_and_a_bad_uid_range_is_refused() {
        let default = load_with("", &[]).unwrap().sandbox_reconciler;
        assert_eq!(default.isolation, Isolation::Bwrap);
        assert_eq!(default.network, SandboxNetwork::Host);
        let chosen = load_with(
            "[sandbox_reconciler]\nisolation = \"none\"\nnetwork = \"none\"\n",
            &[],
        )
        .unwrap()
        .sandbox_reconciler;
        assert_eq!(chosen.isolation, Isolation::None);
        assert_eq!(chosen.network, SandboxNetwork::None);
        let unknown = load_with("[sandbox_reconciler]\nisolation = \"off\"\n", &[]);
        assert!(unknown.is_err(), "{unknown:?}");
        for range in [
            "sandbox_uid_base = 0",
            "sandbox_uid_count = 0",
            "sandbox_uid_base = 4294967295",
        ] {
            let err = load_with(&format!("[sandbox_reconciler]\n{range}\n"), &[]).unwrap_err();
            assert!(
                err.to_string()
                    .contains("sandbox_reconciler.sandbox_uid_base"),
                "{range}: {err}"
            );
        }
    }

    #[test]
    fn a_profiles_orgs_are_names_and_an_absent_list_shares_it() {
        let profile = "[[credential_health.profiles]]\nname = \"p\"\ncredential_id = \"c\"\ncapacity = 1\nerror_pattern = \"e\"\nexhausted_pattern = \"x\"\n";
        let shared = load_with(profile, &[]).unwrap();
        assert!(shared.credential_health.profiles[0].orgs.is_empty());
        let owned = load_with(&format!("{profile}orgs = [\"acme\", \"globex\"]\n"), &[]).unwrap();
        assert_eq!(owned.credential_health.profiles[0].orgs, ["acme", "globex"]);
        let err = load_with(&format!("{profile}orgs = [\"acme\", \"a b\"]\n"), &[]).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("invalid config: credential_health.profiles[0].orgs[1]:"),
            "{err}"
        );
    }

    #[test]
    fn a_missing_file_is_named() {
        let err = Config::load(Some(Path::new("/nonexistent/runplane.toml"))).unwrap_err();
        assert_eq!(
            err.to_string(),
            "config file /nonexistent/runplane.toml does not exist"
        );
    }

    #[test]
    fn a_redis_url_names_one_server_a_cluster_or_memory() {
        use RedisTarget::*;
        let t = RedisTarget::parse;
        assert_eq!(t("memory://"), Ok(Memory));
        assert_eq!(t("redis://h:6379/2"), Ok(Single("redis://h:6379/2".into())));
        assert_eq!(t("rediss://h:6380"), Ok(Single("rediss://h:6380".into())));
        assert_eq!(
            t("redis+cluster://a:7000,b:7001/"),
            Ok(Cluster(vec![
                "redis://a:7000".into(),
                "redis://b:7001".into()
            ]))
        );
        assert_eq!(
            t("rediss+cluster://u:p@a:7000,b:7001"),
            Ok(Cluster(vec![
                "rediss://u:p@a:7000".into(),
                "rediss://u:p@b:7001".into()
            ]))
        );
        assert_eq!(
            t("redis://a:7000, redis://b:7001"),
            Ok(Cluster(vec![
                "redis://a:7000".into(),
                "redis://b:7001".into()
            ]))
        );
        for bad in [
            "",
            "http://h",
            "redis+cluster://",
            "redis+cluster://a:1,,b:2",
            "redis+cluster://a:1/0,b:2",
            "redis://a:1,http://b",
            "redis://a:1,",
        ] {
            assert!(t(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(
            redact_url("redis://u:pw@a:1,redis://u:pw@b:2"),
            "redis://u:***@a:1,redis://u:***@b:2"
        );
        // The reason never repeats the URL (a password could be in it).
        let reason = t("redis://u:secret@a:1,nope").unwrap_err();
        assert!(!reason.contains("secret"));
    }
}

#[cfg(test)]
mod example {
    use super::*;

    /// `deploy/runplane.example.toml` documents every field at its default; keep it so.
    #[test]
    fn the_example_file_loads_and_matches_the_defaults() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/runplane.example.toml");
        let figment = Figment::new().merge(Toml::file_exact(&path));
        let example: Config = figment
            .extract()
            .expect("example parses with no unknown field");
        example.validate().expect("example is valid");
        let defaults = Config::default();
        assert_eq!(format!("{example:?}"), format!("{defaults:?}"));
    }
}
