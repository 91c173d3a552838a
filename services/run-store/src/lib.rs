//! The run store: runs, run keys, events with signed receipts, steering and results.
//!
//! DESIGN.md "Run store" is the contract. The gRPC surface is
//! `runplane.runstore.v1.RunnerService` (the runner, authenticated by its run key) and
//! `runplane.runstore.v1.RunService` (operators and services, by token).

pub mod auth;
pub mod changes;
pub mod config;
pub mod convert;
pub mod domain;
pub mod error;
pub mod grpc;
pub mod store;

use std::sync::Arc;

use runplane_clock::SharedClock;
use runplane_grpc::ServiceSet;
use runplane_proto::runstore::v1::run_service_server::RunServiceServer;
use runplane_proto::runstore::v1::runner_service_server::RunnerServiceServer;

pub use config::{Limits, RunStoreSettings};
pub use error::RunStoreError;

/// A started run store, ready to be registered on a server.
#[derive(Debug, Clone)]
pub struct RunStore {
    shared: Arc<grpc::Shared>,
}

impl RunStore {
    /// Opens and migrates the run store's database (`[run_store].database_url`).
    pub async fn open(
        config: &runplane_config::Config,
        clock: SharedClock,
    ) -> Result<Self, RunStoreError> {
        let settings = RunStoreSettings::from_config(config)?;
        let db =
            runplane_db::connect_and_migrate::<store::Migrator>(&settings.database_url).await?;
        Ok(Self {
            shared: Arc::new(grpc::Shared {
                store: store::Store::new(db, clock),
                operators: auth::OperatorAuth::from_config(config),
                settings,
                changes: changes::Changes::new(),
            }),
        })
    }

    pub fn store(&self) -> &store::Store {
        &self.shared.store
    }

    /// The two tonic services, for callers that wrap them (tests cut responses).
    pub fn services(
        &self,
    ) -> (
        RunnerServiceServer<grpc::RunnerApi>,
        RunServiceServer<grpc::RunApi>,
    ) {
        (
            RunnerServiceServer::new(grpc::RunnerApi {
                shared: self.shared.clone(),
            }),
            RunServiceServer::new(grpc::RunApi {
                shared: self.shared.clone(),
            }),
        )
    }

    /// The public key receipts are signed with.
    pub fn receipt_public_key(&self) -> [u8; 32] {
        self.shared.settings.signer.public_key()
    }

    /// Adds the run store's gRPC services to `services`.
    pub fn register(&self, services: &mut ServiceSet) {
        let (runner, run) = self.services();
        let store = self.clone();
        services
            .add(runner)
            .add(run)
            .on_shutdown(move || store.begin_shutdown());
    }

    /// Ends long polls and watches now instead of letting them hold the shutdown up:
    /// polls answer with what is pending, watches end so their clients resume elsewhere.
    pub fn begin_shutdown(&self) {
        self.shared.changes.close();
    }
}
