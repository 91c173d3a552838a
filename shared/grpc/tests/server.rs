//! The server plumbing over a real socket: trace context joins the caller's trace,
//! health follows shutdown, reflection answers in both versions, errors carry reasons.

use std::time::Duration;

use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use runplane_grpc::{ErrorReason, ServiceSet, error_info, serve, status_with_reason};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio_stream_shim::StreamExt as _;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tracing_subscriber::layer::SubscriberExt;

mod tokio_stream_shim {
    pub use futures::StreamExt;
}

struct Running {
    addr: String,
    stop: Option<oneshot::Sender<()>>,
    done:
        tokio::task::JoinHandle<Result<runplane_grpc::Stopped, runplane_grpc::server::ServeError>>,
}

async fn start(services: ServiceSet, grace: Duration) -> Running {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = oneshot::channel::<()>();
    let done = tokio::spawn(serve(
        listener,
        services,
        async {
            let _ = stopped.await;
        },
        grace,
    ));
    Running {
        addr,
        stop: Some(stop),
        done,
    }
}

/// A Watch of the server's overall health, past its first answer (SERVING).
async fn watch_serving(addr: &str) -> tonic::Streaming<HealthCheckResponse> {
    let mut health = HealthClient::new(runplane_grpc::client::connect(addr).await.unwrap());
    let mut watch = health
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let first: HealthCheckResponse = watch.next().await.unwrap().unwrap();
    assert_eq!(first.status(), ServingStatus::Serving);
    watch
}

#[tokio::test]
async fn a_request_with_traceparent_joins_the_callers_trace() {
    runplane_telemetry::install_propagator();
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    // The test runtime is current-thread, so the server's tasks see this subscriber.
    let _guard = tracing::subscriber::set_default(subscriber);

    let server = start(ServiceSet::new(), Duration::from_secs(5)).await;
    let channel = runplane_grpc::client::endpoint(&server.addr)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);

    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent_span = "00f067aa0ba902b7";
    let mut request = tonic::Request::new(HealthCheckRequest {
        service: String::new(),
    });
    request.metadata_mut().insert(
        "traceparent",
        format!("00-{trace_id}-{parent_span}-01").parse().unwrap(),
    );
    health.check(request).await.expect("health check");

    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();
    let span = spans
        .iter()
        .find(|s| s.name == "grpc.health.v1.Health/Check")
        .unwrap_or_else(|| {
            panic!(
                "no server span among {:?}",
                spans.iter().map(|s| &s.name).collect::<Vec<_>>()
            )
        });
    assert_eq!(
        span.span_context.trace_id(),
        TraceId::from_hex(trace_id).unwrap()
    );
    assert_eq!(span.parent_span_id, SpanId::from_hex(parent_span).unwrap());
    let attribute = |key: &str| {
        span.attributes
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| kv.value.to_string())
    };
    assert_eq!(attribute("rpc.system").as_deref(), Some("grpc"));
    assert_eq!(
        attribute("rpc.service").as_deref(),
        Some("grpc.health.v1.Health")
    );
    assert_eq!(attribute("rpc.method").as_deref(), Some("Check"));
}

#[tokio::test]
async fn a_request_without_traceparent_starts_its_own_trace() {
    runplane_telemetry::install_propagator();
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    let _guard = tracing::subscriber::set_default(subscriber);

    let server = start(ServiceSet::new(), Duration::from_secs(5)).await;
    let mut health = HealthClient::new(runplane_grpc::client::connect(&server.addr).await.unwrap());
    health
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap();
    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();
    let span = spans
        .iter()
        .find(|s| s.name == "grpc.health.v1.Health/Check")
        .expect("server span");
    assert_eq!(span.parent_span_id, SpanId::INVALID);
    assert_ne!(span.span_context.trace_id(), TraceId::INVALID);
}

#[tokio::test]
async fn client_channels_inject_the_current_trace_context() {
    runplane_telemetry::install_propagator();
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    let _guard = tracing::subscriber::set_default(subscriber);

    let server = start(ServiceSet::new(), Duration::from_secs(5)).await;
    let mut health = HealthClient::new(runplane_grpc::client::connect(&server.addr).await.unwrap());
    let caller = tracing::info_span!("caller");
    {
        use tracing::Instrument;
        health
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .instrument(caller)
            .await
            .unwrap();
    }
    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();
    let caller = spans
        .iter()
        .find(|s| s.name == "caller")
        .expect("caller span");
    let server_span = spans
        .iter()
        .find(|s| s.name == "grpc.health.v1.Health/Check")
        .expect("server span");
    assert_eq!(
        server_span.span_context.trace_id(),
        caller.span_context.trace_id()
    );
    assert_eq!(server_span.parent_span_id, caller.span_context.span_id());
}

#[tokio::test]
async fn health_turns_not_serving_on_shutdown_before_the_server_stops() {
    let mut server = start(ServiceSet::new(), Duration::from_millis(200)).await;
    let mut watch = watch_serving(&server.addr).await;

    server.stop.take().unwrap().send(()).unwrap();
    let next: HealthCheckResponse = watch.next().await.unwrap().unwrap();
    assert_eq!(next.status(), ServingStatus::NotServing);

    // The open Watch stream keeps a call in flight; the deadline ends it.
    server
        .done
        .await
        .unwrap()
        .expect("serve returns after the grace");
}

/// A background task whose panic stops the process turns health NOT_SERVING and makes
/// `serve` return an error naming it, so the process exits and its supervisor starts a
/// fresh one; a task that finishes its round at shutdown is awaited first.
#[tokio::test]
async fn a_background_task_that_stops_the_process_ends_serving_with_its_name() {
    use runplane_grpc::{OnCancel, OnPanic, Task, Tasks};
    let tasks = Tasks::new();
    let (finished_tx, finished_rx) = std::sync::mpsc::channel::<()>();
    tasks.spawn(
        Task {
            name: "test.rounds",
            on_cancel: OnCancel::Finish,
            on_panic: OnPanic::Restart,
        },
        move |cancelled| {
            let finished = finished_tx.clone();
            async move {
                cancelled.cancelled().await;
                tokio::time::sleep(Duration::from_millis(50)).await;
                let _ = finished.send(());
            }
        },
    );
    let (panic_now, panic_when) = tokio::sync::watch::channel(false);
    tasks.spawn(
        Task {
            name: "test.essential",
            on_cancel: OnCancel::Abort,
            on_panic: OnPanic::Stop,
        },
        move |_| {
            let mut when = panic_when.clone();
            async move {
                let _ = when.wait_for(|now| *now).await;
                panic!("the essential loop broke");
            }
        },
    );
    let mut services = ServiceSet::new();
    services.background(&tasks);
    let server = start(services, Duration::from_secs(5)).await;
    let mut watch = watch_serving(&server.addr).await;

    panic_now.send_replace(true);
    let next: HealthCheckResponse = watch.next().await.unwrap().unwrap();
    assert_eq!(next.status(), ServingStatus::NotServing);
    drop(watch);
    let stopped = server.done.await.unwrap();
    assert!(
        matches!(
            stopped,
            Err(runplane_grpc::server::ServeError::Task("test.essential"))
        ),
        "{stopped:?}"
    );
    finished_rx
        .try_recv()
        .expect("the finishing task's round was not awaited");
}

#[tokio::test]
async fn unknown_service_names_are_not_found_by_health() {
    let server = start(ServiceSet::new(), Duration::from_secs(5)).await;
    let mut health = HealthClient::new(runplane_grpc::client::connect(&server.addr).await.unwrap());
    let err = health
        .check(HealthCheckRequest {
            service: "runplane.nope.v1.Nothing".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
}

#[tokio::test]
async fn reflection_answers_in_v1_and_v1alpha_and_lists_health() {
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient as V1;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest as V1Request;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse as V1Response;
    use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient as V1Alpha;
    use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest as AlphaRequest;
    use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse as AlphaResponse;

    let server = start(ServiceSet::new(), Duration::from_secs(5)).await;
    let channel = runplane_grpc::client::connect(&server.addr).await.unwrap();

    let mut v1 = V1::new(channel.clone());
    let request = tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(V1Request::ListServices(String::new())),
    };
    let mut responses = v1
        .server_reflection_info(futures::stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let Some(V1Response::ListServicesResponse(list)) =
        responses.next().await.unwrap().unwrap().message_response
    else {
        panic!("v1 did not list services");
    };
    let v1_names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        v1_names.contains(&"grpc.health.v1.Health".to_owned()),
        "{v1_names:?}"
    );
    assert!(v1_names.contains(&"grpc.reflection.v1.ServerReflection".to_owned()));
    assert!(
        v1_names.contains(&"runplane.runstore.v1.RunService".to_owned()),
        "{v1_names:?}"
    );

    let mut alpha = V1Alpha::new(channel);
    let request = tonic_reflection::pb::v1alpha::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(AlphaRequest::ListServices(String::new())),
    };
    let mut responses = alpha
        .server_reflection_info(futures::stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let Some(AlphaResponse::ListServicesResponse(list)) =
        responses.next().await.unwrap().unwrap().message_response
    else {
        panic!("v1alpha did not list services");
    };
    let alpha_names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        alpha_names.contains(&"grpc.health.v1.Health".to_owned()),
        "{alpha_names:?}"
    );
}

#[test]
fn errors_carry_a_stable_reason_in_error_info() {
    let status = status_with_reason(
        Code::FailedPrecondition,
        ErrorReason::RunTerminal,
        "run is terminal",
        [("verdict", "succeeded")],
    );
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(status.message(), "run is terminal");
    let info = error_info(&status).expect("error info attached");
    assert_eq!(info.reason, "RUN_TERMINAL");
    assert_eq!(info.domain, "runplane.dev");
    assert_eq!(
        info.metadata.get("verdict").map(String::as_str),
        Some("succeeded")
    );
}
