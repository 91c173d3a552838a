//! Logs and traces for every runplane process.
//!
//! - Logs go to stderr (stdout belongs to CLI output), `info` by default, `RUST_LOG`
//!   overrides, text or JSON.
//! - Traces are exported over OTLP/gRPC when `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//!   `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set; the standard `OTEL_*` variables
//!   configure the exporter. The W3C trace-context propagator is always installed, so
//!   context crosses gRPC hops even when this process exports nothing.
//! - Metrics ([`metrics`]) are exported over OTLP/gRPC on the same endpoint (or
//!   `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`) every `OTEL_METRIC_EXPORT_INTERVAL` ms
//!   (default 60 s); without an endpoint the instruments are no-ops.
//! - [`Telemetry::shutdown`] (or drop) flushes spans and metrics still buffered.

pub mod metrics;

use std::io::IsTerminal;

use opentelemetry::propagation::TextMapCompositePropagator;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use opentelemetry_sdk::propagation::{BaggagePropagator, TraceContextPropagator};
use opentelemetry_sdk::trace::SdkTracerProvider;
use runplane_config::LogFormat;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Directives used when `RUST_LOG` is unset: runplane at info, chatty dependencies quieter.
pub const DEFAULT_FILTER: &str =
    "info,h2=warn,hyper=warn,hyper_util=warn,tower=warn,sqlx=warn,sea_orm=warn,opentelemetry=warn";

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("invalid RUST_LOG: {0}")]
    Filter(String),
    #[error("could not build the OTLP span exporter: {0}")]
    Exporter(String),
    #[error("could not build the OTLP metric exporter: {0}")]
    MetricExporter(String),
    #[error("a global tracing subscriber is already installed")]
    AlreadyInstalled,
}

/// What [`init`] needs to know.
#[derive(Debug, Clone)]
pub struct TelemetryOptions {
    /// `service.name` of exported spans unless `OTEL_SERVICE_NAME` says otherwise.
    pub service_name: String,
    pub log_format: LogFormat,
}

/// Keeps the tracer provider alive; flushes it on shutdown or drop.
#[derive(Debug)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    meters: Option<SdkMeterProvider>,
}

impl Telemetry {
    /// True when spans are exported over OTLP.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Flushes and stops span export.
    pub fn shutdown(mut self) {
        self.flush_and_stop();
    }

    fn flush_and_stop(&mut self) {
        if let Some(meters) = self.meters.take() {
            if let Err(e) = meters.force_flush() {
                eprintln!("runplane: flushing metrics failed: {e}");
            }
            let _ = meters.shutdown();
        }
        if let Some(provider) = self.provider.take() {
            if let Err(e) = provider.force_flush() {
                eprintln!("runplane: flushing spans failed: {e}");
            }
            if let Err(e) = provider.shutdown() {
                eprintln!("runplane: stopping span export failed: {e}");
            }
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        self.flush_and_stop();
    }
}

/// Installs the W3C trace-context (and baggage) propagator as the global one.
pub fn install_propagator() {
    opentelemetry::global::set_text_map_propagator(TextMapCompositePropagator::new(vec![
        Box::new(TraceContextPropagator::new()),
        Box::new(BaggagePropagator::new()),
    ]));
}

fn env_set(name: &str) -> bool {
    std::env::var(name).is_ok_and(|s| !s.trim().is_empty())
}

fn otlp_configured() -> bool {
    [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ]
    .iter()
    .any(|v| std::env::var(v).is_ok_and(|s| !s.trim().is_empty()))
}

/// Installs the global subscriber and, when configured, OTLP export. Call once, inside a
/// tokio runtime (the OTLP exporter's channel needs one).
pub fn init(options: &TelemetryOptions) -> Result<Telemetry, TelemetryError> {
    install_propagator();

    let filter = match std::env::var("RUST_LOG") {
        Ok(directives) if !directives.trim().is_empty() => {
            EnvFilter::try_new(&directives).map_err(|e| TelemetryError::Filter(e.to_string()))?
        }
        _ => EnvFilter::new(DEFAULT_FILTER),
    };

    let mut resource = Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name(options.service_name.clone());
    }
    let resource = resource.build();
    let meters = if otlp_configured() || env_set("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") {
        let exporter = opentelemetry_otlp::MetricExporter::builder()
            .with_tonic()
            .build()
            .map_err(|e| TelemetryError::MetricExporter(e.to_string()))?;
        let meters = SdkMeterProvider::builder()
            .with_periodic_exporter(exporter)
            .with_resource(resource.clone())
            .build();
        opentelemetry::global::set_meter_provider(meters.clone());
        Some(meters)
    } else {
        None
    };
    let provider = if otlp_configured() {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()
            .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
        Some(
            SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_resource(resource)
                .build(),
        )
    } else {
        None
    };
    let otel_layer = provider
        .as_ref()
        .map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer("runplane")));

    let registry = tracing_subscriber::registry().with(filter).with(otel_layer);
    let installed = match options.log_format {
        LogFormat::Text => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .with_ansi(std::io::stderr().is_terminal())
                    .with_writer(std::io::stderr),
            )
            .try_init(),
        LogFormat::Json => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .with_current_span(true)
                    .with_writer(std::io::stderr),
            )
            .try_init(),
    };
    installed.map_err(|_| TelemetryError::AlreadyInstalled)?;
    if let Some(p) = &provider {
        opentelemetry::global::set_tracer_provider(p.clone());
    }
    Ok(Telemetry { provider, meters })
}
