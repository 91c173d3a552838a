//! `[credential_health]`: outage detection, cool-off and quarantine, and the profiles
//! runs are admitted through.

use std::collections::{BTreeMap, BTreeSet};

use runplane_ids::Name;
use serde::Deserialize;

use crate::checks::in_range;
use crate::error::ConfigError;
use crate::sandbox_reconciler::{SandboxLimits, SandboxNetwork};
use crate::server::default_endpoint;

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
    /// The priority (0 to 9, higher first) of a run created through this profile
    /// without one of its own. It orders an org's own queued runs; orgs share a
    /// credential by their weights (`[run_store.tenancy]`) whatever their priorities.
    #[serde(default)]
    pub priority: u32,
    /// How long an ended run of this profile is kept, in seconds from its end (10 at
    /// least); unset, `run_store.ended_run_retention_seconds`.
    #[serde(default)]
    pub ended_run_retention_seconds: Option<u32>,
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
    /// What this profile's sandboxes may use, where it differs from
    /// `[sandbox_reconciler.limits]`: each limit given here replaces that one.
    #[serde(default)]
    pub limits: ProfileLimits,
    /// The image of this profile's sandboxes under the container driver
    /// (`[registry/]name[:tag][@digest]`); unset, the deployment's
    /// `sandbox_reconciler.container.image`. A process sandbox has no image: a driver
    /// that runs processes refuses to start a sandbox whose profile names one.
    #[serde(default)]
    pub image: Option<String>,
    /// How long a run of this profile may stay paused (PauseRun) before it ends FAILED
    /// `paused_too_long`, in seconds (1 to 30 days); unset, 24 hours.
    #[serde(default)]
    pub max_pause_seconds: Option<u32>,
    /// Whether the time a run of this profile spends paused counts toward its deadline;
    /// unset, it does. `false` moves the deadline on by each pause's length.
    #[serde(default)]
    pub deadline_counts_paused_time: Option<bool>,
    /// Which failures of this profile's runs start a new attempt, and how soon
    /// (`retry = { max_attempts = 3, … }`); unset, [`RetryPolicy::default`].
    #[serde(default)]
    pub retry: Option<RetryPolicy>,
}

/// A profile's retry policy, classified by what a failure proves (the model is
/// Kubernetes' `podFailurePolicy`). Infrastructure endings (the runner or sandbox died
/// without a verdict, a sandbox or node lost past its grace) start the next attempt
/// while attempts remain; the agent's own failure does not, unless its exit code is
/// listed, or it was killed at its memory limit and `on_out_of_memory` says so.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryPolicy {
    /// Most attempts a run makes, the first included (1 to 100; 1 never retries).
    pub max_attempts: u32,
    /// The wait before the second attempt, in seconds; each later wait doubles, up to
    /// `max_backoff_seconds`, and is jittered (the wait is drawn from its upper half).
    pub backoff_seconds: f64,
    /// The longest wait between attempts, in seconds.
    pub max_backoff_seconds: f64,
    /// Exit codes of the agent (1 to 255) that are retried like an infrastructure
    /// failure; empty, an agent's non-zero exit ends the run.
    pub exit_codes: Vec<i32>,
    /// Whether an agent killed at its sandbox's memory limit is retried.
    pub on_out_of_memory: bool,
    /// Whether a run whose sandbox's image could not be had (not on the engine, or its
    /// pull failed: `image_unavailable`) is retried, for a registry that comes back.
    pub on_image_unavailable: bool,
}

impl Default for RetryPolicy {
    /// At most 3 attempts, 1 s doubling to 30 s, no exit code, OOM kill or missing image
    /// retried.
    fn default() -> Self {
        Self {
            max_attempts: 3,
            backoff_seconds: 1.0,
            max_backoff_seconds: 30.0,
            exit_codes: Vec::new(),
            on_out_of_memory: false,
            on_image_unavailable: false,
        }
    }
}

/// The longest wait between attempts a profile may set: one hour.
pub const MAX_RETRY_BACKOFF_SECONDS: f64 = 3600.0;

impl RetryPolicy {
    /// Refuses what cannot be meant, naming the field under `field`.
    pub fn validate(&self, field: &str) -> Result<(), ConfigError> {
        in_range(format!("{field}.max_attempts"), self.max_attempts, 1..=100)?;
        for (name, seconds) in [
            ("backoff_seconds", self.backoff_seconds),
            ("max_backoff_seconds", self.max_backoff_seconds),
        ] {
            if !seconds.is_finite() || !(0.0..=MAX_RETRY_BACKOFF_SECONDS).contains(&seconds) {
                return Err(ConfigError::invalid(
                    format!("{field}.{name}"),
                    format!("must be between 0 and {MAX_RETRY_BACKOFF_SECONDS} seconds"),
                ));
            }
        }
        if self.max_backoff_seconds < self.backoff_seconds {
            return Err(ConfigError::invalid(
                format!("{field}.max_backoff_seconds"),
                "must be at least backoff_seconds",
            ));
        }
        for (i, code) in self.exit_codes.iter().enumerate() {
            in_range(format!("{field}.exit_codes[{i}]"), *code, 1..=255)?;
        }
        Ok(())
    }
}

/// How long a run may stay paused when its profile does not say.
pub const DEFAULT_MAX_PAUSE_SECONDS: u32 = 24 * 3600;
/// The longest `max_pause_seconds` a profile may set: 30 days.
pub const MAX_PAUSE_SECONDS: u32 = 30 * 24 * 3600;

/// A profile's own limits; an unset one is the deployment's.
#[derive(Debug, Clone, Copy, PartialEq, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProfileLimits {
    pub cpus: Option<f64>,
    pub memory_mib: Option<u64>,
    pub pids: Option<u32>,
    pub disk_mib: Option<u64>,
}

impl ProfileLimits {
    /// Whether the profile sets any limit of its own.
    pub fn is_set(&self) -> bool {
        *self != Self::default()
    }

    /// `base` with this profile's limits put over it.
    pub fn over(&self, base: &SandboxLimits) -> SandboxLimits {
        SandboxLimits {
            cpus: self.cpus.unwrap_or(base.cpus),
            memory_mib: self.memory_mib.unwrap_or(base.memory_mib),
            pids: self.pids.unwrap_or(base.pids),
            disk_mib: self.disk_mib.unwrap_or(base.disk_mib),
        }
    }
}

impl CredentialHealthConfig {
    /// The profiles whose sandboxes have no network (`network = "none"`).
    pub fn offline_profiles(&self) -> BTreeSet<String> {
        self.profiles
            .iter()
            .filter(|p| p.network == Some(SandboxNetwork::None))
            .map(|p| p.name.clone())
            .collect()
    }

    /// The image of the sandboxes of each profile that names its own.
    pub fn profile_images(&self) -> BTreeMap<String, String> {
        self.profiles
            .iter()
            .filter_map(|p| Some((p.name.clone(), p.image.clone()?)))
            .collect()
    }

    /// The limits of the sandboxes of each profile that sets its own, over `base` (the
    /// deployment's `[sandbox_reconciler.limits]`).
    pub fn profile_limits(&self, base: &SandboxLimits) -> BTreeMap<String, SandboxLimits> {
        self.profiles
            .iter()
            .filter(|p| p.limits.is_set())
            .map(|p| (p.name.clone(), p.limits.over(base)))
            .collect()
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if !(2..=1000).contains(&self.outage_threshold) {
            return Err(ConfigError::invalid(
                "credential_health.outage_threshold",
                "must be between 2 and 1000 (one failing run is not an outage)",
            ));
        }
        for (field, value, max) in [
            (
                "credential_health.outage_window_seconds",
                self.outage_window_seconds,
                3600,
            ),
            (
                "credential_health.cool_off_seconds",
                self.cool_off_seconds,
                3600,
            ),
            (
                "credential_health.quarantine_seconds",
                self.quarantine_seconds,
                7 * 86_400,
            ),
            (
                "credential_health.notice_retention_hours",
                self.notice_retention_hours,
                24 * 365,
            ),
        ] {
            in_range(field, value, 1..=max)?;
        }
        let mut seen = BTreeSet::new();
        for (i, p) in self.profiles.iter().enumerate() {
            let field = format!("credential_health.profiles[{i}]");
            for (what, value) in [("name", &p.name), ("credential_id", &p.credential_id)] {
                if let Err(e) = Name::parse(value) {
                    return Err(ConfigError::invalid(
                        format!("{field}.{what}"),
                        e.to_string(),
                    ));
                }
            }
            for (j, org) in p.orgs.iter().enumerate() {
                if let Err(e) = Name::parse(org) {
                    return Err(ConfigError::invalid(
                        format!("{field}.orgs[{j}]"),
                        e.to_string(),
                    ));
                }
            }
            in_range(format!("{field}.capacity"), p.capacity, 1..=100_000)?;
            in_range(format!("{field}.priority"), p.priority, 0..=9)?;
            if let Some(seconds) = p.ended_run_retention_seconds {
                in_range(
                    format!("{field}.ended_run_retention_seconds"),
                    seconds,
                    10..=u32::MAX,
                )?;
            }
            if !seen.insert((p.name.as_str(), p.credential_id.as_str())) {
                return Err(ConfigError::invalid(
                    field,
                    format!(
                        "profile `{}` names credential `{}` twice",
                        p.name, p.credential_id
                    ),
                ));
            }
            // Every limit it sets is checked against the same bounds as the deployment's.
            p.limits
                .over(&SandboxLimits::default())
                .validate(&format!("{field}.limits"))?;
            if let Some(other) = self
                .profiles
                .iter()
                .find(|o| o.name == p.name && o.limits != p.limits)
            {
                return Err(ConfigError::invalid(
                    format!("{field}.limits"),
                    format!(
                        "profile `{}` gives its sandboxes two sets of limits (on credentials `{}` and `{}`); say them once, the same on every entry",
                        p.name, other.credential_id, p.credential_id
                    ),
                ));
            }
            if let Some(seconds) = p.max_pause_seconds {
                in_range(
                    format!("{field}.max_pause_seconds"),
                    seconds,
                    1..=MAX_PAUSE_SECONDS,
                )?;
            }
            if let Some(other) = self.profiles.iter().find(|o| {
                o.name == p.name
                    && (o.max_pause_seconds, o.deadline_counts_paused_time)
                        != (p.max_pause_seconds, p.deadline_counts_paused_time)
            }) {
                return Err(ConfigError::invalid(
                    format!("{field}.max_pause_seconds"),
                    format!(
                        "profile `{}` says two things of its pauses (on credentials `{}` and `{}`); say max_pause_seconds and deadline_counts_paused_time once, the same on every entry",
                        p.name, other.credential_id, p.credential_id
                    ),
                ));
            }
            if let Some(retry) = &p.retry {
                retry.validate(&format!("{field}.retry"))?;
            }
            if let Some(other) = self
                .profiles
                .iter()
                .find(|o| o.name == p.name && o.retry != p.retry)
            {
                return Err(ConfigError::invalid(
                    format!("{field}.retry"),
                    format!(
                        "profile `{}` gives its runs two retry policies (on credentials `{}` and `{}`); say it once, the same on every entry",
                        p.name, other.credential_id, p.credential_id
                    ),
                ));
            }
            if let Some(image) = &p.image
                && !crate::checks::is_image_reference(image)
            {
                return Err(ConfigError::invalid(
                    format!("{field}.image"),
                    format!("`{image}` is not an image reference ([registry/]name[:tag][@digest])"),
                ));
            }
            if let Some(other) = self
                .profiles
                .iter()
                .find(|o| o.name == p.name && o.image != p.image)
            {
                return Err(ConfigError::invalid(
                    format!("{field}.image"),
                    format!(
                        "profile `{}` gives its sandboxes two images (on credentials `{}` and `{}`); say it once, the same on every entry",
                        p.name, other.credential_id, p.credential_id
                    ),
                ));
            }
            // A profile's sandboxes have one network, whichever credential carries them.
            if let Some(other) = self
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
            priority: 0,
            ended_run_retention_seconds: None,
            orgs: Vec::new(),
            network: None,
            limits: ProfileLimits::default(),
            image: None,
            max_pause_seconds: None,
            deadline_counts_paused_time: None,
            retry: None,
        }
    }
}
