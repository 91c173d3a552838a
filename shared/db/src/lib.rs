//! Database connections for runplane services.
//!
//! Production runs on Postgres (`postgres://…`); the embedded default (`runplane dev`)
//! runs on SQLite (`sqlite://path`, created when missing, in WAL mode so readers do not
//! block the writer). Each service owns its own database and migrates it at start.

pub mod exclusive;
pub mod migrations;
pub mod notify;
pub mod outbox;

use std::path::Path;
use std::time::Duration;

use sea_orm::{ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DbBackend};
use sea_orm_migration::MigratorTrait;

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("unsupported database url `{0}`: use postgres://… or sqlite://path")]
    UnsupportedUrl(String),
    #[error("could not create the directory for {path}: {reason}")]
    CreateDir { path: String, reason: String },
    #[error("could not connect to {url}: {reason}")]
    Connect { url: String, reason: String },
    #[error("migrating {url} failed: {reason}")]
    Migrate { url: String, reason: String },
}

pub use runplane_config::redact_url;

/// How long a Postgres session may sit idle inside a transaction before the server
/// ends it (see [`connect`]).
pub const IDLE_IN_TRANSACTION_TIMEOUT_MS: u64 = 5_000;

/// Connects to `url` (Postgres or SQLite).
pub async fn connect(url: &str) -> Result<DatabaseConnection, DbError> {
    let safe = redact_url(url);
    let url = if let Some(path) = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
    {
        let (file, query) = path.split_once('?').unwrap_or((path, ""));
        if file != ":memory:"
            && let Some(dir) = Path::new(file)
                .parent()
                .filter(|d| !d.as_os_str().is_empty())
        {
            std::fs::create_dir_all(dir).map_err(|e| DbError::CreateDir {
                path: file.to_owned(),
                reason: e.to_string(),
            })?;
        }
        // Create the file when it does not exist.
        let query = if query.contains("mode=") {
            query.to_owned()
        } else if query.is_empty() {
            "mode=rwc".to_owned()
        } else {
            format!("{query}&mode=rwc")
        };
        format!("sqlite://{file}?{query}")
    } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        url.to_owned()
    } else {
        return Err(DbError::UnsupportedUrl(safe));
    };

    let mut options = ConnectOptions::new(url);
    options
        .connect_timeout(Duration::from_secs(5))
        .acquire_timeout(Duration::from_secs(10))
        .sqlx_logging(false);
    if options.get_url().starts_with("sqlite:") {
        options.max_connections(8).map_sqlx_sqlite_opts(|o| {
            o.journal_mode(sea_orm::sqlx::sqlite::SqliteJournalMode::Wal)
                .busy_timeout(Duration::from_secs(5))
                .foreign_keys(true)
        });
    } else {
        // A replica frozen (SIGSTOP, a wedged node) in the middle of a transaction holds
        // its row locks for as long as its connection lives, and every other replica's
        // writes to those rows wait behind it. Postgres ends such a session after this
        // long idle inside a transaction, and its locks go with it. No runplane
        // transaction waits on anything but the database, so a live one never idles
        // this long.
        options.max_connections(16).map_sqlx_postgres_opts(|o| {
            o.options([(
                "idle_in_transaction_session_timeout",
                IDLE_IN_TRANSACTION_TIMEOUT_MS.to_string(),
            )])
        });
    }
    Database::connect(options)
        .await
        .map_err(|e| DbError::Connect {
            url: safe,
            reason: e.to_string(),
        })
}

/// A transaction that will write. On SQLite it takes the write lock at `BEGIN`
/// (IMMEDIATE), so two writers queue on the busy timeout instead of one failing when it
/// upgrades a read lock; on Postgres it is an ordinary READ COMMITTED transaction.
pub async fn write_tx(
    db: &DatabaseConnection,
) -> Result<sea_orm::DatabaseTransaction, sea_orm::DbErr> {
    use sea_orm::{SqliteTransactionMode, TransactionOptions, TransactionTrait};
    if db.get_database_backend() == DbBackend::Sqlite {
        db.begin_with_options(TransactionOptions {
            sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
            ..Default::default()
        })
        .await
    } else {
        db.begin().await
    }
}

/// The advisory lock key migrations run under on Postgres (any fixed number; it is
/// `runplane` in ASCII).
pub const MIGRATION_LOCK: i64 = 0x72_75_6e_70_6c_61_6e_65;

/// Connects and applies every pending migration of `M`; on Postgres one process at a
/// time ([`MIGRATION_LOCK`]).
pub async fn connect_and_migrate<M: MigratorTrait>(
    url: &str,
) -> Result<DatabaseConnection, DbError> {
    let db = connect(url).await?;
    let failed = |e: sea_orm::DbErr| DbError::Migrate {
        url: redact_url(url),
        reason: e.to_string(),
    };
    if is_postgres(&db) {
        // Replicas started together on a fresh database would create the same tables at
        // once and one would fail (a duplicate `pg_type` row). One migrates at a time,
        // under a transaction-scoped advisory lock; the others wait for it, then find
        // every migration applied. Postgres runs the DDL in the transaction.
        use sea_orm::TransactionTrait;
        let txn = db.begin().await.map_err(failed)?;
        txn.execute_unprepared(&format!("SELECT pg_advisory_xact_lock({MIGRATION_LOCK})"))
            .await
            .map_err(failed)?;
        M::up(&txn, None).await.map_err(failed)?;
        txn.commit().await.map_err(failed)?;
    } else {
        M::up(&db, None).await.map_err(failed)?;
    }
    tracing::debug!(url = %redact_url(url), backend = ?db.get_database_backend(), "database migrated");
    Ok(db)
}

/// True for the Postgres backend; some statements (row locks) differ by backend.
pub fn is_postgres(db: &DatabaseConnection) -> bool {
    db.get_database_backend() == DbBackend::Postgres
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("postgres://app:s3cret@db:5432/runs"),
            "postgres://app:***@db:5432/runs"
        );
        assert_eq!(
            redact_url("postgres://app@db/runs"),
            "postgres://app@db/runs"
        );
        assert_eq!(redact_url("sqlite://x.db"), "sqlite://x.db");
    }
}
