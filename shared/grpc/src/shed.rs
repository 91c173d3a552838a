//! Load shedding: each service handles at most so many ordinary calls at once, and a
//! call past that is answered at once with `RESOURCE_EXHAUSTED` and pushback instead of
//! queueing behind the others.
//!
//! A server that queues everything gets slower for everyone when a fleet reconnects at
//! once; one that refuses the excess with a pushback (`grpc-retry-pushback-ms` and
//! `google.rpc.RetryInfo`, reason `RATE_LIMITED`) stays fast for the calls it takes, and
//! runplane's transport waits out the pushback outside the outage budget. Long polls and
//! streams are not counted: they wait by design and would starve the limit.

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
use crate::guard::service_of;

/// Layer of [`LoadShed`].
#[derive(Debug, Clone)]
pub struct LoadShedLayer {
    limits: Arc<HashMap<String, Arc<Semaphore>>>,
    pushback: Duration,
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
        }
    }
}

impl<S> Layer<S> for LoadShedLayer {
    type Service = LoadShed<S>;

    fn layer(&self, inner: S) -> Self::Service {
        LoadShed {
            inner,
            limits: self.limits.clone(),
            pushback: self.pushback,
        }
    }
}

/// See the module docs.
#[derive(Debug, Clone)]
pub struct LoadShed<S> {
    inner: S,
    limits: Arc<HashMap<String, Arc<Semaphore>>>,
    pushback: Duration,
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
    S: Service<http::Request<ReqBody>, Response = http::Response<Body>> + Send,
    S::Future: Send + 'static,
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
        let permit = match self.limits.get(service) {
            Some(slots) if counted => match slots.clone().try_acquire_owned() {
                Ok(permit) => Some(permit),
                Err(_) => {
                    tracing::debug!(
                        rpc.service = service,
                        "shedding a call over the concurrency limit"
                    );
                    let response = overloaded(service, self.pushback);
                    return Box::pin(async move { Ok(response) });
                }
            },
            _ => None,
        };
        let call = self.inner.call(request);
        Box::pin(async move {
            let response = call.await;
            drop(permit);
            response
        })
    }
}
