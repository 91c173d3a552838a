//! Connect and migrate on both backends, with a real migration.

use runplane_testkit::{TestDatabase, TestSqlite};
use sea_orm::{ConnectionTrait, Statement};
use sea_orm_migration::prelude::*;

struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![Box::new(CreateWidgets)]
    }
}

#[derive(DeriveMigrationName)]
struct CreateWidgets;

#[async_trait::async_trait]
impl MigrationTrait for CreateWidgets {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table("widgets")
                    .col(ColumnDef::new("id").string().not_null().primary_key())
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table("widgets").to_owned())
            .await
    }
}

async fn widgets_roundtrip(url: &str) {
    let db = runplane_db::connect_and_migrate::<Migrator>(url)
        .await
        .expect("first start migrates");
    db.execute_unprepared("INSERT INTO widgets (id) VALUES ('w1')")
        .await
        .expect("table exists");
    drop(db);

    // A restart finds the migration applied and the row kept.
    let db = runplane_db::connect_and_migrate::<Migrator>(url)
        .await
        .expect("second start is a no-op");
    let row = db
        .query_one_raw(Statement::from_string(
            db.get_database_backend(),
            "SELECT COUNT(*) AS n FROM widgets",
        ))
        .await
        .unwrap()
        .unwrap();
    let n: i64 = row.try_get("", "n").unwrap();
    assert_eq!(n, 1);
}

#[tokio::test]
async fn postgres_connects_and_migrates_once() {
    let test_db = TestDatabase::new().await;
    widgets_roundtrip(test_db.url()).await;
}

#[tokio::test]
async fn sqlite_creates_its_file_and_migrates_once() {
    let sqlite = TestSqlite::new();
    widgets_roundtrip(&sqlite.url()).await;
    assert!(sqlite.path().exists());
}

#[tokio::test]
async fn an_unknown_scheme_is_refused_by_name() {
    let err = runplane_db::connect("mysql://root:pw@localhost/x")
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "unsupported database url `mysql://root:***@localhost/x`: use postgres://… or sqlite://path"
    );
}

/// Replicas started together on a fresh Postgres migrate one at a time: while another
/// process holds the migration lock, a start waits, and it finishes once that one is
/// done. (Without the lock two replicas created the same tables at once and one failed
/// with a duplicate `pg_type` row.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_waits_for_another_replicas_migration_on_postgres() {
    let db = TestDatabase::new().await;
    let other = sea_orm::Database::connect(db.url()).await.unwrap();
    let holder = {
        use sea_orm::TransactionTrait;
        other.begin().await.unwrap()
    };
    holder
        .execute_unprepared(&format!(
            "SELECT pg_advisory_xact_lock({})",
            runplane_db::MIGRATION_LOCK
        ))
        .await
        .unwrap();
    let url = db.url().to_owned();
    let mut start =
        tokio::spawn(async move { runplane_db::connect_and_migrate::<Migrator>(&url).await });
    // It waits for the lock, however long the other migration takes.
    assert!(
        tokio::time::timeout(std::time::Duration::from_secs(2), &mut start)
            .await
            .is_err(),
        "migrated while another replica held the migration lock"
    );
    holder.commit().await.unwrap();
    start
        .await
        .unwrap()
        .expect("migrates once the other replica is done");

    // And several starting at once all come up.
    let starts: Vec<_> = (0..4)
        .map(|_| {
            let url = db.url().to_owned();
            tokio::spawn(async move { runplane_db::connect_and_migrate::<Migrator>(&url).await })
        })
        .collect();
    for start in starts {
        start.await.unwrap().expect("every replica starts");
    }
}
