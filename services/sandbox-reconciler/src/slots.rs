//! Which queued runs may start now.
//!
//! A credential carries at most its capacity of runs at once. The numbers come from the
//! two services that own them: capacity, cool-off and quarantine from credential
//! health's fleet view (GetFleet), busy slots from the run store, which counts and claims
//! under one lock per credential (ClaimSlots). So the count dispatch uses is the count
//! the fleet view prints, and several reconciler replicas claiming at once never put
//! more runs on a credential than it holds. A run that does not fit stays QUEUED, with a
//! waiting reason, and is claimed oldest first when a slot frees; a full fleet is not an
//! outage, so nothing is refused.

use runplane_proto::credentials::v1 as credentials_pb;
use runplane_proto::runstore::v1 as runstore_pb;

use crate::clients::{FleetClient, RunStoreClient};

/// Most runs one round claims.
pub const CLAIM_PER_ROUND: u32 = 100;

/// The runs dispatch gives sandboxes now: those this call claimed, and those claimed
/// earlier whose sandbox may not exist yet (an answer lost, a crash between the claim and
/// the placement), which are STARTING without a run key. Placing a run twice is harmless:
/// its sandbox is keyed by the run.
///
/// Without `fleet` (no credential health runs: `[run_store] admission` off) runs are
/// claimed without a capacity. When the fleet cannot be read, nothing is claimed this
/// round: runs wait rather than overfill a credential.
///
/// At most `max_runs` (1 to [`CLAIM_PER_ROUND`]) are claimed: the room the ready nodes
/// have. Runs between attempts wait out their backoff: the answer's second part is when
/// the first of them may be placed (`None`: none waits).
pub async fn runs_to_place(
    run_store: &RunStoreClient,
    fleet: Option<&FleetClient>,
    max_runs: u32,
    now_us: i64,
) -> Result<(Vec<runstore_pb::Run>, Option<i64>), tonic::Status> {
    let max_runs = max_runs.clamp(1, CLAIM_PER_ROUND);
    let request = match fleet {
        None => runstore_pb::ClaimSlotsRequest {
            credentials: Vec::new(),
            unlimited: true,
            max_runs,
        },
        Some(fleet) => {
            let view = fleet
                .clone()
                .get_fleet(credentials_pb::GetFleetRequest::default())
                .await?
                .into_inner();
            runstore_pb::ClaimSlotsRequest {
                credentials: view.credentials.iter().map(slots_of).collect(),
                unlimited: false,
                max_runs,
            }
        }
    };
    let mut runs = run_store
        .clone()
        .claim_slots(request)
        .await?
        .into_inner()
        .claimed;
    let starting = run_store
        .clone()
        .list_runs(runstore_pb::ListRunsRequest {
            states: vec![runstore_pb::RunState::Starting as i32],
            page_size: 500,
            view: runstore_pb::RunView::Basic as i32,
            ..Default::default()
        })
        .await?
        .into_inner()
        .runs;
    let mut next_retry: Option<i64> = None;
    for run in starting {
        let unkeyed = run.sandbox_generation == 0;
        // A run between attempts waits out its backoff (the run store refuses its key
        // until then).
        let retry_at = run
            .retry_at
            .as_ref()
            .and_then(runplane_clock::from_timestamp)
            .filter(|at| *at > now_us);
        if let Some(at) = retry_at.filter(|_| unkeyed) {
            next_retry = Some(next_retry.map_or(at, |n| n.min(at)));
            continue;
        }
        if unkeyed && !runs.iter().any(|r| r.id == run.id) {
            runs.push(run);
        }
    }
    Ok((runs, next_retry))
}

/// One credential of the fleet view as ClaimSlots fills it.
fn slots_of(c: &credentials_pb::CredentialHealth) -> runstore_pb::CredentialSlots {
    let unavailable =
        out_for(c.quarantined_for_seconds, c.cooling_off_for_seconds).unwrap_or_default();
    runstore_pb::CredentialSlots {
        credential_id: c.credential_id.clone(),
        capacity: c.capacity,
        unavailable,
        unavailable_orgs: c
            .orgs
            .iter()
            .filter_map(|o| {
                let reason = out_for(o.quarantined_for_seconds, o.cooling_off_for_seconds)?;
                Some(runstore_pb::UnavailableOrg {
                    org_id: o.org_id.clone(),
                    reason: format!("{reason} for org {} (its own runs reported it)", o.org_id),
                })
            })
            .collect(),
    }
}

/// Why a credential (or an org's share of it) takes nothing, quarantine first; `None`
/// when it may.
fn out_for(quarantined_for_seconds: u32, cooling_off_for_seconds: u32) -> Option<String> {
    if quarantined_for_seconds > 0 {
        Some(format!(
            "quarantined for {quarantined_for_seconds} s (exhausted)"
        ))
    } else if cooling_off_for_seconds > 0 {
        Some(format!(
            "cooling off for {cooling_off_for_seconds} s after repeated backend errors"
        ))
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quarantine_and_cool_off_say_why_a_credential_takes_nothing() {
        let mut c = credentials_pb::CredentialHealth {
            credential_id: "cred-a".into(),
            capacity: 2,
            ..Default::default()
        };
        assert_eq!(slots_of(&c).unavailable, "");
        c.cooling_off_for_seconds = 42;
        assert_eq!(
            slots_of(&c).unavailable,
            "cooling off for 42 s after repeated backend errors"
        );
        c.quarantined_for_seconds = 1800;
        assert_eq!(
            slots_of(&c).unavailable,
            "quarantined for 1800 s (exhausted)"
        );
    }

    #[test]
    fn a_shared_credential_out_for_one_org_names_that_org_alone() {
        let c = credentials_pb::CredentialHealth {
            credential_id: "shared".into(),
            capacity: 2,
            orgs: vec![
                credentials_pb::OrgHealth {
                    org_id: "acme".into(),
                    cooling_off_for_seconds: 30,
                    quarantined_for_seconds: 0,
                },
                // Expired by the time it is read: no longer out.
                credentials_pb::OrgHealth {
                    org_id: "beta".into(),
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        let slots = slots_of(&c);
        assert_eq!(slots.unavailable, "");
        assert_eq!(
            slots.unavailable_orgs,
            [runstore_pb::UnavailableOrg {
                org_id: "acme".into(),
                reason: "cooling off for 30 s after repeated backend errors for org acme (its own runs reported it)".into(),
            }]
        );
    }
}
