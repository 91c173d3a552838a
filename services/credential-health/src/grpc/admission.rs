//! CheckAdmission: which credential a new run may use, or why none may.

use runplane_proto::credentials::v1 as credentials_pb;
use runplane_telemetry::metrics;
use tonic::{Request, Response, Status};

use super::state::HealthServiceState;
use super::validate::name;
use crate::error::CredentialHealthError;
use crate::store::state_key;

pub(super) async fn check_admission(
    service: &HealthServiceState,
    request: Request<credentials_pb::CheckAdmissionRequest>,
) -> Result<Response<credentials_pb::CheckAdmissionResponse>, Status> {
    use credentials_pb::check_admission_request::Target;
    service.authenticate(&request)?;
    let req = request.into_inner();
    name("org_id", &req.org_id, false)?;
    let org = req.org_id.as_str();
    let not_owned = |field: &'static str, value: &str| CredentialHealthError::NotOwned {
        org: org.to_owned(),
        target: format!(
            "{} {value}",
            if field == "profile" {
                "profile"
            } else {
                "credential"
            }
        ),
        field,
        value: value.to_owned(),
    };
    let mut max_run_seconds = 0;
    let mut priority = 0;
    let (profile, candidates): (String, Vec<(String, u32)>) = match &req.target {
        Some(Target::Profile(p)) => {
            name("profile", p, true)?;
            if service.profiles.named(p).next().is_none() {
                return Err(CredentialHealthError::ProfileUnknown(p.clone()).into());
            }
            // Only the org's own (or shared) credentials of the pool are candidates:
            // another org's credential is neither chosen nor reported on.
            let entries: Vec<(String, u32)> = service
                .profiles
                .named(p)
                .filter(|e| e.admits(org))
                .map(|e| {
                    max_run_seconds = max_run_seconds.max(e.max_run_seconds);
                    priority = priority.max(e.priority);
                    (e.credential_id.clone(), e.capacity)
                })
                .collect();
            if entries.is_empty() {
                return Err(not_owned("profile", p).into());
            }
            (p.clone(), entries)
        }
        Some(Target::CredentialId(c)) => {
            name("credential_id", c, true)?;
            if service.profiles.on_credential(c).next().is_none() {
                return Err(CredentialHealthError::CredentialUnknown(c.clone()).into());
            }
            // A credential named directly is the org's when some profile on it admits
            // the org; its capacity is what those profiles give.
            let capacity: u32 = service
                .profiles
                .on_credential(c)
                .filter(|e| e.admits(org))
                .map(|e| e.capacity)
                .sum();
            if capacity == 0 {
                return Err(not_owned("credential_id", c).into());
            }
            (String::new(), vec![(c.clone(), capacity)])
        }
        None => {
            return Err(CredentialHealthError::invalid(
                "target",
                "exactly one of profile or credential_id is required",
            )
            .into());
        }
    };
    let ids: Vec<String> = candidates.iter().map(|(c, _)| c.clone()).collect();
    // A shared credential may be out for this org alone, on its own runs' evidence.
    let own_key = |c: &str| state_key(c, Some(org));
    let mut keys = ids.clone();
    if !org.is_empty() {
        keys.extend(
            ids.iter()
                .filter(|c| service.profiles.shared(c))
                .map(|c| own_key(c)),
        );
    }
    let states = service.store.states(&keys).await?;
    let now = service.store.now_ms();
    let seconds = |key: &str| {
        states.get(key).map_or((0, 0), |(st, _)| {
            (
                st.cooling_off_for_seconds(now),
                st.quarantined_for_seconds(now),
            )
        })
    };
    let health = |c: &str| {
        let (whole, own) = (seconds(c), seconds(&own_key(c)));
        Penalty {
            cooling: whole.0.max(own.0),
            quarantined: whole.1.max(own.1),
            org_only: whole == (0, 0) && own != (0, 0),
        }
    };
    let healthy: Vec<&(String, u32)> = candidates
        .iter()
        .filter(|(c, _)| health(c).is_none())
        .collect();
    if healthy.is_empty() {
        let refused = refusal(&profile, org, &candidates, health);
        if let CredentialHealthError::Refused { reason, .. } = &refused {
            metrics::admission_refusals().add(1, &[metrics::attr("reason", reason.as_str_name())]);
        }
        return Err(refused.into());
    }
    // Busy slots, to pick the least loaded healthy credential and report free. The
    // count is advisory: if the run store cannot be asked, admission still answers.
    let counts = service.count_active(ids.clone()).await.ok();
    let busy = |c: &str| -> Option<u32> {
        let counts = counts.as_ref()?;
        Some(if profile.is_empty() {
            counts.active_by_credential.get(c).copied().unwrap_or(0)
        } else {
            counts
                .active_by_profile_credential
                .get(&format!("{profile}/{c}"))
                .copied()
                .unwrap_or(0)
        })
    };
    let free = |(c, capacity): &(String, u32)| capacity.saturating_sub(busy(c).unwrap_or(0));
    // The most free slots; on a tie, the first in credential order.
    let mut chosen = healthy[0];
    for candidate in &healthy[1..] {
        if free(candidate) > free(chosen) {
            chosen = candidate;
        }
    }
    tracing::Span::current().record("credential_id", chosen.0.as_str());
    Ok(Response::new(credentials_pb::CheckAdmissionResponse {
        free: free(chosen),
        credential_id: chosen.0.clone(),
        profile,
        max_run_seconds,
        priority,
    }))
}

/// What keeps a credential from taking an org's run now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Penalty {
    cooling: u32,
    quarantined: u32,
    /// Only this org's share of a shared credential is out.
    org_only: bool,
}

impl Penalty {
    fn is_none(&self) -> bool {
        self.cooling == 0 && self.quarantined == 0
    }
}

/// Why nothing of `candidates` may take a run. One credential: exhaustion wins over a
/// cool-off. A profile: the reason of the credential that becomes usable first, so the
/// caller learns when to ask again.
fn refusal(
    profile: &str,
    org: &str,
    candidates: &[(String, u32)],
    health: impl Fn(&str) -> Penalty,
) -> CredentialHealthError {
    let mut best: Option<(u32, &str, Penalty)> = None;
    for (c, _) in candidates {
        let penalty = health(c);
        let usable_in = if penalty.quarantined > 0 {
            penalty.quarantined
        } else {
            penalty.cooling
        };
        if best.is_none_or(|(at, ..)| usable_in < at) {
            best = Some((usable_in, c, penalty));
        }
    }
    let (_, credential_id, penalty) = best.expect("at least one candidate");
    let Penalty {
        cooling,
        quarantined,
        org_only,
    } = penalty;
    let mut on = if profile.is_empty() {
        format!("credential {credential_id}")
    } else if candidates.len() == 1 {
        format!("profile {profile} (credential {credential_id})")
    } else {
        format!("profile {profile} (every credential; soonest {credential_id})")
    };
    if org_only {
        on.push_str(&format!(
            " for org {org} (its own runs reported it; the credential is shared and other orgs still use it)"
        ));
    }
    let (reason, message) = if quarantined > 0 {
        (
            runplane_grpc::ErrorReason::Exhausted,
            format!("{on} is quarantined as exhausted (spent), {quarantined} s left"),
        )
    } else {
        (
            runplane_grpc::ErrorReason::CoolingOff,
            format!("{on} is cooling off after repeated backend errors, {cooling} s left"),
        )
    };
    CredentialHealthError::Refused {
        reason,
        message,
        credential_id: credential_id.to_owned(),
        cooling_off_for_seconds: cooling,
        quarantined_for_seconds: quarantined,
    }
}
