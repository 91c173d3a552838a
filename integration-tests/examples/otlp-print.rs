//! Prints every span an OTLP/gRPC exporter sends, one line each:
//! `cargo run -p runplane-integration-tests --example otlp-print [ADDR]` (default
//! 127.0.0.1:4317), then start runplane with OTEL_EXPORTER_OTLP_ENDPOINT=http://ADDR.

use std::time::Duration;

use runplane_integration_tests::otlp::{attribute, start_receiver_on};

#[tokio::main]
async fn main() {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:4317".to_owned());
    let (endpoint, receiver) = start_receiver_on(&addr).await;
    println!("OTLP receiver on {endpoint}");
    let mut printed = 0;
    loop {
        let spans = receiver.spans.lock().unwrap().clone();
        for r in spans.iter().skip(printed) {
            let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
            let run_id = attribute(&r.span, "run_id");
            println!(
                "{:<28} trace {} span {} parent {:<16} {}{}",
                r.service,
                hex(&r.span.trace_id),
                hex(&r.span.span_id),
                hex(&r.span.parent_span_id),
                r.span.name,
                if run_id.is_empty() {
                    String::new()
                } else {
                    format!(" run_id={run_id}")
                }
            );
        }
        printed = spans.len();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
