//! The stream lease: granted to a run's first controller, renewed, released, parked
//! around a suspend and unparked.

use redis::Value;

use super::connection::RedisStore;
use super::reply::{int, text};
use super::scripts::{ACQUIRE, PARK, RELEASE, RENEW, UNPARK};
use crate::domain::policy::{LEASE_GC_FACTOR, STATE_TTL};
use crate::store::{Acquired, PARKED_EXPIRES_MS, Result, StoreError};

pub(super) async fn acquire(
    store: &RedisStore,
    run: &str,
    controller: &str,
    token: &str,
    ttl_ms: i64,
    now_ms: i64,
    attempt: u32,
) -> Result<Acquired> {
    let k = store.keys(run);
    let mut conn = store.conn.clone();
    let out: Vec<Value> = ACQUIRE
        .key(&k.lease)
        .key(&k.meta)
        .key(&k.frames)
        .key(&k.times)
        .arg(controller)
        .arg(token)
        .arg(ttl_ms)
        .arg(now_ms)
        .arg(LEASE_GC_FACTOR)
        .arg(STATE_TTL.as_millis() as u64)
        .arg(attempt.max(1))
        .invoke_async(&mut conn)
        .await?;
    match text(&out[0]).as_str() {
        "ok" => {
            store.remember(run).await?;
            store.changed(run).await;
            Ok(Acquired {
                token: text(&out[1]),
                expires_ms: int(&out[2]),
                next_sequence: int(&out[3]) as u64,
            })
        }
        "held" => Err(StoreError::Held {
            controller: text(&out[1]),
        }),
        _ => Err(StoreError::TakeoverRequired),
    }
}

pub(super) async fn renew(
    store: &RedisStore,
    run: &str,
    token: &str,
    ttl_ms: i64,
    now_ms: i64,
) -> Result<i64> {
    let k = store.keys(run);
    let mut conn = store.conn.clone();
    let out: Vec<Value> = RENEW
        .key(&k.lease)
        .key(&k.meta)
        .key(&k.frames)
        .key(&k.times)
        .arg(token)
        .arg(ttl_ms)
        .arg(now_ms)
        .arg(LEASE_GC_FACTOR)
        .arg(STATE_TTL.as_millis() as u64)
        .invoke_async(&mut conn)
        .await?;
    match text(&out[0]).as_str() {
        "ok" => Ok(int(&out[1])),
        _ => Err(StoreError::Fenced),
    }
}

pub(super) async fn release(store: &RedisStore, run: &str, token: &str) -> Result<bool> {
    let k = store.keys(run);
    let mut conn = store.conn.clone();
    let released: i64 = RELEASE
        .key(&k.lease)
        .arg(token)
        .invoke_async(&mut conn)
        .await?;
    if released == 1 {
        store.changed(run).await;
    }
    Ok(released == 1)
}

pub(super) async fn park(store: &RedisStore, run: &str) -> Result<bool> {
    let k = store.keys(run);
    let mut conn = store.conn.clone();
    let parked: i64 = PARK
        .key(&k.lease)
        .arg(PARKED_EXPIRES_MS)
        .invoke_async(&mut conn)
        .await?;
    if parked == 1 {
        store.changed(run).await;
    }
    Ok(parked == 1)
}

pub(super) async fn unpark(
    store: &RedisStore,
    run: &str,
    ttl_ms: i64,
    now_ms: i64,
) -> Result<bool> {
    let k = store.keys(run);
    let mut conn = store.conn.clone();
    let unparked: i64 = UNPARK
        .key(&k.lease)
        .arg(ttl_ms)
        .arg(now_ms)
        .arg(LEASE_GC_FACTOR)
        .invoke_async(&mut conn)
        .await?;
    if unparked == 1 {
        store.changed(run).await;
    }
    Ok(unparked == 1)
}
