//! The server's own limits over real sockets: a stream flood on one connection is
//! refused and then cut off while other connections are served, a message over its
//! service's limit never reaches the handler, and a call without a credential is
//! refused before its body is read.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use runplane_grpc::{ErrorReason, ServerLimits, ServiceSet, error_info, serve};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tonic::Code;
use tonic::body::Body;
use tonic::server::{NamedService, UnaryService};
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

async fn start(services: ServiceSet) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(
        listener,
        services,
        std::future::pending(),
        Duration::from_secs(1),
    ));
    addr
}

async fn health_check(addr: std::net::SocketAddr) -> Result<HealthCheckResponse, tonic::Status> {
    let channel = runplane_grpc::client::endpoint(&format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .map(tonic::Response::into_inner)
}

// --- a raw HTTP/2 client, so nothing on the client side queues streams for us ---

const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
const REFUSED_STREAM: u32 = 0x7;
const ENHANCE_YOUR_CALM: u32 = 0xb;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut out = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    out.extend(stream.to_be_bytes());
    out.extend(payload);
    out
}

/// HPACK literals (no indexing, no Huffman) of a health Watch call whose request
/// message never comes, so every accepted stream stays open.
fn watch_headers() -> Vec<u8> {
    fn literal(out: &mut Vec<u8>, name: &str, value: &str) {
        out.push(0x00);
        out.push(name.len() as u8);
        out.extend(name.as_bytes());
        out.push(value.len() as u8);
        out.extend(value.as_bytes());
    }
    let mut block = vec![0x83, 0x86]; // :method POST, :scheme http (static table)
    literal(&mut block, ":path", "/grpc.health.v1.Health/Watch");
    literal(&mut block, ":authority", "localhost");
    literal(&mut block, "content-type", "application/grpc");
    literal(&mut block, "te", "trailers");
    block
}

#[derive(Debug, Default)]
struct Flood {
    refused: Vec<u32>,
    go_away: Option<u32>,
}

/// Opens `streams` streams on one connection as fast as it can, and reads what the
/// server answers until it closes the connection or goes quiet.
async fn flood(addr: std::net::SocketAddr, streams: u32) -> Flood {
    let socket = TcpStream::connect(addr).await.unwrap();
    let (mut reader, mut writer) = socket.into_split();
    let (ack_tx, mut ack_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let write = tokio::spawn(async move {
        writer
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await?;
        writer.write_all(&frame(SETTINGS, 0, 0, &[])).await?;
        let block = watch_headers();
        let mut batch = Vec::new();
        for i in 0..streams {
            while ack_rx.try_recv().is_ok() {
                batch.extend(frame(SETTINGS, 0x1, 0, &[]));
            }
            // END_HEADERS, no END_STREAM: the request stays open.
            batch.extend(frame(HEADERS, 0x4, 2 * i + 1, &block));
            if batch.len() > 64 * 1024 {
                writer.write_all(&batch).await?;
                batch.clear();
            }
        }
        writer.write_all(&batch).await?;
        std::io::Result::Ok(writer)
    });

    let mut seen = Flood::default();
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let read = tokio::time::timeout(Duration::from_secs(3), reader.read(&mut chunk)).await;
        let n = match read {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
            Ok(Ok(n)) => n,
        };
        buf.extend_from_slice(&chunk[..n]);
        while buf.len() >= 9 {
            let len =
                (usize::from(buf[0]) << 16) | (usize::from(buf[1]) << 8) | usize::from(buf[2]);
            if buf.len() < 9 + len {
                break;
            }
            let (kind, flags) = (buf[3], buf[4]);
            let stream = u32::from_be_bytes([buf[5], buf[6], buf[7], buf[8]]) & 0x7fff_ffff;
            let payload = &buf[9..9 + len];
            match kind {
                SETTINGS if flags & 0x1 == 0 => {
                    let _ = ack_tx.send(());
                }
                RST_STREAM
                    if u32::from_be_bytes(payload[..4].try_into().unwrap()) == REFUSED_STREAM =>
                {
                    seen.refused.push(stream);
                }
                GOAWAY => {
                    seen.go_away = Some(u32::from_be_bytes(payload[4..8].try_into().unwrap()));
                }
                _ => {}
            }
            buf.drain(..9 + len);
        }
    }
    write.abort();
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_streams_on_one_connection_are_refused_past_the_limit() {
    let addr = start(ServiceSet::new()).await;
    let limits = ServerLimits::default();
    let streams = 10_000;

    let flood = flood(addr, streams).await;

    let first_refused = *flood
        .refused
        .first()
        .expect("streams past the limit refused");
    assert_eq!(
        first_refused,
        2 * limits.max_concurrent_streams + 1,
        "the first stream past max_concurrent_streams is the first refused"
    );
    assert_eq!(
        flood.go_away,
        Some(ENHANCE_YOUR_CALM),
        "the reset-flood guard closes the connection"
    );
    assert!(
        flood.refused.len() <= limits.max_local_error_reset_streams,
        "no more than the guard's refusals: {}",
        flood.refused.len()
    );

    // Another connection is served as if nothing happened.
    let answer = tokio::time::timeout(Duration::from_secs(5), health_check(addr))
        .await
        .expect("the server still answers others");
    assert!(answer.is_ok(), "{answer:?}");
}

// --- a service whose handler counts the calls that reach it ---

#[derive(Clone, Default)]
struct Echo {
    /// Calls the service was handed (before its body is decoded).
    reached: Arc<AtomicUsize>,
    /// Calls whose request was decoded and handled.
    handled: Arc<AtomicUsize>,
}

impl NamedService for Echo {
    const NAME: &'static str = "runplane.test.v1.Echo";
}

struct EchoHandler(Arc<AtomicUsize>);

impl UnaryService<HealthCheckRequest> for EchoHandler {
    type Response = HealthCheckResponse;
    type Future = std::future::Ready<Result<tonic::Response<HealthCheckResponse>, tonic::Status>>;

    fn call(&mut self, _request: tonic::Request<HealthCheckRequest>) -> Self::Future {
        self.0.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Ok(tonic::Response::new(HealthCheckResponse { status: 1 })))
    }
}

impl tower_service::Service<http::Request<Body>> for Echo {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        self.reached.fetch_add(1, Ordering::SeqCst);
        let handler = EchoHandler(self.handled.clone());
        Box::pin(async move {
            let codec =
                tonic_prost::ProstCodec::<HealthCheckResponse, HealthCheckRequest>::default();
            let mut grpc = tonic::server::Grpc::new(codec)
                .apply_max_message_size_config(Some(64 * 1024 * 1024), None);
            Ok(grpc.unary(handler, request).await)
        })
    }
}

async fn call_echo(
    addr: std::net::SocketAddr,
    bearer: Option<&str>,
    payload_bytes: usize,
) -> Result<HealthCheckResponse, tonic::Status> {
    let channel = runplane_grpc::client::endpoint(&format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = tonic::client::Grpc::new(channel);
    client.ready().await.unwrap();
    let mut request = tonic::Request::new(HealthCheckRequest {
        service: "x".repeat(payload_bytes),
    });
    if let Some(bearer) = bearer {
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {bearer}").parse().unwrap());
    }
    let codec = tonic_prost::ProstCodec::<HealthCheckRequest, HealthCheckResponse>::default();
    client
        .unary(
            request,
            http::uri::PathAndQuery::from_static("/runplane.test.v1.Echo/Echo"),
            codec,
        )
        .await
        .map(tonic::Response::into_inner)
}

fn echo_server(echo: &Echo, limit: usize) -> ServiceSet {
    let mut services = ServiceSet::new();
    services.add(echo.clone());
    let mut limits = ServerLimits::default();
    limits
        .max_decoding_message_bytes_by_service
        .insert(Echo::NAME.to_owned(), limit);
    services.limits(limits);
    services
}

#[tokio::test]
async fn a_message_over_its_services_limit_is_refused_before_the_handler() {
    let echo = Echo::default();
    let addr = start(echo_server(&echo, 64 * 1024)).await;

    call_echo(addr, Some("token"), 60 * 1024)
        .await
        .expect("a message under the limit is served");
    assert_eq!(echo.handled.load(Ordering::SeqCst), 1);

    let refused = call_echo(addr, Some("token"), 100 * 1024)
        .await
        .expect_err("over the limit");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    let info = error_info(&refused).expect("error info");
    assert_eq!(info.reason, ErrorReason::MessageTooLarge.as_str_name());
    assert_eq!(
        info.metadata.get("limit").map(String::as_str),
        Some("65536")
    );
    assert_eq!(
        echo.handled.load(Ordering::SeqCst),
        1,
        "the handler never ran"
    );
}

#[tokio::test]
async fn an_unauthenticated_4_mib_request_is_refused_without_being_decoded() {
    let echo = Echo::default();
    let addr = start(echo_server(&echo, 8 * 1024 * 1024)).await;

    for bearer in [None, Some("")] {
        let refused = call_echo(addr, bearer, 4 * 1024 * 1024)
            .await
            .expect_err("no credential");
        assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
        let info = error_info(&refused).expect("error info");
        assert_eq!(info.reason, ErrorReason::Unauthenticated.as_str_name());
    }
    assert_eq!(
        echo.reached.load(Ordering::SeqCst),
        0,
        "the service was never handed the body"
    );

    // Health stays open to probes without a credential.
    health_check(addr)
        .await
        .expect("health needs no credential");
}
