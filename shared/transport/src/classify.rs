//! Whether a failed attempt may be sent again.

use std::time::Duration;

use tonic::Code;
use tonic_types::StatusExt;

/// What a failure proves about the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// It never reached a handler: safe to send again for every method.
    ProvenNotSent,
    /// It may have been processed: safe to send again only when replay-safe.
    MaybeProcessed,
    /// `RESOURCE_EXHAUSTED`: the server is rate limiting; its own bounded counter.
    RateLimited,
    /// An answer to act on, not to retry (`INVALID_ARGUMENT`, `NOT_FOUND`, …).
    Final,
}

impl Failure {
    pub fn as_str(self) -> &'static str {
        match self {
            Failure::ProvenNotSent => "proven_not_sent",
            Failure::MaybeProcessed => "maybe_processed",
            Failure::RateLimited => "rate_limited",
            Failure::Final => "final",
        }
    }
}

/// A gRPC status answered by the server.
pub fn code(code: Code) -> Failure {
    match code {
        Code::Unavailable | Code::Internal | Code::Unknown | Code::DeadlineExceeded => {
            Failure::MaybeProcessed
        }
        Code::ResourceExhausted => Failure::RateLimited,
        _ => Failure::Final,
    }
}

/// A status answered by the server, with what its reason adds to its code: a quota
/// refusal (`RESOURCE_EXHAUSTED` with reason `QUOTA_EXCEEDED`) holds until the caller's
/// runs move on, so it is an answer to act on, not rate limiting to wait out.
pub fn status(status: &tonic::Status) -> Failure {
    match status.code() {
        Code::ResourceExhausted
            if status
                .get_error_details()
                .error_info()
                .is_some_and(|info| info.reason == "QUOTA_EXCEEDED") =>
        {
            Failure::Final
        }
        other => code(other),
    }
}

/// A transport error from the channel, by what its cause chain proves.
pub fn error(error: &(dyn std::error::Error + 'static)) -> Failure {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = cause {
        // tonic wraps everything its connector reports (refused, DNS, no route, connect
        // timeout) in its ConnectError: no byte of the request was written.
        if e.is::<tonic::ConnectError>() {
            return Failure::ProvenNotSent;
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind as K;
            if matches!(
                io.kind(),
                K::ConnectionRefused
                    | K::AddrNotAvailable
                    | K::NetworkUnreachable
                    | K::HostUnreachable
            ) {
                return Failure::ProvenNotSent;
            }
        }
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            // REFUSED_STREAM, or a remote GOAWAY for a stream above its last id: the
            // server says it processed nothing of this stream.
            if h2.reason() == Some(h2::Reason::REFUSED_STREAM)
                || (h2.is_go_away() && h2.is_remote() && h2.reason() == Some(h2::Reason::NO_ERROR))
            {
                return Failure::ProvenNotSent;
            }
        }
        cause = e.source();
    }
    Failure::MaybeProcessed
}

/// A connect that failed: the connection is no good, try the next address.
pub fn is_connect(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = cause {
        if e.is::<tonic::ConnectError>() {
            return true;
        }
        cause = e.source();
    }
    false
}

/// tonic's channel ended the attempt at the `grpc-timeout` it was sent with.
pub fn is_timeout(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = cause {
        if e.is::<tonic::TimeoutExpired>() {
            return true;
        }
        cause = e.source();
    }
    false
}

/// What the server said about retrying.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pushback {
    /// Nothing: the client's own backoff decides.
    None,
    /// Wait at least this long.
    After(Duration),
    /// A pushback that cannot be read (negative, garbled): gRFC A6 says stop retrying.
    Stop,
}

/// The server's pushback: `grpc-retry-pushback-ms`, else `google.rpc.RetryInfo`.
pub fn pushback(headers: &http::HeaderMap, status: &tonic::Status) -> Pushback {
    if let Some(value) = headers.get("grpc-retry-pushback-ms") {
        return match value.to_str().ok().map(str::trim).map(str::parse::<u64>) {
            Some(Ok(ms)) => Pushback::After(Duration::from_millis(ms)),
            _ => Pushback::Stop,
        };
    }
    match status.get_details_retry_info() {
        Some(info) => info.retry_delay.map_or(Pushback::Stop, Pushback::After),
        None => Pushback::None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_classified() {
        assert_eq!(code(Code::Unavailable), Failure::MaybeProcessed);
        assert_eq!(code(Code::Internal), Failure::MaybeProcessed);
        assert_eq!(code(Code::Unknown), Failure::MaybeProcessed);
        assert_eq!(code(Code::ResourceExhausted), Failure::RateLimited);
        let quota = tonic::Status::with_error_details(
            Code::ResourceExhausted,
            "org acme has 10 runs queued",
            tonic_types::ErrorDetails::with_error_info("QUOTA_EXCEEDED", "runplane.dev", []),
        );
        assert_eq!(status(&quota), Failure::Final);
        let shed = tonic::Status::with_error_details(
            Code::ResourceExhausted,
            "busy",
            tonic_types::ErrorDetails::with_error_info("RATE_LIMITED", "runplane.dev", []),
        );
        assert_eq!(status(&shed), Failure::RateLimited);
        assert_eq!(code(Code::InvalidArgument), Failure::Final);
        assert_eq!(code(Code::FailedPrecondition), Failure::Final);
        assert_eq!(code(Code::Unauthenticated), Failure::Final);
    }
}
