//! What the sandbox reconciler takes from runplane's configuration.

use std::time::Duration;

use runplane_config::Config;

use crate::reconcile::ReconcileSettings;

impl ReconcileSettings {
    /// The round's numbers, from `[sandbox_reconciler]` (and the offline profiles of
    /// `[credential_health]`); the rest keep their defaults.
    pub fn from_config(config: &Config) -> Self {
        let r = &config.sandbox_reconciler;
        Self {
            loss_grace: Duration::from_secs(r.loss_grace_seconds.into()),
            idle_timeout: Duration::from_secs(r.idle_timeout_seconds.into()),
            dispatch: r.dispatch,
            local_sandboxes: r.local_sandboxes,
            profiles: crate::domain::placement::ProfileSandboxes::from_config(config),
            retention: Duration::from_secs(r.ended_sandbox_retention_seconds.into()),
            ..Self::default()
        }
    }
}

/// The key route tokens are signed with: `route_token_key`, or one derived from the
/// service token when it is empty.
pub fn route_key(config: &Config) -> Vec<u8> {
    match config.sandbox_reconciler.route_token_key.expose() {
        "" => runplane_sandbox::route_token::default_key(config.auth.service_token.expose()),
        key => key.as_bytes().to_vec(),
    }
}

/// How long a route token holds (`route_token_ttl_seconds`).
pub fn route_ttl(config: &Config) -> Duration {
    Duration::from_secs(config.sandbox_reconciler.route_token_ttl_seconds.into())
}

/// How often the round runs without a wake-up (`tick_interval_ms`).
pub fn tick_interval(config: &Config) -> Duration {
    Duration::from_millis(config.sandbox_reconciler.tick_interval_ms.into())
}
