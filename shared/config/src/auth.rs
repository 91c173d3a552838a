//! `[auth]`: the bearer tokens of operators, orgs and services.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::error::ConfigError;
use crate::secret::Secret;

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// Bearer token of operators (humans, the CLI, grpcurl) acting in any org. Required
    /// to serve; at least 32 characters.
    pub operator_token: Secret,
    /// Bearer token runplane's services call each other with, any org. Required to
    /// serve; at least 32 characters, and not the operator token. It cannot reach what
    /// only operators may do (CreateRun, steering, node credentials), and node agents
    /// never hold it: each has its own node credential.
    pub service_token: Secret,
    /// Org-scoped operator tokens: org id to token (each at least 32 characters). A call
    /// with one of these acts only in its org.
    pub org_tokens: BTreeMap<String, Secret>,
}

impl AuthConfig {
    /// Serving needs an operator token; the error says how to set one.
    pub fn require_operator_token(&self) -> Result<&Secret, ConfigError> {
        if self.operator_token.is_empty() {
            return Err(ConfigError::invalid(
                "auth.operator_token",
                "required to serve; set it in the config file or RUNPLANE_AUTH__OPERATOR_TOKEN",
            ));
        }
        Ok(&self.operator_token)
    }

    /// Serving needs the service token too; the error says how to set one.
    pub fn require_service_token(&self) -> Result<&Secret, ConfigError> {
        if self.service_token.is_empty() {
            return Err(ConfigError::invalid(
                "auth.service_token",
                "required to serve: the token runplane's services call each other with; set it in the config file or RUNPLANE_AUTH__SERVICE_TOKEN (at least 32 characters, not the operator token)",
            ));
        }
        Ok(&self.service_token)
    }

    /// Tokens that are set are long enough and distinct; whether they are required
    /// depends on the role (see the `require_` methods).
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if !self.operator_token.is_empty() && self.operator_token.expose().len() < 32 {
            return Err(ConfigError::invalid(
                "auth.operator_token",
                "must be at least 32 characters",
            ));
        }
        if !self.service_token.is_empty() && self.service_token.expose().len() < 32 {
            return Err(ConfigError::invalid(
                "auth.service_token",
                "must be at least 32 characters",
            ));
        }
        if !self.service_token.is_empty()
            && self.service_token.expose() == self.operator_token.expose()
        {
            return Err(ConfigError::invalid(
                "auth.service_token",
                "must differ from auth.operator_token: services and operators hold different secrets",
            ));
        }
        if self
            .org_tokens
            .iter()
            .any(|(org, token)| org.is_empty() || token.expose().len() < 32)
        {
            return Err(ConfigError::invalid(
                "auth.org_tokens",
                "every entry needs a non-empty org id and a token of at least 32 characters",
            ));
        }
        Ok(())
    }
}
