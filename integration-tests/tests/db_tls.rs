//! TLS and passwords to the stores, through runplane's own connection code: a Redis that
//! speaks only TLS and wants a password holds the stream recovery store's leases and
//! frames when `redis_url` is `rediss://:PASSWORD@…` and `redis_ca_file` names the CA
//! that signed it, and refuses a wrong password (the error never shows it), plaintext
//! and an unrelated CA; a PostgreSQL that admits only TLS (`hostssl` alone in pg_hba)
//! runs the run store's migrations over `sslmode=verify-full&sslrootcert=…` and refuses
//! `sslmode=disable` and an unrelated CA.
//!
//! Each test starts its own server from Debian's packages (`redis-server`, PostgreSQL's
//! `initdb` and `pg_ctl`) on a free port with a fresh test CA, and stops it and removes
//! its files when it ends, passing or not. A missing tool fails the test, naming the
//! package that brings it.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use runplane_clock::SystemClock;
use runplane_config::Config;
use runplane_stream_recovery::domain::policy::BufferLimits;
use runplane_stream_recovery::store::RecoveryStore;
use runplane_stream_recovery::store::redis::RedisStore;
use runplane_testkit::pki::TestPki;
use sea_orm::{ConnectionTrait, Statement};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const PASSWORD: &str = "tls-test-pw-7c1e9b";
const OPERATOR_TOKEN: &str = "integration-test-operator-token-0123456789";

fn path(p: &Path) -> String {
    p.display().to_string()
}

/// The CA, the server's certificate and key (for `localhost` and `127.0.0.1`) and an
/// unrelated CA, as files in `dir`.
struct Certs {
    ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    rogue_ca: PathBuf,
}

fn certs_in(dir: &Path) -> Certs {
    let pki = TestPki::generate();
    let files = pki.write_to(dir);
    let rogue_ca = dir.join("rogue-ca.pem");
    std::fs::write(&rogue_ca, &pki.rogue_ca.cert).expect("write the unrelated CA");
    Certs {
        ca: files.ca_cert,
        server_cert: files.server_cert,
        server_key: files.server_key,
        rogue_ca,
    }
}

/// `tool` on the PATH, or a failure naming the package that brings it.
fn require_tool(tool: &str, package: &str) {
    let found = std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(tool).is_file()));
    assert!(
        found,
        "{tool} is not installed: this test starts its own server with it (apt-get install {package})"
    );
}

// --- Redis --------------------------------------------------------------------------

/// A `redis-server` listening only on a TLS port with `--requirepass`; killed, and its
/// directory removed, when dropped.
struct TlsRedis {
    _server: Child,
    port: u16,
    certs: Certs,
    _dir: tempfile::TempDir,
}

impl TlsRedis {
    async fn start() -> Self {
        require_tool("redis-server", "redis-server");
        let dir = tempfile::tempdir().expect("temp dir");
        let certs = certs_in(dir.path());
        let port = runplane_testkit::free_local_addr().port();
        let mut server = Command::new("redis-server")
            .args(["--port", "0", "--bind", "127.0.0.1"])
            .args(["--tls-port", &port.to_string()])
            .args(["--tls-cert-file", &path(&certs.server_cert)])
            .args(["--tls-key-file", &path(&certs.server_key)])
            .args(["--tls-ca-cert-file", &path(&certs.ca)])
            .args(["--tls-auth-clients", "no"])
            .args(["--requirepass", PASSWORD])
            .args(["--save", "", "--appendonly", "no"])
            .args(["--dir", &path(dir.path())])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("start redis-server");
        // It says so on stdout once it accepts connections; a build without TLS exits
        // at once, complaining about the unknown --tls-port.
        let mut lines = BufReader::new(server.stdout.take().expect("stdout")).lines();
        let mut seen = String::new();
        let ready = tokio::time::timeout(Duration::from_secs(30), async {
            while let Ok(Some(line)) = lines.next_line().await {
                seen.push_str(&line);
                seen.push('\n');
                if line.contains("Ready to accept connections") {
                    return true;
                }
            }
            false
        })
        .await;
        assert!(
            matches!(ready, Ok(true)),
            "redis-server with TLS did not start (a build without TLS refuses --tls-port; \
             Debian's redis-server has it):\n{seen}"
        );
        // Keep draining its log so a chatty server never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        TlsRedis {
            _server: server,
            port,
            certs,
            _dir: dir,
        }
    }

    fn config(&self, url: String, ca: &Path) -> Config {
        let mut config = runplane_testkit::config::with_operator(OPERATOR_TOKEN);
        config.stream_recovery.redis_url = url;
        config.stream_recovery.redis_ca_file = path(ca);
        config.stream_recovery.key_prefix = format!("tls-test-{}:", uuid::Uuid::new_v4());
        config
    }

    fn url(&self, password: &str) -> String {
        format!("rediss://:{password}@127.0.0.1:{}", self.port)
    }
}

/// `RedisStore::open` of `config`, bounded so a wedged handshake fails the test.
async fn open_store(config: &Config) -> Result<RedisStore, String> {
    tokio::time::timeout(
        Duration::from_secs(60),
        RedisStore::open(&config.stream_recovery),
    )
    .await
    .map_err(|_| "RedisStore::open did not finish in 60 s".to_owned())?
    .map_err(|e| e.to_string())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_stream_recovery_store_keeps_a_stream_on_a_redis_behind_tls_and_a_password() {
    let redis = TlsRedis::start().await;
    let config = redis.config(redis.url(PASSWORD), &redis.certs.ca);
    config.validate().expect("rediss:// with its CA file loads");
    let store = open_store(&config).await.expect("open over TLS");

    let run = uuid::Uuid::new_v4().to_string();
    let now = 1_700_000_000_000;
    let lease = store
        .acquire(&run, "controller-1", "token-1", 30_000, now, 1)
        .await
        .expect("a lease over TLS");
    assert_eq!(lease.next_sequence, 1);
    let limits = BufferLimits {
        max_frames: 100,
        stream_bytes: 1 << 20,
        org_hour_bytes: 1 << 20,
        org_buffer_bytes: 1 << 20,
        ttl: Duration::from_secs(600),
    };
    store
        .append(
            &run,
            &lease.token,
            &[(1, b"over tls".to_vec())],
            now,
            &limits,
            false,
        )
        .await
        .expect("a frame stored over TLS");
    let replay = store.read(&run, 1, 10).await.expect("read back over TLS");
    assert_eq!(replay.frames.len(), 1);
    assert_eq!(replay.frames[0].data, b"over tls");
    store.forget(&run).await.expect("forget the run");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_redis_password_is_refused_without_showing_it() {
    let redis = TlsRedis::start().await;
    let wrong = "wrong-pw-4d2a8f";
    let config = redis.config(redis.url(wrong), &redis.certs.ca);
    let err = open_store(&config).await.expect_err("a wrong password");
    assert!(!err.contains(wrong), "{err}");
    assert!(
        err.to_lowercase().contains("authentication failed"),
        "the error says the password was refused: {err}"
    );

    // The coordinator's own start says which store it could not reach, redacted.
    let err = runplane_stream_recovery::StreamRecovery::open(&config, SystemClock::shared())
        .await
        .expect_err("the coordinator cannot open its store");
    let message = err.to_string();
    assert!(!message.contains(wrong), "{message}");
    assert!(
        message.contains(&format!("rediss://:***@127.0.0.1:{}", redis.port)),
        "{message}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tls_redis_refuses_plaintext_and_a_server_the_ca_did_not_sign_is_refused() {
    let redis = TlsRedis::start().await;

    let mut plain = redis.config(
        format!("redis://:{PASSWORD}@127.0.0.1:{}", redis.port),
        &redis.certs.ca,
    );
    plain.stream_recovery.redis_ca_file.clear();
    let err = open_store(&plain)
        .await
        .expect_err("plaintext to a TLS port");
    assert!(!err.contains(PASSWORD), "{err}");

    let rogue = redis.config(redis.url(PASSWORD), &redis.certs.rogue_ca);
    let err = open_store(&rogue)
        .await
        .expect_err("a server certificate the named CA did not sign");
    assert!(!err.contains(PASSWORD), "{err}");
    assert!(err.contains("invalid peer certificate"), "{err}");
}

// --- PostgreSQL ---------------------------------------------------------------------

/// A PostgreSQL cluster of its own, initialised as the `postgres` user in a temporary
/// directory, listening on 127.0.0.1 with `ssl = on` and `hostssl` alone in pg_hba;
/// stopped (immediate) and removed when dropped.
struct TlsPostgres {
    bin: PathBuf,
    data: PathBuf,
    port: u16,
    certs: Certs,
    _dir: tempfile::TempDir,
}

/// The newest PostgreSQL's binaries under /usr/lib/postgresql.
fn postgres_bin() -> PathBuf {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = entry.path().join("bin");
            bin.join("initdb").is_file().then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, bin)| bin)
        .expect("no PostgreSQL under /usr/lib/postgresql/*/bin: this test starts its own cluster with initdb and pg_ctl (apt-get install postgresql)")
}

/// Runs `program args` as the `postgres` user, failing with its output when it fails.
fn as_postgres(program: &Path, args: &[&str]) {
    require_tool("runuser", "util-linux");
    let output = std::process::Command::new("runuser")
        .args(["-u", "postgres", "--"])
        .arg(program)
        .args(args)
        .output()
        .expect("run runuser");
    assert!(
        output.status.success(),
        "{} {args:?} as postgres failed: {}{}",
        program.display(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

fn chown_postgres(path: &Path) {
    let status = std::process::Command::new("chown")
        .args(["-R", "postgres:postgres"])
        .arg(path)
        .status()
        .expect("run chown");
    assert!(status.success(), "chown postgres {}", path.display());
}

impl TlsPostgres {
    fn start() -> Self {
        let bin = postgres_bin();
        let dir = tempfile::tempdir().expect("temp dir");
        let certs = certs_in(dir.path());
        let data = dir.path().join("data");
        let port = runplane_testkit::free_local_addr().port();
        chown_postgres(dir.path());
        // PostgreSQL refuses a key others can read.
        let chmod = std::process::Command::new("chmod")
            .arg("600")
            .arg(&certs.server_key)
            .status()
            .expect("run chmod");
        assert!(chmod.success());
        as_postgres(
            &bin.join("initdb"),
            &[
                "-D",
                &path(&data),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
            ],
        );
        let settings = format!(
            "listen_addresses = '127.0.0.1'\nport = {port}\nunix_socket_directories = '{dir}'\n\
             ssl = on\nssl_cert_file = '{cert}'\nssl_key_file = '{key}'\nfsync = off\n",
            dir = path(dir.path()),
            cert = path(&certs.server_cert),
            key = path(&certs.server_key),
        );
        append(&data.join("postgresql.conf"), &settings);
        // Over TCP only TLS connections have an entry: a plaintext one is refused.
        std::fs::write(
            data.join("pg_hba.conf"),
            "hostssl all all 127.0.0.1/32 trust\n",
        )
        .expect("write pg_hba.conf");
        let postgres = TlsPostgres {
            bin,
            data,
            port,
            certs,
            _dir: dir,
        };
        let log = path(&postgres.data.join("server.log"));
        as_postgres(
            &postgres.bin.join("pg_ctl"),
            &["-D", &path(&postgres.data), "-l", &log, "-w", "start"],
        );
        postgres
    }

    fn url(&self, query: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres?{query}",
            self.port
        )
    }
}

impl Drop for TlsPostgres {
    fn drop(&mut self) {
        // Best effort: a failure here must not hide the test's own.
        let _ = std::process::Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(self.bin.join("pg_ctl"))
            .args(["-D", &path(&self.data), "-m", "immediate", "-w", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

fn append(file: &Path, text: &str) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(file)
        .expect("open postgresql.conf");
    f.write_all(text.as_bytes()).expect("append settings");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_run_store_migrates_over_verified_tls_and_plaintext_is_refused() {
    let postgres = TlsPostgres::start();
    let url = postgres.url(&format!(
        "sslmode=verify-full&sslrootcert={}",
        path(&postgres.certs.ca)
    ));
    let config = runplane_testkit::config::run_store(OPERATOR_TOKEN, &url);
    config
        .validate()
        .expect("verify-full with its root cert loads");
    runplane_run_store::RunStore::open(&config, SystemClock::shared())
        .await
        .expect("the run store opens and migrates over TLS");

    // The server says this session is encrypted.
    let db = runplane_db::connect(&url).await.expect("connect over TLS");
    let ssl = db
        .query_one_raw(Statement::from_string(
            db.get_database_backend(),
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
        ))
        .await
        .expect("ask pg_stat_ssl")
        .expect("a row for this session");
    assert!(ssl.try_get::<bool>("", "ssl").expect("ssl column"));
    // `require` encrypts without checking the certificate.
    runplane_db::connect(&postgres.url("sslmode=require"))
        .await
        .expect("connect with sslmode=require");

    let err = runplane_db::connect(&postgres.url("sslmode=disable"))
        .await
        .expect_err("plaintext is refused by the server");
    assert!(err.to_string().contains("pg_hba.conf"), "{err}");

    let rogue = postgres.url(&format!(
        "sslmode=verify-full&sslrootcert={}",
        path(&postgres.certs.rogue_ca)
    ));
    let err = runplane_db::connect(&rogue)
        .await
        .expect_err("a server certificate the named CA did not sign");
    assert!(
        err.to_string().contains("invalid peer certificate"),
        "{err}"
    );
}
