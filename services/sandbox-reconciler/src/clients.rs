//! The services the reconciler calls, with the service token: a leaf that the round,
//! dispatch and slot claims all name their clients from.

use runplane_grpc::client::{Bearer, TracedChannel};
use runplane_proto::credentials::v1::credential_health_service_client::CredentialHealthServiceClient;
use runplane_proto::recovery::v1::stream_recovery_service_client::StreamRecoveryServiceClient;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use tonic::service::interceptor::InterceptedService;

/// The run store.
pub type RunStoreClient = RunServiceClient<InterceptedService<TracedChannel, Bearer>>;

/// Credential health, asked for the fleet's capacity.
pub type FleetClient = CredentialHealthServiceClient<InterceptedService<TracedChannel, Bearer>>;

/// The stream recovery coordinator, asked to park and unpark streams.
pub type RecoveryClient = StreamRecoveryServiceClient<InterceptedService<TracedChannel, Bearer>>;
