//! The checks every request passes before anything is read or written: pure functions of
//! its fields, public so that tests can feed them any input.

use std::time::Duration;

use runplane_ids::RunId;
use runplane_proto::recovery::v1 as recovery_pb;

use crate::domain::policy::DEFAULT_LEASE_TTL;
use crate::error::RecoveryError;

/// The highest frame sequence accepted: 2^53, the largest integer a Lua number holds
/// exactly.
pub const MAX_FRAME_SEQUENCE: u64 = 1 << 53;

fn invalid(field: &str, why: &str) -> RecoveryError {
    RecoveryError::Invalid {
        field: field.to_owned(),
        why: why.to_owned(),
    }
}

/// A [`RunId`], as the run store mints them; anything else is refused before any key is
/// read or written.
pub fn run_id(id: &str) -> Result<(), RecoveryError> {
    RunId::parse(id)
        .map(|_| ())
        .map_err(|e| invalid("run_id", &e.to_string()))
}

/// An AcquireLease controller id: 16 to 128 printable ASCII bytes.
pub fn controller_id(id: &str) -> Result<(), RecoveryError> {
    if !(16..=128).contains(&id.len()) || !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(invalid(
            "controller_id",
            "must be 16 to 128 printable ASCII bytes",
        ));
    }
    Ok(())
}

/// A lease's time to live in milliseconds: `DEFAULT_LEASE_TTL` when unset or zero,
/// otherwise 5 s to 120 s.
pub fn lease_ttl_ms(ttl: Option<&prost_types::Duration>) -> Result<i64, RecoveryError> {
    let ms = match ttl {
        None => DEFAULT_LEASE_TTL.as_millis() as i64,
        Some(d) if d.seconds == 0 && d.nanos == 0 => DEFAULT_LEASE_TTL.as_millis() as i64,
        // Saturating: a client's far-off duration must not overflow (and panic).
        Some(d) => d
            .seconds
            .saturating_mul(1000)
            .saturating_add(i64::from(d.nanos / 1_000_000)),
    };
    if !(5_000..=120_000).contains(&ms) {
        return Err(invalid("ttl", "must be 5 s to 120 s"));
    }
    Ok(ms)
}

/// An AppendFrames batch: 1 to 256 frames of 1 byte to 64 KiB each, at most 1 MiB in
/// all, numbered contiguously upwards from at least 1 to at most `MAX_FRAME_SEQUENCE`.
/// Returns the batch's bytes.
pub fn frames(frames: &[recovery_pb::FrameInput]) -> Result<usize, RecoveryError> {
    if frames.is_empty() || frames.len() > 256 {
        return Err(invalid("frames", "1 to 256 frames"));
    }
    let total: usize = frames.iter().map(|f| f.data.len()).sum();
    if total > 1 << 20 {
        return Err(RecoveryError::BatchTooLarge {
            limit: 1 << 20,
            actual: total as u64,
        });
    }
    for (i, f) in frames.iter().enumerate() {
        if f.data.is_empty() || f.data.len() > 64 << 10 {
            return Err(invalid("frames", "each frame is 1 byte to 64 KiB"));
        }
        // Checked: a client's u64::MAX must not overflow here, and sequences stay
        // within what the store's Lua numbers (doubles) hold exactly.
        let follows = i == 0 || frames[i - 1].sequence.checked_add(1) == Some(f.sequence);
        if f.sequence == 0 || f.sequence > MAX_FRAME_SEQUENCE || !follows {
            return Err(invalid(
                "frames",
                "sequences start at 1, are at most 2^53 and are contiguous and ascending",
            ));
        }
    }
    Ok(total)
}

/// A Tail's heartbeat interval, as `runplane_grpc::heartbeat::interval` bounds it.
pub fn heartbeat_interval(
    interval: Option<&prost_types::Duration>,
) -> Result<Duration, RecoveryError> {
    runplane_grpc::heartbeat::interval(interval).map_err(|why| invalid("heartbeat_interval", why))
}

/// A PlanRecovery reason: at most 256 bytes.
pub fn plan_reason(reason: &str) -> Result<(), RecoveryError> {
    if reason.len() > 256 {
        return Err(invalid("reason", "at most 256 bytes"));
    }
    Ok(())
}

/// A SweepOrphans batch size: 0 for the default of 100, otherwise 1 to 500.
pub fn sweep_limit(limit: u32) -> Result<usize, RecoveryError> {
    match limit {
        0 => Ok(100),
        n @ 1..=500 => Ok(n as usize),
        _ => Err(invalid("limit", "must be 0 to 500")),
    }
}
