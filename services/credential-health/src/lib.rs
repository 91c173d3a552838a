//! Credential health: typed backend errors, outage incidents and cool-off, exhaustion
//! quarantine, admission and notices.
//!
//! DESIGN.md "Credential health" is the contract. The gRPC surface is
//! `runplane.credentials.v1.CredentialHealthService`. Until the credential health issue
//! lands it answers `UNIMPLEMENTED`; the database is already opened and migrated.

pub mod error;
pub mod grpc;
pub mod store;

use runplane_grpc::ServiceSet;
use runplane_proto::credentials::v1::credential_health_service_server::CredentialHealthServiceServer;
use sea_orm::DatabaseConnection;

pub use error::CredentialHealthError;

/// Started credential health, ready to be registered on a server.
pub struct CredentialHealth {
    db: DatabaseConnection,
}

impl CredentialHealth {
    /// Opens and migrates the service's database (`[credential_health].database_url`).
    pub async fn open(config: &runplane_config::Config) -> Result<Self, CredentialHealthError> {
        let db = runplane_db::connect_and_migrate::<store::Migrator>(
            &config.credential_health.database_url,
        )
        .await?;
        Ok(Self { db })
    }

    pub fn database(&self) -> &DatabaseConnection {
        &self.db
    }

    /// Adds the service to `services`.
    pub fn register(&self, services: &mut ServiceSet) {
        services.add(CredentialHealthServiceServer::new(
            grpc::CredentialHealthApi,
        ));
    }
}
