//! The tonic side of the reconciler. Every method still has the generated default body,
//! which answers `UNIMPLEMENTED`.

use runplane_proto::reconciler::v1::node_service_server::NodeService;
use runplane_proto::reconciler::v1::sandbox_service_server::SandboxService;

/// `runplane.reconciler.v1.SandboxService`.
#[derive(Debug, Clone)]
pub struct SandboxApi;

impl SandboxService for SandboxApi {}

/// `runplane.reconciler.v1.NodeService`: node agents register, heartbeat and publish.
#[derive(Debug, Clone)]
pub struct NodeApi;

impl NodeService for NodeApi {}
