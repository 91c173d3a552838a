//! The stream lease: AcquireLease, RenewLease and ReleaseLease from the run's runner (its
//! key checked by the run store), ParkStream and UnparkStream from the node agent around
//! a suspend.

use runplane_proto::recovery::v1 as recovery_pb;
use tonic::{Request, Response, Status};

use super::state::{CoordinatorState, new_token, store_error, timestamp};
use super::validate;

pub(super) async fn acquire(
    s: &CoordinatorState,
    request: Request<recovery_pb::AcquireLeaseRequest>,
) -> Result<Response<recovery_pb::AcquireLeaseResponse>, Status> {
    let req = request.get_ref();
    validate::run_id(&req.run_id)?;
    validate::controller_id(&req.controller_id)?;
    let ttl = validate::lease_ttl_ms(req.ttl.as_ref())?;
    let key = s.runner_key(&request, &req.run_id).await?;
    let acquired = s
        .store
        .acquire(
            &req.run_id,
            &req.controller_id,
            &new_token(),
            ttl,
            s.now_ms(),
            key.attempt,
        )
        .await
        .map_err(store_error)?;
    Ok(Response::new(recovery_pb::AcquireLeaseResponse {
        controller_token: acquired.token,
        expires_at: Some(timestamp(acquired.expires_ms)),
        next_sequence: acquired.next_sequence,
    }))
}

pub(super) async fn renew(
    s: &CoordinatorState,
    request: Request<recovery_pb::RenewLeaseRequest>,
) -> Result<Response<recovery_pb::RenewLeaseResponse>, Status> {
    let req = request.get_ref();
    validate::run_id(&req.run_id)?;
    let ttl = validate::lease_ttl_ms(req.ttl.as_ref())?;
    s.runner(&request, &req.run_id).await?;
    let expires = s
        .store
        .renew(&req.run_id, &req.controller_token, ttl, s.now_ms())
        .await
        .map_err(store_error)?;
    Ok(Response::new(recovery_pb::RenewLeaseResponse {
        expires_at: Some(timestamp(expires)),
    }))
}

pub(super) async fn release(
    s: &CoordinatorState,
    request: Request<recovery_pb::ReleaseLeaseRequest>,
) -> Result<Response<recovery_pb::ReleaseLeaseResponse>, Status> {
    let req = request.get_ref();
    validate::run_id(&req.run_id)?;
    s.runner(&request, &req.run_id).await?;
    let released = s
        .store
        .release(&req.run_id, &req.controller_token)
        .await
        .map_err(store_error)?;
    Ok(Response::new(recovery_pb::ReleaseLeaseResponse {
        released,
    }))
}

pub(super) async fn park(
    s: &CoordinatorState,
    request: Request<recovery_pb::ParkStreamRequest>,
) -> Result<Response<recovery_pb::ParkStreamResponse>, Status> {
    s.operator(&request)?;
    let req = request.get_ref();
    validate::run_id(&req.run_id)?;
    let parked = s.store.park(&req.run_id).await.map_err(store_error)?;
    tracing::info!(sandbox_id = %req.sandbox_id, parked, "stream parked for a suspend");
    Ok(Response::new(recovery_pb::ParkStreamResponse { parked }))
}

pub(super) async fn unpark(
    s: &CoordinatorState,
    request: Request<recovery_pb::UnparkStreamRequest>,
) -> Result<Response<recovery_pb::UnparkStreamResponse>, Status> {
    s.operator(&request)?;
    let req = request.get_ref();
    validate::run_id(&req.run_id)?;
    let ttl = validate::lease_ttl_ms(req.ttl.as_ref())?;
    let unparked = s
        .store
        .unpark(&req.run_id, ttl, s.now_ms())
        .await
        .map_err(store_error)?;
    Ok(Response::new(recovery_pb::UnparkStreamResponse {
        unparked,
    }))
}
