//! GetFleet: capacity, busy slots and policy state per credential and per profile.

use runplane_proto::credentials::v1 as credentials_pb;
use tonic::{Request, Response, Status};

use super::state::HealthServiceState;
use super::validate::name;
use crate::error::CredentialHealthError;
use crate::store::incidents::incident_view;
use crate::view::{self, timestamp};

pub(super) async fn get_fleet(
    service: &HealthServiceState,
    request: Request<credentials_pb::GetFleetRequest>,
) -> Result<Response<credentials_pb::GetFleetResponse>, Status> {
    service.authenticate(&request)?;
    let req = request.into_inner();
    name("profile", &req.profile, false)?;
    name("credential_id", &req.credential_id, false)?;
    let entries: Vec<_> = service
        .profiles
        .all()
        .iter()
        .filter(|p| req.profile.is_empty() || p.name == req.profile)
        .filter(|p| req.credential_id.is_empty() || p.credential_id == req.credential_id)
        .collect();
    if entries.is_empty() {
        if !req.profile.is_empty() && service.profiles.named(&req.profile).next().is_none() {
            return Err(CredentialHealthError::ProfileUnknown(req.profile).into());
        }
        if !req.credential_id.is_empty()
            && service
                .profiles
                .on_credential(&req.credential_id)
                .next()
                .is_none()
        {
            return Err(CredentialHealthError::CredentialUnknown(req.credential_id).into());
        }
    }
    let mut ids: Vec<String> = entries.iter().map(|p| p.credential_id.clone()).collect();
    ids.sort();
    ids.dedup();
    let states = service.store.states(&ids).await?;
    let org_penalties = service.store.org_penalties(&ids).await?;
    let counts = service.count_active(ids.clone()).await?;
    let now = service.store.now_ms();
    let default_state = crate::domain::policy::CredentialState::default();
    let credentials = ids
        .iter()
        .map(|c| {
            let on: Vec<_> = service.profiles.on_credential(c).collect();
            let (state, incident) = states
                .get(c)
                .map_or((&default_state, None), |(st, i)| (st, i.as_ref()));
            let mut health = view::credential(
                c,
                on.iter().map(|p| p.name.clone()).collect(),
                on.iter().map(|p| p.capacity).sum(),
                Some(counts.active_by_credential.get(c).copied().unwrap_or(0)),
                state,
                incident.map(|i| incident_view(i, now)),
                now,
            );
            health.queued = counts.queued_by_credential.get(c).copied().unwrap_or(0);
            health.orgs = org_penalties
                .get(c)
                .into_iter()
                .flatten()
                .map(|(org, st)| credentials_pb::OrgHealth {
                    org_id: org.clone(),
                    cooling_off_for_seconds: st.cooling_off_for_seconds(now),
                    quarantined_for_seconds: st.quarantined_for_seconds(now),
                })
                .collect();
            health
        })
        .collect();
    let profiles = entries
        .iter()
        .map(|p| {
            let (state, incident) = states
                .get(&p.credential_id)
                .map_or((&default_state, None), |(st, i)| (st, i.as_ref()));
            let cooling = state.cooling_off_for_seconds(now);
            let quarantined = state.quarantined_for_seconds(now);
            let busy = counts
                .active_by_profile_credential
                .get(&format!("{}/{}", p.name, p.credential_id))
                .copied()
                .unwrap_or(0);
            credentials_pb::ProfileHealth {
                profile: p.name.clone(),
                credential_id: p.credential_id.clone(),
                capacity: p.capacity,
                busy,
                free: view::free(p.capacity, busy, cooling, quarantined),
                cooling_off_for_seconds: cooling,
                quarantined_for_seconds: quarantined,
                open_incident_id: incident
                    .filter(|_| cooling > 0)
                    .map(|i| i.id.clone())
                    .unwrap_or_default(),
            }
        })
        .collect();
    Ok(Response::new(credentials_pb::GetFleetResponse {
        credentials,
        profiles,
        observed_at: Some(timestamp(now)),
    }))
}
