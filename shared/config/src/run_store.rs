//! `[run_store]`: the run store's database, endpoint, receipt key and limits.

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
        Ok(())
    }
}
