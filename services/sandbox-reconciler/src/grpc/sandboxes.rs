//! `runplane.reconciler.v1.SandboxService`: sandboxes created, destroyed, listed, routed
//! to and woken.

use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::reconciler::v1::sandbox_service_server::SandboxService;
use tonic::{Request, Response, Status};

use super::convert::{node_of, sandbox_of, wake_of};
use super::validate::{MAX_REASON_BYTES, at_most, node_name, page_size, sandbox_id};
use super::{RETRY_AFTER, SandboxApi};
use crate::domain::placement;
use crate::domain::status::SandboxStatus;
use crate::error::ReconcilerError;
use crate::store::entities::route_identity;
use runplane_sandbox::route_token::{self, RouteClaims};

#[tonic::async_trait]
impl SandboxService for SandboxApi {
    #[tracing::instrument(skip_all, fields(run_id = %request.get_ref().run_id))]
    async fn create_sandbox(
        &self,
        request: Request<reconciler_pb::CreateSandboxRequest>,
    ) -> Result<Response<reconciler_pb::CreateSandboxResponse>, Status> {
        let s = &self.state;
        s.authenticate(&request)?;
        let req = request.get_ref();
        if !(16..=128).contains(&req.client_request_id.len())
            || !req.client_request_id.bytes().all(|b| b.is_ascii_graphic())
        {
            return Err(ReconcilerError::InvalidField {
                field: "client_request_id",
                reason: "must be 16 to 128 printable ASCII bytes".into(),
            }
            .into());
        }
        if req.substrate() != reconciler_pb::Substrate::Direct {
            return Err(ReconcilerError::InvalidField {
                field: "substrate",
                reason: "only SUBSTRATE_DIRECT has a driver so far".into(),
            }
            .into());
        }
        if !req.node_id.is_empty() {
            node_name("node_id", &req.node_id)?;
        }
        let idle_timeout_ms = req
            .idle_timeout
            .as_ref()
            // Saturating: a client's far-off duration must not overflow (and panic).
            .map(|d| {
                d.seconds
                    .max(0)
                    .saturating_mul(1000)
                    .saturating_add(i64::from(d.nanos.max(0) / 1_000_000))
            })
            .unwrap_or(15 * 60 * 1000);
        // The run's org comes from the run store, which also proves the run exists.
        let run = s
            .run_store
            .clone()
            .get_run(runplane_proto::runstore::v1::GetRunRequest {
                run_id: req.run_id.clone(),
            })
            .await?
            .into_inner()
            .run
            .unwrap_or_default();
        let node_id = if req.node_id.is_empty() {
            s.store
                .ready_nodes(s.store.silent_since())
                .await?
                .first()
                .map_or_else(
                    || crate::domain::placement::LOCAL_NODE.to_owned(),
                    |n| n.id.clone(),
                )
        } else {
            req.node_id.clone()
        };
        if let Some(live) = s.store.live_sandbox_of(&run.id).await?
            && live.client_request_id != req.client_request_id
        {
            return Err(ReconcilerError::SandboxExists {
                run_id: run.id,
                sandbox_id: live.id,
            }
            .into());
        }
        let row = s
            .store
            .create_placed(crate::store::NewSandbox {
                client_request_id: req.client_request_id.clone(),
                network: s.profiles.network_of(&run.profile),
                limits: s.profiles.limits_of(&run.profile),
                image: s.profiles.image_of(&run.profile),
                // The sandbox's work joins the run's trace (this call's, if untraced).
                traceparent: if run.traceparent.is_empty() {
                    runplane_grpc::trace_context::current_traceparent().unwrap_or_default()
                } else {
                    run.traceparent
                },
                attempt: run.attempt.max(1),
                run_id: run.id,
                org_id: run.org_id,
                node_id,
                idle_timeout_ms,
            })
            .await?;
        let placement = s.store.placement(&row.id).await?;
        Ok(Response::new(reconciler_pb::CreateSandboxResponse {
            sandbox: Some(sandbox_of(&placement, None)),
        }))
    }

    #[tracing::instrument(skip_all, fields(sandbox_id = %request.get_ref().sandbox_id))]
    async fn destroy_sandbox(
        &self,
        request: Request<reconciler_pb::DestroySandboxRequest>,
    ) -> Result<Response<reconciler_pb::DestroySandboxResponse>, Status> {
        let s = &self.state;
        s.authenticate(&request)?;
        let req = request.get_ref();
        // Checked first: nothing of an oversized reason is written or logged.
        at_most("reason", &req.reason, MAX_REASON_BYTES)?;
        sandbox_id(&req.sandbox_id)?;
        let row = s.store.sandbox(&req.sandbox_id).await?;
        // Its node is handed a DESTROY assignment; a local one is stopped here (and by the
        // next round if this fails). The run is not failed here: the run store decides that.
        if row.status != crate::store::DELETED
            && s.store
                .mark_deleted(&row.id, row.execution_generation)
                .await?
        {
            tracing::info!(reason = %req.reason, "sandbox destroyed");
        }
        let row = s.store.sandbox(&row.id).await?;
        if row.active_node_id.as_deref() == Some(crate::domain::placement::LOCAL_NODE)
            && row.observed() != Some(crate::store::DELETED)
        {
            crate::reconcile::stop_local(&s.store, &s.local_driver(), &row).await?;
        }
        let placement = s.store.placement(&row.id).await?;
        Ok(Response::new(reconciler_pb::DestroySandboxResponse {
            sandbox: Some(sandbox_of(&placement, None)),
        }))
    }

    async fn list_nodes(
        &self,
        request: Request<reconciler_pb::ListNodesRequest>,
    ) -> Result<Response<reconciler_pb::ListNodesResponse>, Status> {
        let s = &self.state;
        s.authenticate(&request)?;
        let req = request.get_ref();
        let limit = page_size(req.page_size)?;
        let nodes = s
            .store
            .list_nodes(
                (!req.page_token.is_empty()).then_some(req.page_token.as_str()),
                u64::from(limit),
            )
            .await?;
        let silent_since = s.store.silent_since();
        let next_page_token = if nodes.len() == limit as usize {
            nodes.last().map(|n| n.id.clone()).unwrap_or_default()
        } else {
            String::new()
        };
        Ok(Response::new(reconciler_pb::ListNodesResponse {
            nodes: nodes
                .iter()
                .map(|n| {
                    let mut shown = node_of(n);
                    if n.is_fenced() {
                        shown.state = reconciler_pb::NodeState::Fenced as i32;
                    } else if n.last_heartbeat_us < silent_since {
                        shown.state = reconciler_pb::NodeState::Unresponsive as i32;
                    }
                    shown
                })
                .collect(),
            next_page_token,
        }))
    }

    async fn list_sandboxes(
        &self,
        request: Request<reconciler_pb::ListSandboxesRequest>,
    ) -> Result<Response<reconciler_pb::ListSandboxesResponse>, Status> {
        let s = &self.state;
        s.authenticate(&request)?;
        let req = request.get_ref();
        let limit = page_size(req.page_size)?;
        if !req.page_token.is_empty() {
            sandbox_id(&req.page_token)?;
        }
        // UNSPECIFIED is kept, and matches no sandbox.
        let wanted: Vec<Option<SandboxStatus>> = req
            .statuses
            .iter()
            .filter_map(|st| reconciler_pb::SandboxStatus::try_from(*st).ok())
            .map(|st| SandboxStatus::try_from(st).ok())
            .collect();
        let rows = s
            .store
            .list_sandboxes(
                (!req.run_id.is_empty()).then_some(req.run_id.as_str()),
                (!req.node_id.is_empty()).then_some(req.node_id.as_str()),
                (!req.page_token.is_empty()).then_some(req.page_token.as_str()),
                u64::from(limit),
            )
            .await?;
        let next_page_token = if rows.len() == limit as usize {
            rows.last().map(|r| r.id.clone()).unwrap_or_default()
        } else {
            String::new()
        };
        let mut sandboxes = Vec::new();
        for row in rows {
            if !wanted.is_empty() && !wanted.contains(&Some(row.status)) {
                continue;
            }
            let placement = s.store.placement(&row.id).await?;
            let wake = s.store.open_wake(&row.id).await?;
            sandboxes.push(sandbox_of(&placement, wake.as_ref()));
        }
        Ok(Response::new(reconciler_pb::ListSandboxesResponse {
            sandboxes,
            next_page_token,
        }))
    }

    async fn get_sandbox(
        &self,
        request: Request<reconciler_pb::GetSandboxRequest>,
    ) -> Result<Response<reconciler_pb::GetSandboxResponse>, Status> {
        let s = &self.state;
        s.authenticate(&request)?;
        let id = &request.get_ref().sandbox_id;
        sandbox_id(id)?;
        let placement = s.store.placement(id).await?;
        let wake = s.store.open_wake(id).await?;
        Ok(Response::new(reconciler_pb::GetSandboxResponse {
            sandbox: Some(sandbox_of(&placement, wake.as_ref())),
        }))
    }

    #[tracing::instrument(skip_all, fields(sandbox_id = %request.get_ref().sandbox_id))]
    async fn resolve_route(
        &self,
        request: Request<reconciler_pb::ResolveRouteRequest>,
    ) -> Result<Response<reconciler_pb::ResolveRouteResponse>, Status> {
        let s = &self.state;
        s.authenticate(&request)?;
        let req = request.get_ref();
        sandbox_id(&req.sandbox_id)?;
        if req.session_id.len() > 128 || req.session_id.contains('|') {
            return Err(ReconcilerError::InvalidField {
                field: "session_id",
                reason: "at most 128 bytes, no '|'".into(),
            }
            .into());
        }
        let p = s.live_placement(&req.sandbox_id).await?;
        let Some(node_id) = placement::serving_node(
            &p.sandbox.placement(),
            p.route.as_ref().map(route_identity::Model::identity),
        ) else {
            s.refuse_wake_of_ended_run(&p.sandbox).await?;
            let wake = s
                .store
                .queue_wake(&req.sandbox_id, "session reattach")
                .await?;
            // Assign it now, not at the next interval.
            s.signals.want_round();
            tracing::info!(wake_id = %wake.id, "sandbox not placed; wake queued");
            return Err(ReconcilerError::NotPlaced {
                id: req.sandbox_id.clone(),
                wake_id: wake.id,
                retry_after_ms: RETRY_AFTER.as_millis() as u64,
            }
            .into());
        };
        let node = p
            .node
            .clone()
            .ok_or_else(|| ReconcilerError::NodeNotRegistered {
                id: req.sandbox_id.clone(),
                node_id: node_id.clone(),
            })?;
        let expires_us = s.store.now_us() + s.route_ttl.as_micros() as i64;
        let generation = p.sandbox.execution_generation as u64;
        let token = route_token::sign(
            &route_token::node_key(&s.route_key, &node.id),
            &RouteClaims {
                sandbox_id: req.sandbox_id.clone(),
                node_id: node.id.clone(),
                execution_generation: generation,
                session_id: req.session_id.clone(),
                expires_unix: expires_us / 1_000_000,
            },
        );
        Ok(Response::new(reconciler_pb::ResolveRouteResponse {
            node_id: node.id,
            endpoint: node.endpoint,
            route_token: token,
            expires_at: Some(runplane_clock::to_timestamp(expires_us)),
            execution_generation: generation,
        }))
    }

    async fn request_wake(
        &self,
        request: Request<reconciler_pb::RequestWakeRequest>,
    ) -> Result<Response<reconciler_pb::RequestWakeResponse>, Status> {
        let s = &self.state;
        s.authenticate(&request)?;
        let req = request.get_ref();
        sandbox_id(&req.sandbox_id)?;
        at_most("reason", &req.reason, MAX_REASON_BYTES)?;
        let p = s.live_placement(&req.sandbox_id).await?;
        if placement::serving_node(
            &p.sandbox.placement(),
            p.route.as_ref().map(route_identity::Model::identity),
        )
        .is_some()
        {
            return Ok(Response::new(reconciler_pb::RequestWakeResponse {
                placed: true,
                wake: None,
            }));
        }
        s.refuse_wake_of_ended_run(&p.sandbox).await?;
        let wake = s.store.queue_wake(&req.sandbox_id, &req.reason).await?;
        s.signals.want_round();
        Ok(Response::new(reconciler_pb::RequestWakeResponse {
            placed: false,
            wake: Some(wake_of(&wake)),
        }))
    }
}
