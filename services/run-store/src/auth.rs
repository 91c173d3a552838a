//! Who is calling, as the server's authentication layer (`runplane_grpc::auth`) found:
//! the operator token and any service token act in any org, an org token only in its
//! org, and a run key is checked here against its run. Tokens and keys are compared by
//! SHA-256 and never logged.

use runplane_grpc::auth::Caller;
use runplane_ids::OrgScope;
use tonic::Request;

use crate::error::RunStoreError;

/// The token a runner presented, for its run key to be checked against the store.
pub fn presented<T>(request: &Request<T>) -> Result<&str, RunStoreError> {
    runplane_grpc::auth::caller(request)
        .and_then(Caller::presented)
        .map(|p| p.expose())
        .ok_or(RunStoreError::Unauthenticated)
}

/// The orgs the operator, service or org token a call comes from may act in; a run key
/// (or no caller) acts in none.
pub fn org_scope<T>(request: &Request<T>) -> Result<OrgScope, RunStoreError> {
    runplane_grpc::auth::caller(request)
        .and_then(Caller::org_scope)
        .ok_or(RunStoreError::Unauthenticated)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_org_token_is_scoped_to_its_org() {
        let mut acme = Request::new(());
        acme.extensions_mut().insert(Caller::Org("acme".into()));
        assert_eq!(org_scope(&acme).unwrap(), OrgScope::Only("acme".into()));
    }

    #[test]
    fn a_call_without_an_operator_caller_is_unauthenticated() {
        let bare = Request::new(());
        assert!(matches!(
            org_scope(&bare),
            Err(RunStoreError::Unauthenticated)
        ));
        assert!(matches!(
            presented(&bare),
            Err(RunStoreError::Unauthenticated)
        ));
        let mut service = Request::new(());
        service
            .extensions_mut()
            .insert(Caller::Service(runplane_grpc::auth::Role::Any));
        assert_eq!(org_scope(&service).unwrap(), OrgScope::Any);
        assert!(matches!(
            presented(&service),
            Err(RunStoreError::Unauthenticated)
        ));
    }
}
