//! Latency and throughput of a batch of calls, driven from concurrent callers.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct Stats {
    pub rate: f64,
    pub p50: Duration,
    pub p99: Duration,
    pub max: Duration,
}

pub fn stats(mut latencies: Vec<Duration>, elapsed: Duration) -> Stats {
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() as f64 - 1.0) * q).round() as usize];
    Stats {
        rate: latencies.len() as f64 / elapsed.as_secs_f64(),
        p50: at(0.50),
        p99: at(0.99),
        max: *latencies.last().expect("at least one call"),
    }
}

/// Calls `f(i)` for `i` in `0..ops` from `callers` tasks (each its own share, in order);
/// returns the latency of every call, its result, and the wall time.
pub async fn drive<T, F, Fut>(ops: usize, callers: usize, f: F) -> (Stats, Vec<(Duration, T)>)
where
    T: Send + 'static,
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = T> + Send,
{
    let f = Arc::new(f);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..callers {
        let f = f.clone();
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::with_capacity(ops / callers + 1);
            for i in (c..ops).step_by(callers) {
                let t = Instant::now();
                let result = f(i).await;
                out.push((t.elapsed(), result));
            }
            out
        }));
    }
    let mut results = Vec::with_capacity(ops);
    for t in tasks {
        results.extend(t.await.unwrap());
    }
    let elapsed = started.elapsed();
    (
        stats(results.iter().map(|(d, _)| *d).collect(), elapsed),
        results,
    )
}

pub fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1000.0)
}
