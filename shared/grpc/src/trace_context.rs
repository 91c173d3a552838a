//! W3C trace context across gRPC hops.
//!
//! The server layer extracts `traceparent`/`tracestate` from the request headers with the
//! global propagator and opens the request span as their child; the client layer injects
//! the current span's context into every outgoing request. Both are no-ops for context
//! when no propagator or tracer is installed, so they are always on.

use std::task::{Context, Poll};

use http::{HeaderMap, HeaderName, HeaderValue, Request, Response};
use opentelemetry::propagation::{Extractor, Injector};
use tower_layer::Layer;
use tower_service::Service;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Reads propagation fields from HTTP headers.
pub struct HeaderExtractor<'a>(pub &'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

/// Writes propagation fields into HTTP headers.
pub struct HeaderInjector<'a>(pub &'a mut HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(key.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

/// The parent context a request carries, per the global propagator.
pub fn extract_context(headers: &HeaderMap) -> opentelemetry::Context {
    opentelemetry::global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(headers)))
}

/// Writes the current span's context into `headers`.
pub fn inject_current_context(headers: &mut HeaderMap) {
    let cx = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&cx, &mut HeaderInjector(headers))
    });
}

/// The current span's W3C `traceparent`, for work that continues it later (an outbox
/// row delivered after the decision's span ended); `None` outside a sampled trace.
pub fn current_traceparent() -> Option<String> {
    let mut headers = HeaderMap::new();
    inject_current_context(&mut headers);
    headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// Makes `span` a child of the W3C `traceparent` (an outbox row's, a run's, the
/// `TRACEPARENT` a runner was started with), so work done later joins the trace of the
/// decision that caused it. An empty or malformed value leaves `span` as it was.
pub fn continue_trace(span: &tracing::Span, traceparent: &str) {
    let Ok(value) = HeaderValue::from_str(traceparent) else {
        return;
    };
    if traceparent.is_empty() {
        return;
    }
    let mut headers = HeaderMap::new();
    headers.insert("traceparent", value);
    let _ = span.set_parent(extract_context(&headers));
}

/// The span of one outbox delivery, continuing the trace of the decision that owed it.
pub fn outbox_span(kind: &str, key: &str, traceparent: &str) -> tracing::Span {
    let span = tracing::info_span!("outbox.deliver", kind = %kind, key = %key);
    continue_trace(&span, traceparent);
    span
}

/// A span for periodic background work (a reconcile round, a dispatch poll) that is not
/// exported, nor is anything it calls: its parent is a remote context marked not
/// sampled, which the parent-based sampler follows here and in the services it calls.
/// Without it every tick is a root trace of its own, burying runs' traces. Work inside it
/// that belongs to a run continues the run's trace explicitly ([`continue_trace`]).
pub fn background_span(name: &'static str) -> tracing::Span {
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
    };
    let span = tracing::info_span!("background", otel.name = name);
    // Random, and never all zero (an all-zero id is invalid and would be ignored).
    let trace_id = TraceId::from(rand::random::<u128>() | 1);
    let span_id = SpanId::from(rand::random::<u64>() | 1);
    let unsampled = SpanContext::new(
        trace_id,
        span_id,
        TraceFlags::default(),
        true,
        TraceState::default(),
    );
    let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(unsampled));
    span
}

/// Server side: one `grpc.request` span per call, child of the caller's trace.
#[derive(Debug, Clone, Copy, Default)]
pub struct ServerTraceLayer;

impl<S> Layer<S> for ServerTraceLayer {
    type Service = ServerTrace<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ServerTrace { inner }
    }
}

#[derive(Debug, Clone)]
pub struct ServerTrace<S> {
    inner: S,
}

impl<S, B, ResBody> Service<Request<B>> for ServerTrace<S>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = futures::future::BoxFuture<'static, Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let path = request.uri().path().to_owned();
        let (service, method) = split_path(&path);
        let span = tracing::info_span!(
            "grpc.request",
            otel.name = %path.trim_start_matches('/'),
            otel.kind = "server",
            rpc.system = "grpc",
            rpc.service = %service,
            rpc.method = %method,
            rpc.grpc.status_code = tracing::field::Empty,
        );
        let parent = extract_context(request.headers());
        // A missing or malformed traceparent leaves the span a root; nothing to report.
        let _ = span.set_parent(parent);

        let future = span.in_scope(|| self.inner.call(request));
        let record_on = span.clone();
        Box::pin(
            async move {
                let response = future.await?;
                // Errors end trailers-only, so their status is in the headers; a success
                // puts it in trailers, which this layer does not wait for.
                if let Some(code) = response
                    .headers()
                    .get("grpc-status")
                    .and_then(|v| v.to_str().ok())
                {
                    record_on.record("rpc.grpc.status_code", code);
                }
                Ok(response)
            }
            .instrument(span),
        )
    }
}

fn split_path(path: &str) -> (&str, &str) {
    let trimmed = path.trim_start_matches('/');
    trimmed.split_once('/').unwrap_or((trimmed, ""))
}

/// Client side: injects the current trace context into every request.
#[derive(Debug, Clone, Copy, Default)]
pub struct ClientTraceLayer;

impl<S> Layer<S> for ClientTraceLayer {
    type Service = ClientTrace<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ClientTrace { inner }
    }
}

#[derive(Debug, Clone)]
pub struct ClientTrace<S> {
    inner: S,
}

impl<S, B> Service<Request<B>> for ClientTrace<S>
where
    S: Service<Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        inject_current_context(request.headers_mut());
        self.inner.call(request)
    }
}
