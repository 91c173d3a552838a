//! What stream recovery takes from runplane's configuration.

use runplane_config::Config;

use crate::error::RecoveryError;

/// The store `config` names cannot be reached, for `reason`; its URL is redacted.
pub fn unreachable(config: &Config, reason: String) -> RecoveryError {
    RecoveryError::Unreachable {
        url: runplane_config::redact_url(&config.stream_recovery.redis_url),
        reason,
    }
}
