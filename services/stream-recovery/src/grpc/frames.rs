//! AppendFrames: the lease holder's frames into the run's replay buffer, charged to the
//! stream's and the org's byte budgets.

use runplane_proto::recovery::v1 as recovery_pb;
use tonic::{Request, Response, Status};

use super::state::{CoordinatorState, store_error};
use super::validate;

pub(super) async fn append(
    s: &CoordinatorState,
    request: Request<recovery_pb::AppendFramesRequest>,
) -> Result<Response<recovery_pb::AppendFramesResponse>, Status> {
    let req = request.get_ref();
    validate::run_id(&req.run_id)?;
    let total = validate::frames(&req.frames)?;
    let org = s.runner(&request, &req.run_id).await?;
    let frames: Vec<(u64, Vec<u8>)> = req
        .frames
        .iter()
        .map(|f| (f.sequence, f.data.clone()))
        .collect();
    // The org's hourly budget is reserved for the whole batch first (its own key, so
    // Redis Cluster keeps working), then what the append did not store is given back:
    // a replay costs nothing, a refusal writes nothing.
    let now = s.now_ms();
    let hour = now.div_euclid(3_600_000);
    let reserved = total as u64;
    let org_left = s
        .store
        .charge_org(&org, hour, reserved, &s.limits)
        .await
        .map_err(store_error)?;
    let appended = match s
        .store
        .append(
            &req.run_id,
            &req.controller_token,
            &frames,
            now,
            &s.limits,
            req.resync,
        )
        .await
    {
        Ok(a) => a,
        Err(e) => {
            let _ = s.store.refund_org(&org, hour, reserved).await;
            return Err(store_error(e));
        }
    };
    let unused = reserved - appended.stored_bytes.min(reserved);
    let _ = s.store.refund_org(&org, hour, unused).await;
    Ok(Response::new(recovery_pb::AppendFramesResponse {
        next_sequence: appended.next_sequence,
        stored_count: appended.stored,
        budget: Some(recovery_pb::ReplayBudget {
            stream_bytes_remaining: appended.stream_bytes_remaining,
            org_hour_bytes_remaining: org_left + unused,
        }),
    }))
}
