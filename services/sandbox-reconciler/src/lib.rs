//! The sandbox reconciler: sandboxes, nodes, loss grace, placement, routes and wakes.
//!
//! DESIGN.md "Sandbox reconciler" is the contract. The gRPC surface is
//! `runplane.reconciler.v1.SandboxService` (operators, the run store, session routing)
//! and `runplane.reconciler.v1.NodeService` (node agents). Until the reconciler issue
//! lands both answer `UNIMPLEMENTED`; the database is already opened and migrated.

pub mod error;
pub mod grpc;
pub mod store;

use runplane_grpc::ServiceSet;
use runplane_proto::reconciler::v1::node_service_server::NodeServiceServer;
use runplane_proto::reconciler::v1::sandbox_service_server::SandboxServiceServer;
use sea_orm::DatabaseConnection;

pub use error::ReconcilerError;

/// A started reconciler, ready to be registered on a server.
pub struct SandboxReconciler {
    db: DatabaseConnection,
}

impl SandboxReconciler {
    /// Opens and migrates the reconciler's database (`[sandbox_reconciler].database_url`).
    pub async fn open(config: &runplane_config::Config) -> Result<Self, ReconcilerError> {
        let db = runplane_db::connect_and_migrate::<store::Migrator>(
            &config.sandbox_reconciler.database_url,
        )
        .await?;
        Ok(Self { db })
    }

    pub fn database(&self) -> &DatabaseConnection {
        &self.db
    }

    /// Adds the reconciler's gRPC services to `services`.
    pub fn register(&self, services: &mut ServiceSet) {
        services
            .add(SandboxServiceServer::new(grpc::SandboxApi))
            .add(NodeServiceServer::new(grpc::NodeApi));
    }
}
