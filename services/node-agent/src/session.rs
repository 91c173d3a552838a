//! The node agent's session endpoint (`runplane.node.v1.SessionService`): where route
//! tokens are verified.
//!
//! ResolveRoute signs a token for the node serving the sandbox with that node's own key
//! ([`route_token::node_key`]); the node learns its key at registration. [`Sessions::attach`]
//! is the verifier: the signature and expiry ([`route_token::verify`]), then the claims
//! against this node: its id, the sandbox the request names, and the execution generation
//! running here now. Anything else is UNAUTHENTICATED/ROUTE_TOKEN_INVALID, with no hint
//! of which check failed. An attach is session traffic, so the agent's idle clock of that
//! sandbox restarts ([`Sessions::last_attach`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use runplane_proto::node::v1 as node_pb;
use runplane_proto::node::v1::session_service_server::{SessionService, SessionServiceServer};
use tokio::time::Instant;
use tonic::{Request, Response, Status};

use runplane_sandbox::route_token;

use crate::error::SessionError;

/// What the session endpoint knows of this node: its id and route key, and the sandboxes
/// running here (id to execution generation), which the agent's loop keeps current.
#[derive(Clone)]
pub struct Sessions {
    node_id: String,
    key: Arc<Mutex<Vec<u8>>>,
    running: Arc<Mutex<HashMap<String, u64>>>,
    attached: Arc<Mutex<HashMap<String, Instant>>>,
    /// Route tokens expire on this clock.
    clock: runplane_clock::SharedClock,
}

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sessions")
            .field("node_id", &self.node_id)
            .finish_non_exhaustive()
    }
}

impl Sessions {
    /// Sessions of node `node_id`, which verify nothing until [`Sessions::set_key`].
    pub fn new(node_id: &str, clock: runplane_clock::SharedClock) -> Self {
        Self {
            clock,
            node_id: node_id.to_owned(),
            key: Arc::default(),
            running: Arc::default(),
            attached: Arc::default(),
        }
    }

    /// The route key RegisterNode answered with.
    pub fn set_key(&self, key: Vec<u8>) {
        *self.key.lock().expect("session key lock") = key;
    }

    /// The sandboxes running here now and their generations; a suspended or stopped one
    /// takes no session.
    pub fn set_running(&self, running: impl IntoIterator<Item = (String, u64)>) {
        let running: HashMap<_, _> = running.into_iter().collect();
        self.attached
            .lock()
            .expect("session lock")
            .retain(|id, _| running.contains_key(id));
        *self.running.lock().expect("session lock") = running;
    }

    /// When a session last attached to `sandbox_id`, if one did.
    pub fn last_attach(&self, sandbox_id: &str) -> Option<Instant> {
        self.attached
            .lock()
            .expect("session lock")
            .get(sandbox_id)
            .copied()
    }

    /// Verifies `token` for `sandbox_id` on this node at `now_unix` and records the
    /// attach; the claims when it holds.
    pub fn attach(
        &self,
        token: &str,
        sandbox_id: &str,
        now_unix: i64,
    ) -> Option<route_token::RouteClaims> {
        let key = self.key.lock().expect("session key lock").clone();
        if key.is_empty() {
            return None;
        }
        let claims = route_token::verify(&key, token, now_unix)?;
        let running = self
            .running
            .lock()
            .expect("session lock")
            .get(sandbox_id)
            .copied();
        let holds = claims.node_id == self.node_id
            && claims.sandbox_id == sandbox_id
            && running == Some(claims.execution_generation);
        if !holds {
            return None;
        }
        self.attached
            .lock()
            .expect("session lock")
            .insert(sandbox_id.to_owned(), Instant::now());
        Some(claims)
    }

    pub fn service(&self) -> SessionServiceServer<Self> {
        SessionServiceServer::new(self.clone())
    }
}

fn refused() -> Status {
    SessionError::RouteTokenInvalid.into()
}

#[tonic::async_trait]
impl SessionService for Sessions {
    #[tracing::instrument(skip_all, fields(sandbox_id = %request.get_ref().sandbox_id))]
    async fn attach(
        &self,
        request: Request<node_pb::AttachRequest>,
    ) -> Result<Response<node_pb::AttachResponse>, Status> {
        let token = runplane_grpc::auth::caller(&request)
            .and_then(runplane_grpc::auth::Caller::presented)
            .ok_or_else(refused)?;
        let sandbox_id = &request.get_ref().sandbox_id;
        if sandbox_id.is_empty() || sandbox_id.len() > 128 {
            return Err(SessionError::InvalidField {
                field: "sandbox_id",
                reason: "1 to 128 bytes".into(),
            }
            .into());
        }
        let now = self.clock.now().timestamp();
        let Some(claims) = self.attach(token.expose(), sandbox_id, now) else {
            tracing::info!("route token refused");
            return Err(refused());
        };
        Ok(Response::new(node_pb::AttachResponse {
            sandbox_id: claims.sandbox_id,
            execution_generation: claims.execution_generation,
            session_id: claims.session_id,
            expires_at: Some(prost_types::Timestamp {
                seconds: claims.expires_unix,
                nanos: 0,
            }),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use runplane_sandbox::route_token::{RouteClaims, node_key, sign};

    fn claims(sandbox: &str, node: &str, generation: u64) -> RouteClaims {
        RouteClaims {
            sandbox_id: sandbox.into(),
            node_id: node.into(),
            execution_generation: generation,
            session_id: "sess".into(),
            expires_unix: 1000,
        }
    }

    #[test]
    fn a_token_holds_only_for_this_node_this_sandbox_and_its_generation_now() {
        let key = b"route-signing-key";
        let sessions = Sessions::new("a", runplane_clock::SystemClock::shared());
        sessions.set_running([("s1".to_owned(), 2), ("s2".to_owned(), 1)]);
        let good = sign(&node_key(key, "a"), &claims("s1", "a", 2));
        assert!(sessions.attach(&good, "s1", 999).is_none(), "no key yet");
        sessions.set_key(node_key(key, "a"));
        assert!(sessions.last_attach("s1").is_none());
        assert!(sessions.attach(&good, "s1", 999).is_some());
        assert!(sessions.last_attach("s1").is_some());

        assert!(
            sessions.attach(&good, "s2", 999).is_none(),
            "another sandbox"
        );
        assert!(sessions.attach(&good, "s1", 1000).is_none(), "expired");
        let older = sign(&node_key(key, "a"), &claims("s1", "a", 1));
        assert!(
            sessions.attach(&older, "s1", 999).is_none(),
            "an older generation"
        );
        let for_b = sign(&node_key(key, "b"), &claims("s1", "b", 2));
        assert!(
            sessions.attach(&for_b, "s1", 999).is_none(),
            "node b's token"
        );
        let b_claims_a = sign(&node_key(key, "b"), &claims("s1", "a", 2));
        assert!(
            sessions.attach(&b_claims_a, "s1", 999).is_none(),
            "minted by node b"
        );
        let misnamed = sign(&node_key(key, "a"), &claims("s1", "b", 2));
        assert!(
            sessions.attach(&misnamed, "s1", 999).is_none(),
            "names another node"
        );

        sessions.set_running([("s2".to_owned(), 1)]);
        assert!(
            sessions.attach(&good, "s1", 999).is_none(),
            "no longer running here"
        );
        assert!(sessions.last_attach("s1").is_none());
    }
}
