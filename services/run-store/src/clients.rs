//! Clients of other services the run store calls: a leaf, so the gRPC handlers and the
//! outbox use the same type without importing each other.

/// Credential health, called with the service token: admission for new runs, and the
/// outbox's reports of failed turns.
pub type CredentialHealthClient = runplane_proto::credentials::v1::credential_health_service_client::CredentialHealthServiceClient<
    tonic::service::interceptor::InterceptedService<
        runplane_grpc::client::TracedChannel,
        runplane_grpc::client::Bearer,
    >,
>;
