//! The replay buffer: frames appended under the lease and read back by tails, and the
//! org's hourly byte budget each append is charged to.

use redis::{ScriptInvocation, Value};

use super::connection::RedisStore;
use super::reply::{bytes, int, text};
use super::scripts::{APPEND, CHARGE_ORG, READ, REFUND_ORG};
use crate::domain::policy::{BufferLimits, DEFAULT_LEASE_TTL};
use crate::store::{Appended, Replay, Result, StoreError, StoredFrame};

impl RedisStore {
    /// The APPEND script call `append` makes, exactly.
    pub fn append_invocation(
        &self,
        run: &str,
        token: &str,
        frames: &[(u64, Vec<u8>)],
        now_ms: i64,
        limits: &BufferLimits,
        resync: bool,
    ) -> ScriptInvocation<'static> {
        let k = self.keys(run);
        let mut invocation = APPEND.prepare_invoke();
        invocation
            .key(&k.lease)
            .key(&k.meta)
            .key(&k.frames)
            .key(&k.times)
            .arg(token)
            .arg(now_ms)
            .arg(limits.max_frames)
            .arg(limits.stream_bytes)
            .arg(limits.ttl.as_millis() as u64)
            .arg(DEFAULT_LEASE_TTL.as_millis() as u64)
            .arg(if resync { "1" } else { "0" })
            .arg(self.channel())
            .arg(run);
        for (sequence, data) in frames {
            invocation.arg(*sequence).arg(data.as_slice());
        }
        invocation
    }
}

pub(super) async fn append(
    store: &RedisStore,
    run: &str,
    token: &str,
    frames: &[(u64, Vec<u8>)],
    now_ms: i64,
    limits: &BufferLimits,
    resync: bool,
) -> Result<Appended> {
    let mut conn = store.conn.clone();
    let out: Vec<Value> = store
        .append_invocation(run, token, frames, now_ms, limits, resync)
        .invoke_async(&mut conn)
        .await?;
    match text(&out[0]).as_str() {
        "ok" => {
            // The script published the frames to the other replicas.
            store.notifier.notify(run);
            Ok(Appended {
                next_sequence: int(&out[1]) as u64,
                stored: int(&out[2]) as u32,
                stream_bytes_remaining: int(&out[3]).max(0) as u64,
                stored_bytes: int(&out[4]).max(0) as u64,
            })
        }
        "gap" => Err(StoreError::Gap {
            next: int(&out[1]) as u64,
        }),
        "budget" => Err(StoreError::BudgetExceeded { scope: "stream" }),
        _ => Err(StoreError::Fenced),
    }
}

pub(super) async fn read(store: &RedisStore, run: &str, from: u64, max: usize) -> Result<Replay> {
    let k = store.keys(run);
    let mut conn = store.conn.clone();
    let out: Vec<Value> = READ
        .key(&k.meta)
        .key(&k.frames)
        .key(&k.times)
        .arg(from)
        .arg(max)
        .invoke_async(&mut conn)
        .await?;
    let frames = out[2..]
        .chunks(3)
        .map(|c| StoredFrame {
            sequence: int(&c[0]) as u64,
            data: bytes(&c[1]),
            appended_ms: int(&c[2]),
        })
        .collect();
    Ok(Replay {
        first_available: int(&out[0]) as u64,
        next_sequence: int(&out[1]) as u64,
        frames,
    })
}

pub(super) async fn charge_org(
    store: &RedisStore,
    org: &str,
    hour: i64,
    bytes: u64,
    limits: &BufferLimits,
) -> Result<u64> {
    let mut conn = store.conn.clone();
    // The window's counters, oldest first; the last is this hour's. One hash tag, so one
    // slot.
    let mut charge = CHARGE_ORG.prepare_invoke();
    for h in hour - limits.window_hours() + 1..=hour {
        charge.key(store.org_hour(org, h));
    }
    let left: i64 = charge
        .arg(bytes)
        .arg(limits.org_hour_bytes)
        .arg(limits.org_buffer_bytes)
        .arg(limits.org_counter_ttl_ms())
        .invoke_async(&mut conn)
        .await?;
    match left {
        -1 => Err(StoreError::BudgetExceeded { scope: "org_hour" }),
        -2 => Err(StoreError::BudgetExceeded {
            scope: "org_buffer",
        }),
        left => Ok(left.max(0) as u64),
    }
}

pub(super) async fn refund_org(store: &RedisStore, org: &str, hour: i64, bytes: u64) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    let mut conn = store.conn.clone();
    let key = store.org_hour(org, hour);
    let _: i64 = REFUND_ORG
        .key(key)
        .arg(bytes)
        .invoke_async(&mut conn)
        .await?;
    Ok(())
}
