//! A role that only one process may hold per database, for as long as it runs: a Postgres
//! session-level advisory lock on a connection of its own, taken at start.
//!
//! The lock goes with the session: a process that exits or is killed closes its
//! connection and frees the role, so a restarted process takes it over within the wait.
//! A frozen (SIGSTOPped) holder keeps it; that is the point, since it may wake and carry
//! on. SQLite is one process's file, so there is nothing to hold there.

use std::time::Duration;

use sea_orm::{DatabaseConnection, DbErr, sqlx};

/// Holds the role while it lives; dropping it closes the session and frees it.
#[derive(Debug)]
pub struct Exclusive {
    _session: Option<sqlx::PgConnection>,
}

/// Takes the role `key` on `db`, trying every 250 ms for up to `wait` (a holder that was
/// just killed may still have its session open for a moment). `Ok(None)`: another process
/// holds it.
pub async fn hold(
    db: &DatabaseConnection,
    key: i64,
    wait: Duration,
) -> Result<Option<Exclusive>, DbErr> {
    if !crate::is_postgres(db) {
        return Ok(Some(Exclusive { _session: None }));
    }
    let sql = |e: sqlx::Error| DbErr::Custom(e.to_string());
    // A session of its own, out of the pool: the lock lives exactly as long as it.
    let mut session = db
        .get_postgres_connection_pool()
        .acquire()
        .await
        .map_err(sql)?
        .detach();
    let until = tokio::time::Instant::now() + wait;
    loop {
        let taken: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(key)
            .fetch_one(&mut session)
            .await
            .map_err(sql)?;
        if taken {
            return Ok(Some(Exclusive {
                _session: Some(session),
            }));
        }
        if tokio::time::Instant::now() >= until {
            return Ok(None);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_second_holder_is_refused_until_the_first_lets_go() {
        let database = runplane_testkit::TestDatabase::new().await;
        let first_db = crate::connect(database.url()).await.unwrap();
        let second_db = crate::connect(database.url()).await.unwrap();
        let first = hold(&first_db, 42, Duration::ZERO).await.unwrap();
        assert!(first.is_some(), "a free role is taken");
        assert!(
            hold(&second_db, 42, Duration::from_millis(300))
                .await
                .unwrap()
                .is_none(),
            "a held role is refused"
        );
        assert!(
            hold(&second_db, 43, Duration::ZERO)
                .await
                .unwrap()
                .is_some(),
            "another role is independent"
        );
        drop(first);
        assert!(
            hold(&second_db, 42, Duration::from_secs(10))
                .await
                .unwrap()
                .is_some(),
            "a role whose holder went is taken over within the wait"
        );
    }

    #[tokio::test]
    async fn sqlite_has_nothing_to_hold() {
        let dir = tempfile::tempdir().unwrap();
        let db = crate::connect(&format!("sqlite://{}", dir.path().join("db").display()))
            .await
            .unwrap();
        assert!(hold(&db, 42, Duration::ZERO).await.unwrap().is_some());
        assert!(hold(&db, 42, Duration::ZERO).await.unwrap().is_some());
    }
}
