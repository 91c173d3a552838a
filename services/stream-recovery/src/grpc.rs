//! The tonic side of the coordinator. Every method still has the generated default body,
//! which answers `UNIMPLEMENTED`.

use runplane_proto::recovery::v1::stream_recovery_service_server::StreamRecoveryService;

/// `runplane.recovery.v1.StreamRecoveryService`.
#[derive(Debug, Clone)]
pub struct StreamRecoveryApi;

impl StreamRecoveryService for StreamRecoveryApi {}
