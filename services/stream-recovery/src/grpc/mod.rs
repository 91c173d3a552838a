//! The tonic side of the coordinator: authenticate, validate, call the store and the run
//! store, map errors.
//!
//! - [`state`]: what every handler shares, and the run store calls they make;
//! - [`validate`]: the checks of every request, before anything is read or written;
//! - [`leases`]: the runner's lease calls, and the node agent's park and unpark;
//! - [`frames`]: AppendFrames, into the run's replay buffer;
//! - [`planning`]: takeover planning (PlanRecovery) and GetRecoveryBudget;
//! - [`tail`]: Tail's stream;
//! - [`sweep`]: SweepOrphans and the scheduled orphan sweep.

mod frames;
mod leases;
mod planning;
mod state;
mod sweep;
mod tail;
pub mod validate;

pub use state::{CoordinatorState, RunStoreClient};
pub use sweep::sweep_forever;

use std::sync::Arc;

use runplane_proto::recovery::v1 as recovery_pb;
use runplane_proto::recovery::v1::stream_recovery_service_server::StreamRecoveryService;
use tonic::{Request, Response, Status};

/// `runplane.recovery.v1.StreamRecoveryService`: each call is one concern's function.
#[derive(Debug, Clone)]
pub struct StreamRecoveryApi {
    pub state: Arc<CoordinatorState>,
}

#[tonic::async_trait]
impl StreamRecoveryService for StreamRecoveryApi {
    #[tracing::instrument(skip_all, fields(run_id = %request.get_ref().run_id))]
    async fn acquire_lease(
        &self,
        request: Request<recovery_pb::AcquireLeaseRequest>,
    ) -> Result<Response<recovery_pb::AcquireLeaseResponse>, Status> {
        leases::acquire(&self.state, request).await
    }

    async fn renew_lease(
        &self,
        request: Request<recovery_pb::RenewLeaseRequest>,
    ) -> Result<Response<recovery_pb::RenewLeaseResponse>, Status> {
        leases::renew(&self.state, request).await
    }

    async fn release_lease(
        &self,
        request: Request<recovery_pb::ReleaseLeaseRequest>,
    ) -> Result<Response<recovery_pb::ReleaseLeaseResponse>, Status> {
        leases::release(&self.state, request).await
    }

    #[tracing::instrument(skip_all, fields(run_id = %request.get_ref().run_id, frames = request.get_ref().frames.len()))]
    async fn append_frames(
        &self,
        request: Request<recovery_pb::AppendFramesRequest>,
    ) -> Result<Response<recovery_pb::AppendFramesResponse>, Status> {
        frames::append(&self.state, request).await
    }

    async fn tail(
        &self,
        request: Request<recovery_pb::TailRequest>,
    ) -> Result<Response<tail::TailStream>, Status> {
        tail::open(self.state.clone(), request).await
    }

    async fn get_recovery_budget(
        &self,
        request: Request<recovery_pb::GetRecoveryBudgetRequest>,
    ) -> Result<Response<recovery_pb::GetRecoveryBudgetResponse>, Status> {
        planning::get_recovery_budget(&self.state, request).await
    }

    #[tracing::instrument(skip_all, fields(run_id = %request.get_ref().run_id))]
    async fn plan_recovery(
        &self,
        request: Request<recovery_pb::PlanRecoveryRequest>,
    ) -> Result<Response<recovery_pb::PlanRecoveryResponse>, Status> {
        planning::plan_recovery(&self.state, request).await
    }

    #[tracing::instrument(skip_all, fields(run_id = %request.get_ref().run_id))]
    async fn park_stream(
        &self,
        request: Request<recovery_pb::ParkStreamRequest>,
    ) -> Result<Response<recovery_pb::ParkStreamResponse>, Status> {
        leases::park(&self.state, request).await
    }

    #[tracing::instrument(skip_all, fields(run_id = %request.get_ref().run_id))]
    async fn unpark_stream(
        &self,
        request: Request<recovery_pb::UnparkStreamRequest>,
    ) -> Result<Response<recovery_pb::UnparkStreamResponse>, Status> {
        leases::unpark(&self.state, request).await
    }

    async fn sweep_orphans(
        &self,
        request: Request<recovery_pb::SweepOrphansRequest>,
    ) -> Result<Response<recovery_pb::SweepOrphansResponse>, Status> {
        sweep::sweep_orphans(&self.state, request).await
    }
}
