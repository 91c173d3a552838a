//! `[run_store]`: the run store's database, endpoint, receipt key and limits.

use std::collections::BTreeMap;

use runplane_ids::Name;
use serde::Deserialize;

use crate::checks::in_range;
use crate::error::ConfigError;
use crate::secret::Secret;
use crate::server::default_endpoint;

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
    /// The public halves (64 hex digits each) of receipt signing keys no longer in use,
    /// so GetReceiptPublicKey still answers for receipts they signed. Never keep an old
    /// signing key to verify with: retire it by its public key (`runplane receipt keygen`
    /// printed it; docs/operations.md says how to rotate).
    pub retired_receipt_public_keys: Vec<String>,
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
    /// How orgs share credentials and how much each may hold.
    pub tenancy: TenancyConfig,
    /// How long an ended run is kept, in seconds from its end, 10 at least: then it is
    /// deleted with its events, steering messages, keys and keyed-call records. Its
    /// receipt is kept. A profile's `ended_run_retention_seconds` replaces it.
    pub ended_run_retention_seconds: u32,
    /// How long an ended run's events are kept, in seconds from its end; 0: as long as
    /// the run. Watchers asking for removed events get an `EventsGap`.
    pub event_retention_seconds: u32,
    /// How often a replica deletes what retention let go, in milliseconds; each pass
    /// deletes bounded batches.
    pub retention_sweep_interval_ms: u32,
    /// Most steers and interrupts a run holds not yet delivered to its runner; past it
    /// Steer and Interrupt are refused RESOURCE_EXHAUSTED (QUOTA_EXCEEDED).
    pub max_queued_steering_messages: u32,
    /// Most events a run stores; past it a runner's AppendEvents is refused
    /// RESOURCE_EXHAUSTED (QUOTA_EXCEEDED) and writes nothing, and the runner counts what
    /// it could not store in one `events_lost` event with its verdict.
    pub max_events_per_run: u32,
    /// Most bytes of event text, data and names a run stores; past it as
    /// `max_events_per_run`.
    pub max_event_bytes_per_run: u64,
    /// Endpoints sent run lifecycle events (`[[run_store.webhooks]]`).
    pub webhooks: Vec<crate::webhooks::WebhookConfig>,
    /// How webhook deliveries are retried and bounded.
    pub webhook_delivery: crate::webhooks::WebhookDeliveryConfig,
}

/// `[run_store.tenancy]`: the slots of a credential are shared across the orgs with runs
/// queued on it by weighted fair share, and each org holds at most its quotas.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TenancyConfig {
    /// An org's weight where `orgs` sets none, 1 to 1000: an org of weight 2 gets twice
    /// the starts of an org of weight 1 while both have runs waiting on a credential.
    pub default_weight: u32,
    /// Most runs an org has STARTING or RUNNING at once; more wait QUEUED, saying so.
    /// 0: no quota.
    pub max_active_runs: u32,
    /// Most runs an org has QUEUED; CreateRun past it is refused RESOURCE_EXHAUSTED
    /// (QUOTA_EXCEEDED) and writes nothing. 0: no quota.
    pub max_queued_runs: u32,
    /// One org's own weight and quotas (`[run_store.tenancy.orgs.<org>]`); what it does
    /// not set is the default above.
    pub orgs: BTreeMap<String, OrgTenancy>,
}

/// One org's weight and quotas; an unset one is `[run_store.tenancy]`'s.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OrgTenancy {
    pub weight: Option<u32>,
    pub max_active_runs: Option<u32>,
    pub max_queued_runs: Option<u32>,
}

impl Default for TenancyConfig {
    fn default() -> Self {
        Self {
            default_weight: 1,
            max_active_runs: 0,
            max_queued_runs: 10_000,
            orgs: BTreeMap::new(),
        }
    }
}

impl TenancyConfig {
    /// `org`'s weight.
    pub fn weight(&self, org: &str) -> u32 {
        self.org(org).weight.unwrap_or(self.default_weight)
    }

    /// Most runs `org` has active at once; None: no quota.
    pub fn max_active_runs(&self, org: &str) -> Option<u32> {
        Some(
            self.org(org)
                .max_active_runs
                .unwrap_or(self.max_active_runs),
        )
        .filter(|&n| n > 0)
    }

    /// Most runs `org` has queued; None: no quota.
    pub fn max_queued_runs(&self, org: &str) -> Option<u32> {
        Some(
            self.org(org)
                .max_queued_runs
                .unwrap_or(self.max_queued_runs),
        )
        .filter(|&n| n > 0)
    }

    fn org(&self, org: &str) -> OrgTenancy {
        self.orgs.get(org).copied().unwrap_or_default()
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        in_range(
            "run_store.tenancy.default_weight",
            self.default_weight,
            1..=1000,
        )?;
        for (org, own) in &self.orgs {
            let field = format!("run_store.tenancy.orgs.{org}");
            if let Err(e) = Name::parse(org) {
                return Err(ConfigError::invalid(field, e.to_string()));
            }
            if let Some(weight) = own.weight {
                in_range(format!("{field}.weight"), weight, 1..=1000)?;
            }
        }
        Ok(())
    }
}

impl Default for RunStoreConfig {
    fn default() -> Self {
        Self {
            database_url: "postgres://postgres@127.0.0.1:5432/runplane_run_store".to_owned(),
            endpoint: default_endpoint(),
            receipt_signing_key: Secret::default(),
            retired_receipt_public_keys: Vec::new(),
            max_batch_events: 1000,
            max_batch_bytes: 1 << 20,
            max_poll_wait_seconds: 30,
            admission: true,
            max_run_duration_seconds: 7 * 24 * 3600,
            deadline_sweep_interval_ms: 1000,
            tenancy: TenancyConfig::default(),
            ended_run_retention_seconds: 30 * 86_400,
            event_retention_seconds: 0,
            retention_sweep_interval_ms: 5000,
            max_queued_steering_messages: 100,
            max_events_per_run: 1_000_000,
            max_event_bytes_per_run: 1 << 30,
            webhooks: Vec::new(),
            webhook_delivery: Default::default(),
        }
    }
}

impl RunStoreConfig {
    /// The receipt key and the batch limits. Apart from [`Self::validate_deadlines`]
    /// because the config reports these before other sections' errors, those after.
    pub(crate) fn validate_receipt_key_and_batches(&self) -> Result<(), ConfigError> {
        let key = self.receipt_signing_key.expose();
        if !key.is_empty() && (key.len() != 64 || !key.bytes().all(|b| b.is_ascii_hexdigit())) {
            return Err(ConfigError::invalid(
                "run_store.receipt_signing_key",
                "must be 64 hex digits (an Ed25519 seed; `runplane receipt keygen` makes one)",
            ));
        }
        for (i, public) in self.retired_receipt_public_keys.iter().enumerate() {
            if public.len() != 64 || !public.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(ConfigError::invalid(
                    format!("run_store.retired_receipt_public_keys[{i}]"),
                    "must be 64 hex digits (an Ed25519 public key, as `runplane receipt keygen` \
                     printed it), never the signing key",
                ));
            }
        }
        in_range(
            "run_store.max_batch_events",
            self.max_batch_events,
            1..=10_000,
        )?;
        in_range(
            "run_store.max_batch_bytes",
            self.max_batch_bytes,
            1024..=(16 << 20),
        )?;
        Ok(())
    }

    /// The run deadlines and the longest steering poll.
    pub(crate) fn validate_deadlines(&self) -> Result<(), ConfigError> {
        if self.max_run_duration_seconds == 0 {
            return Err(ConfigError::invalid(
                "run_store.max_run_duration_seconds",
                "must be at least 1",
            ));
        }
        in_range(
            "run_store.deadline_sweep_interval_ms",
            self.deadline_sweep_interval_ms,
            10..=600_000,
        )?;
        in_range(
            "run_store.max_poll_wait_seconds",
            self.max_poll_wait_seconds,
            1..=300,
        )?;
        in_range(
            "run_store.ended_run_retention_seconds",
            self.ended_run_retention_seconds,
            10..=u32::MAX,
        )?;
        if self.event_retention_seconds != 0 {
            in_range(
                "run_store.event_retention_seconds",
                self.event_retention_seconds,
                10..=self.ended_run_retention_seconds,
            )?;
        }
        in_range(
            "run_store.max_queued_steering_messages",
            self.max_queued_steering_messages,
            1..=100_000,
        )?;
        in_range(
            "run_store.max_events_per_run",
            self.max_events_per_run,
            10..=u32::MAX,
        )?;
        in_range(
            "run_store.max_event_bytes_per_run",
            self.max_event_bytes_per_run,
            1024..=u64::MAX,
        )?;
        in_range(
            "run_store.retention_sweep_interval_ms",
            self.retention_sweep_interval_ms,
            100..=600_000,
        )?;
        Ok(())
    }
}
