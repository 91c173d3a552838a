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

/// The key route tokens are signed with: `route_token_key`, or, when it is empty, one
/// derived from the token the reconciler calls with (its own service token, else the
/// shared one), which every replica of it holds.
pub fn route_key(config: &Config) -> Vec<u8> {
    match config.sandbox_reconciler.route_token_key.expose() {
        "" => runplane_sandbox::route_token::default_key(
            config
                .auth
                .calling_token(runplane_config::ServiceRole::SandboxReconciler)
                .expose(),
        ),
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

#[cfg(test)]
mod tests {
    use runplane_config::{Config, Secret};
    use runplane_sandbox::route_token::default_key;

    #[test]
    fn the_default_route_key_derives_from_the_reconcilers_own_token_when_it_has_one() {
        let shared = "shared-service-token-0123456789abcdef012345";
        let own = "reconciler-own-token-0123456789abcdef012345";
        let mut config = Config::default();
        config.auth.service_token = Secret::new(shared);
        assert_eq!(super::route_key(&config), default_key(shared));
        config.auth.service_tokens.sandbox_reconciler = Secret::new(own);
        assert_eq!(super::route_key(&config), default_key(own));
        config.sandbox_reconciler.route_token_key = Secret::new("an-explicit-route-key");
        assert_eq!(super::route_key(&config), b"an-explicit-route-key");
    }
}
