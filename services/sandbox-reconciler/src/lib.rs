//! The sandbox reconciler: sandboxes, nodes, loss grace, placement, routes and wakes.
//!
//! DESIGN.md "Sandbox reconciler" is the contract. Built so far: the model and its
//! migrations; the loss-grace tick (every write a compare-and-set on what the tick read)
//! over a driver trait with a scriptable fake; FailRun through a transactional outbox;
//! the one placement rule with `ResolveRoute`, `RequestWake` and `GetSandbox`. The
//! process driver, node agents, dispatch and `runplane run` are still to come; their
//! methods answer `UNIMPLEMENTED`.

pub mod domain;
pub mod drivers;
pub mod error;
pub mod grpc;
pub mod reconcile;
pub mod store;

use std::sync::Arc;
use std::time::Duration;

use runplane_clock::SharedClock;
use runplane_grpc::ServiceSet;
use runplane_proto::reconciler::v1::node_service_server::NodeServiceServer;
use runplane_proto::reconciler::v1::sandbox_service_server::SandboxServiceServer;
use sha2::{Digest, Sha256};

pub use error::ReconcilerError;

/// A started reconciler, ready to be registered on a server.
#[derive(Debug, Clone)]
pub struct SandboxReconciler {
    shared: Arc<grpc::Shared>,
}

impl SandboxReconciler {
    /// Opens and migrates the reconciler's database (`[sandbox_reconciler].database_url`).
    pub async fn open(
        config: &runplane_config::Config,
        clock: SharedClock,
    ) -> Result<Self, ReconcilerError> {
        let db = runplane_db::connect_and_migrate::<store::Migrator>(
            &config.sandbox_reconciler.database_url,
        )
        .await?;
        let token = &config.auth.operator_token;
        let route_key = match config.sandbox_reconciler.route_token_key.expose() {
            "" => token.expose().as_bytes().to_vec(),
            key => key.as_bytes().to_vec(),
        };
        Ok(Self {
            shared: Arc::new(grpc::Shared {
                store: store::Store::new(db, clock),
                token_hash: (!token.is_empty())
                    .then(|| Sha256::digest(token.expose().as_bytes()).into()),
                route_key,
                route_ttl: Duration::from_secs(
                    config.sandbox_reconciler.route_token_ttl_seconds.into(),
                ),
            }),
        })
    }

    pub fn store(&self) -> &store::Store {
        &self.shared.store
    }

    /// Adds the reconciler's gRPC services to `services`.
    pub fn register(&self, services: &mut ServiceSet) {
        services
            .add(SandboxServiceServer::new(grpc::SandboxApi {
                shared: self.shared.clone(),
            }))
            .add(NodeServiceServer::new(grpc::NodeApi));
    }
}
