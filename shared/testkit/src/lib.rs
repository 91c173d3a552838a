//! Fixtures for tests that talk to the real Postgres and Redis.
//!
//! Each test gets its own Postgres database (created on the local server, dropped when
//! the fixture is dropped) or its own Redis key prefix (its keys deleted on drop), so the
//! suite runs in parallel. When a server is unreachable the fixture panics with the
//! command that starts it: these tests never skip.
//!
//! Overrides: `RUNPLANE_TEST_POSTGRES_URL` (an admin URL, default
//! `postgres://postgres@127.0.0.1:5432/postgres`) and `RUNPLANE_TEST_REDIS_URL` (default
//! `redis://127.0.0.1:6379`).

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};

use std::time::Duration;

use sea_orm::{ConnectOptions, ConnectionTrait, Database};

pub mod pki;

pub const DEFAULT_POSTGRES_ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";
pub const START_POSTGRES: &str =
    "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start";
pub const START_REDIS: &str =
    "redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save \"\" --appendonly no";

/// A refused connection fails in seconds, not after sqlx's default 30 s of retries.
fn admin_options(admin_url: &str) -> ConnectOptions {
    let mut options = ConnectOptions::new(admin_url.to_owned());
    options
        .max_connections(1)
        .connect_timeout(Duration::from_secs(3))
        .acquire_timeout(Duration::from_secs(3))
        .sqlx_logging(false);
    options
}

fn postgres_admin_url() -> String {
    std::env::var("RUNPLANE_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| DEFAULT_POSTGRES_ADMIN_URL.to_owned())
}

/// A fresh Postgres database for one test, dropped (with its connections) on drop.
#[derive(Debug)]
pub struct TestDatabase {
    name: String,
    url: String,
    admin_url: String,
}

impl TestDatabase {
    /// A database on the server `RUNPLANE_TEST_POSTGRES_URL` (or the local default) names.
    pub async fn new() -> Self {
        Self::on(postgres_admin_url()).await
    }

    /// A database on the server reached through `admin_url` (a user that may create
    /// databases). Panics with the start command when the server is unreachable.
    pub async fn on(admin_url: String) -> Self {
        let admin = Database::connect(admin_options(&admin_url)).await.unwrap_or_else(|e| {
            panic!(
                "Postgres is not reachable at {admin_url}: {e}\n\
                 start it with: {START_POSTGRES}\n\
                 (or point RUNPLANE_TEST_POSTGRES_URL at a server where this user may create databases)"
            )
        });
        let name = format!("rp_test_{}", uuid::Uuid::new_v4().simple());
        admin
            .execute_unprepared(&format!("CREATE DATABASE \"{name}\""))
            .await
            .unwrap_or_else(|e| panic!("CREATE DATABASE {name} on {admin_url}: {e}"));
        let _ = admin.close().await;
        let url = match admin_url.rsplit_once('/') {
            Some((server, _)) => format!("{server}/{name}"),
            None => panic!("RUNPLANE_TEST_POSTGRES_URL must end with /<database>"),
        };
        Self {
            name,
            url,
            admin_url,
        }
    }

    /// `postgres://…/rp_test_…` of this test's database.
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        // Drop runs outside any async context we can rely on; do it on a thread of its own.
        let admin_url = self.admin_url.clone();
        let name = self.name.clone();
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime for dropping the test database");
            rt.block_on(async {
                let admin = Database::connect(admin_options(&admin_url)).await?;
                admin
                    .execute_unprepared(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
                    .await?;
                admin.close().await
            })
        })
        .join();
        if let Ok(Err(e)) = dropped {
            eprintln!("testkit: could not drop test database {}: {e}", self.name);
        }
    }
}

/// A SQLite database file in a temporary directory, removed on drop.
#[derive(Debug)]
pub struct TestSqlite {
    dir: tempfile::TempDir,
}

impl TestSqlite {
    pub fn new() -> Self {
        Self {
            dir: tempfile::tempdir().expect("temporary directory for SQLite"),
        }
    }

    pub fn path(&self) -> PathBuf {
        self.dir.path().join("test.sqlite")
    }

    /// `sqlite://<path>`.
    pub fn url(&self) -> String {
        format!("sqlite://{}", self.path().display())
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Default for TestSqlite {
    fn default() -> Self {
        Self::new()
    }
}

/// A Redis key prefix of one test's own; its keys are deleted on drop.
#[derive(Debug)]
pub struct TestRedis {
    url: String,
    prefix: String,
}

impl TestRedis {
    /// A prefix on the server `RUNPLANE_TEST_REDIS_URL` (or the local default) names.
    pub async fn new() -> Self {
        Self::on(
            std::env::var("RUNPLANE_TEST_REDIS_URL")
                .unwrap_or_else(|_| DEFAULT_REDIS_URL.to_owned()),
        )
        .await
    }

    /// A prefix on the server at `url`. Panics with the start command when unreachable.
    pub async fn on(url: String) -> Self {
        let unreachable = |e: &dyn std::fmt::Display| -> ! {
            panic!("Redis is not reachable at {url}: {e}\nstart it with: {START_REDIS}")
        };
        let client = redis::Client::open(url.as_str()).unwrap_or_else(|e| unreachable(&e));
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .unwrap_or_else(|e| unreachable(&e));
        let pong: String = redis::cmd("PING")
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| unreachable(&e));
        assert_eq!(pong, "PONG");
        Self {
            prefix: format!("rp-test-{}:", uuid::Uuid::new_v4().simple()),
            url,
        }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// Every key the test writes starts with this.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Keys currently under the prefix.
    pub async fn keys(&self) -> Vec<String> {
        let client = redis::Client::open(self.url.as_str()).expect("redis url");
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("redis connection");
        scan_prefix(&mut conn, &self.prefix).await
    }
}

async fn scan_prefix(conn: &mut redis::aio::MultiplexedConnection, prefix: &str) -> Vec<String> {
    let mut keys = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(500)
            .query_async(conn)
            .await
            .expect("SCAN");
        keys.extend(batch);
        if next == 0 {
            return keys;
        }
        cursor = next;
    }
}

impl Drop for TestRedis {
    fn drop(&mut self) {
        let url = self.url.clone();
        let prefix = self.prefix.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime for cleaning test keys");
            rt.block_on(async {
                let Ok(client) = redis::Client::open(url.as_str()) else {
                    return;
                };
                let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
                    return;
                };
                let keys = scan_prefix(&mut conn, &prefix).await;
                if !keys.is_empty() {
                    let _: Result<(), _> = redis::cmd("DEL").arg(keys).query_async(&mut conn).await;
                }
            })
        })
        .join();
    }
}

/// A loopback address nobody listens on right now (the port may be taken later).
pub fn free_local_addr() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local addr")
}
