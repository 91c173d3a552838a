//! A process frozen inside a transaction (a SIGSTOPped replica) must not hold its row
//! locks for ever: Postgres ends a session idle in a transaction after
//! `IDLE_IN_TRANSACTION_TIMEOUT_MS`, and another connection's write to the locked row
//! then goes through.

use std::time::Duration;

use runplane_testkit::TestDatabase;
use sea_orm::{ConnectionTrait, TransactionTrait};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_left_idle_loses_its_locks_to_other_writers() {
    let db = TestDatabase::new().await;
    let frozen = runplane_db::connect(db.url()).await.unwrap();
    let other = runplane_db::connect(db.url()).await.unwrap();
    other
        .execute_unprepared("CREATE TABLE slots (id TEXT PRIMARY KEY, n INT NOT NULL)")
        .await
        .unwrap();
    other
        .execute_unprepared("INSERT INTO slots VALUES ('a', 0)")
        .await
        .unwrap();

    // Takes the row's lock, then does nothing more: as a process stopped mid-transaction.
    let held = frozen.begin().await.unwrap();
    held.execute_unprepared("SELECT n FROM slots WHERE id = 'a' FOR UPDATE")
        .await
        .unwrap();

    let limit = Duration::from_millis(runplane_db::IDLE_IN_TRANSACTION_TIMEOUT_MS) * 4;
    tokio::time::timeout(
        limit,
        other.execute_unprepared("UPDATE slots SET n = n + 1 WHERE id = 'a'"),
    )
    .await
    .expect("the idle transaction's lock was released")
    .unwrap();
    drop(held);
}
