//! One attempt of a call: sent on the upstream's current connection, bounded by its
//! deadline and the connection's handshake timeout, and classified by what it proves.

use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use runplane_proto::MethodPolicy;
use tokio::time::Instant;
use tonic::body::Body;
use tower_service::Service;

use crate::classify::{self, Failure, Pushback};
use crate::config::RetryConfig;
use crate::deadline;
use crate::upstream::{Conn, ConnChannel};

/// Errors the layer returns: the inner channel's, boxed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What one attempt came to.
pub(crate) enum Attempt {
    Done(http::Response<Body>),
    Failed {
        failure: Failure,
        /// The response to hand on if this failure is final (a gRPC status), or the error.
        last: Result<http::Response<Body>, BoxError>,
        pushback: Pushback,
        /// The connection is condemned: retry on a new one.
        reconnect: bool,
    },
}

impl Attempt {
    fn error(failure: Failure, status: tonic::Status) -> Self {
        Attempt::Failed {
            failure,
            last: Err(Box::new(status)),
            pushback: Pushback::None,
            reconnect: true,
        }
    }
}

/// One attempt under its deadline and the connection's handshake timeout.
pub(crate) async fn bounded(
    config: &RetryConfig,
    conn: &Conn,
    request: http::Request<Body>,
    policy: &MethodPolicy,
    deadline: Option<Duration>,
) -> Attempt {
    let started = Instant::now();
    // A stream has no deadline, but its response headers must come in time.
    let deadline_at = started + deadline.unwrap_or(config.attempt_timeout);
    let handshake_at = started + config.handshake_timeout;
    let attempt = send(conn.channel.clone(), request, policy);
    tokio::pin!(attempt);
    let past_deadline = || {
        // Past its deadline, an attempt is like a reset: it may have been processed,
        // unless the server never said a word.
        let failure = if conn.heard.load(Ordering::SeqCst) {
            Failure::MaybeProcessed
        } else {
            Failure::ProvenNotSent
        };
        Attempt::error(
            failure,
            tonic::Status::deadline_exceeded(format!(
                "no answer from {} within the {} ms attempt deadline",
                conn.address,
                (deadline_at - started).as_millis()
            )),
        )
    };
    let mut handshake_checked = false;
    loop {
        tokio::select! {
            done = &mut attempt => return match done {
                // tonic's channel enforces the `grpc-timeout` we send as well.
                Attempt::Failed { last: Err(e), .. } if classify::is_timeout(&*e) => {
                    past_deadline()
                }
                done => done,
            },
            () = tokio::time::sleep_until(handshake_at), if !handshake_checked => {
                handshake_checked = true;
                if !conn.heard.load(Ordering::SeqCst) {
                    return Attempt::error(Failure::ProvenNotSent, tonic::Status::unavailable(format!(
                        "no answer from {}: it sent nothing within the {} ms handshake timeout",
                        conn.address,
                        config.handshake_timeout.as_millis()
                    )));
                }
            }
            () = tokio::time::sleep_until(deadline_at) => return past_deadline(),
        }
    }
}

/// Sends `request` once: a unary response is read whole, so a body cut short is seen
/// here; a stream is handed on once its headers are in.
async fn send(
    mut inner: ConnChannel,
    request: http::Request<Body>,
    policy: &MethodPolicy,
) -> Attempt {
    let ready = std::future::poll_fn(|cx| inner.poll_ready(cx))
        .await
        .map_err(BoxError::from);
    let response = match ready {
        Ok(()) => inner.call(request).await.map_err(BoxError::from),
        Err(e) => Err(e),
    };
    let response = match response {
        Ok(r) => r,
        Err(e) => {
            let failure = classify::error(&*e);
            return Attempt::Failed {
                failure,
                // A connect that failed: try the next address.
                reconnect: classify::is_connect(&*e),
                last: Err(e),
                pushback: Pushback::None,
            };
        }
    };
    // A status in the headers (trailers-only) is the whole answer.
    if let Some(status) = tonic::Status::from_header_map(response.headers()) {
        if status.code() == tonic::Code::Ok {
            return Attempt::Done(response);
        }
        let pushback = classify::pushback(response.headers(), &status);
        return Attempt::Failed {
            failure: classify::status(&status),
            last: Ok(response),
            pushback,
            reconnect: false,
        };
    }
    if policy.server_streaming {
        return Attempt::Done(response);
    }
    // Unary: read it whole so a cut body is seen here.
    let (parts, body) = response.into_parts();
    match body.collect().await {
        Err(e) => Attempt::Failed {
            failure: Failure::MaybeProcessed,
            last: Err(Box::new(e)),
            pushback: Pushback::None,
            reconnect: false,
        },
        Ok(collected) => {
            let trailers = collected.trailers().cloned();
            let data = collected.to_bytes();
            let status = trailers.as_ref().and_then(tonic::Status::from_header_map);
            let response = http::Response::from_parts(parts, whole_body(data, trailers.clone()));
            match status {
                Some(s) if s.code() != tonic::Code::Ok => Attempt::Failed {
                    failure: classify::status(&s),
                    pushback: trailers
                        .as_ref()
                        .map_or(Pushback::None, |t| classify::pushback(t, &s)),
                    last: Ok(response),
                    reconnect: false,
                },
                // No trailers at all: the stream ended without a status, cut short.
                None => Attempt::Failed {
                    failure: Failure::MaybeProcessed,
                    last: Ok(response),
                    pushback: Pushback::None,
                    reconnect: false,
                },
                Some(_) => Attempt::Done(response),
            }
        }
    }
}

pub(crate) fn rebuild(
    parts: &http::request::Parts,
    body: Bytes,
    deadline: Option<Duration>,
) -> http::Request<Body> {
    let mut request = http::Request::new(Body::new(http_body_util::Full::new(body)));
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = parts.uri.clone();
    *request.version_mut() = parts.version;
    *request.headers_mut() = parts.headers.clone();
    if let Some(d) = deadline {
        request
            .headers_mut()
            .insert("grpc-timeout", deadline::header(d));
    }
    request
}

fn whole_body(data: Bytes, trailers: Option<http::HeaderMap>) -> Body {
    let mut frames = vec![Ok::<_, std::convert::Infallible>(http_body::Frame::data(
        data,
    ))];
    if let Some(t) = trailers {
        frames.push(Ok(http_body::Frame::trailers(t)));
    }
    Body::new(http_body_util::StreamBody::new(futures::stream::iter(
        frames,
    )))
}
