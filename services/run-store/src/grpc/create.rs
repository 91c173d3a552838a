//! CreateRun's checks of its request: pure, so the fuzz tests reach them.

use std::time::Duration;

use runplane_proto::runstore::v1 as runstore_pb;

use crate::domain::validate;
use crate::error::RunStoreError;

type Result<T> = std::result::Result<T, RunStoreError>;

/// What CreateRun's checks made of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckedCreateRun {
    /// The profile asked for; empty when a credential was named.
    pub profile: String,
    /// The credential named; empty when a profile was asked for.
    pub credential_id: String,
    pub labels: std::collections::BTreeMap<String, String>,
    pub max_duration: Option<Duration>,
    /// The priority asked for; `None`: the profile's.
    pub priority: Option<i32>,
}

/// Most arguments a run has.
const MAX_ARGS: usize = 256;
/// Most bytes of arguments a run has in all, so a run's spec stays a small part of any
/// message that carries it.
pub const MAX_ARGS_BYTES: usize = 128 * 1024;

/// CreateRun's checks of its request, before anything is asked or written: every field
/// against its documented bound, `max_duration` against `max_run_duration_seconds`.
/// Pure, so it is fuzzed (`tests/fuzz.rs`).
pub fn check_create_run(
    req: &runstore_pb::CreateRunRequest,
    max_run_duration_seconds: u32,
) -> Result<CheckedCreateRun> {
    use runstore_pb::create_run_request::Target;
    validate::client_key("client_request_id", &req.client_request_id)?;
    validate::name("org_id", &req.org_id)?;
    if !req.lead_id.is_empty() {
        validate::name("lead_id", &req.lead_id)?;
    }
    let (profile, credential_id) = match &req.target {
        Some(Target::Profile(p)) => {
            validate::name("profile", p)?;
            (p.clone(), String::new())
        }
        Some(Target::CredentialId(c)) => {
            validate::name("credential_id", c)?;
            (String::new(), c.clone())
        }
        None => {
            return Err(RunStoreError::invalid(
                "target",
                "exactly one of profile or credential_id is required",
            ));
        }
    };
    validate::bounded("command", &req.command, 1, 4096)?;
    if req.args.len() > MAX_ARGS {
        return Err(RunStoreError::invalid(
            "args",
            format!("at most {MAX_ARGS} arguments"),
        ));
    }
    for arg in &req.args {
        validate::bounded("args", arg, 0, 4096)?;
    }
    let args_bytes: usize = req.args.iter().map(String::len).sum();
    if args_bytes > MAX_ARGS_BYTES {
        return Err(RunStoreError::invalid(
            "args",
            format!("at most {MAX_ARGS_BYTES} bytes in all, not {args_bytes}"),
        ));
    }
    if let Some(p) = req.priority
        && !(0..=9).contains(&p)
    {
        return Err(RunStoreError::invalid("priority", "must be 0 to 9"));
    }
    use crate::domain::labels::{self, MAX_LABELS};
    if req.labels.len() > MAX_LABELS {
        return Err(RunStoreError::invalid(
            "labels",
            format!("at most {MAX_LABELS} labels, not {}", req.labels.len()),
        ));
    }
    let labels: std::collections::BTreeMap<String, String> = req
        .labels
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    for (k, v) in &labels {
        if let Some(why) = labels::check(k, v) {
            return Err(RunStoreError::invalid("labels", why));
        }
    }
    let max_duration = match req.max_duration.as_ref() {
        None => None,
        Some(d) => Some(checked_max_duration(d, max_run_duration_seconds)?),
    };
    Ok(CheckedCreateRun {
        profile,
        credential_id,
        labels,
        max_duration,
        priority: req.priority,
    })
}

/// CreateRun's `max_duration`: positive and at most `[run_store]
/// max_run_duration_seconds`.
pub(super) fn checked_max_duration(d: &prost_types::Duration, bound: u32) -> Result<Duration> {
    let out_of_range = || {
        RunStoreError::invalid(
            "max_duration",
            format!("must be more than 0 s and at most {bound} s"),
        )
    };
    if d.seconds < 0 || d.nanos < 0 || d.nanos >= 1_000_000_000 || (d.seconds, d.nanos) == (0, 0) {
        return Err(out_of_range());
    }
    let d = Duration::new(d.seconds as u64, d.nanos as u32);
    if d > Duration::from_secs(bound.into()) {
        return Err(out_of_range());
    }
    Ok(d)
}
