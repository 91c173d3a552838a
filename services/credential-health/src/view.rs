//! How policy state reads in the API: one place decides free, cool-off and quarantine.
//!
//! A leaf: it reads domain state and writes protos, so the store (a report's answer) and
//! the service (the fleet) both build their views here without depending on each other.

use runplane_proto::credentials::v1 as credentials_pb;

use crate::domain::policy::CredentialState;

/// Health of one credential. `busy` is `None` where the run store was not asked (a
/// report's answer): free is then the capacity. `open_incident` is shown only while the
/// credential is cooling off.
pub fn credential(
    credential_id: &str,
    profiles: Vec<String>,
    capacity: u32,
    busy: Option<u32>,
    state: &CredentialState,
    open_incident: Option<credentials_pb::Incident>,
    now_ms: i64,
) -> credentials_pb::CredentialHealth {
    let cooling = state.cooling_off_for_seconds(now_ms);
    let quarantined = state.quarantined_for_seconds(now_ms);
    let busy = busy.unwrap_or(0);
    credentials_pb::CredentialHealth {
        credential_id: credential_id.to_owned(),
        profiles,
        capacity,
        busy,
        free: free(capacity, busy, cooling, quarantined),
        cooling_off_for_seconds: cooling,
        quarantined_for_seconds: quarantined,
        open_incident: open_incident.filter(|_| cooling > 0),
        queued: 0,
        orgs: Vec::new(),
    }
}

/// Capacity minus busy, floored at 0; 0 while cooling off or quarantined.
pub fn free(capacity: u32, busy: u32, cooling: u32, quarantined: u32) -> u32 {
    if cooling > 0 || quarantined > 0 {
        0
    } else {
        capacity.saturating_sub(busy)
    }
}

/// A stored millisecond time as a protobuf `Timestamp`.
pub fn timestamp(ms: i64) -> prost_types::Timestamp {
    runplane_clock::to_timestamp(runplane_clock::ms_to_us(ms))
}
