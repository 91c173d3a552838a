//! ListIncidents: pages of incidents, newest first, behind tokens bound to the filters.

use runplane_proto::credentials::v1 as credentials_pb;
use sha2::{Digest, Sha256};
use tonic::{Request, Response, Status};

use super::state::HealthServiceState;
use super::validate::name;
use crate::error::CredentialHealthError;
use crate::store::incidents::incident_view;

pub(super) async fn list_incidents(
    service: &HealthServiceState,
    request: Request<credentials_pb::ListIncidentsRequest>,
) -> Result<Response<credentials_pb::ListIncidentsResponse>, Status> {
    service.authenticate(&request)?;
    let req = request.into_inner();
    name("credential_id", &req.credential_id, false)?;
    let state = credentials_pb::IncidentState::try_from(req.state)
        .map_err(|_| CredentialHealthError::invalid("state", "unknown incident state"))?;
    let limit = runplane_grpc::page_size(req.page_size, 50)
        .map_err(|reason| CredentialHealthError::invalid("page_size", reason))?;
    let filters = format!("{}|{}", req.credential_id, req.state);
    let after = match req.page_token.as_str() {
        "" => None,
        token => Some(decode_page_token(token, &filters)?),
    };
    let mut rows = service
        .store
        .incidents(
            (!req.credential_id.is_empty()).then_some(req.credential_id.as_str()),
            state,
            after,
            u64::from(limit) + 1,
        )
        .await?;
    let next_page_token = if rows.len() > limit as usize {
        rows.truncate(limit as usize);
        let last = rows.last().expect("a full page");
        format!(
            "{}:{}:{}",
            page_filter_tag(&filters),
            last.opened_at_ms,
            last.id
        )
    } else {
        String::new()
    };
    let now = service.store.now_ms();
    Ok(Response::new(credentials_pb::ListIncidentsResponse {
        incidents: rows.iter().map(|i| incident_view(i, now)).collect(),
        next_page_token,
    }))
}

fn page_filter_tag(filters: &str) -> String {
    let digest = Sha256::digest(filters.as_bytes());
    digest[..6].iter().map(|b| format!("{b:02x}")).collect()
}

fn decode_page_token(token: &str, filters: &str) -> Result<(i64, String), CredentialHealthError> {
    let invalid = || {
        CredentialHealthError::CursorInvalid("page_token was not issued for these filters".into())
    };
    let mut parts = token.splitn(3, ':');
    let (Some(tag), Some(at), Some(id)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(invalid());
    };
    if tag != page_filter_tag(filters) {
        return Err(invalid());
    }
    Ok((at.parse().map_err(|_| invalid())?, id.to_owned()))
}
