//! What stream recovery takes from runplane's configuration.

use runplane_config::{Config, RedisTarget};

use crate::error::RecoveryError;

/// The Redis store `[stream_recovery]` names (`redis_url`, keys under `key_prefix`).
pub fn redis_target(config: &Config) -> Result<RedisTarget, RecoveryError> {
    config
        .stream_recovery
        .target()
        .map_err(|reason| unreachable(config, reason.to_owned()))
}

/// The store `config` names cannot be reached, for `reason`; its URL is redacted.
pub fn unreachable(config: &Config, reason: String) -> RecoveryError {
    RecoveryError::Unreachable {
        url: runplane_config::redact_url(&config.stream_recovery.redis_url),
        reason,
    }
}
