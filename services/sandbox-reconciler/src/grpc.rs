//! The tonic side of the reconciler: authenticate, validate, call the store, map errors.
//! Methods not built yet keep the generated body, which answers `UNIMPLEMENTED`.

use std::sync::Arc;
use std::time::Duration;

use runplane_proto::reconciler::v1 as pb;
use runplane_proto::reconciler::v1::node_service_server::NodeService;
use runplane_proto::reconciler::v1::sandbox_service_server::SandboxService;
use sha2::{Digest, Sha256};
use tonic::{Request, Response, Status};

use crate::domain::placement;
use crate::domain::route_token::{self, RouteClaims};
use crate::error::ReconcilerError;
use crate::store::entities::{sandbox, wake};
use crate::store::{Placement, Store};

/// How soon a client told NOT_PLACED should try again.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);

/// What the services share.
pub struct Shared {
    pub store: Store,
    /// SHA-256 of the service/operator token.
    pub token_hash: Option<[u8; 32]>,
    pub route_key: Vec<u8>,
    pub route_ttl: Duration,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").finish_non_exhaustive()
    }
}

impl Shared {
    /// The placement of a sandbox that has not ended (SANDBOX_ENDED otherwise).
    async fn live_placement(&self, id: &str) -> Result<Placement, ReconcilerError> {
        let p = self.store.placement(id).await?;
        if placement::is_ended(&p.sandbox) {
            return Err(ReconcilerError::SandboxEnded {
                id: p.sandbox.id.clone(),
                status: p.sandbox.status.clone(),
            });
        }
        Ok(p)
    }

    fn authenticate<T>(&self, request: &Request<T>) -> Result<(), ReconcilerError> {
        let token = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .ok_or(ReconcilerError::Unauthenticated)?;
        let hash: [u8; 32] = Sha256::digest(token.trim().as_bytes()).into();
        match self.token_hash {
            Some(expected) if expected == hash => Ok(()),
            _ => Err(ReconcilerError::Unauthenticated),
        }
    }
}

#[derive(Debug, Clone)]
pub struct SandboxApi {
    pub shared: Arc<Shared>,
}

#[derive(Debug, Clone)]
pub struct NodeApi;

impl NodeService for NodeApi {}

fn sandbox_id(id: &str) -> Result<(), ReconcilerError> {
    if uuid::Uuid::parse_str(id).is_err() {
        return Err(ReconcilerError::InvalidField {
            field: "sandbox_id",
            reason: "must be a sandbox id (a UUID)".into(),
        });
    }
    Ok(())
}

fn timestamp(us: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: us.div_euclid(1_000_000),
        nanos: (us.rem_euclid(1_000_000) * 1000) as i32,
    }
}

fn status_of(name: &str) -> pb::SandboxStatus {
    match name {
        "creating" => pb::SandboxStatus::Creating,
        "started" => pb::SandboxStatus::Started,
        "suspended" => pb::SandboxStatus::Suspended,
        "restoring" => pb::SandboxStatus::Restoring,
        "exited" => pb::SandboxStatus::Exited,
        "lost" => pb::SandboxStatus::Lost,
        "deleted" => pb::SandboxStatus::Deleted,
        _ => pb::SandboxStatus::Unspecified,
    }
}

fn wake_of(w: &wake::Model) -> pb::Wake {
    pb::Wake {
        id: w.id.clone(),
        sandbox_id: w.sandbox_id.clone(),
        state: match w.state.as_str() {
            "pending" => pb::WakeState::Pending,
            "assigned" => pb::WakeState::Assigned,
            "restored" => pb::WakeState::Restored,
            "failed" => pb::WakeState::Failed,
            _ => pb::WakeState::Unspecified,
        } as i32,
        node_id: w.node_id.clone().unwrap_or_default(),
        attempts: w.attempts as u32,
        last_error: w.last_error.clone(),
        requested_at: Some(timestamp(w.requested_at_us)),
        settled_at: w.settled_at_us.map(timestamp),
    }
}

/// A sandbox as the API shows it: placement through the one placement rule.
pub fn sandbox_of(p: &Placement, pending_wake: Option<&wake::Model>) -> pb::Sandbox {
    let s: &sandbox::Model = &p.sandbox;
    pb::Sandbox {
        id: s.id.clone(),
        run_id: s.run_id.clone(),
        org_id: s.org_id.clone(),
        substrate: match s.substrate.as_str() {
            "kubernetes" => pb::Substrate::Kubernetes,
            "direct" => pb::Substrate::Direct,
            _ => pb::Substrate::Unspecified,
        } as i32,
        status: status_of(&s.status) as i32,
        active_node_id: s.active_node_id.clone().unwrap_or_default(),
        route_identity: p.route.as_ref().map(|r| pb::RouteIdentity {
            current_node_id: r.current_node_id.clone(),
            execution_generation: r.execution_generation as u64,
        }),
        execution_generation: s.execution_generation as u64,
        loss_observed_at: s.loss_observed_at_us.map(timestamp),
        idle_timeout: Some(prost_types::Duration {
            seconds: s.idle_timeout_ms / 1000,
            nanos: ((s.idle_timeout_ms % 1000) * 1_000_000) as i32,
        }),
        exit_code: s.exit_code,
        pending_wake: pending_wake.map(wake_of),
        created_at: Some(timestamp(s.created_at_us)),
        updated_at: Some(timestamp(s.updated_at_us)),
    }
}

#[tonic::async_trait]
impl SandboxService for SandboxApi {
    async fn get_sandbox(
        &self,
        request: Request<pb::GetSandboxRequest>,
    ) -> Result<Response<pb::GetSandboxResponse>, Status> {
        let s = &self.shared;
        s.authenticate(&request)?;
        let id = &request.get_ref().sandbox_id;
        sandbox_id(id)?;
        let placement = s.store.placement(id).await?;
        let wake = s.store.open_wake(id).await?;
        Ok(Response::new(pb::GetSandboxResponse {
            sandbox: Some(sandbox_of(&placement, wake.as_ref())),
        }))
    }

    #[tracing::instrument(skip_all, fields(sandbox_id = %request.get_ref().sandbox_id))]
    async fn resolve_route(
        &self,
        request: Request<pb::ResolveRouteRequest>,
    ) -> Result<Response<pb::ResolveRouteResponse>, Status> {
        let s = &self.shared;
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
        let Some(node_id) = placement::serving_node(&p.sandbox, p.route.as_ref()) else {
            let wake = s
                .store
                .queue_wake(&req.sandbox_id, "session reattach")
                .await?;
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
            &s.route_key,
            &RouteClaims {
                sandbox_id: req.sandbox_id.clone(),
                node_id: node.id.clone(),
                execution_generation: generation,
                session_id: req.session_id.clone(),
                expires_unix: expires_us / 1_000_000,
            },
        );
        Ok(Response::new(pb::ResolveRouteResponse {
            node_id: node.id,
            endpoint: node.endpoint,
            route_token: token,
            expires_at: Some(timestamp(expires_us)),
            execution_generation: generation,
        }))
    }

    async fn request_wake(
        &self,
        request: Request<pb::RequestWakeRequest>,
    ) -> Result<Response<pb::RequestWakeResponse>, Status> {
        let s = &self.shared;
        s.authenticate(&request)?;
        let req = request.get_ref();
        sandbox_id(&req.sandbox_id)?;
        if req.reason.len() > 256 {
            return Err(ReconcilerError::InvalidField {
                field: "reason",
                reason: "at most 256 bytes".into(),
            }
            .into());
        }
        let p = s.live_placement(&req.sandbox_id).await?;
        if placement::serving_node(&p.sandbox, p.route.as_ref()).is_some() {
            return Ok(Response::new(pb::RequestWakeResponse {
                placed: true,
                wake: None,
            }));
        }
        let wake = s.store.queue_wake(&req.sandbox_id, &req.reason).await?;
        Ok(Response::new(pb::RequestWakeResponse {
            placed: false,
            wake: Some(wake_of(&wake)),
        }))
    }
}
