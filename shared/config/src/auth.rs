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
    /// The SHA-256 (64 hex digits) of the operator token, in place of `operator_token`: a
    /// server admits operators with only this, so it never holds the token itself
    /// (`printf %s "$TOKEN" | sha256sum`). Set one of the two.
    pub operator_token_sha256: String,
    /// Org id to the SHA-256 (64 hex digits) of its token, in place of `org_tokens`.
    pub org_token_sha256: BTreeMap<String, String>,
}

/// The 32 bytes of a SHA-256 written as 64 hex digits.
pub fn parse_sha256(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.trim();
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in hex.as_bytes().chunks(2).enumerate() {
        out[i] = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(out)
}

impl AuthConfig {
    /// Serving needs the operator token or its digest; the error says how to set one.
    pub fn require_operator_token(&self) -> Result<(), ConfigError> {
        if self.operator_token.is_empty() && self.operator_token_sha256.is_empty() {
            return Err(ConfigError::invalid(
                "auth.operator_token",
                "required to serve; set it (or its SHA-256 as auth.operator_token_sha256) in \
                 the config file or RUNPLANE_AUTH__OPERATOR_TOKEN",
            ));
        }
        Ok(())
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
        if !self.operator_token_sha256.is_empty() {
            if parse_sha256(&self.operator_token_sha256).is_none() {
                return Err(ConfigError::invalid(
                    "auth.operator_token_sha256",
                    "must be 64 hex digits: the SHA-256 of the operator token",
                ));
            }
            if !self.operator_token.is_empty() {
                return Err(ConfigError::invalid(
                    "auth.operator_token_sha256",
                    "set auth.operator_token or its SHA-256, not both",
                ));
            }
        }
        for (org, digest) in &self.org_token_sha256 {
            if org.is_empty() || parse_sha256(digest).is_none() {
                return Err(ConfigError::invalid(
                    "auth.org_token_sha256",
                    "every entry needs a non-empty org id and 64 hex digits: the SHA-256 of \
                     its token",
                ));
            }
            if self.org_tokens.contains_key(org) {
                return Err(ConfigError::invalid(
                    "auth.org_token_sha256",
                    format!("org {org} has a token in auth.org_tokens too: set one of the two"),
                ));
            }
        }
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
