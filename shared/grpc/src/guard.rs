//! What a server checks before a handler reads a request body: that the call carries a
//! bearer credential of a sane form, and that no message in the body is over its
//! service's decoding limit.
//!
//! Both run in the server's tower stack, ahead of every service, so a client without a
//! credential cannot make a server buffer and decode megabytes, and a message over the
//! limit is refused from its 5-byte gRPC prefix, before any of it is buffered. Who the
//! caller is, and whether the method is theirs, is [`crate::auth`]'s to judge; this layer
//! only refuses what no service would accept.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http_body::{Body as HttpBody, Frame};
use tonic::body::Body;
use tonic::{Code, Status};
use tower_layer::Layer;
use tower_service::Service;

use crate::auth::token_is_well_formed;
use crate::error::{ErrorReason, status_with_reason};
use crate::method::{OPEN_SERVICES, service_of};

/// Decoding limits by service.
#[derive(Debug, Clone)]
pub struct MessageLimits {
    default: usize,
    by_service: BTreeMap<String, usize>,
}

impl MessageLimits {
    pub fn new(default: usize, by_service: BTreeMap<String, usize>) -> Self {
        Self {
            default,
            by_service,
        }
    }

    fn for_service(&self, service: &str) -> usize {
        self.by_service
            .get(service)
            .copied()
            .unwrap_or(self.default)
    }
}

/// Whether `value` is `Bearer <token>` with a token of a form some service could accept.
fn bearer_is_well_formed(value: Option<&http::HeaderValue>) -> bool {
    let Some(value) = value.and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let Some((scheme, token)) = value.split_once(' ') else {
        return false;
    };
    scheme.eq_ignore_ascii_case("bearer") && token_is_well_formed(token.trim())
}

/// Layer of [`RequestGuard`].
#[derive(Debug, Clone)]
pub struct RequestGuardLayer {
    limits: Arc<MessageLimits>,
}

impl RequestGuardLayer {
    pub fn new(limits: MessageLimits) -> Self {
        Self {
            limits: Arc::new(limits),
        }
    }
}

impl<S> Layer<S> for RequestGuardLayer {
    type Service = RequestGuard<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RequestGuard {
            inner,
            limits: self.limits.clone(),
        }
    }
}

/// Refuses a call without a well-formed bearer (UNAUTHENTICATED) before its body is
/// read, and hands the rest a body that fails with MESSAGE_TOO_LARGE at the prefix of
/// a message over the service's limit.
#[derive(Debug, Clone)]
pub struct RequestGuard<S> {
    inner: S,
    limits: Arc<MessageLimits>,
}

type BoxFuture<T, E> = Pin<Box<dyn std::future::Future<Output = Result<T, E>> + Send>>;

impl<S, ReqBody> Service<http::Request<ReqBody>> for RequestGuard<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>> + Send,
    S::Future: Send + 'static,
    ReqBody: HttpBody<Data = bytes::Bytes> + Send + 'static,
    ReqBody::Error: Into<tonic::codegen::StdError>,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        let service = service_of(request.uri().path()).to_owned();
        let open = OPEN_SERVICES.iter().any(|p| service.starts_with(p));
        if !open && !bearer_is_well_formed(request.headers().get(http::header::AUTHORIZATION)) {
            let status = status_with_reason(
                Code::Unauthenticated,
                ErrorReason::Unauthenticated,
                "missing or malformed authorization: Bearer metadata",
                std::iter::empty::<(String, String)>(),
            );
            return Box::pin(async move { Ok(status.into_http()) });
        }
        let limit = self.limits.for_service(&service);
        let request = request.map(|body| Body::new(LimitedBody::new(body, limit)));
        Box::pin(self.inner.call(request))
    }
}

pin_project_lite::pin_project! {
    /// A request body that walks the gRPC length prefixes as the bytes go by and fails
    /// at the first one announcing a message over `limit`.
    struct LimitedBody<B> {
        #[pin]
        inner: B,
        limit: usize,
        // Bytes of the current prefix seen so far, and how many message bytes remain
        // before the next prefix.
        prefix: [u8; 5],
        prefix_len: usize,
        remaining: usize,
        failed: bool,
    }
}

impl<B> LimitedBody<B> {
    fn new(inner: B, limit: usize) -> Self {
        Self {
            inner,
            limit,
            prefix: [0; 5],
            prefix_len: 0,
            remaining: 0,
            failed: false,
        }
    }
}

/// Walks `data` from the state (`prefix`, `prefix_len`, `remaining`); the length of the
/// first message over `limit`, if one starts here.
fn scan(
    data: &[u8],
    limit: usize,
    prefix: &mut [u8; 5],
    prefix_len: &mut usize,
    remaining: &mut usize,
) -> Option<usize> {
    let mut at = 0;
    while at < data.len() {
        if *remaining > 0 {
            let skip = (*remaining).min(data.len() - at);
            *remaining -= skip;
            at += skip;
            continue;
        }
        prefix[*prefix_len] = data[at];
        *prefix_len += 1;
        at += 1;
        if *prefix_len == 5 {
            *prefix_len = 0;
            let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
            if len > limit {
                return Some(len);
            }
            *remaining = len;
        }
    }
    None
}

impl<B> HttpBody for LimitedBody<B>
where
    B: HttpBody<Data = bytes::Bytes>,
    B::Error: Into<tonic::codegen::StdError>,
{
    type Data = bytes::Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        if *this.failed {
            return Poll::Ready(None);
        }
        let frame = match std::task::ready!(this.inner.poll_frame(cx)) {
            None => return Poll::Ready(None),
            Some(Err(e)) => return Poll::Ready(Some(Err(Status::from_error(e.into())))),
            Some(Ok(frame)) => frame,
        };
        if let Some(data) = frame.data_ref()
            && let Some(len) = scan(
                data,
                *this.limit,
                this.prefix,
                this.prefix_len,
                this.remaining,
            )
        {
            *this.failed = true;
            return Poll::Ready(Some(Err(status_with_reason(
                Code::InvalidArgument,
                ErrorReason::MessageTooLarge,
                format!(
                    "request message of {len} bytes is over this service's limit of {} bytes",
                    this.limit
                ),
                [
                    ("limit", this.limit.to_string()),
                    ("actual", len.to_string()),
                ],
            ))));
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_are_found_across_chunk_boundaries() {
        let mut body = vec![0, 0, 0, 0, 3, b'a', b'b', b'c'];
        body.extend([0, 0, 0, 0x10, 0]); // 4096 bytes announced
        let (mut prefix, mut prefix_len, mut remaining) = ([0; 5], 0, 0);
        let mut found = None;
        for chunk in body.chunks(2) {
            found = found.or(scan(
                chunk,
                1024,
                &mut prefix,
                &mut prefix_len,
                &mut remaining,
            ));
        }
        assert_eq!(found, Some(4096));
        let (mut prefix, mut prefix_len, mut remaining) = ([0; 5], 0, 0);
        assert_eq!(
            scan(
                &body[..8],
                1024,
                &mut prefix,
                &mut prefix_len,
                &mut remaining
            ),
            None
        );
    }

    #[test]
    fn the_bearer_form_is_checked() {
        let ok = http::HeaderValue::from_static("Bearer abc.DEF-123");
        assert!(bearer_is_well_formed(Some(&ok)));
        for bad in ["Bearer ", "Basic abc", "abc", "Bearer a b"] {
            let value = http::HeaderValue::from_static(bad);
            assert!(!bearer_is_well_formed(Some(&value)), "{bad}");
        }
        assert!(!bearer_is_well_formed(None));
    }
}
