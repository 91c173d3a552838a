//! What the client concludes from the HTTP/2 frames that end a stream: a raw HTTP/2
//! server (the h2 crate, no gRPC layer) answers a gRPC call with exactly one frame, and
//! the transport's classification of the channel's error is checked against what the
//! frame proves. Only a frame that says the server processed nothing of the stream
//! (REFUSED_STREAM; a GOAWAY whose last stream id is below it) may be "never sent": those
//! are the errors a non-idempotent call is retried after.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use h2::Reason;
use runplane_transport::Failure;
use runplane_transport::classify;
use tokio::net::TcpListener;
use tonic::transport::{Channel, Endpoint};
use tower_service::Service;

#[derive(Clone, Copy)]
enum Frame {
    /// RST_STREAM(REFUSED_STREAM) on every stream.
    RefusedStream,
    /// GOAWAY(NO_ERROR) naming the stream just received as processed, then close.
    GoAwayCoveringTheStream,
    /// RST_STREAM(INTERNAL_ERROR): the server may have acted on the request.
    InternalError,
    /// GOAWAY(NO_ERROR) with last stream id 0, sent once the request's frames wait unread
    /// in the socket: the server processed nothing of the stream.
    GoAwayBelowTheStream,
}

async fn raw_h2_server(frame: Frame) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                // A second handle on the socket, to see the request arrive without h2
                // reading it.
                let watcher = socket.into_std().unwrap();
                let peeker = watcher.try_clone().unwrap();
                let socket = tokio::net::TcpStream::from_std(watcher).unwrap();
                let Ok(mut connection) = h2::server::handshake(socket).await else {
                    return;
                };
                if let Frame::GoAwayBelowTheStream = frame {
                    let peeker = tokio::net::TcpStream::from_std(peeker).unwrap();
                    let mut byte = [0u8; 1];
                    let _ =
                        tokio::time::timeout(Duration::from_secs(5), peeker.peek(&mut byte)).await;
                    connection.abrupt_shutdown(Reason::NO_ERROR);
                    while connection.accept().await.is_some() {}
                    return;
                }
                let mut held: Vec<h2::server::SendResponse<Bytes>> = Vec::new();
                while let Some(Ok((_request, mut respond))) = connection.accept().await {
                    match frame {
                        Frame::RefusedStream => respond.send_reset(Reason::REFUSED_STREAM),
                        Frame::InternalError | Frame::GoAwayBelowTheStream => {
                            respond.send_reset(Reason::INTERNAL_ERROR)
                        }
                        Frame::GoAwayCoveringTheStream => {
                            connection.abrupt_shutdown(Reason::NO_ERROR);
                            held.push(respond);
                        }
                    }
                }
            });
        }
    });
    address
}

/// One gRPC call over a plain tonic channel; the channel's error, whatever it is.
async fn call(address: SocketAddr) -> tonic::transport::Error {
    let mut channel: Channel = Endpoint::from_shared(format!("http://{address}"))
        .unwrap()
        .connect()
        .await
        .expect("the raw server accepts the connection");
    let request = http::Request::post("/runplane.runstore.v1.RunnerService/Hello")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(tonic::body::Body::empty())
        .unwrap();
    std::future::poll_fn(|cx| channel.poll_ready(cx))
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), channel.call(request))
        .await
        .expect("the call ends")
        .expect_err("the raw server answers no call")
}

fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut out = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        out += &format!(": {e} ({e:?})");
        cause = e.source();
    }
    out
}

#[tokio::test]
async fn a_refused_stream_is_never_sent() {
    let error = call(raw_h2_server(Frame::RefusedStream).await).await;
    assert_eq!(
        classify::error(&error),
        Failure::ProvenNotSent,
        "{}",
        chain(&error)
    );
}

#[tokio::test]
async fn a_goaway_that_covers_the_stream_may_have_been_processed() {
    let error = call(raw_h2_server(Frame::GoAwayCoveringTheStream).await).await;
    assert_eq!(
        classify::error(&error),
        Failure::MaybeProcessed,
        "{}",
        chain(&error)
    );
}

#[tokio::test]
async fn a_goaway_below_the_stream_is_never_sent() {
    let error = call(raw_h2_server(Frame::GoAwayBelowTheStream).await).await;
    assert_eq!(
        classify::error(&error),
        Failure::ProvenNotSent,
        "{}",
        chain(&error)
    );
}

#[tokio::test]
async fn a_reset_stream_may_have_been_processed() {
    let error = call(raw_h2_server(Frame::InternalError).await).await;
    assert_eq!(
        classify::error(&error),
        Failure::MaybeProcessed,
        "{}",
        chain(&error)
    );
}
