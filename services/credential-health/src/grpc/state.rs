//! What every handler works with: the store, the profiles, the run store's client, the
//! notice watchers, and who is calling.

use std::time::Duration;

use runplane_db::notify::Relay;
use runplane_grpc::client::{Bearer, TracedChannel};
use runplane_grpc::notifier::Notifier;
use runplane_ids::OrgScope;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use tokio::sync::watch;
use tonic::Request;
use tonic::service::interceptor::InterceptedService;

use crate::domain::profiles::Profiles;
use crate::error::CredentialHealthError;
use crate::store::Store;

/// The run store, called with the service token.
pub type RunStoreClient = RunServiceClient<InterceptedService<TracedChannel, Bearer>>;

/// How long admission waits for the run store's active-run count before choosing
/// without it.
const COUNT_TIMEOUT: Duration = Duration::from_secs(2);

/// What every CredentialHealthService handler works with; [`crate::CredentialHealth`]'s
/// rounds and shutdown reach the same store, clients and watchers through it.
pub struct HealthServiceState {
    pub store: Store,
    pub profiles: Profiles,
    pub run_store: RunStoreClient,
    /// The tokens the server's authentication layer knows (`[auth]`).
    pub tokens: runplane_grpc::auth::Tokens,
    /// Notice watchers, by lead ([`crate::store::notices::notice_key`]); what each last sent is its
    /// lead's notice sequence.
    pub notices: Notifier<i64>,
    /// Tells the other replicas which leads got notices (Postgres only).
    pub notice_relay: Option<Relay>,
    /// Bumped when this process owes the run store a call.
    pub outbox: watch::Sender<u64>,
    /// Set at shutdown: watches end.
    pub closing: watch::Sender<bool>,
}

impl std::fmt::Debug for HealthServiceState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HealthServiceState").finish_non_exhaustive()
    }
}

impl HealthServiceState {
    /// Calls only runplane's services and operators make: an org token is refused.
    pub(super) fn authenticate<T>(
        &self,
        request: &Request<T>,
    ) -> Result<(), CredentialHealthError> {
        match self.caller(request)? {
            OrgScope::Any => Ok(()),
            OrgScope::Only(org) => Err(CredentialHealthError::OrgDenied { org }),
        }
    }

    /// The orgs the caller the server's authentication layer found may act in; only
    /// WatchNotices takes an org token, and the layer refuses one on every other method.
    pub(super) fn caller<T>(
        &self,
        request: &Request<T>,
    ) -> Result<OrgScope, CredentialHealthError> {
        runplane_grpc::auth::caller(request)
            .and_then(runplane_grpc::auth::Caller::org_scope)
            .ok_or(CredentialHealthError::Unauthenticated)
    }

    /// Active runs per credential and per `profile/credential`, from the run store.
    pub(super) async fn count_active(
        &self,
        credentials: Vec<String>,
    ) -> Result<runstore_pb::CountActiveRunsResponse, CredentialHealthError> {
        let mut client = self.run_store.clone();
        let call = client.count_active_runs(runstore_pb::CountActiveRunsRequest {
            credential_ids: credentials,
            profiles: Vec::new(),
        });
        match tokio::time::timeout(COUNT_TIMEOUT, call).await {
            Ok(Ok(answer)) => Ok(answer.into_inner()),
            Ok(Err(status)) => Err(CredentialHealthError::Upstream(format!(
                "{:?}: {}",
                status.code(),
                status.message()
            ))),
            Err(_) => Err(CredentialHealthError::Upstream(
                "CountActiveRuns did not answer in time".into(),
            )),
        }
    }
}
