//! The tonic side of the reconciler: authenticate, validate, call the store, map errors.
//!
//! One file per service ([`sandboxes`] SandboxService, [`nodes`] NodeService,
//! [`node_credentials`] NodeCredentialService), the request checks in [`validate`] (pure,
//! so the fuzz tests reach them) and the wire forms of rows in [`convert`].

mod convert;
mod node_credentials;
mod nodes;
mod sandboxes;
pub mod validate;

use std::sync::Arc;
use std::time::Duration;

use tonic::Request;

pub use crate::clients::RecoveryClient;
use crate::error::ReconcilerError;
use crate::store::entities::route_identity;
use crate::store::entities::sandbox;
use crate::store::{Placement, Store};
pub use convert::sandbox_of;
pub use validate::check_publication;
use validate::{int64, node_name};

/// How soon a client told NOT_PLACED should try again.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);

/// What the reconciler's three gRPC services share: its store, its clients of the
/// other services, and its keys.
pub struct ReconcilerState {
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
    /// What each profile's sandboxes get that differs from the deployment's.
    pub profiles: crate::domain::placement::ProfileSandboxes,
}

impl std::fmt::Debug for ReconcilerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").finish_non_exhaustive()
    }
}

impl ReconcilerState {
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
            tracing::info!(sandbox_id = %row.id, run_id = %row.run_id, "wake refused: the run has ended; sandbox deleted, its stop owed");
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
        if p.sandbox.status.is_ended() {
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
        validate::sandbox_id(sandbox_id)?;
        self.store
            .node_at_epoch(node_id, int64("epoch", epoch)?)
            .await?;
        let p = self.live_placement(sandbox_id).await?;
        let holds = crate::domain::wake::holder(
            &p.sandbox.placement(),
            p.route.as_ref().map(route_identity::Model::identity),
        ) == Some(node_id)
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
            Some(c) if c.org_scope() == Some(runplane_ids::OrgScope::Any) => Ok(()),
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
    ) -> Result<crate::store::entities::node_credential::Model, ReconcilerError> {
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
        Ok(credential)
    }
}

#[derive(Debug, Clone)]
pub struct SandboxApi {
    pub state: Arc<ReconcilerState>,
}

/// `runplane.reconciler.v1.NodeService`: node agents register, heartbeat, take their
/// assignments and publish what they observe.
#[derive(Debug, Clone)]
pub struct NodeApi {
    pub state: Arc<ReconcilerState>,
}

/// `runplane.reconciler.v1.NodeCredentialService`: operators make and revoke node agents'
/// own credentials. Operator token only.
#[derive(Debug, Clone)]
pub struct NodeCredentialApi {
    pub state: Arc<ReconcilerState>,
}

/// How often nodes are asked to heartbeat.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(2);
