//! Load shedding: each service handles at most so many ordinary calls at once; a call
//! past that waits a short, bounded time for a slot, in arrival order, and is then
//! answered with `RESOURCE_EXHAUSTED` and pushback instead of queueing without end.
//!
//! A server that queues everything gets slower for everyone when a fleet reconnects at
//! once; one that refuses the excess with a pushback (`grpc-retry-pushback-ms` and
//! `google.rpc.RetryInfo`, reason `RATE_LIMITED`) stays fast for the calls it takes, and
//! runplane's transport waits out the pushback outside the outage budget. The short wait
//! in between serves a burst in order: refused at once, the same burst comes back at
//! random after its pushback, and some calls lose that lottery again and again (measured
//! in the runner's outage bench, capacity-capped table). Long polls and streams are not
//! counted: they wait by design and would starve the limit.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use runplane_proto::CallClass;
use tokio::sync::Semaphore;
use tonic::body::Body;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};
use tower_layer::Layer;
use tower_service::Service;

use crate::error::ErrorReason;
use crate::method::service_of;

/// Layer of [`LoadShed`].
#[derive(Debug, Clone)]
pub struct LoadShedLayer {
    limits: Arc<HashMap<String, Arc<Semaphore>>>,
    pushback: Duration,
    queue: Duration,
}

impl LoadShedLayer {
    /// `limits`: the most ordinary calls each service (full name) handles at once; a
    /// service not listed is not limited.
    pub fn new(limits: impl IntoIterator<Item = (String, usize)>, pushback: Duration) -> Self {
        Self {
            limits: Arc::new(
                limits
                    .into_iter()
                    .map(|(service, n)| (service, Arc::new(Semaphore::new(n))))
                    .collect(),
            ),
            pushback,
            queue: Duration::ZERO,
        }
    }

    /// A call over the limit waits up to `queue` for a slot (tokio's semaphore is fair:
    /// first come, first served) before it is shed; zero sheds at once.
    pub fn queueing(mut self, queue: Duration) -> Self {
        self.queue = queue;
        self
    }
}

impl<S> Layer<S> for LoadShedLayer {
    type Service = LoadShed<S>;

    fn layer(&self, inner: S) -> Self::Service {
        LoadShed {
            inner,
            limits: self.limits.clone(),
            pushback: self.pushback,
            queue: self.queue,
        }
    }
}

/// See the module docs.
#[derive(Debug, Clone)]
pub struct LoadShed<S> {
    inner: S,
    limits: Arc<HashMap<String, Arc<Semaphore>>>,
    pushback: Duration,
    queue: Duration,
}

type BoxFuture<T, E> = Pin<Box<dyn std::future::Future<Output = Result<T, E>> + Send>>;

/// The overload answer: trailers-only, with both forms of pushback gRFC A6 knows.
fn overloaded(service: &str, pushback: Duration) -> http::Response<Body> {
    let mut details = ErrorDetails::with_retry_info(Some(pushback));
    details.set_error_info(
        ErrorReason::RateLimited.as_str_name(),
        runplane_proto::ERROR_DOMAIN,
        [("service".to_owned(), service.to_owned())],
    );
    let mut response: http::Response<Body> = Status::with_error_details(
        Code::ResourceExhausted,
        format!("{service} is at its concurrency limit; retry after the pushback"),
        details,
    )
    .into_http();
    response.headers_mut().insert(
        "grpc-retry-pushback-ms",
        http::HeaderValue::from(pushback.as_millis().min(u64::MAX as u128) as u64),
    );
    response
}

impl<S, ReqBody> Service<http::Request<ReqBody>> for LoadShed<S>
where
    S: Service<http::Request<ReqBody>, Response = http::Response<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    ReqBody: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        let path = request.uri().path();
        let service = service_of(path);
        let counted = runplane_proto::policy_for(path)
            .is_none_or(|policy| policy.call_class() == CallClass::Unary);
        let slots = match self.limits.get(service) {
            Some(slots) if counted => slots.clone(),
            _ => return Box::pin(self.inner.call(request)),
        };
        if let Ok(permit) = slots.clone().try_acquire_owned() {
            let call = self.inner.call(request);
            return Box::pin(async move {
                let response = call.await;
                drop(permit);
                response
            });
        }
        let (queue, pushback, service) = (self.queue, self.pushback, service.to_owned());
        // The service polled ready is the one that takes the call, later: a clone stays.
        let ready = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, ready);
        Box::pin(async move {
            let Ok(Ok(permit)) = tokio::time::timeout(queue, slots.acquire_owned()).await else {
                tracing::debug!(
                    rpc.service = %service,
                    "shedding a call over the concurrency limit"
                );
                return Ok(overloaded(&service, pushback));
            };
            let response = inner.call(request).await;
            drop(permit);
            response
        })
    }
}
