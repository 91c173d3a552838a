//! runplane's protobuf contract, generated at build time from `proto/`.
//!
//! - one module per package (`runstore::v1`, `reconciler::v1`, …) with prost messages
//!   and tonic clients and servers;
//! - [`FILE_DESCRIPTOR_SET`] for gRPC reflection;
//! - [`METHOD_POLICIES`] and [`policy_for`]: each RPC's replay-safety policy and its
//!   callers, from its `runplane.options.v1.policy` option.

pub use runplane_proto_policy::{
    CallClass, Caller, Callers, MethodPolicy, OutageBudget, ReplaySafety,
};

/// The encoded `FileDescriptorSet` of every runplane proto and its imports, with options.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/runplane_descriptor.bin"));

include!(concat!(env!("OUT_DIR"), "/method_policies.rs"));

/// The policy of the RPC at `path` (`/package.Service/Method`), if runplane defines it.
pub fn policy_for(path: &str) -> Option<&'static MethodPolicy> {
    runplane_proto_policy::lookup(METHOD_POLICIES, path)
}

/// `ErrorInfo.domain` of every error runplane returns.
pub const ERROR_DOMAIN: &str = "runplane.dev";

/// Limits of the API that two services hold to, one checking what the other sends: both
/// read them here, so they cannot drift apart. The protos state them in their comments.
pub mod limits {
    /// Most bytes of a failed turn's tail that ReportTurnFailure accepts (8 KiB): the
    /// run store reports the tail's end, cut to this.
    pub const MAX_FAILURE_TAIL_BYTES: usize = 8 << 10;
    /// Most ids in `ListRunsRequest.run_ids` (500): the reconciler asks about its
    /// sandboxes' runs at most this many at a time.
    pub const MAX_LIST_RUNS_RUN_IDS: usize = 500;
    /// Most sandboxes a node may declare it runs at once (RegisterNode's `capacity`, a
    /// node credential's `max_capacity`).
    pub const MAX_NODE_CAPACITY: u32 = 10_000;
}

/// Generated code is checked by the proto build, not by clippy.
macro_rules! package {
    ($module:ident, $package:literal) => {
        #[allow(clippy::all, clippy::pedantic, missing_docs)]
        pub mod $module {
            pub mod v1 {
                tonic::include_proto!($package);
            }
        }
    };
}

package!(options, "runplane.options.v1");
package!(errors, "runplane.errors.v1");
package!(runstore, "runplane.runstore.v1");
package!(reconciler, "runplane.reconciler.v1");
package!(recovery, "runplane.recovery.v1");
package!(credentials, "runplane.credentials.v1");
package!(node, "runplane.node.v1");

impl runstore::v1::RunState {
    /// SUCCEEDED, FAILED, CANCELLED and BACKEND_ERROR: no runner call, steer or event is
    /// accepted after them.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Self::Succeeded | Self::Failed | Self::Cancelled | Self::BackendError
        )
    }
}
