//! The Lua scripts, one file each under `lua/`, headed by its KEYS, ARGV and reply. The
//! `redis` crate's `Script` loads each once and again on `NOSCRIPT`.

use std::sync::LazyLock;

use redis::Script;

/// `keep(key, ms)`, prepended to the scripts that call it.
const KEEP: &str = include_str!("lua/keep.lua");

/// A script whose body may call `keep`.
fn with_keep(body: &str) -> Script {
    Script::new(&format!("{KEEP}{body}"))
}

pub(super) static ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| with_keep(include_str!("lua/acquire_lease.lua")));
pub(super) static RENEW: LazyLock<Script> =
    LazyLock::new(|| with_keep(include_str!("lua/renew_lease.lua")));
pub(super) static PARK: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/park_lease.lua")));
pub(super) static UNPARK: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/unpark_lease.lua")));
pub(super) static RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/release_lease.lua")));
pub(super) static APPEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/append_frames.lua")));
pub(super) static CHARGE_ORG: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/charge_org.lua")));
pub(super) static REFUND_ORG: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/refund_org.lua")));
pub(super) static READ: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/read_frames.lua")));
pub(super) static BUDGET: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/read_budget.lua")));
pub(super) static CLAIM: LazyLock<Script> =
    LazyLock::new(|| with_keep(include_str!("lua/claim.lua")));
pub(super) static UNCLAIM: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/unclaim.lua")));
