//! The fixtures isolate tests, clean up after them, and fail loudly instead of skipping.

use runplane_testkit::{TestDatabase, TestRedis};
use sea_orm::{ConnectionTrait, Database, Statement};

async fn database_exists(name: &str) -> bool {
    let admin = Database::connect(runplane_testkit::DEFAULT_POSTGRES_ADMIN_URL)
        .await
        .unwrap();
    let row = admin
        .query_one_raw(Statement::from_string(
            admin.get_database_backend(),
            format!("SELECT COUNT(*) AS n FROM pg_database WHERE datname = '{name}'"),
        ))
        .await
        .unwrap()
        .unwrap();
    row.try_get::<i64>("", "n").unwrap() == 1
}

#[tokio::test]
async fn each_test_database_is_its_own_and_is_dropped_after() {
    let a = TestDatabase::new().await;
    let b = TestDatabase::new().await;
    assert_ne!(a.name(), b.name());
    assert!(database_exists(a.name()).await);
    // An open connection must not keep the database alive past the fixture.
    let held = Database::connect(a.url()).await.unwrap();
    let name = a.name().to_owned();
    drop(a);
    assert!(!database_exists(&name).await);
    drop(held);
    drop(b);
}

#[tokio::test]
#[should_panic(expected = "start it with: pg_ctlcluster")]
async fn an_unreachable_postgres_fails_with_the_start_command() {
    TestDatabase::on("postgres://postgres@127.0.0.1:1/postgres".to_owned()).await;
}

#[tokio::test]
async fn redis_keys_under_the_prefix_are_deleted_after() {
    let redis_fixture = TestRedis::new().await;
    let prefix = redis_fixture.prefix().to_owned();
    let client = redis::Client::open(redis_fixture.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    for i in 0..3 {
        let _: () = redis::cmd("SET")
            .arg(format!("{prefix}k{i}"))
            .arg("v")
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    assert_eq!(redis_fixture.keys().await.len(), 3);
    drop(redis_fixture);
    let left: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(left.is_empty(), "{left:?}");
}

#[tokio::test]
#[should_panic(expected = "start it with: redis-server")]
async fn an_unreachable_redis_fails_with_the_start_command() {
    TestRedis::on("redis://127.0.0.1:1".to_owned()).await;
}
