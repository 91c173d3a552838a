//! The state both gRPC services work with, and the checks they share: who calls, which
//! run they may see, what admission grants.

use std::time::Duration;

use runplane_grpc::proto_duration as duration;
use runplane_ids::OrgScope;
use runplane_proto::credentials::v1 as credentials_pb;
use runplane_proto::runstore::v1 as runstore_pb;
use tonic::{Request, Status};

use crate::auth::{org_scope, presented};
use crate::changes::Changes;
use crate::clients::CredentialHealthClient;
use crate::config::RunStoreSettings;
use crate::domain::validate;
use crate::error::RunStoreError;
use crate::store::entities::run;
use crate::store::{RunnerAuth, Store};

type Result<T> = std::result::Result<T, RunStoreError>;

/// What admission granted a new run.
#[derive(Debug)]
pub(super) struct Admitted {
    /// The credential it runs on; empty when admission is off and a profile was named.
    pub credential_id: String,
    /// The profile's default deadline (0: none).
    pub max_run_seconds: u32,
    /// The profile's priority, a run's when it asks for none.
    pub priority: i32,
}

/// What the run store's two gRPC services (and its background rounds) work with: the
/// store, the settings, the change notifications and the admission client.
#[derive(Debug)]
pub struct ServiceState {
    pub store: Store,
    pub settings: RunStoreSettings,
    /// The tokens the server's authentication layer knows (`[auth]`).
    pub tokens: runplane_grpc::auth::Tokens,
    pub changes: Changes,
    /// Credential health, asked for admission and told of failed turns; `None` when
    /// `[run_store] admission` is off.
    pub credential_health: Option<CredentialHealthClient>,
    /// The lifecycle webhook endpoints (`[[run_store.webhooks]]`), delivered by the
    /// service's webhooks task and listed by ListWebhooks.
    pub webhooks: crate::webhooks::Webhooks,
}

/// How long CreateRun waits for credential health's admission before answering
/// UNAVAILABLE (nothing stored, so the caller's retry asks again).
const ADMISSION_TIMEOUT: Duration = Duration::from_secs(5);

impl ServiceState {
    /// Asks credential health whether the run may start on `target`; returns what it
    /// admitted the run on. Refusals come back as credential health answered them
    /// (COOLING_OFF, EXHAUSTED, PROFILE_UNKNOWN, CREDENTIAL_UNKNOWN, and
    /// CREDENTIAL_NOT_OWNED for another org's credential or profile).
    pub(super) async fn admit(
        &self,
        org_id: &str,
        target: &runstore_pb::create_run_request::Target,
    ) -> std::result::Result<Admitted, Status> {
        let Some(client) = &self.credential_health else {
            return Ok(Admitted {
                credential_id: match target {
                    runstore_pb::create_run_request::Target::CredentialId(c) => c.clone(),
                    runstore_pb::create_run_request::Target::Profile(_) => String::new(),
                },
                max_run_seconds: 0,
                priority: 0,
            });
        };
        let request = credentials_pb::CheckAdmissionRequest {
            org_id: org_id.to_owned(),
            target: Some(match target {
                runstore_pb::create_run_request::Target::Profile(p) => {
                    credentials_pb::check_admission_request::Target::Profile(p.clone())
                }
                runstore_pb::create_run_request::Target::CredentialId(c) => {
                    credentials_pb::check_admission_request::Target::CredentialId(c.clone())
                }
            }),
        };
        let mut client = client.clone();
        let answer = tokio::time::timeout(ADMISSION_TIMEOUT, client.check_admission(request)).await;
        match answer {
            Ok(Ok(admitted)) => {
                let admitted = admitted.into_inner();
                Ok(Admitted {
                    credential_id: admitted.credential_id,
                    max_run_seconds: admitted.max_run_seconds,
                    priority: i32::try_from(admitted.priority.min(9)).unwrap_or_default(),
                })
            }
            Ok(Err(status))
                if matches!(
                    status.code(),
                    tonic::Code::FailedPrecondition
                        | tonic::Code::NotFound
                        | tonic::Code::InvalidArgument
                        | tonic::Code::PermissionDenied
                ) =>
            {
                tracing::info!(code = ?status.code(), message = status.message(), "run refused by admission");
                Err(status)
            }
            Ok(Err(status)) => Err(RunStoreError::Upstream(format!(
                "credential health did not admit the run: {:?}: {}",
                status.code(),
                status.message()
            ))
            .into()),
            Err(_) => Err(RunStoreError::Upstream(
                "credential health did not answer admission in time".into(),
            )
            .into()),
        }
    }
    /// The orgs the calling operator, service or org token may act in.
    pub(super) fn org_scope<T>(&self, request: &Request<T>) -> Result<OrgScope> {
        org_scope(request)
    }

    /// Calls only runplane's own services may make.
    pub(super) fn service<T>(&self, request: &Request<T>) -> Result<()> {
        match self.org_scope(request)? {
            OrgScope::Any => Ok(()),
            OrgScope::Only(org) => Err(RunStoreError::OrgDenied { org }),
        }
    }

    pub(super) async fn runner<T>(
        &self,
        request: &Request<T>,
        run_id: &str,
        allow_terminal: bool,
    ) -> Result<RunnerAuth> {
        let key = presented(request)?;
        validate::run_id(run_id)?;
        self.store
            .authenticate_runner(key, run_id, allow_terminal)
            .await
    }

    /// The run, if the caller may see it. A run of another org is reported as not
    /// found, so org tokens cannot probe for ids.
    pub(super) async fn visible_run(&self, scope: &OrgScope, run_id: &str) -> Result<run::Model> {
        validate::run_id(run_id)?;
        let run = self.store.get_run(run_id).await?;
        if scope.org_for(&run.org_id).is_err() {
            return Err(RunStoreError::RunNotFound {
                run_id: run_id.to_owned(),
            });
        }
        Ok(run)
    }

    pub(super) fn limits(&self) -> runstore_pb::RunnerLimits {
        let l = &self.settings.limits;
        runstore_pb::RunnerLimits {
            max_batch_events: l.max_batch_events,
            max_batch_bytes: l.max_batch_bytes,
            max_event_text_bytes: l.max_event_text_bytes,
            max_ack_ids: l.max_ack_ids,
            max_poll_wait: Some(duration(l.max_poll_wait)),
            max_failure_tail_bytes: l.max_failure_tail_bytes,
        }
    }
}
