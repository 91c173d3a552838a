//! runplane's configuration.
//!
//! Sources, later wins: built-in defaults, a TOML file, then environment variables named
//! `RUNPLANE_<SECTION>__<FIELD>` (double underscore between section and field, e.g.
//! `RUNPLANE_SERVER__LISTEN=0.0.0.0:7070`). [`Config::load`] validates the result and
//! every error names the field it is about; secrets never appear in an error.

mod auth;
mod checks;
mod credential_health;
mod error;
mod node;
mod run_store;
mod sandbox_reconciler;
mod secret;
mod server;
mod store_urls;
mod stream_recovery;
mod telemetry;
mod tls;
mod webhooks;

use std::net::SocketAddr;
use std::path::Path;

use figment::Figment;
use figment::providers::{Env, Format, Toml};
use serde::Deserialize;

pub use auth::{AuthConfig, PerRole, ServiceRole, parse_sha256};
use checks::validate_endpoint_list;
pub use checks::{is_image_reference, is_name};
pub use credential_health::{
    CredentialHealthConfig, DEFAULT_MAX_PAUSE_SECONDS, MAX_PAUSE_SECONDS,
    MAX_RETRY_BACKOFF_SECONDS, ProfileConfig, ProfileLimits, RetryPolicy,
};
pub use error::ConfigError;
pub use node::NodeConfig;
pub use run_store::{OrgTenancy, RunStoreConfig, TenancyConfig};
pub use sandbox_reconciler::{
    ContainerConfig, DriverKind, Isolation, Limit, PullPolicy, SandboxLimits, SandboxNetwork,
    SandboxReconcilerConfig,
};
pub use secret::Secret;
pub use server::{DEFAULT_LISTEN, ServerConfig};
pub use store_urls::redact_url;
use store_urls::validate_database_url;
pub use stream_recovery::{RedisTarget, StreamRecoveryConfig};
pub use telemetry::{LogFormat, TelemetryConfig};
pub use tls::TlsConfig;
pub use webhooks::{
    WEBHOOK_EVENTS, WebhookConfig, WebhookDeliveryConfig, WebhookTarget, is_private_target,
    webhook_secret_key,
};

/// Prefix of every environment override.
pub const ENV_PREFIX: &str = "RUNPLANE_";

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub server: ServerConfig,
    pub auth: AuthConfig,
    pub telemetry: TelemetryConfig,
    pub run_store: RunStoreConfig,
    pub sandbox_reconciler: SandboxReconcilerConfig,
    pub stream_recovery: StreamRecoveryConfig,
    pub credential_health: CredentialHealthConfig,
    pub node: NodeConfig,
    pub tls: TlsConfig,
}

impl Config {
    /// Defaults, then `file` (when given), then `RUNPLANE_*` variables; validated.
    pub fn load(file: Option<&Path>) -> Result<Config, ConfigError> {
        refuse_unreadable_env()?;
        Self::from_figment(Self::figment(file)?)
    }

    /// The layered sources, before extraction. Exposed so tests can add their own.
    pub fn figment(file: Option<&Path>) -> Result<Figment, ConfigError> {
        let mut figment = Figment::new();
        if let Some(path) = file {
            if !path.is_file() {
                return Err(ConfigError::MissingFile {
                    path: path.display().to_string(),
                });
            }
            figment = figment.merge(Toml::file_exact(path));
        }
        // Only `SECTION__FIELD` variables are configuration; others with the prefix
        // (`RUNPLANE_CONFIG`, the runner's `RUNPLANE_RUN_KEY`) belong to someone else.
        Ok(figment.merge(
            Env::prefixed(ENV_PREFIX)
                .filter(|key| key.as_str().contains("__"))
                .split("__"),
        ))
    }

    pub fn from_figment(figment: Figment) -> Result<Config, ConfigError> {
        let config: Config = figment
            .extract()
            .map_err(|e| ConfigError::Parse(describe(e)))?;
        config.validate()?;
        Ok(config)
    }

    /// Checks what serde cannot. Requirements that depend on the role (tokens to serve)
    /// are checked by [`Config::require_operator_token`] and
    /// [`Config::require_calling_token`].
    pub fn validate(&self) -> Result<(), ConfigError> {
        // Section by section; when several fields are wrong, the first in this order is
        // the one reported.
        self.server.validate()?;
        self.auth.validate()?;
        self.run_store.validate_receipt_key_and_batches()?;
        self.sandbox_reconciler.validate()?;
        self.credential_health.validate()?;
        self.tls.validate()?;
        self.run_store.validate_deadlines()?;
        self.run_store.tenancy.validate()?;
        webhooks::validate_webhooks(&self.run_store.webhooks)?;
        self.run_store.webhook_delivery.validate()?;
        for (field, url) in [
            ("run_store.database_url", &self.run_store.database_url),
            (
                "sandbox_reconciler.database_url",
                &self.sandbox_reconciler.database_url,
            ),
            (
                "credential_health.database_url",
                &self.credential_health.database_url,
            ),
        ] {
            validate_database_url(field, url)?;
        }
        self.stream_recovery.validate()?;
        for (field, endpoint) in [
            ("run_store.endpoint", &self.run_store.endpoint),
            (
                "sandbox_reconciler.endpoint",
                &self.sandbox_reconciler.endpoint,
            ),
            ("stream_recovery.endpoint", &self.stream_recovery.endpoint),
            (
                "credential_health.endpoint",
                &self.credential_health.endpoint,
            ),
        ] {
            validate_endpoint_list(field, endpoint, !self.tls.ca_file.is_empty())?;
        }
        Ok(())
    }

    pub fn listen_addr(&self) -> Result<SocketAddr, ConfigError> {
        self.server.listen_addr()
    }

    /// A reconciler served with local sandboxes would run agents beside this process's
    /// secrets; it needs `local_sandboxes_beside_secrets` to say that is meant.
    pub fn require_agents_apart_from_secrets(&self) -> Result<(), ConfigError> {
        let reconciler = &self.sandbox_reconciler;
        if reconciler.local_sandboxes && !reconciler.local_sandboxes_beside_secrets {
            return Err(ConfigError::invalid(
                "sandbox_reconciler.local_sandboxes",
                "agents would run beside this process's secrets (the service token, the \
                 database URL, the operator token): an agent that escapes its containment \
                 reaches them. Run agents on node agents (local_sandboxes = false and \
                 `runplane node`), or set sandbox_reconciler.local_sandboxes_beside_secrets \
                 = true to accept that risk (one trusted tenant, a trial)",
            ));
        }
        Ok(())
    }

    /// Serving needs an operator token (or its digest); the error says how to set one.
    pub fn require_operator_token(&self) -> Result<(), ConfigError> {
        self.auth.require_operator_token()
    }

    /// Serving `role` needs a token to call the others with (its own or the shared
    /// one); the error says how to set one.
    pub fn require_calling_token(&self, role: ServiceRole) -> Result<&Secret, ConfigError> {
        self.auth.require_calling_token(role)
    }

    pub fn shutdown_grace(&self) -> std::time::Duration {
        self.server.shutdown_grace()
    }
}

/// figment 0.10 reads a backslash escape in an environment value by character index as
/// if it were a byte index: after a non-ASCII character it panics (or garbles the value).
/// Such a variable is refused, naming its field, before figment sees it (found by
/// fuzzing).
fn refuse_unreadable_env() -> Result<(), ConfigError> {
    for (key, value) in std::env::vars_os() {
        let (Some(key), Some(value)) = (key.to_str(), value.to_str()) else {
            continue;
        };
        let Some(field) = key.strip_prefix(ENV_PREFIX).filter(|f| f.contains("__")) else {
            continue;
        };
        let before_escape = value.split('\\').next().unwrap_or_default();
        if value.contains('\\') && !before_escape.is_ascii() {
            return Err(ConfigError::invalid(
                field.to_lowercase().replace("__", "."),
                "a backslash after a non-ASCII character cannot be read from the environment; set it in the config file",
            ));
        }
    }
    Ok(())
}

/// Fields whose values are secrets, by key name.
const SECRET_KEYS: &[&str] = &[
    "operator_token",
    "service_token",
    "receipt_signing_key",
    "route_token_key",
];

/// Figment's message plus where the bad value came from; never the value of a secret,
/// because figment only quotes values for type errors and secrets are plain strings.
fn describe(error: figment::Error) -> String {
    error
        .into_iter()
        .map(|e| {
            // serde's messages quote the value they could not take; for a secret (an
            // unquoted numeric token, say) that would print it.
            let secret = e.path.last().is_some_and(|key| {
                SECRET_KEYS.iter().any(|s| key.eq_ignore_ascii_case(s))
            }) || e.path.iter().any(|key| {
                key.eq_ignore_ascii_case("org_tokens") || key.eq_ignore_ascii_case("service_tokens")
            });
            if secret {
                format!(
                    "key \"{}\" holds a value of the wrong type (a secret: not shown); expected a string",
                    e.path.join(".")
                )
            } else {
                e.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod store_url_tests;

#[cfg(test)]
mod example {
    use super::*;

    /// `deploy/runplane.example.toml` documents every field at its default; keep it so.
    #[test]
    fn the_example_file_loads_and_matches_the_defaults() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/runplane.example.toml");
        let figment = Figment::new().merge(Toml::file_exact(&path));
        let example: Config = figment
            .extract()
            .expect("example parses with no unknown field");
        example.validate().expect("example is valid");
        let defaults = Config::default();
        assert_eq!(format!("{example:?}"), format!("{defaults:?}"));
    }
}
