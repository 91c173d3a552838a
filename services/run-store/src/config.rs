//! What the run store takes from runplane's configuration.

use std::time::Duration;

use runplane_config::Config;

use crate::domain::limits::Limits;
use crate::domain::receipt::ReceiptSigner;
use crate::error::RunStoreError;

/// The run store's settings.
#[derive(Debug, Clone)]
pub struct RunStoreSettings {
    pub database_url: String,
    pub limits: Limits,
    pub signer: ReceiptSigner,
    /// The longest deadline a run may have (`[run_store] max_run_duration_seconds`).
    pub max_run_duration_seconds: u32,
    /// How often the deadline sweep runs.
    pub deadline_sweep_interval: Duration,
    /// How orgs share credentials and what each may hold (`[run_store.tenancy]`).
    pub tenancy: runplane_config::TenancyConfig,
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
        Ok(Self {
            database_url: config.run_store.database_url.clone(),
            limits: Limits {
                max_batch_events: config.run_store.max_batch_events,
                max_batch_bytes: config.run_store.max_batch_bytes,
                max_poll_wait: Duration::from_secs(config.run_store.max_poll_wait_seconds.into()),
                ..Limits::default()
            },
            signer,
            max_run_duration_seconds: config.run_store.max_run_duration_seconds,
            deadline_sweep_interval: Duration::from_millis(
                config.run_store.deadline_sweep_interval_ms.into(),
            ),
            tenancy: config.run_store.tenancy.clone(),
        })
    }
}
