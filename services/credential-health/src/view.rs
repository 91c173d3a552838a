//! How policy state reads in the API: one place decides free, cool-off and quarantine.

use runplane_proto::credentials::v1 as credentials_pb;

use crate::domain::policy::CredentialState;
use crate::store::entities::incident;
use crate::store::incident_view;

/// Health of one credential. `busy` is `None` where the run store was not asked (a
/// report's answer): free is then the capacity.
pub fn credential(
    credential_id: &str,
    profiles: Vec<String>,
    capacity: u32,
    busy: Option<u32>,
    state: &CredentialState,
    open_incident: Option<&incident::Model>,
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
        open_incident: open_incident
            .filter(|_| cooling > 0)
            .map(|i| incident_view(i, now_ms)),
        queued: 0,
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
