//! The tonic side of the run store: authenticate, validate, call the store, map errors.
//!
//! - [`runner`]: RunnerService, what a sandbox's runner calls with its run key;
//! - [`operator`]: RunService, what operators and services call;
//! - [`watch`]: WatchRun's stream.

mod operator;
mod runner;
mod watch;

pub use operator::{CheckedCreateRun, check_create_run};
pub use runner::check_acks;

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use futures::Stream;
use prost::Message;
use runplane_grpc::proto_duration as duration;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_server::RunService;
use runplane_proto::runstore::v1::runner_service_server::RunnerService;
use runplane_telemetry::metrics;
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use crate::auth::{Operator, presented};
use crate::changes::Changes;
use crate::config::RunStoreSettings;
use crate::convert;
use crate::domain::ids::{digest_hex, hex};
use crate::domain::state::RunState;
use crate::domain::verdict::Verdict;
use crate::domain::{ids, validate};
use crate::error::RunStoreError;
use crate::store::{Ack, FailRequest, NewRun, RunFilter, RunnerAuth, Store};

type Result<T> = std::result::Result<T, RunStoreError>;

/// Most ids one ListRuns may name (`run_ids`).
const MAX_LISTED_RUN_IDS: usize = 500;

/// Most bytes of a CancelRun reason.
const MAX_CANCEL_REASON_BYTES: usize = 256;

/// What admission granted a new run.
#[derive(Debug)]
struct Admitted {
    /// The credential it runs on; empty when admission is off and a profile was named.
    credential_id: String,
    /// The profile's default deadline (0: none).
    max_run_seconds: u32,
}

/// What both services share.
#[derive(Debug)]
pub struct Shared {
    pub store: Store,
    pub settings: RunStoreSettings,
    /// The tokens the server's authentication layer knows (`[auth]`).
    pub tokens: runplane_grpc::auth::Tokens,
    pub changes: Changes,
    /// Credential health, asked for admission and told of failed turns; `None` when
    /// `[run_store] admission` is off.
    pub credential_health: Option<CredentialHealthClient>,
}

/// Credential health, called with the service token.
pub type CredentialHealthClient = runplane_proto::credentials::v1::credential_health_service_client::CredentialHealthServiceClient<
    tonic::service::interceptor::InterceptedService<
        runplane_grpc::client::TracedChannel,
        runplane_grpc::client::Bearer,
    >,
>;

/// How long CreateRun waits for credential health's admission before answering
/// UNAVAILABLE (nothing stored, so the caller's retry asks again).
const ADMISSION_TIMEOUT: Duration = Duration::from_secs(5);

impl Shared {
    /// Asks credential health whether the run may start on `target`; returns what it
    /// admitted the run on. Refusals come back as credential health answered them
    /// (COOLING_OFF, EXHAUSTED, PROFILE_UNKNOWN, CREDENTIAL_UNKNOWN, and
    /// CREDENTIAL_NOT_OWNED for another org's credential or profile).
    async fn admit(
        &self,
        org_id: &str,
        target: &runstore_pb::create_run_request::Target,
    ) -> std::result::Result<Admitted, Status> {
        use runplane_proto::credentials::v1 as credentials_pb;
        let Some(client) = &self.credential_health else {
            return Ok(Admitted {
                credential_id: match target {
                    runstore_pb::create_run_request::Target::CredentialId(c) => c.clone(),
                    runstore_pb::create_run_request::Target::Profile(_) => String::new(),
                },
                max_run_seconds: 0,
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
}

impl Shared {
    fn operator<T>(&self, request: &Request<T>) -> Result<Operator> {
        Operator::of(request)
    }

    /// Calls only runplane's own services may make.
    fn service<T>(&self, request: &Request<T>) -> Result<()> {
        match self.operator(request)? {
            Operator::AnyOrg => Ok(()),
            Operator::Org(org) => Err(RunStoreError::OrgDenied { org }),
        }
    }

    async fn runner<T>(
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

    /// The run, if the operator may see it. A run of another org is reported as not
    /// found, so org tokens cannot probe for ids.
    async fn visible_run(
        &self,
        operator: &Operator,
        run_id: &str,
    ) -> Result<crate::store::entities::run::Model> {
        validate::run_id(run_id)?;
        let run = self.store.get_run(run_id).await?;
        if operator.may_act_in(&run.org_id).is_err() {
            return Err(RunStoreError::RunNotFound {
                run_id: run_id.to_owned(),
            });
        }
        Ok(run)
    }

    fn limits(&self) -> runstore_pb::RunnerLimits {
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

fn from_duration(
    field: &'static str,
    d: Option<&prost_types::Duration>,
) -> Result<Option<Duration>> {
    match d {
        None => Ok(None),
        Some(d) if d.seconds < 0 || d.nanos < 0 => {
            Err(RunStoreError::invalid(field, "must not be negative"))
        }
        Some(d) => Ok(Some(Duration::new(d.seconds as u64, d.nanos as u32))),
    }
}

/// `runplane.runstore.v1.RunnerService`: calls from the runner inside a sandbox.
#[derive(Debug, Clone)]
pub struct RunnerApi {
    pub shared: Arc<Shared>,
}

/// `runplane.runstore.v1.RunService`: calls from operators and other services.
#[derive(Debug, Clone)]
pub struct RunApi {
    pub shared: Arc<Shared>,
}
