//! Reconcile tick cost at 1k, 10k and 50k sandboxes on Postgres.
//!
//! The fake driver answers every probe after a fixed 1 ms (as a network probe would);
//! one sandbox in sixteen is reported lost (so the tick writes a loss stamp for it), the
//! rest alive. The table gives the tick's wall time, the database statements it ran (read
//! batches plus compare-and-set writes) per sandbox, and how the per-sandbox time scales
//! against 1k.
//!
//! Run: `cargo bench -p runplane-sandbox-reconciler --bench tick` (needs the local Postgres).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use runplane_sandbox::Probe;
use runplane_sandbox_reconciler::drivers::FakeDriver;
use runplane_sandbox_reconciler::reconcile::{ReconcileSettings, Reconciler};
use runplane_sandbox_reconciler::store::entities::sandbox;
use runplane_sandbox_reconciler::store::{Migrator, Store};
use runplane_testkit::TestDatabase;
use sea_orm::{ConnectionTrait, EntityTrait, IntoActiveModel};

const PROBE_LATENCY: Duration = Duration::from_millis(1);

#[tokio::main]
async fn main() {
    let test_db = TestDatabase::new().await;
    let mut db = runplane_db::connect_and_migrate::<Migrator>(test_db.url())
        .await
        .unwrap();
    let statements = Arc::new(AtomicU64::new(0));
    let counter = statements.clone();
    db.set_metric_callback(move |_| {
        counter.fetch_add(1, Ordering::Relaxed);
    });
    let store = Store::new(db.clone(), runplane_clock::SystemClock::shared());
    let driver = FakeDriver::new(|row| {
        Box::pin(async move {
            tokio::time::sleep(PROBE_LATENCY).await;
            if row.id.ends_with('0') {
                Probe::Lost
            } else {
                Probe::Alive
            }
        })
    });
    let settings = ReconcileSettings::default();
    let reconciler = Reconciler::new(store.clone(), Arc::new(driver), settings.clone());

    println!(
        "reconcile tick on Postgres: fake driver, {} ms probes, {} in flight, batches of {}",
        PROBE_LATENCY.as_millis(),
        settings.probe_concurrency,
        settings.batch
    );
    println!(
        "{:>9} | {:>10} {:>12} | {:>10} {:>14} | {:>8} | {:>8}",
        "sandboxes", "tick ms", "µs/sandbox", "statements", "stmts/sandbox", "stamped", "scaling"
    );
    let mut base_per_sandbox: Option<f64> = None;
    for n in [1_000usize, 10_000, 50_000] {
        db.execute_unprepared("DELETE FROM sandboxes")
            .await
            .unwrap();
        let now = store.now_us();
        let rows: Vec<_> = (0..n)
            .map(|i| sandbox::Model {
                id: uuid::Uuid::new_v4().to_string(),
                run_id: format!("run-{i}"),
                org_id: "bench".into(),
                client_request_id: format!("bench-{n}-{i}"),
                substrate: "direct".into(),
                status: sandbox::SandboxStatus::Started,
                active_node_id: Some("node".into()),
                execution_generation: 1,
                loss_observed_at_us: None,
                idle_timeout_ms: 0,
                exit_code: None,
                driver_handle: String::new(),
                observation_seq: 0,
                observed_status: String::new(),
                created_at_us: now,
                updated_at_us: now,
                traceparent: String::new(),
                network: String::new(),
                limits: String::new(),
                image: String::new(),
                paused: 0,
                attempt: 1,
            })
            .collect();
        for chunk in rows.chunks(1000) {
            sandbox::Entity::insert_many(
                chunk
                    .iter()
                    .cloned()
                    .map(IntoActiveModel::into_active_model),
            )
            .exec_without_returning(&db)
            .await
            .unwrap();
        }
        statements.store(0, Ordering::Relaxed);
        let started = Instant::now();
        let report = reconciler.tick().await.unwrap();
        let elapsed = started.elapsed();
        let used = statements.load(Ordering::Relaxed);
        assert_eq!(report.probed as usize, n);
        let per_sandbox = elapsed.as_secs_f64() * 1e6 / n as f64;
        let scaling = per_sandbox / *base_per_sandbox.get_or_insert(per_sandbox);
        println!(
            "{:>9} | {:>10.0} {:>12.1} | {:>10} {:>14.3} | {:>8} | {:>7.2}x",
            n,
            elapsed.as_secs_f64() * 1000.0,
            per_sandbox,
            used,
            used as f64 / n as f64,
            report.stamped,
            scaling
        );
    }
}
