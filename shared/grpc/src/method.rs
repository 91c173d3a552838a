//! What a request's path names: its service, and whether that service is open to
//! every caller. The server's layers (authentication, the request guard, load shedding)
//! all route by it.

/// Services whose calls need no credential: health (load balancers, probes) and
/// reflection (grpcurl's `list` and `describe`).
pub(crate) const OPEN_SERVICES: &[&str] = &["grpc.health.v1.", "grpc.reflection."];

/// The service name of a gRPC path, `/pkg.Service/Method` → `pkg.Service`.
pub(crate) fn service_of(path: &str) -> &str {
    let path = path.strip_prefix('/').unwrap_or(path);
    path.split_once('/').map_or(path, |(service, _)| service)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_service_is_the_first_path_segment() {
        assert_eq!(
            service_of("/runplane.runstore.v1.RunService/GetRun"),
            "runplane.runstore.v1.RunService"
        );
    }
}
