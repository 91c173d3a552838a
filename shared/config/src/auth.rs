//! `[auth]`: the bearer tokens of operators, orgs and services.
//!
//! Services call each other with the shared `service_token` (admitted wherever any
//! service role is named) or, split by caller, with their own role's token
//! (`service_tokens.<role>`, admitted only where that role is named); a server admits the
//! other roles by their digests (`service_token_sha256.<role>`) without holding them.

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
    /// The shared bearer token runplane's services call each other with, any org:
    /// admitted wherever any service role is named (`runplane dev`, simple deployments).
    /// At least 32 characters, and not the operator token. It cannot reach what only
    /// operators may do (CreateRun, steering, node credentials), and node agents never
    /// hold it: each has its own node credential.
    pub service_token: Secret,
    /// Each service role's own token, in place of the shared one for that role's calls:
    /// `runplane serve <role>` calls the others with it, and it is admitted only on the
    /// methods that name the role. At least 32 characters, all different.
    pub service_tokens: PerRole<Secret>,
    /// Each service role's token as its SHA-256 (64 hex digits): a server admits that
    /// role's calls without holding its token. A role is in this table or in
    /// `service_tokens`, not both.
    pub service_token_sha256: PerRole<String>,
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

/// A service calling the others: each has a token of its own, named by its role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ServiceRole {
    RunStore,
    SandboxReconciler,
    StreamRecovery,
    CredentialHealth,
}

impl ServiceRole {
    pub const ALL: [ServiceRole; 4] = [
        ServiceRole::RunStore,
        ServiceRole::SandboxReconciler,
        ServiceRole::StreamRecovery,
        ServiceRole::CredentialHealth,
    ];

    /// The role's key in `[auth.service_tokens]` and `[auth.service_token_sha256]`.
    pub const fn key(self) -> &'static str {
        match self {
            ServiceRole::RunStore => "run_store",
            ServiceRole::SandboxReconciler => "sandbox_reconciler",
            ServiceRole::StreamRecovery => "stream_recovery",
            ServiceRole::CredentialHealth => "credential_health",
        }
    }
}

/// One value per service role, under the fixed keys of [`ServiceRole::key`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PerRole<T> {
    pub run_store: T,
    pub sandbox_reconciler: T,
    pub stream_recovery: T,
    pub credential_health: T,
}

impl<T> PerRole<T> {
    pub fn get(&self, role: ServiceRole) -> &T {
        match role {
            ServiceRole::RunStore => &self.run_store,
            ServiceRole::SandboxReconciler => &self.sandbox_reconciler,
            ServiceRole::StreamRecovery => &self.stream_recovery,
            ServiceRole::CredentialHealth => &self.credential_health,
        }
    }

    pub fn get_mut(&mut self, role: ServiceRole) -> &mut T {
        match role {
            ServiceRole::RunStore => &mut self.run_store,
            ServiceRole::SandboxReconciler => &mut self.sandbox_reconciler,
            ServiceRole::StreamRecovery => &mut self.stream_recovery,
            ServiceRole::CredentialHealth => &mut self.credential_health,
        }
    }

    /// Each role with its value, in [`ServiceRole::ALL`] order.
    pub fn iter(&self) -> impl Iterator<Item = (ServiceRole, &T)> {
        ServiceRole::ALL
            .into_iter()
            .map(|role| (role, self.get(role)))
    }
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

    /// The token `role` calls the other services with: its own when set, else the
    /// shared one (empty when neither is; serving refuses that, see
    /// [`AuthConfig::require_calling_token`]).
    pub fn calling_token(&self, role: ServiceRole) -> &Secret {
        match self.service_tokens.get(role) {
            own if !own.is_empty() => own,
            _ => &self.service_token,
        }
    }

    /// Serving `role` needs a token to call the others with: its own or the shared one.
    /// The error names both fields and their variables.
    pub fn require_calling_token(&self, role: ServiceRole) -> Result<&Secret, ConfigError> {
        let token = self.calling_token(role);
        if token.is_empty() {
            let key = role.key();
            return Err(ConfigError::invalid(
                "auth.service_token",
                format!(
                    "required to serve {key}: the token it calls the other services with; set \
                     it (RUNPLANE_AUTH__SERVICE_TOKEN), or this role's own \
                     auth.service_tokens.{key} (RUNPLANE_AUTH__SERVICE_TOKENS__{}), in the \
                     config file or the environment (at least 32 characters, not the \
                     operator token)",
                    key.to_uppercase()
                ),
            ));
        }
        Ok(token)
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
        self.validate_service_roles()?;
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
        self.validate_distinct()?;
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

    /// Each role's own token is long enough, each digest is 64 hex digits, and no role
    /// is given both ways.
    fn validate_service_roles(&self) -> Result<(), ConfigError> {
        for (role, token) in self.service_tokens.iter() {
            if !token.is_empty() && token.expose().len() < 32 {
                return Err(ConfigError::invalid(
                    format!("auth.service_tokens.{}", role.key()),
                    "must be at least 32 characters",
                ));
            }
        }
        for (role, digest) in self.service_token_sha256.iter() {
            if digest.is_empty() {
                continue;
            }
            let key = role.key();
            if parse_sha256(digest).is_none() {
                return Err(ConfigError::invalid(
                    format!("auth.service_token_sha256.{key}"),
                    format!("must be 64 hex digits: the SHA-256 of the {key} token"),
                ));
            }
            if !self.service_tokens.get(role).is_empty() {
                return Err(ConfigError::invalid(
                    format!("auth.service_token_sha256.{key}"),
                    format!("set auth.service_tokens.{key} or its SHA-256, not both"),
                ));
            }
        }
        Ok(())
    }

    /// The operator token, the shared service token and each role's own (in full or by
    /// digest) are different secrets: one of them stolen is one caller, never two. They
    /// are compared by SHA-256, so a digest stands for its token; the later field of two
    /// equal ones is named.
    fn validate_distinct(&self) -> Result<(), ConfigError> {
        let full = |field: String, token: &Secret| {
            (!token.is_empty()).then(|| (field, sha256(token.expose())))
        };
        let mut seen: Vec<(String, [u8; 32])> = Vec::new();
        let operator = full("auth.operator_token".into(), &self.operator_token).or_else(|| {
            parse_sha256(&self.operator_token_sha256).map(|d| ("auth.operator_token".into(), d))
        });
        let roles = self
            .service_tokens
            .iter()
            .filter_map(|(role, token)| full(format!("auth.service_tokens.{}", role.key()), token));
        let digests = self
            .service_token_sha256
            .iter()
            .filter_map(|(role, digest)| {
                parse_sha256(digest)
                    .map(|d| (format!("auth.service_token_sha256.{}", role.key()), d))
            });
        let secrets = operator
            .into_iter()
            .chain(full("auth.service_token".into(), &self.service_token))
            .chain(roles)
            .chain(digests);
        for (field, digest) in secrets {
            if let Some((earlier, _)) = seen.iter().find(|(_, d)| *d == digest) {
                return Err(ConfigError::invalid(
                    field,
                    format!(
                        "must differ from {earlier}: each service and the operators hold \
                         different secrets"
                    ),
                ));
            }
            seen.push((field, digest));
        }
        Ok(())
    }
}

/// The SHA-256 of a secret, as tokens are compared.
fn sha256(secret: &str) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(secret.as_bytes()).into()
}
