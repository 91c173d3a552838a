//! Outbox delivery by several replicas over one table, on both backends: each row is
//! sent by one replica at a time, and a row whose claimant died is sent by another once
//! the claim lapses. "Replicas" are separate connection pools on the same database, each
//! running the real `deliver_due`; the interleavings are forced, not hoped for.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use runplane_db::outbox::{self, CLAIM_TIMEOUT, Delivery};
use runplane_testkit::{TestDatabase, TestSqlite};
use sea_orm::DatabaseConnection;
use sea_orm_migration::prelude::*;
use tokio::sync::{Notify, Semaphore};

struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![Box::new(CreateOutbox)]
    }
}

#[derive(DeriveMigrationName)]
struct CreateOutbox;

#[async_trait::async_trait]
impl MigrationTrait for CreateOutbox {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager.create_table(outbox::create_table()).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table("outbox").to_owned())
            .await
    }
}

const START_US: i64 = 1_000_000_000;

/// The callee: counts calls per idempotency key. A gated callee holds each call until
/// the test lets it through, and says when one arrived.
#[derive(Clone, Default)]
struct Callee {
    calls: Arc<Mutex<HashMap<String, u32>>>,
    arrived: Arc<Notify>,
}

impl Callee {
    fn calls(&self) -> HashMap<String, u32> {
        self.calls.lock().unwrap().clone()
    }

    async fn answer(&self, row: outbox::OutboxRow, gate: Option<&Semaphore>) -> Delivery {
        *self
            .calls
            .lock()
            .unwrap()
            .entry(row.idempotency_key)
            .or_default() += 1;
        self.arrived.notify_one();
        if let Some(gate) = gate {
            gate.acquire().await.unwrap().forget();
        }
        Delivery::Delivered
    }
}

async fn replica(url: &str) -> DatabaseConnection {
    runplane_db::connect_and_migrate::<Migrator>(url)
        .await
        .expect("database opens")
}

async fn enqueue(db: &DatabaseConnection, n: usize) -> Vec<String> {
    let mut keys = Vec::new();
    for i in 0..n {
        let key = format!("call-{i:03}");
        // Distinct creation times, so "oldest first" is one order.
        let row = outbox::row("test.call", key.clone(), vec![], START_US - 1000 + i as i64);
        assert!(outbox::enqueue(db, row).await.unwrap());
        keys.push(key);
    }
    keys
}

async fn undelivered(db: &DatabaseConnection) -> usize {
    outbox::all(db)
        .await
        .unwrap()
        .iter()
        .filter(|r| r.delivered_at_us.is_none())
        .count()
}

/// Replica A is mid-call on the oldest row while replica B runs a whole round: B must
/// send every other row and not A's. Then A finishes its round.
async fn two_replicas_send_each_row_once(url: &str) {
    let (a, b) = (replica(url).await, replica(url).await);
    let keys = enqueue(&a, 5).await;
    let callee = Callee::default();
    let gate = Arc::new(Semaphore::new(0));
    let now = || START_US;

    let round_a = tokio::spawn({
        let (callee, gate, a) = (callee.clone(), gate.clone(), a.clone());
        async move {
            outbox::deliver_due(&a, now, 100, |row| {
                let (callee, gate) = (callee.clone(), gate.clone());
                async move { callee.answer(row, Some(&gate)).await }
            })
            .await
            .unwrap()
        }
    });
    callee.arrived.notified().await;
    let sent_by_b = outbox::deliver_due(&b, now, 100, |row| {
        let callee = callee.clone();
        async move { callee.answer(row, None).await }
    })
    .await
    .unwrap();
    // Let A's held call (and any later one) through.
    gate.add_permits(keys.len());
    let sent_by_a = round_a.await.unwrap();

    let calls = callee.calls();
    for key in &keys {
        assert_eq!(
            calls.get(key),
            Some(&1),
            "{key} sent once; all calls: {calls:?}"
        );
    }
    assert_eq!(
        sent_by_a, 1,
        "A sent the row it held and nothing B had sent"
    );
    assert_eq!(sent_by_b, 4);
    assert_eq!(undelivered(&a).await, 0);
}

/// Replica A dies in the middle of a call (its round is dropped). Until A's claim
/// lapses nobody sends the row again; after, replica B does.
async fn a_dead_replicas_row_is_sent_after_its_claim_lapses(url: &str) {
    let (a, b) = (replica(url).await, replica(url).await);
    let keys = enqueue(&a, 1).await;
    let callee = Callee::default();
    let now = Arc::new(AtomicI64::new(START_US));
    let clock = || {
        let now = now.clone();
        move || now.load(Ordering::SeqCst)
    };

    let round_a = tokio::spawn({
        let (callee, a, clock) = (callee.clone(), a.clone(), clock());
        async move {
            let never = Semaphore::new(0);
            outbox::deliver_due(&a, clock, 100, |row| {
                let (callee, never) = (callee.clone(), &never);
                async move { callee.answer(row, Some(never)).await }
            })
            .await
        }
    });
    callee.arrived.notified().await;
    round_a.abort();
    assert!(round_a.await.unwrap_err().is_cancelled());

    let deliver_b = || {
        let callee = callee.clone();
        outbox::deliver_due(&b, clock(), 100, move |row| {
            let callee = callee.clone();
            async move { callee.answer(row, None).await }
        })
    };
    // Just before the claim lapses: still A's.
    now.fetch_add(CLAIM_TIMEOUT.as_micros() as i64 - 1, Ordering::SeqCst);
    assert_eq!(
        deliver_b().await.unwrap(),
        0,
        "the row is A's until its claim lapses"
    );
    assert_eq!(callee.calls().get(&keys[0]), Some(&1));

    now.fetch_add(1, Ordering::SeqCst);
    assert_eq!(
        deliver_b().await.unwrap(),
        1,
        "the lapsed claim is B's to send"
    );
    assert_eq!(callee.calls().get(&keys[0]), Some(&2));
    assert_eq!(undelivered(&b).await, 0);
}

/// A claimant whose call failed after its claim lapsed (and another replica took the
/// row) must not push the row back: the other replica's claim stands.
async fn a_late_failure_does_not_undo_a_newer_claim(url: &str) {
    let db = replica(url).await;
    enqueue(&db, 1).await;
    let claim_us = CLAIM_TIMEOUT.as_micros() as i64;
    let stale = outbox::claim_next(&db, START_US, claim_us)
        .await
        .unwrap()
        .expect("due");
    let newer = outbox::claim_next(&db, START_US + claim_us, claim_us)
        .await
        .unwrap()
        .expect("the first claim lapsed");
    outbox::delivery_failed(&db, &stale, START_US + claim_us + 1, "late")
        .await
        .unwrap();
    let row = outbox::all(&db).await.unwrap().remove(0);
    assert_eq!(row.next_attempt_at_us, newer.next_attempt_at_us);
    assert_eq!((row.attempts, row.last_error.as_str()), (0, ""));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_two_replicas_send_each_row_once() {
    let db = TestDatabase::new().await;
    two_replicas_send_each_row_once(db.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_two_replicas_send_each_row_once() {
    let db = TestSqlite::new();
    two_replicas_send_each_row_once(&db.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_dead_replicas_row_is_sent_after_its_claim_lapses() {
    let db = TestDatabase::new().await;
    a_dead_replicas_row_is_sent_after_its_claim_lapses(db.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_dead_replicas_row_is_sent_after_its_claim_lapses() {
    let db = TestSqlite::new();
    a_dead_replicas_row_is_sent_after_its_claim_lapses(&db.url()).await;
}

#[tokio::test]
async fn postgres_a_late_failure_does_not_undo_a_newer_claim() {
    let db = TestDatabase::new().await;
    a_late_failure_does_not_undo_a_newer_claim(db.url()).await;
}

#[tokio::test]
async fn sqlite_a_late_failure_does_not_undo_a_newer_claim() {
    let db = TestSqlite::new();
    a_late_failure_does_not_undo_a_newer_claim(&db.url()).await;
}
