//! The tonic side of the reconciler: authenticate, validate, call the store, map errors.

use std::sync::Arc;
use std::time::Duration;

use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::reconciler::v1::node_credential_service_server::NodeCredentialService;
use runplane_proto::reconciler::v1::node_service_server::NodeService;
use runplane_proto::reconciler::v1::sandbox_service_server::SandboxService;
use sha2::{Digest, Sha256};
use tonic::{Request, Response, Status};

use crate::domain::placement;
use crate::domain::status::SandboxStatus;
use crate::error::ReconcilerError;
use crate::store::entities::{node, sandbox, wake};
use crate::store::nodes::{Assigned, MAX_WAKE_ERROR_BYTES, Observation};
use crate::store::{Placement, Store};
use runplane_sandbox::route_token::{self, RouteClaims};

pub use crate::clients::RecoveryClient;

/// How soon a client told NOT_PLACED should try again.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);

/// What the services share.
pub struct Shared {
    pub store: Store,
    /// Hands work to node agents at once (see [`crate::signals`]).
    pub signals: crate::signals::Signals,
    /// The run store, for the run keys node agents claim.
    pub run_store: crate::reconcile::RunStoreClient,
    /// The stream recovery coordinator, which parks a node's sandbox's stream for it.
    pub recovery: RecoveryClient,
    pub run_store_endpoint: String,
    pub recovery_endpoint: String,
    /// Where this reconciler's own (local) sandboxes live.
    pub local_state_dir: std::path::PathBuf,
    /// The tokens the server's authentication layer knows (`[auth]`).
    pub tokens: runplane_grpc::auth::Tokens,
    pub route_key: Vec<u8>,
    pub route_ttl: Duration,
    /// Profiles whose sandboxes get no network (`network = "none"`).
    pub offline_profiles: std::collections::BTreeSet<String>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").finish_non_exhaustive()
    }
}

impl Shared {
    /// The driver of this reconciler's own sandboxes, for stopping them (it launches
    /// nothing, so it needs no binary).
    fn local_driver(&self) -> crate::drivers::ProcessDriver {
        crate::drivers::ProcessDriver::new(&self.local_state_dir, "runplane")
    }

    /// Refuses a wake for an unplaced sandbox whose run has ended, deleting the sandbox
    /// (which settles its wakes) instead of waking it; the round would otherwise do that
    /// only after a node restored it. When the run store cannot say, the wake proceeds
    /// and the round's sweep is the safety net.
    async fn refuse_wake_of_ended_run(&self, row: &sandbox::Model) -> Result<(), ReconcilerError> {
        let run = self
            .run_store
            .clone()
            .get_run(runplane_proto::runstore::v1::GetRunRequest {
                run_id: row.run_id.clone(),
            })
            .await;
        let terminal = match run {
            Ok(answer) => answer
                .into_inner()
                .run
                .is_some_and(|r| r.state().is_terminal()),
            Err(status) => {
                tracing::debug!(code = ?status.code(), "run state unknown; the wake proceeds");
                false
            }
        };
        if !terminal {
            return Ok(());
        }
        if self
            .store
            .mark_deleted(&row.id, row.execution_generation)
            .await?
        {
            tracing::info!(sandbox_id = %row.id, run_id = %row.run_id, "wake refused: the run has ended; sandbox destroyed");
        }
        let now = self.store.sandbox(&row.id).await?;
        Err(ReconcilerError::SandboxEnded {
            id: now.id,
            status: now.status,
        })
    }

    /// The placement of a sandbox that has not ended (SANDBOX_ENDED otherwise).
    async fn live_placement(&self, id: &str) -> Result<Placement, ReconcilerError> {
        let p = self.store.placement(id).await?;
        if placement::is_ended(&p.sandbox) {
            return Err(ReconcilerError::SandboxEnded {
                id: p.sandbox.id.clone(),
                status: p.sandbox.status,
            });
        }
        Ok(p)
    }

    /// The sandbox `sandbox_id` if node `node_id` (at `epoch`) holds its execution
    /// `generation`: it is placed there, or suspended with its route identity naming it
    /// (the holder [`crate::domain::wake::holder`] finds). NODE_NOT_OWNER otherwise.
    async fn held_by(
        &self,
        node_id: &str,
        epoch: u64,
        sandbox_id: &str,
        generation: u64,
    ) -> Result<sandbox::Model, ReconcilerError> {
        node_name("node_id", node_id)?;
        self::sandbox_id(sandbox_id)?;
        self.store
            .node_at_epoch(node_id, int64("epoch", epoch)?)
            .await?;
        let p = self.live_placement(sandbox_id).await?;
        let holds = crate::domain::wake::holder(&p.sandbox, p.route.as_ref()) == Some(node_id)
            && p.sandbox.execution_generation == int64("execution_generation", generation)?;
        if !holds {
            return Err(ReconcilerError::NodeNotOwner {
                node_id: node_id.to_owned(),
                sandbox_id: sandbox_id.to_owned(),
            });
        }
        Ok(p.sandbox)
    }

    /// The operator or a service, as the server's authentication layer found: every
    /// method but NodeService's (the layer admits only the callers each method names).
    fn authenticate<T>(&self, request: &Request<T>) -> Result<(), ReconcilerError> {
        match runplane_grpc::auth::caller(request) {
            Some(c) if c.is_any_org() => Ok(()),
            _ => Err(ReconcilerError::Unauthenticated),
        }
    }

    /// NodeService's check: a live node credential issued for `node_id` (the request's).
    /// Nothing else acts as a node: not the operator token, not the service token (the
    /// layer refuses both here). A credential of another node is
    /// NODE_CREDENTIAL_WRONG_NODE, a revoked one UNAUTHENTICATED.
    async fn authenticate_node<T>(
        &self,
        request: &Request<T>,
        node_id: &str,
    ) -> Result<(), ReconcilerError> {
        let presented = runplane_grpc::auth::caller(request)
            .and_then(runplane_grpc::auth::Caller::presented)
            .ok_or(ReconcilerError::Unauthenticated)?;
        if !presented
            .expose()
            .starts_with(crate::store::node_credentials::TOKEN_PREFIX)
        {
            return Err(ReconcilerError::Unauthenticated);
        }
        let hash = crate::store::node_credentials::token_sha256(presented.expose());
        let credential = self
            .store
            .node_credential_by_hash(&hash)
            .await?
            .ok_or(ReconcilerError::Unauthenticated)?;
        if credential.revoked_at_us.is_some() {
            return Err(ReconcilerError::NodeCredentialRevoked);
        }
        if credential.node_id != node_id {
            tracing::warn!(
                credential_id = %credential.id,
                credential_node = %credential.node_id,
                "node credential used for another node; refused"
            );
            return Err(ReconcilerError::NodeCredentialWrongNode {
                node_id: node_id.to_owned(),
            });
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
pub struct SandboxApi {
    pub shared: Arc<Shared>,
}

/// `runplane.reconciler.v1.NodeService`: node agents register, heartbeat, take their
/// assignments and publish what they observe.
#[derive(Debug, Clone)]
pub struct NodeApi {
    pub shared: Arc<Shared>,
}

/// How often nodes are asked to heartbeat.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(2);

fn node_of(n: &node::Model) -> reconciler_pb::Node {
    reconciler_pb::Node {
        id: n.id.clone(),
        endpoint: n.endpoint.clone(),
        capacity: n.capacity as u32,
        used: n.used as u32,
        labels: Default::default(),
        epoch: n.epoch as u64,
        state: reconciler_pb::NodeState::Ready as i32,
        registered_at: Some(runplane_clock::to_timestamp(n.registered_at_us)),
        last_heartbeat_at: Some(runplane_clock::to_timestamp(n.last_heartbeat_us)),
    }
}

/// A list's page size: 0 means 100, at most 500.
fn page_size(requested: u32) -> Result<u32, ReconcilerError> {
    runplane_grpc::page_size(requested, 100).map_err(|reason| ReconcilerError::InvalidField {
        field: "page_size",
        reason: reason.into(),
    })
}

/// PublishSandboxState's checks of its request, before the node's epoch is read or
/// anything is written: the node's epoch and the observation to publish. Pure, so it is
/// fuzzed (`tests/fuzz.rs`).
pub fn check_publication(
    req: &reconciler_pb::PublishSandboxStateRequest,
) -> Result<(i64, Observation<'_>), ReconcilerError> {
    node_name("node_id", &req.node_id)?;
    sandbox_id(&req.sandbox_id)?;
    let epoch = int64("epoch", req.epoch)?;
    let status = match req.status() {
        reconciler_pb::SandboxStatus::Started => SandboxStatus::Started,
        reconciler_pb::SandboxStatus::Suspended => SandboxStatus::Suspended,
        reconciler_pb::SandboxStatus::Restoring => SandboxStatus::Restoring,
        reconciler_pb::SandboxStatus::Exited => SandboxStatus::Exited,
        reconciler_pb::SandboxStatus::Lost => SandboxStatus::Lost,
        // The acknowledgement of a DESTROY assignment: the process is stopped.
        reconciler_pb::SandboxStatus::Deleted => SandboxStatus::Deleted,
        _ => {
            return Err(ReconcilerError::InvalidField {
                field: "status",
                reason: "must be started, suspended, restoring, exited, lost or deleted".into(),
            });
        }
    };
    Ok((
        epoch,
        Observation {
            sandbox_id: &req.sandbox_id,
            generation: int64("execution_generation", req.execution_generation)?,
            // Newer-than is all a sequence is compared for: past i64::MAX it stays newest.
            seq: req.observation_seq.min(i64::MAX as u64) as i64,
            status,
            placed: req.placed,
            exit_code: req.exit_code,
        },
    ))
}

fn node_name(field: &'static str, value: &str) -> Result<(), ReconcilerError> {
    if value.is_empty()
        || value.len() > 128
        || !value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
    {
        return Err(ReconcilerError::InvalidField {
            field,
            reason: "1 to 128 bytes of letters, digits, '.', '_', ':' and '-'".into(),
        });
    }
    Ok(())
}

fn assignment_of(a: &Assigned) -> reconciler_pb::Assignment {
    let (row, intent, wake) = match a {
        Assigned::Run(row) => (row, reconciler_pb::AssignmentIntent::Run, None),
        Assigned::Restore(row, wake) => (row, reconciler_pb::AssignmentIntent::Restore, Some(wake)),
        Assigned::Destroy(row) => (row, reconciler_pb::AssignmentIntent::Destroy, None),
    };
    reconciler_pb::Assignment {
        sandbox_id: row.id.clone(),
        run_id: row.run_id.clone(),
        intent: intent as i32,
        execution_generation: row.execution_generation as u64,
        wake_id: wake.map(|w| w.id.clone()).unwrap_or_default(),
        wake_attempt: wake.map(|w| w.attempts as u32).unwrap_or_default(),
        idle_timeout: Some(prost_types::Duration {
            seconds: row.idle_timeout_ms / 1000,
            nanos: ((row.idle_timeout_ms % 1000) * 1_000_000) as i32,
        }),
        no_network: row.network == "none",
    }
}

/// A revision that changes whenever the assignment list does.
fn revision(assignments: &[reconciler_pb::Assignment]) -> u64 {
    let mut h = Sha256::new();
    for a in assignments {
        h.update(a.sandbox_id.as_bytes());
        h.update(a.intent.to_be_bytes());
        h.update(a.execution_generation.to_be_bytes());
        h.update(a.wake_id.as_bytes());
        h.update(a.wake_attempt.to_be_bytes());
    }
    u64::from_be_bytes(h.finalize()[..8].try_into().expect("8 bytes")).max(1)
}

#[tonic::async_trait]
impl NodeService for NodeApi {
    #[tracing::instrument(skip_all, fields(node_id = %request.get_ref().node_id))]
    async fn register_node(
        &self,
        request: Request<reconciler_pb::RegisterNodeRequest>,
    ) -> Result<Response<reconciler_pb::RegisterNodeResponse>, Status> {
        let s = &self.shared;
        s.authenticate_node(&request, &request.get_ref().node_id)
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
        if !(1..=10_000).contains(&req.capacity) {
            return Err(ReconcilerError::InvalidField {
                field: "capacity",
                reason: "must be 1 to 10000".into(),
            }
            .into());
        }
        let node = s
            .store
            .register_node(
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
        let s = &self.shared;
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
        let s = &self.shared;
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

    #[tracing::instrument(skip_all, fields(node_id = %request.get_ref().node_id, sandbox_id = %request.get_ref().sandbox_id))]
    async fn claim_launch(
        &self,
        request: Request<reconciler_pb::ClaimLaunchRequest>,
    ) -> Result<Response<reconciler_pb::ClaimLaunchResponse>, Status> {
        let s = &self.shared;
        s.authenticate_node(&request, &request.get_ref().node_id)
            .await?;
        let req = request.get_ref();
        node_name("node_id", &req.node_id)?;
        sandbox_id(&req.sandbox_id)?;
        s.store
            .node_at_epoch(&req.node_id, int64("epoch", req.epoch)?)
            .await?;
        let row = s.store.sandbox(&req.sandbox_id).await?;
        if placement::is_ended(&row) {
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
        let s = &self.shared;
        s.authenticate_node(&request, &request.get_ref().node_id)
            .await?;
        let req = request.get_ref();
        let (epoch, observation) = check_publication(req)?;
        s.store.node_at_epoch(&req.node_id, epoch).await?;
        let (applied, row) = s
            .store
            .publish_observation(&req.node_id, epoch, &observation)
            .await?;
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
        let s = &self.shared;
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
        let s = &self.shared;
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
        let s = &self.shared;
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
        let s = &self.shared;
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

/// Longest `reason` of DestroySandbox and RequestWake, as their protos document.
const MAX_REASON_BYTES: usize = 256;

/// Refuses a client string longer than its documented bound.
fn at_most(field: &'static str, value: &str, max: usize) -> Result<(), ReconcilerError> {
    if value.len() > max {
        return Err(ReconcilerError::InvalidField {
            field,
            reason: format!("at most {max} bytes"),
        });
    }
    Ok(())
}

/// A client's unsigned number as the signed column it is compared with: one past
/// `i64::MAX` would wrap to a negative value, so it is refused instead.
fn int64(field: &'static str, value: u64) -> Result<i64, ReconcilerError> {
    i64::try_from(value).map_err(|_| ReconcilerError::InvalidField {
        field,
        reason: format!("must be at most {}", i64::MAX),
    })
}

/// As [`int64`], for 32-bit columns.
fn int32(field: &'static str, value: u32) -> Result<i32, ReconcilerError> {
    i32::try_from(value).map_err(|_| ReconcilerError::InvalidField {
        field,
        reason: format!("must be at most {}", i32::MAX),
    })
}

fn sandbox_id(id: &str) -> Result<(), ReconcilerError> {
    if uuid::Uuid::parse_str(id).is_err() {
        return Err(ReconcilerError::InvalidField {
            field: "sandbox_id",
            reason: "must be a sandbox id (a UUID)".into(),
        });
    }
    Ok(())
}

fn wake_of(w: &wake::Model) -> reconciler_pb::Wake {
    reconciler_pb::Wake {
        id: w.id.clone(),
        sandbox_id: w.sandbox_id.clone(),
        state: match w.state.as_str() {
            "pending" => reconciler_pb::WakeState::Pending,
            "assigned" => reconciler_pb::WakeState::Assigned,
            "restored" => reconciler_pb::WakeState::Restored,
            "failed" => reconciler_pb::WakeState::Failed,
            _ => reconciler_pb::WakeState::Unspecified,
        } as i32,
        node_id: w.node_id.clone().unwrap_or_default(),
        attempts: w.attempts as u32,
        last_error: w.last_error.clone(),
        requested_at: Some(runplane_clock::to_timestamp(w.requested_at_us)),
        settled_at: w.settled_at_us.map(runplane_clock::to_timestamp),
    }
}

/// A sandbox as the API shows it: placement through the one placement rule.
pub fn sandbox_of(p: &Placement, pending_wake: Option<&wake::Model>) -> reconciler_pb::Sandbox {
    let s: &sandbox::Model = &p.sandbox;
    reconciler_pb::Sandbox {
        id: s.id.clone(),
        run_id: s.run_id.clone(),
        org_id: s.org_id.clone(),
        substrate: match s.substrate.as_str() {
            "kubernetes" => reconciler_pb::Substrate::Kubernetes,
            "direct" => reconciler_pb::Substrate::Direct,
            _ => reconciler_pb::Substrate::Unspecified,
        } as i32,
        status: reconciler_pb::SandboxStatus::from(s.status) as i32,
        active_node_id: s.active_node_id.clone().unwrap_or_default(),
        route_identity: p.route.as_ref().map(|r| reconciler_pb::RouteIdentity {
            current_node_id: r.current_node_id.clone(),
            execution_generation: r.execution_generation as u64,
        }),
        execution_generation: s.execution_generation as u64,
        loss_observed_at: s.loss_observed_at_us.map(runplane_clock::to_timestamp),
        idle_timeout: Some(prost_types::Duration {
            seconds: s.idle_timeout_ms / 1000,
            nanos: ((s.idle_timeout_ms % 1000) * 1_000_000) as i32,
        }),
        exit_code: s.exit_code,
        pending_wake: pending_wake.map(wake_of),
        created_at: Some(runplane_clock::to_timestamp(s.created_at_us)),
        updated_at: Some(runplane_clock::to_timestamp(s.updated_at_us)),
    }
}

#[tonic::async_trait]
impl SandboxService for SandboxApi {
    #[tracing::instrument(skip_all, fields(run_id = %request.get_ref().run_id))]
    async fn create_sandbox(
        &self,
        request: Request<reconciler_pb::CreateSandboxRequest>,
    ) -> Result<Response<reconciler_pb::CreateSandboxResponse>, Status> {
        let s = &self.shared;
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
                network: crate::domain::placement::network_of(&s.offline_profiles, &run.profile),
                // The sandbox's work joins the run's trace (this call's, if untraced).
                traceparent: if run.traceparent.is_empty() {
                    runplane_grpc::trace_context::current_traceparent().unwrap_or_default()
                } else {
                    run.traceparent
                },
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
        let s = &self.shared;
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
        let s = &self.shared;
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
                    if n.last_heartbeat_us < silent_since {
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
        let s = &self.shared;
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
        let s = &self.shared;
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
        let s = &self.shared;
        s.authenticate(&request)?;
        let req = request.get_ref();
        sandbox_id(&req.sandbox_id)?;
        at_most("reason", &req.reason, MAX_REASON_BYTES)?;
        let p = s.live_placement(&req.sandbox_id).await?;
        if placement::serving_node(&p.sandbox, p.route.as_ref()).is_some() {
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

/// `runplane.reconciler.v1.NodeCredentialService`: operators make and revoke node agents'
/// own credentials. Operator token only.
#[derive(Debug, Clone)]
pub struct NodeCredentialApi {
    pub shared: Arc<Shared>,
}

fn node_credential_of(
    c: &crate::store::entities::node_credential::Model,
) -> reconciler_pb::NodeCredential {
    reconciler_pb::NodeCredential {
        id: c.id.clone(),
        node_id: c.node_id.clone(),
        created_at: Some(runplane_clock::to_timestamp(c.created_at_us)),
        revoked_at: c.revoked_at_us.map(runplane_clock::to_timestamp),
    }
}

#[tonic::async_trait]
impl NodeCredentialService for NodeCredentialApi {
    #[tracing::instrument(skip_all, fields(node_id = %request.get_ref().node_id))]
    async fn create_node_credential(
        &self,
        request: Request<reconciler_pb::CreateNodeCredentialRequest>,
    ) -> Result<Response<reconciler_pb::CreateNodeCredentialResponse>, Status> {
        let s = &self.shared;
        s.authenticate(&request)?;
        let req = request.get_ref();
        node_name("node_id", &req.node_id)?;
        let (row, token) = s.store.create_node_credential(&req.node_id).await?;
        // The secret is in the answer only, never in a log line.
        tracing::info!(credential_id = %row.id, "node credential created");
        Ok(Response::new(reconciler_pb::CreateNodeCredentialResponse {
            credential: Some(node_credential_of(&row)),
            token,
        }))
    }

    #[tracing::instrument(skip_all, fields(node_id = %request.get_ref().node_id))]
    async fn revoke_node_credentials(
        &self,
        request: Request<reconciler_pb::RevokeNodeCredentialsRequest>,
    ) -> Result<Response<reconciler_pb::RevokeNodeCredentialsResponse>, Status> {
        let s = &self.shared;
        s.authenticate(&request)?;
        let req = request.get_ref();
        node_name("node_id", &req.node_id)?;
        let revoked = s.store.revoke_node_credentials(&req.node_id).await?;
        tracing::info!(revoked, "node credentials revoked");
        Ok(Response::new(
            reconciler_pb::RevokeNodeCredentialsResponse {
                revoked: revoked.min(u64::from(u32::MAX)) as u32,
            },
        ))
    }

    async fn list_node_credentials(
        &self,
        request: Request<reconciler_pb::ListNodeCredentialsRequest>,
    ) -> Result<Response<reconciler_pb::ListNodeCredentialsResponse>, Status> {
        let s = &self.shared;
        s.authenticate(&request)?;
        let req = request.get_ref();
        if !req.node_id.is_empty() {
            node_name("node_id", &req.node_id)?;
        }
        let rows = s
            .store
            .list_node_credentials((!req.node_id.is_empty()).then_some(req.node_id.as_str()))
            .await?;
        Ok(Response::new(reconciler_pb::ListNodeCredentialsResponse {
            credentials: rows.iter().map(node_credential_of).collect(),
        }))
    }
}
