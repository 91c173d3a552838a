//! What credential health takes from runplane's configuration.

use runplane_config::Config;

use crate::domain::policy::PolicyConfig;

impl PolicyConfig {
    /// The outage policy's numbers, from `[credential_health]`.
    pub fn from_config(config: &Config) -> Self {
        let c = &config.credential_health;
        Self {
            threshold: c.outage_threshold as usize,
            window_ms: i64::from(c.outage_window_seconds) * 1000,
            cool_off_ms: i64::from(c.cool_off_seconds) * 1000,
            quarantine_ms: i64::from(c.quarantine_seconds) * 1000,
        }
    }
}

/// How long a lead's notices are kept (`notice_retention_hours`), in milliseconds.
pub fn notice_retention_ms(config: &Config) -> i64 {
    i64::from(config.credential_health.notice_retention_hours) * 3_600_000
}
