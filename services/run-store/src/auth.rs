//! Who is calling.
//!
//! Operators and services present a configured token as `authorization: Bearer <token>`;
//! the service token acts in any org, an org token only in its org. Runners present
//! their run key the same way. Tokens and keys are compared by SHA-256 and never logged.

use std::collections::HashMap;

use runplane_config::Config;
use tonic::metadata::MetadataMap;

use crate::domain::ids::secret_hash;
use crate::error::RunStoreError;

/// The bearer credential of a call, if any.
pub fn bearer(metadata: &MetadataMap) -> Option<&str> {
    let value = metadata.get("authorization")?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    (scheme.eq_ignore_ascii_case("bearer") && !token.trim().is_empty()).then(|| token.trim())
}

/// An authenticated operator or service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Operator {
    /// The service token: any org.
    AnyOrg,
    /// An org-scoped token.
    Org(String),
}

impl Operator {
    /// Refuses a call about `org` from a token scoped to another org.
    pub fn may_act_in(&self, org: &str) -> Result<(), RunStoreError> {
        match self {
            Operator::AnyOrg => Ok(()),
            Operator::Org(own) if own == org => Ok(()),
            Operator::Org(_) => Err(RunStoreError::OrgDenied {
                org: org.to_owned(),
            }),
        }
    }

    /// The org a listing is confined to: an org token's own, whatever was asked.
    pub fn org_filter(&self, asked: &str) -> Result<Option<String>, RunStoreError> {
        match self {
            Operator::AnyOrg => Ok((!asked.is_empty()).then(|| asked.to_owned())),
            Operator::Org(own) if asked.is_empty() || asked == own => Ok(Some(own.clone())),
            Operator::Org(_) => Err(RunStoreError::OrgDenied {
                org: asked.to_owned(),
            }),
        }
    }
}

/// Checks operator and service tokens.
#[derive(Debug, Clone)]
pub struct OperatorAuth {
    service_token_hash: Option<String>,
    org_token_hashes: HashMap<String, String>,
}

impl OperatorAuth {
    pub fn from_config(config: &Config) -> Self {
        let service = &config.auth.operator_token;
        Self {
            service_token_hash: (!service.is_empty()).then(|| secret_hash(service.expose())),
            org_token_hashes: config
                .auth
                .org_tokens
                .iter()
                .map(|(org, token)| (secret_hash(token.expose()), org.clone()))
                .collect(),
        }
    }

    pub fn authenticate(&self, metadata: &MetadataMap) -> Result<Operator, RunStoreError> {
        let token = bearer(metadata).ok_or(RunStoreError::Unauthenticated)?;
        let hash = secret_hash(token);
        if self.service_token_hash.as_deref() == Some(hash.as_str()) {
            return Ok(Operator::AnyOrg);
        }
        self.org_token_hashes
            .get(&hash)
            .map(|org| Operator::Org(org.clone()))
            .ok_or(RunStoreError::Unauthenticated)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata(value: &str) -> MetadataMap {
        let mut m = MetadataMap::new();
        m.insert("authorization", value.parse().unwrap());
        m
    }

    #[test]
    fn service_and_org_tokens_are_told_apart() {
        let mut config = Config::default();
        config.auth.operator_token = runplane_config::Secret::new("s".repeat(40));
        config
            .auth
            .org_tokens
            .insert("acme".into(), runplane_config::Secret::new("a".repeat(40)));
        let auth = OperatorAuth::from_config(&config);

        let service = auth
            .authenticate(&metadata(&format!("Bearer {}", "s".repeat(40))))
            .unwrap();
        assert_eq!(service, Operator::AnyOrg);
        let acme = auth
            .authenticate(&metadata(&format!("bearer {}", "a".repeat(40))))
            .unwrap();
        assert_eq!(acme, Operator::Org("acme".into()));
        assert!(acme.may_act_in("acme").is_ok());
        assert!(acme.may_act_in("globex").is_err());
        assert_eq!(acme.org_filter("").unwrap(), Some("acme".into()));

        assert!(matches!(
            auth.authenticate(&metadata("Bearer nope")),
            Err(RunStoreError::Unauthenticated)
        ));
        assert!(matches!(
            auth.authenticate(&MetadataMap::new()),
            Err(RunStoreError::Unauthenticated)
        ));
    }
}
