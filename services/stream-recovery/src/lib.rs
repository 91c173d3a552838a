//! The stream recovery coordinator: stream leases, per-run restart budgets and replay
//! buffers, in Redis (or in process for `runplane dev`).
//!
//! DESIGN.md "Stream recovery coordinator" is the contract. The gRPC surface is
//! `runplane.recovery.v1.StreamRecoveryService`. Until the coordinator issue lands it
//! answers `UNIMPLEMENTED`.

pub mod grpc;
pub mod policy;
pub mod store;

use runplane_grpc::ServiceSet;
use runplane_proto::recovery::v1::stream_recovery_service_server::StreamRecoveryServiceServer;

/// The coordinator, ready to be registered on a server.
#[derive(Debug, Default)]
pub struct StreamRecovery;

impl StreamRecovery {
    pub fn new() -> Self {
        Self
    }

    /// Adds the coordinator's gRPC service to `services`.
    pub fn register(&self, services: &mut ServiceSet) {
        services.add(StreamRecoveryServiceServer::new(grpc::StreamRecoveryApi));
    }
}
