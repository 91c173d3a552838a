//! ReportTurnFailure: classify a failed turn once and record what it changes.

use runplane_proto::credentials::v1 as credentials_pb;
use runplane_proto::limits::MAX_FAILURE_TAIL_BYTES;
use runplane_telemetry::metrics;
use sha2::{Digest, Sha256};
use tonic::{Request, Response, Status};

use super::state::HealthServiceState;
use super::validate::name;
use crate::error::CredentialHealthError;
use crate::store::Report;

pub(super) async fn report_turn_failure(
    service: &HealthServiceState,
    request: Request<credentials_pb::ReportTurnFailureRequest>,
) -> Result<Response<credentials_pb::ReportTurnFailureResponse>, Status> {
    service.authenticate(&request)?;
    let req = request.into_inner();
    let key_ok = (16..=128).contains(&req.turn_id.len())
        && req.turn_id.bytes().all(|b| b.is_ascii_graphic());
    if !key_ok {
        return Err(CredentialHealthError::invalid(
            "turn_id",
            "must be 16-128 printable ASCII characters",
        )
        .into());
    }
    name("run_id", &req.run_id, true)?;
    name("org_id", &req.org_id, true)?;
    name("lead_id", &req.lead_id, false)?;
    name("credential_id", &req.credential_id, true)?;
    name("profile", &req.profile, false)?;
    if req.failure_tail.len() > MAX_FAILURE_TAIL_BYTES {
        return Err(CredentialHealthError::invalid(
            "failure_tail",
            format!("at most {MAX_FAILURE_TAIL_BYTES} bytes"),
        )
        .into());
    }
    if !req.profile.is_empty() && service.profiles.named(&req.profile).next().is_none() {
        return Err(CredentialHealthError::ProfileUnknown(req.profile).into());
    }
    let Some(profile) = service
        .profiles
        .for_failure(&req.profile, &req.credential_id)
    else {
        // Nobody can map this failure to a credential this service knows: it is
        // dropped from correlation, and loudly, not silently.
        tracing::warn!(
            run_id = %req.run_id,
            credential_id = %req.credential_id,
            profile = %req.profile,
            "turn failure on a credential no profile names; not classified"
        );
        return Err(CredentialHealthError::CredentialUnknown(req.credential_id).into());
    };
    let (outcome, reason) = profile.classify(&req.failure_tail);
    tracing::Span::current().record(
        "outcome",
        crate::store::turn_failures::outcome_name(outcome),
    );
    let on_credential: Vec<(String, u32)> = service
        .profiles
        .on_credential(&req.credential_id)
        .map(|p| (p.name.clone(), p.capacity))
        .collect();
    let request_digest = {
        let mut h = Sha256::new();
        for part in [
            &req.run_id,
            &req.credential_id,
            &req.profile,
            &req.failure_tail,
        ] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part.as_bytes());
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    };
    let shared = service.profiles.shared(&req.credential_id);
    let report = Report {
        shared,
        turn_id: req.turn_id,
        run_id: req.run_id,
        org_id: req.org_id,
        lead_id: req.lead_id,
        credential_id: req.credential_id,
        request_digest,
        outcome,
        reason,
        capacity: on_credential.iter().map(|(_, capacity)| capacity).sum(),
        profiles: on_credential.into_iter().map(|(name, _)| name).collect(),
    };
    let (answer, changes) = service.store.report(&report).await?;
    if changes.opened_incident {
        metrics::credential_incidents().add(1, &[]);
    }
    if changes.quarantined {
        metrics::credential_quarantines().add(1, &[]);
    }
    for lead in &changes.notified_leads {
        service.notices.notify(lead);
        if let Some(relay) = &service.notice_relay {
            relay.publish(lead);
        }
    }
    if changes.outbox {
        service.outbox.send_modify(|n| *n += 1);
    }
    if let Some(incident) = &answer.incident
        && changes.notices > 0
    {
        tracing::warn!(
            incident_id = %incident.id,
            credential_id = %incident.credential_id,
            runs = ?incident.opening_run_ids,
            "backend outage incident: credential cooling off"
        );
    }
    Ok(Response::new(answer))
}
