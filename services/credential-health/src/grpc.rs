//! The tonic side of credential health. Every method still has the generated default
//! body, which answers `UNIMPLEMENTED`.

use runplane_proto::credentials::v1::credential_health_service_server::CredentialHealthService;

/// `runplane.credentials.v1.CredentialHealthService`.
#[derive(Debug, Clone)]
pub struct CredentialHealthApi;

impl CredentialHealthService for CredentialHealthApi {}
