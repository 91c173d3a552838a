//! What the run store takes from runplane's configuration.

use std::collections::BTreeMap;
use std::time::Duration;

use runplane_config::Config;

use crate::domain::limits::Limits;
use crate::domain::receipt::{ReceiptSigner, public_key_from_hex};
use crate::error::RunStoreError;
use crate::store::PauseRule;

/// The run store's settings.
#[derive(Debug, Clone)]
pub struct RunStoreSettings {
    pub database_url: String,
    pub limits: Limits,
    pub signer: ReceiptSigner,
    /// Public keys of retired signing keys, by key id (`[run_store]
    /// retired_receipt_public_keys`): GetReceiptPublicKey answers for them too.
    pub retired_receipt_keys: BTreeMap<String, [u8; 32]>,
    /// The longest deadline a run may have (`[run_store] max_run_duration_seconds`).
    pub max_run_duration_seconds: u32,
    /// How often the deadline sweep runs.
    pub deadline_sweep_interval: Duration,
    /// How orgs share credentials and what each may hold (`[run_store.tenancy]`).
    pub tenancy: runplane_config::TenancyConfig,
    /// How long ended runs and their events are kept.
    pub retention: crate::store::Retention,
    /// How often the retention sweep runs.
    pub retention_sweep_interval: Duration,
    /// Most steers and interrupts a run holds not yet delivered.
    pub max_queued_steering_messages: u32,
    /// What a pause of each profile's runs may do.
    pub pauses: PauseRules,
}

/// How long a pause may last and whether it counts toward the deadline, by profile
/// (`max_pause_seconds`, `deadline_counts_paused_time`); a profile that says nothing
/// gets 24 hours, counted.
#[derive(Debug, Clone, Default)]
pub struct PauseRules {
    by_profile: BTreeMap<String, PauseRule>,
}

impl PauseRules {
    pub fn from_profiles(profiles: &[runplane_config::ProfileConfig]) -> Self {
        let by_profile = profiles
            .iter()
            .map(|p| {
                let seconds = p
                    .max_pause_seconds
                    .unwrap_or(runplane_config::DEFAULT_MAX_PAUSE_SECONDS);
                let rule = PauseRule {
                    max_us: i64::from(seconds) * 1_000_000,
                    counts_toward_deadline: p.deadline_counts_paused_time.unwrap_or(true),
                };
                (p.name.clone(), rule)
            })
            .collect();
        Self { by_profile }
    }

    /// The rule of `profile`'s runs.
    pub fn of(&self, profile: &str) -> PauseRule {
        self.by_profile.get(profile).copied().unwrap_or(PauseRule {
            max_us: i64::from(runplane_config::DEFAULT_MAX_PAUSE_SECONDS) * 1_000_000,
            counts_toward_deadline: true,
        })
    }
}

impl RunStoreSettings {
    pub fn from_config(config: &Config) -> Result<Self, RunStoreError> {
        let key = config.run_store.receipt_signing_key.expose();
        if key.is_empty() {
            return Err(RunStoreError::SigningKey(
                "run_store.receipt_signing_key is required to serve the run store \
                 (`runplane receipt keygen` makes one)"
                    .into(),
            ));
        }
        let signer =
            ReceiptSigner::from_hex(key).map_err(|e| RunStoreError::SigningKey(e.to_string()))?;
        let mut retired_receipt_keys = BTreeMap::new();
        for (i, public) in config
            .run_store
            .retired_receipt_public_keys
            .iter()
            .enumerate()
        {
            let (key_id, public) = public_key_from_hex(public).map_err(|e| {
                RunStoreError::SigningKey(format!(
                    "run_store.retired_receipt_public_keys[{i}]: {e}"
                ))
            })?;
            retired_receipt_keys.insert(key_id, public);
        }
        Ok(Self {
            database_url: config.run_store.database_url.clone(),
            limits: Limits {
                max_batch_events: config.run_store.max_batch_events,
                max_batch_bytes: config.run_store.max_batch_bytes,
                max_poll_wait: Duration::from_secs(config.run_store.max_poll_wait_seconds.into()),
                ..Limits::default()
            },
            signer,
            retired_receipt_keys,
            max_run_duration_seconds: config.run_store.max_run_duration_seconds,
            deadline_sweep_interval: Duration::from_millis(
                config.run_store.deadline_sweep_interval_ms.into(),
            ),
            tenancy: config.run_store.tenancy.clone(),
            retention: retention(config),
            max_queued_steering_messages: config.run_store.max_queued_steering_messages,
            pauses: PauseRules::from_profiles(&config.credential_health.profiles),
            retention_sweep_interval: Duration::from_millis(
                config.run_store.retention_sweep_interval_ms.into(),
            ),
        })
    }
}

/// Retention as `[run_store]` and the profiles that set their own say.
fn retention(config: &Config) -> crate::store::Retention {
    let us = |seconds: u32| i64::from(seconds) * 1_000_000;
    crate::store::Retention {
        runs_us: us(config.run_store.ended_run_retention_seconds),
        runs_by_profile: config
            .credential_health
            .profiles
            .iter()
            .filter_map(|p| Some((p.name.clone(), us(p.ended_run_retention_seconds?))))
            .collect(),
        events_us: match config.run_store.event_retention_seconds {
            0 => None,
            seconds => Some(us(seconds)),
        },
    }
}
