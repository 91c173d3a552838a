//! `runplane.reconciler.v1.NodeCredentialService`: operators make and revoke node
//! agents' own credentials.

use runplane_proto::limits::MAX_NODE_CAPACITY;
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::reconciler::v1::node_credential_service_server::NodeCredentialService;
use tonic::{Request, Response, Status};

use super::NodeCredentialApi;
use super::convert::node_credential_of;
use super::validate::node_name;
use crate::error::ReconcilerError;

#[tonic::async_trait]
impl NodeCredentialService for NodeCredentialApi {
    #[tracing::instrument(skip_all, fields(node_id = %request.get_ref().node_id))]
    async fn create_node_credential(
        &self,
        request: Request<reconciler_pb::CreateNodeCredentialRequest>,
    ) -> Result<Response<reconciler_pb::CreateNodeCredentialResponse>, Status> {
        let s = &self.state;
        s.authenticate(&request)?;
        let req = request.get_ref();
        node_name("node_id", &req.node_id)?;
        if req.max_capacity > MAX_NODE_CAPACITY {
            return Err(ReconcilerError::InvalidField {
                field: "max_capacity",
                reason: format!("must be 0 (none) to {MAX_NODE_CAPACITY}"),
            }
            .into());
        }
        let (row, token) = s
            .store
            .create_node_credential(&req.node_id, req.max_capacity)
            .await?;
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
        let s = &self.state;
        s.authenticate(&request)?;
        let req = request.get_ref();
        node_name("node_id", &req.node_id)?;
        let revoked = s.store.revoke_node_credentials(&req.node_id).await?;
        tracing::info!(
            revoked = revoked.credentials,
            fenced = revoked.fenced,
            fenced_sandboxes = revoked.fenced_sandboxes,
            "node credentials revoked"
        );
        if revoked.fenced_sandboxes > 0 {
            // Their FailRun calls are in the outbox: deliver them now, not a tick later.
            s.signals.want_round();
        }
        let count = |n: u64| n.min(u64::from(u32::MAX)) as u32;
        Ok(Response::new(
            reconciler_pb::RevokeNodeCredentialsResponse {
                revoked: count(revoked.credentials),
                fenced: revoked.fenced,
                fenced_sandboxes: count(revoked.fenced_sandboxes),
            },
        ))
    }

    async fn list_node_credentials(
        &self,
        request: Request<reconciler_pb::ListNodeCredentialsRequest>,
    ) -> Result<Response<reconciler_pb::ListNodeCredentialsResponse>, Status> {
        let s = &self.state;
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
