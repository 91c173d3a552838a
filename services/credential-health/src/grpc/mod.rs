//! The tonic side of credential health: `runplane.credentials.v1.CredentialHealthService`.
//!
//! This file is the service's table of contents: each method authenticates and validates
//! in the file of its concern, which calls the store and maps errors.
//! - [`state`]: what every handler works with, and who is calling;
//! - `turn_failures.rs`: ReportTurnFailure;
//! - `admission.rs`: CheckAdmission;
//! - `fleet.rs`: GetFleet;
//! - `notices.rs`: WatchNotices;
//! - `incidents.rs`: ListIncidents.

mod admission;
mod fleet;
mod incidents;
mod notices;
pub mod state;
mod turn_failures;
mod validate;

pub use notices::{NOTICE_CHANNEL, NOTICE_RECHECK};
pub use state::{HealthServiceState, RunStoreClient};

use std::sync::Arc;

use runplane_proto::credentials::v1 as credentials_pb;
use runplane_proto::credentials::v1::credential_health_service_server::CredentialHealthService;
use tonic::{Request, Response, Status};

use notices::NoticeStream;

/// `runplane.credentials.v1.CredentialHealthService`.
#[derive(Debug, Clone)]
pub struct CredentialHealthApi {
    pub state: Arc<HealthServiceState>,
}

#[tonic::async_trait]
impl CredentialHealthService for CredentialHealthApi {
    #[tracing::instrument(skip_all, fields(
        run_id = %request.get_ref().run_id,
        credential_id = %request.get_ref().credential_id,
        outcome,
    ))]
    async fn report_turn_failure(
        &self,
        request: Request<credentials_pb::ReportTurnFailureRequest>,
    ) -> Result<Response<credentials_pb::ReportTurnFailureResponse>, Status> {
        turn_failures::report_turn_failure(&self.state, request).await
    }

    #[tracing::instrument(skip_all, fields(org_id = %request.get_ref().org_id, credential_id))]
    async fn check_admission(
        &self,
        request: Request<credentials_pb::CheckAdmissionRequest>,
    ) -> Result<Response<credentials_pb::CheckAdmissionResponse>, Status> {
        admission::check_admission(&self.state, request).await
    }

    async fn get_fleet(
        &self,
        request: Request<credentials_pb::GetFleetRequest>,
    ) -> Result<Response<credentials_pb::GetFleetResponse>, Status> {
        fleet::get_fleet(&self.state, request).await
    }

    async fn watch_notices(
        &self,
        request: Request<credentials_pb::WatchNoticesRequest>,
    ) -> Result<Response<NoticeStream>, Status> {
        notices::watch_notices(self.state.clone(), request).await
    }

    async fn list_incidents(
        &self,
        request: Request<credentials_pb::ListIncidentsRequest>,
    ) -> Result<Response<credentials_pb::ListIncidentsResponse>, Status> {
        incidents::list_incidents(&self.state, request).await
    }
}
