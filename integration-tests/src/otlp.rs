//! A minimal OTLP/gRPC receiver (traces and metric sums), for tests that check what
//! runplane exports and for `cargo run -p runplane-integration-tests --example
//! otlp-print`, which prints spans as they arrive.

use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::metrics::v1::metric;
use opentelemetry_proto::tonic::trace::v1::Span;
/// A span as received, with the `service.name` of the process that sent it.
#[derive(Debug, Clone)]
pub struct Received {
    pub service: String,
    pub span: Span,
}

/// One data point of a sum (counter) metric: the sender's `service.name`, the metric
/// name, its attributes and its value.
pub type SumPoint = (String, String, Vec<(String, String)>, f64);

#[derive(Default, Clone)]
pub struct Receiver {
    pub spans: Arc<Mutex<Vec<Received>>>,
    /// (service.name, metric name, attributes, value) of every sum data point.
    pub sums: Arc<Mutex<Vec<SumPoint>>>,
}

#[tonic::async_trait]
impl MetricsService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        let mut sums = self.sums.lock().unwrap();
        for resource_metrics in request.into_inner().resource_metrics {
            let service = resource_metrics
                .resource
                .as_ref()
                .and_then(|r| r.attributes.iter().find(|a| a.key == "service.name"))
                .map(|a| text(a.value.as_ref()))
                .unwrap_or_default();
            for scope in resource_metrics.scope_metrics {
                for m in scope.metrics {
                    let Some(metric::Data::Sum(sum)) = m.data else {
                        continue;
                    };
                    for point in sum.data_points {
                        let value = match point.value {
                            Some(opentelemetry_proto::tonic::metrics::v1::number_data_point::Value::AsInt(v)) => v as f64,
                            Some(opentelemetry_proto::tonic::metrics::v1::number_data_point::Value::AsDouble(v)) => v,
                            None => 0.0,
                        };
                        let attrs = point
                            .attributes
                            .iter()
                            .map(|kv| (kv.key.clone(), text(kv.value.as_ref())))
                            .collect();
                        sums.push((service.clone(), m.name.clone(), attrs, value));
                    }
                }
            }
        }
        Ok(tonic::Response::new(ExportMetricsServiceResponse::default()))
    }
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for resource_spans in request.into_inner().resource_spans {
            let service = resource_spans
                .resource
                .as_ref()
                .and_then(|r| r.attributes.iter().find(|a| a.key == "service.name"))
                .map(|a| text(a.value.as_ref()))
                .unwrap_or_default();
            for scope in resource_spans.scope_spans {
                for span in scope.spans {
                    spans.push(Received {
                        service: service.clone(),
                        span,
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

pub fn text(value: Option<&AnyValue>) -> String {
    match value.and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

pub fn attributes(span: &Span) -> impl Iterator<Item = &KeyValue> {
    span.attributes
        .iter()
        .chain(span.events.iter().flat_map(|e| e.attributes.iter()))
        .chain(span.links.iter().flat_map(|l| l.attributes.iter()))
}

pub fn attribute(span: &Span, key: &str) -> String {
    span.attributes
        .iter()
        .find(|a| a.key == key)
        .map(|a| text(a.value.as_ref()))
        .unwrap_or_default()
}

pub async fn start_receiver() -> (String, Receiver) {
    start_receiver_on("127.0.0.1:0").await
}

/// [`start_receiver`] on a chosen address (e.g. 127.0.0.1:4317, the OTLP default).
pub async fn start_receiver_on(addr: &str) -> (String, Receiver) {
    let receiver = Receiver::default();
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .expect("bind the OTLP receiver");
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let service = TraceServiceServer::new(receiver.clone());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .add_service(MetricsServiceServer::new(receiver.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    (endpoint, receiver)
}
