//! Fixtures for tests that talk to the real Postgres and Redis.
//!
//! Each test gets its own Postgres database (created on the local server, dropped when
//! the fixture is dropped) or its own Redis key prefix (its keys deleted on drop), so the
//! suite runs in parallel. When a server is unreachable the fixture panics with the
//! command that starts it: these tests never skip.
//!
//! Beside them: [`authed`] requests, the [`config`]s tests start services with, and, with
//! the `run-store` feature, a run store served in process ([`run_store`]).
//!
//! Overrides: `RUNPLANE_TEST_POSTGRES_URL` (an admin URL, default
//! `postgres://postgres@127.0.0.1:5432/postgres`), `RUNPLANE_TEST_REDIS_URL` (default
//! `redis://127.0.0.1:6379`) and `RUNPLANE_TEST_REDIS_CLUSTER_URL` (default the local
//! 3-master cluster of `scripts/redis-cluster`).

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};

use std::time::Duration;

use sea_orm::{ConnectOptions, ConnectionTrait, Database};

mod auth;
pub mod config;
pub mod pki;
#[cfg(feature = "run-store")]
pub mod run_store;

pub use auth::authed;

/// The service token (`auth.service_token`) of in-process test harnesses: what their
/// services call each other with, and what their fakes of a service must accept.
pub const SERVICE_TOKEN: &str = "harness-service-token-0123456789abcdef0123";

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

/// The database a suite's test runs on. A suite written with [`on_both_backends!`] runs
/// each of its tests once on each: Postgres, as deployments run, and SQLite, as
/// `runplane dev` does.
#[derive(Debug)]
pub enum Backend {
    Postgres(TestDatabase),
    Sqlite(TestSqlite),
    /// Another replica's database, by URL (the first replica's fixture owns it).
    Shared(String),
}

impl Backend {
    pub async fn postgres() -> Self {
        Backend::Postgres(TestDatabase::new().await)
    }

    pub async fn sqlite() -> Self {
        Backend::Sqlite(TestSqlite::new())
    }

    pub fn url(&self) -> String {
        match self {
            Backend::Postgres(db) => db.url().to_owned(),
            Backend::Sqlite(db) => db.url(),
            Backend::Shared(url) => url.clone(),
        }
    }
}

/// One suite, both backends: `on_both_backends!(World::start => test_a, test_b)` makes
/// `postgres::test_a`, `sqlite::test_a`, … each calling `test_a(World::start(backend)
/// .await)` on a fresh database of its own, on a two-thread runtime (`workers 4, …`
/// gives tests that race several tasks four).
#[macro_export]
macro_rules! on_both_backends {
    ($fixture:ident :: $start:ident => $($name:ident),* $(,)?) => {
        $crate::on_both_backends!(workers 2, $fixture::$start => $($name),*);
    };
    (workers $workers:literal, $fixture:ident :: $start:ident => $($name:ident),* $(,)?) => {
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = $workers)]
                async fn $name() {
                    super::$name(super::$fixture::$start($crate::Backend::postgres().await).await).await
                }
            )*
        }
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = $workers)]
                async fn $name() {
                    super::$name(super::$fixture::$start($crate::Backend::sqlite().await).await).await
                }
            )*
        }
    };
}

/// The local 3-master cluster `scripts/redis-cluster` starts (and `scripts/test` runs).
pub const DEFAULT_REDIS_CLUSTER_URL: &str =
    "redis+cluster://127.0.0.1:7379,127.0.0.1:7380,127.0.0.1:7381";
pub const START_REDIS_CLUSTER: &str = "scripts/redis-cluster";

/// A Redis key prefix of one test's own, on one server or a cluster; its keys are
/// deleted on drop.
#[derive(Debug)]
pub struct TestRedis {
    url: String,
    /// The servers that hold the keys: the one server, or every master of the cluster.
    nodes: Vec<String>,
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
            nodes: vec![url.clone()],
            url,
        }
    }

    /// A prefix on the Redis Cluster `RUNPLANE_TEST_REDIS_CLUSTER_URL` names (default: the
    /// local one `scripts/redis-cluster` starts). Panics with the start command when the
    /// cluster is unreachable or not healthy.
    pub async fn cluster() -> Self {
        let url = std::env::var("RUNPLANE_TEST_REDIS_CLUSTER_URL")
            .unwrap_or_else(|_| DEFAULT_REDIS_CLUSTER_URL.to_owned());
        let hosts = url.strip_prefix("redis+cluster://").unwrap_or_else(|| {
            panic!("RUNPLANE_TEST_REDIS_CLUSTER_URL must be redis+cluster://host:port,...: {url}")
        });
        let seeds: Vec<String> = hosts.split(',').map(|h| format!("redis://{h}")).collect();
        let mut nodes = Vec::new();
        for seed in &seeds {
            let unhealthy = |e: &dyn std::fmt::Display| -> ! {
                panic!(
                    "the Redis Cluster is not reachable at {seed}: {e}\nstart it with: {START_REDIS_CLUSTER}"
                )
            };
            let client = redis::Client::open(seed.as_str()).unwrap_or_else(|e| unhealthy(&e));
            let mut conn = client
                .get_multiplexed_async_connection()
                .await
                .unwrap_or_else(|e| unhealthy(&e));
            let info: String = redis::cmd("CLUSTER")
                .arg("INFO")
                .query_async(&mut conn)
                .await
                .unwrap_or_else(|e| unhealthy(&e));
            if !info.contains("cluster_state:ok") {
                unhealthy(&"cluster_state is not ok");
            }
            // Every master holds keys; with replicas, the masters are the seeds' owners.
            let role: Vec<redis::Value> = redis::cmd("ROLE")
                .query_async(&mut conn)
                .await
                .unwrap_or_else(|e| unhealthy(&e));
            if matches!(role.first(), Some(redis::Value::BulkString(b)) if b == b"master") {
                nodes.push(seed.clone());
            }
        }
        Self {
            prefix: format!("rp-test-{}:", uuid::Uuid::new_v4().simple()),
            nodes,
            url,
        }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// Each server that holds keys, as a `redis://` URL to it alone.
    pub fn nodes(&self) -> &[String] {
        &self.nodes
    }

    /// Every key the test writes starts with this.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Keys currently under the prefix, on every node.
    pub async fn keys(&self) -> Vec<String> {
        let mut keys = Vec::new();
        for node in &self.nodes {
            let client = redis::Client::open(node.as_str()).expect("redis url");
            let mut conn = client
                .get_multiplexed_async_connection()
                .await
                .expect("redis connection");
            keys.extend(scan_prefix(&mut conn, &self.prefix).await);
        }
        keys
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
        let nodes = self.nodes.clone();
        let prefix = self.prefix.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime for cleaning test keys");
            rt.block_on(async {
                for node in nodes {
                    let Ok(client) = redis::Client::open(node.as_str()) else {
                        continue;
                    };
                    let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
                        continue;
                    };
                    // One DEL per key: a cluster node refuses a DEL whose keys span slots.
                    let mut pipe = redis::pipe();
                    for key in scan_prefix(&mut conn, &prefix).await {
                        pipe.cmd("DEL").arg(key).ignore();
                    }
                    let _: Result<(), _> = pipe.query_async(&mut conn).await;
                }
            })
        })
        .join();
    }
}

/// A loopback address nobody listens on right now, for a process a test starts to bind.
///
/// A port the kernel hands out for `:0` comes from its ephemeral range, the range every
/// outbound connection (to Postgres, Redis, a gRPC server) takes its local port from, so
/// between this call and the child's bind such a connection could take it. These ports
/// come from below that range, where no connection's local port ever lands. Each one is
/// reserved for the life of the calling process with a lock on a file named after it
/// (`$TMPDIR/runplane-test-ports/<port>`), so concurrent test processes never pick the
/// same one; a lock dies with its process. A port found in use is passed over.
pub fn free_local_addr() -> SocketAddr {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU32, Ordering};
    const FLOOR: u32 = 10_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    type Reserved = nix::fcntl::Flock<std::fs::File>;
    static RESERVED: Mutex<Vec<Reserved>> = Mutex::new(Vec::new());
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    let span = ephemeral_low.saturating_sub(FLOOR);
    let locks = std::env::temp_dir().join("runplane-test-ports");
    if span > 0 && std::fs::create_dir_all(&locks).is_ok() {
        // Processes start their walk at different places, so they rarely meet at all.
        let start = std::process::id().wrapping_mul(2_654_435_761) % span;
        for _ in 0..span {
            let offset = (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
            let port = u16::try_from(FLOOR + offset).expect("below the ephemeral range");
            let Ok(lock) = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(locks.join(port.to_string()))
            else {
                continue;
            };
            let Ok(lock) =
                nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusiveNonblock)
            else {
                continue;
            };
            if let Ok(listener) = TcpListener::bind(("127.0.0.1", port)) {
                RESERVED.lock().expect("reserved ports").push(lock);
                return listener.local_addr().expect("local addr");
            }
        }
    }
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local addr")
}

#[cfg(test)]
mod tests {
    use super::free_local_addr;

    /// Addresses for children to bind lie below the kernel's ephemeral range, where no
    /// outbound connection takes its local port, and one process never gets one twice.
    #[test]
    fn free_addresses_are_below_the_ephemeral_range_and_not_repeated() {
        let low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let ports: Vec<u16> = (0..64).map(|_| free_local_addr().port()).collect();
        assert!(
            ports.iter().all(|p| *p < low),
            "{ports:?} (ephemeral from {low})"
        );
        let distinct: std::collections::BTreeSet<_> = ports.iter().collect();
        assert_eq!(distinct.len(), ports.len(), "{ports:?}");
    }

    /// A port handed out stays reserved: another process (here, another open of its lock
    /// file, which flock treats the same) cannot take its lock.
    #[test]
    fn a_handed_out_port_is_locked_against_other_processes() {
        let port = free_local_addr().port();
        let file = std::fs::File::open(
            std::env::temp_dir()
                .join("runplane-test-ports")
                .join(port.to_string()),
        )
        .unwrap();
        let taken = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock);
        assert!(taken.is_err(), "port {port} was not reserved");
    }
}
