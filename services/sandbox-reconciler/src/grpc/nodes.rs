//! `runplane.reconciler.v1.NodeService`: node agents register, heartbeat, take their
//! assignments and publish what they observe.

use std::time::Duration;

use runplane_proto::limits::MAX_NODE_CAPACITY;
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::reconciler::v1::node_service_server::NodeService;
use runplane_proto::runstore::v1 as runstore_pb;
use tonic::{Request, Response, Status};

use super::convert::{assignment_of, node_of, revision, sandbox_of, wake_of};
use super::validate::{at_most, check_publication, int32, int64, node_name, sandbox_id};
use super::{HEARTBEAT_EVERY, NodeApi};
use crate::error::ReconcilerError;
use crate::store::nodes::MAX_WAKE_ERROR_BYTES;
use runplane_sandbox::route_token::{self};

#[tonic::async_trait]
impl NodeService for NodeApi {
    #[tracing::instrument(skip_all, fields(node_id = %request.get_ref().node_id))]
    async fn register_node(
        &self,
        request: Request<reconciler_pb::RegisterNodeRequest>,
    ) -> Result<Response<reconciler_pb::RegisterNodeResponse>, Status> {
        let s = &self.state;
        let credential = s
            .authenticate_node(&request, &request.get_ref().node_id)
            .await?;
        let req = request.get_ref();
        node_name("node_id", &req.node_id)?;
        if !(16..=128).contains(&req.boot_id.len()) {
            return Err(ReconcilerError::InvalidField {
                field: "boot_id",
                reason: "must be 16 to 128 bytes".into(),
            }
            .into());
        }
        if req.endpoint.is_empty() || req.endpoint.len() > 256 {
            return Err(ReconcilerError::InvalidField {
                field: "endpoint",
                reason: "must be 1 to 256 bytes".into(),
            }
            .into());
        }
        if !(1..=MAX_NODE_CAPACITY).contains(&req.capacity) {
            return Err(ReconcilerError::InvalidField {
                field: "capacity",
                reason: format!("must be 1 to {MAX_NODE_CAPACITY}"),
            }
            .into());
        }
        // What the operator allowed this node when making its credential: a stolen
        // credential cannot claim more room, and draw more runs, than that.
        if credential.max_capacity > 0 && i64::from(req.capacity) > credential.max_capacity {
            tracing::warn!(credential_id = %credential.id, capacity = req.capacity, ceiling = credential.max_capacity, "node registration above its credential's capacity ceiling; refused");
            return Err(ReconcilerError::InvalidField {
                field: "capacity",
                reason: format!(
                    "must be at most {}: the ceiling set with this node's credential",
                    credential.max_capacity
                ),
            }
            .into());
        }
        let node = s
            .store
            .register_node(
                &credential.id,
                &req.node_id,
                &req.boot_id,
                &req.endpoint,
                req.capacity as i32,
            )
            .await?;
        tracing::info!(epoch = node.epoch, endpoint = %node.endpoint, "node registered");
        Ok(Response::new(reconciler_pb::RegisterNodeResponse {
            epoch: node.epoch as u64,
            node: Some(node_of(&node)),
            heartbeat_interval: Some(runplane_grpc::proto_duration(HEARTBEAT_EVERY)),
            route_key: route_token::node_key(&s.route_key, &node.id),
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<reconciler_pb::HeartbeatRequest>,
    ) -> Result<Response<reconciler_pb::HeartbeatResponse>, Status> {
        let s = &self.state;
        s.authenticate_node(&request, &request.get_ref().node_id)
            .await?;
        let req = request.get_ref();
        node_name("node_id", &req.node_id)?;
        s.store
            .heartbeat(
                &req.node_id,
                int64("epoch", req.epoch)?,
                req.used.min(i32::MAX as u32) as i32,
            )
            .await?;
        Ok(Response::new(reconciler_pb::HeartbeatResponse {
            next_heartbeat_in: Some(runplane_grpc::proto_duration(HEARTBEAT_EVERY)),
        }))
    }

    async fn list_assigned_sandboxes(
        &self,
        request: Request<reconciler_pb::ListAssignedSandboxesRequest>,
    ) -> Result<Response<reconciler_pb::ListAssignedSandboxesResponse>, Status> {
        let s = &self.state;
        s.authenticate_node(&request, &request.get_ref().node_id)
            .await?;
        let req = request.get_ref();
        node_name("node_id", &req.node_id)?;
        let wait = req
            .wait
            .as_ref()
            .map(|d| Duration::new(d.seconds.max(0) as u64, d.nanos.max(0) as u32))
            .unwrap_or_default()
            .min(Duration::from_secs(30));
        let deadline = tokio::time::Instant::now() + wait;
        let mut changes = s.signals.watch_assignments();
        loop {
            s.store
                .node_at_epoch(&req.node_id, int64("epoch", req.epoch)?)
                .await?;
            let assignments: Vec<reconciler_pb::Assignment> = s
                .store
                .assignments(&req.node_id)
                .await?
                .iter()
                .map(assignment_of)
                .collect();
            let revision = revision(&assignments);
            if revision != req.known_revision || tokio::time::Instant::now() >= deadline {
                return Ok(Response::new(
                    reconciler_pb::ListAssignedSandboxesResponse {
                        assignments,
                        revision,
                    },
                ));
            }
            // Read again when a round (here or on another replica) may have changed
            // the assignments, else answer at the deadline.
            changes.changed(deadline).await;
        }
    }

    #[tracing::instrument(skip_all, fields(node_id = %request.get_ref().node_id, sandbox_id = %request.get_ref().sandbox_id, attempt = tracing::field::Empty))]
    async fn claim_launch(
        &self,
        request: Request<reconciler_pb::ClaimLaunchRequest>,
    ) -> Result<Response<reconciler_pb::ClaimLaunchResponse>, Status> {
        let s = &self.state;
        s.authenticate_node(&request, &request.get_ref().node_id)
            .await?;
        let req = request.get_ref();
        node_name("node_id", &req.node_id)?;
        sandbox_id(&req.sandbox_id)?;
        s.store
            .node_at_epoch(&req.node_id, int64("epoch", req.epoch)?)
            .await?;
        let row = s.store.sandbox(&req.sandbox_id).await?;
        if row.status.is_ended() {
            return Err(ReconcilerError::SandboxEnded {
                id: row.id,
                status: row.status,
            }
            .into());
        }
        if row.active_node_id.as_deref() != Some(req.node_id.as_str())
            || row.execution_generation as u64 != req.execution_generation
        {
            return Err(ReconcilerError::NodeNotOwner {
                node_id: req.node_id.clone(),
                sandbox_id: row.id,
            }
            .into());
        }
        tracing::Span::current().record("attempt", row.attempt.max(1));
        // The run store dedupes on the same key the local dispatch uses for this
        // generation, so a replay maps to the same key record.
        let issued = s
            .run_store
            .clone()
            .issue_run_key(runplane_proto::runstore::v1::IssueRunKeyRequest {
                run_id: row.run_id.clone(),
                sandbox_id: row.id.clone(),
                sandbox_generation: row.execution_generation as u64,
                idempotency_key: format!("{}:{}", row.id, row.execution_generation),
                attempt: u32::try_from(row.attempt.max(1)).unwrap_or(u32::MAX),
                node_id: req.node_id.clone(),
            })
            .await?
            .into_inner();
        Ok(Response::new(reconciler_pb::ClaimLaunchResponse {
            run_id: row.run_id,
            run_key: issued.run_key,
            key_id: issued.key_id,
            run_store_endpoint: s.run_store_endpoint.clone(),
            recovery_endpoint: s.recovery_endpoint.clone(),
            traceparent: row.traceparent,
        }))
    }

    async fn publish_sandbox_state(
        &self,
        request: Request<reconciler_pb::PublishSandboxStateRequest>,
    ) -> Result<Response<reconciler_pb::PublishSandboxStateResponse>, Status> {
        let s = &self.state;
        s.authenticate_node(&request, &request.get_ref().node_id)
            .await?;
        let req = request.get_ref();
        let (epoch, observation) = check_publication(req)?;
        s.store.node_at_epoch(&req.node_id, epoch).await?;
        let (applied, row) = s
            .store
            .publish_observation(&req.node_id, epoch, &observation)
            .await?;
        // Whether its agent waits for input goes on to the run store, ordered there by
        // the node's own (generation, sequence); the node publishes again if this fails.
        if let Some(waiting) = req.waiting_for_input
            && applied
        {
            s.run_store
                .clone()
                .report_waiting_for_input(runstore_pb::ReportWaitingForInputRequest {
                    run_id: row.run_id.clone(),
                    execution_generation: req.execution_generation,
                    observation_seq: req.observation_seq,
                    waiting,
                })
                .await
                .map_err(ReconcilerError::Upstream)?;
        }
        let placement = s.store.placement(&row.id).await?;
        Ok(Response::new(reconciler_pb::PublishSandboxStateResponse {
            applied,
            sandbox: Some(sandbox_of(&placement, None)),
        }))
    }

    #[tracing::instrument(skip_all, fields(node_id = %request.get_ref().node_id, wake_id = %request.get_ref().wake_id))]
    async fn report_restored(
        &self,
        request: Request<reconciler_pb::ReportRestoredRequest>,
    ) -> Result<Response<reconciler_pb::ReportRestoredResponse>, Status> {
        let s = &self.state;
        s.authenticate_node(&request, &request.get_ref().node_id)
            .await?;
        let req = request.get_ref();
        node_name("node_id", &req.node_id)?;
        s.store
            .node_at_epoch(&req.node_id, int64("epoch", req.epoch)?)
            .await?;
        let row = s
            .store
            .report_restored(
                &req.node_id,
                &req.wake_id,
                int32("wake_attempt", req.wake_attempt)?,
            )
            .await?;
        tracing::info!(sandbox_id = %row.id, "wake restored; placement and route identity written");
        let placement = s.store.placement(&row.id).await?;
        Ok(Response::new(reconciler_pb::ReportRestoredResponse {
            sandbox: Some(sandbox_of(&placement, None)),
        }))
    }

    async fn report_wake_failed(
        &self,
        request: Request<reconciler_pb::ReportWakeFailedRequest>,
    ) -> Result<Response<reconciler_pb::ReportWakeFailedResponse>, Status> {
        let s = &self.state;
        s.authenticate_node(&request, &request.get_ref().node_id)
            .await?;
        let req = request.get_ref();
        // Checked first: nothing of an oversized error is written or logged.
        at_most("error", &req.error, MAX_WAKE_ERROR_BYTES)?;
        node_name("node_id", &req.node_id)?;
        s.store
            .node_at_epoch(&req.node_id, int64("epoch", req.epoch)?)
            .await?;
        let wake = s
            .store
            .report_wake_failed(
                &req.node_id,
                &req.wake_id,
                int32("wake_attempt", req.wake_attempt)?,
                &req.error,
            )
            .await?;
        Ok(Response::new(reconciler_pb::ReportWakeFailedResponse {
            wake: Some(wake_of(&wake)),
        }))
    }

    #[tracing::instrument(skip_all, fields(sandbox_id = %request.get_ref().sandbox_id))]
    async fn park_sandbox_stream(
        &self,
        request: Request<reconciler_pb::ParkSandboxStreamRequest>,
    ) -> Result<Response<reconciler_pb::ParkSandboxStreamResponse>, Status> {
        let s = &self.state;
        let req = request.get_ref();
        s.authenticate_node(&request, &req.node_id).await?;
        let row = s
            .held_by(
                &req.node_id,
                req.epoch,
                &req.sandbox_id,
                req.execution_generation,
            )
            .await?;
        let answer = s
            .recovery
            .clone()
            .park_stream(runplane_proto::recovery::v1::ParkStreamRequest {
                run_id: row.run_id.clone(),
                sandbox_id: row.id.clone(),
            })
            .await
            .map_err(|status| coordinator_failed("ParkStream", &status))?;
        Ok(Response::new(reconciler_pb::ParkSandboxStreamResponse {
            parked: answer.into_inner().parked,
        }))
    }

    #[tracing::instrument(skip_all, fields(sandbox_id = %request.get_ref().sandbox_id))]
    async fn unpark_sandbox_stream(
        &self,
        request: Request<reconciler_pb::UnparkSandboxStreamRequest>,
    ) -> Result<Response<reconciler_pb::UnparkSandboxStreamResponse>, Status> {
        let s = &self.state;
        let req = request.get_ref();
        s.authenticate_node(&request, &req.node_id).await?;
        let row = s
            .held_by(
                &req.node_id,
                req.epoch,
                &req.sandbox_id,
                req.execution_generation,
            )
            .await?;
        s.recovery
            .clone()
            .unpark_stream(runplane_proto::recovery::v1::UnparkStreamRequest {
                run_id: row.run_id.clone(),
                ttl: req.ttl,
            })
            .await
            .map_err(|status| coordinator_failed("UnparkStream", &status))?;
        Ok(Response::new(reconciler_pb::UnparkSandboxStreamResponse {}))
    }
}

/// The coordinator's refusal as the node should see it: its own answer when it gave a
/// reason (a bad TTL, say), UNAVAILABLE otherwise.
fn coordinator_failed(method: &'static str, status: &Status) -> Status {
    ReconcilerError::Coordinator {
        method,
        status: status.clone(),
    }
    .into()
}
