//! Who is calling, as the server's authentication layer (`runplane_grpc::auth`) found:
//! the operator and service tokens act in any org, an org token only in its org, and a
//! run key is checked here against its run. Tokens and keys are compared by SHA-256 and
//! never logged.

use runplane_grpc::auth::Caller;
use tonic::Request;

use crate::error::RunStoreError;

/// The token a runner presented, for its run key to be checked against the store.
pub fn presented<T>(request: &Request<T>) -> Result<&str, RunStoreError> {
    runplane_grpc::auth::caller(request)
        .and_then(Caller::presented)
        .map(|p| p.expose())
        .ok_or(RunStoreError::Unauthenticated)
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

impl Operator {
    /// The operator a call comes from; a run key (or no caller) is no operator.
    pub fn of<T>(request: &Request<T>) -> Result<Self, RunStoreError> {
        match runplane_grpc::auth::caller(request) {
            Some(Caller::Operator | Caller::Service) => Ok(Operator::AnyOrg),
            Some(Caller::Org(org)) => Ok(Operator::Org(org.clone())),
            Some(Caller::Presented(_)) | None => Err(RunStoreError::Unauthenticated),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_org_token_acts_only_in_its_org() {
        let acme = Operator::Org("acme".into());
        assert!(acme.may_act_in("acme").is_ok());
        assert!(acme.may_act_in("globex").is_err());
        assert_eq!(acme.org_filter("").unwrap(), Some("acme".into()));
        assert!(acme.org_filter("globex").is_err());
        assert!(Operator::AnyOrg.may_act_in("globex").is_ok());
        assert_eq!(Operator::AnyOrg.org_filter("").unwrap(), None);
    }

    #[test]
    fn a_call_without_an_operator_caller_is_unauthenticated() {
        let bare = Request::new(());
        assert!(matches!(
            Operator::of(&bare),
            Err(RunStoreError::Unauthenticated)
        ));
        assert!(matches!(
            presented(&bare),
            Err(RunStoreError::Unauthenticated)
        ));
        let mut service = Request::new(());
        service.extensions_mut().insert(Caller::Service);
        assert_eq!(Operator::of(&service).unwrap(), Operator::AnyOrg);
        assert!(matches!(
            presented(&service),
            Err(RunStoreError::Unauthenticated)
        ));
    }
}
