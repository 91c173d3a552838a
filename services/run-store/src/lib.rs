//! The run store: runs, run keys, events with signed receipts, steering and results.
//!
//! DESIGN.md "Run store" is the contract. The gRPC surface is
//! `runplane.runstore.v1.RunnerService` (the runner, authenticated by its run key) and
//! `runplane.runstore.v1.RunService` (operators and services). Until the run store
//! issue lands, both answer `UNIMPLEMENTED`; the database is already opened and
//! migrated so the storage that issue adds is migrated the same way.

pub mod error;
pub mod grpc;
pub mod store;

use runplane_grpc::ServiceSet;
use runplane_proto::runstore::v1::run_service_server::RunServiceServer;
use runplane_proto::runstore::v1::runner_service_server::RunnerServiceServer;
use sea_orm::DatabaseConnection;

pub use error::RunStoreError;

/// A started run store, ready to be registered on a server.
pub struct RunStore {
    db: DatabaseConnection,
}

impl RunStore {
    /// Opens and migrates the run store's database (`[run_store].database_url`).
    pub async fn open(config: &runplane_config::Config) -> Result<Self, RunStoreError> {
        let db =
            runplane_db::connect_and_migrate::<store::Migrator>(&config.run_store.database_url)
                .await?;
        Ok(Self { db })
    }

    /// The run store's database connection.
    pub fn database(&self) -> &DatabaseConnection {
        &self.db
    }

    /// Adds the run store's gRPC services to `services`.
    pub fn register(&self, services: &mut ServiceSet) {
        services
            .add(RunnerServiceServer::new(grpc::RunnerApi))
            .add(RunServiceServer::new(grpc::RunApi));
    }
}
