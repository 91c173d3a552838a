//! The tonic side of the run store: decode, validate, call the domain, map errors.
//!
//! Every method still has the generated default body, which answers `UNIMPLEMENTED`.

use runplane_proto::runstore::v1::run_service_server::RunService;
use runplane_proto::runstore::v1::runner_service_server::RunnerService;

/// `runplane.runstore.v1.RunnerService`: calls from the runner inside a sandbox.
#[derive(Debug, Clone)]
pub struct RunnerApi;

impl RunnerService for RunnerApi {}

/// `runplane.runstore.v1.RunService`: calls from operators and other services.
#[derive(Debug, Clone)]
pub struct RunApi;

impl RunService for RunApi {}
