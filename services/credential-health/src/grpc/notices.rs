//! WatchNotices: a lead's notices from a cursor, then live, with gaps and heartbeats.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use runplane_ids::OrgScope;
use runplane_proto::credentials::v1 as credentials_pb;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use super::state::HealthServiceState;
use super::validate::name;
use crate::error::CredentialHealthError;
use crate::view::timestamp;

/// How often the replica re-reads the notice counters of the leads being watched,
/// without a wake-up (the safety net: other replicas' notices arrive by NOTIFY).
pub const NOTICE_RECHECK: Duration = Duration::from_secs(30);
/// The Postgres channel of new notices; a key is a lead's [`crate::store::notices::notice_key`].
pub const NOTICE_CHANNEL: &str = "runplane_lead_notices";

pub(super) type NoticeStream = Pin<
    Box<dyn Stream<Item = Result<credentials_pb::WatchNoticesResponse, Status>> + Send + 'static>,
>;

pub(super) async fn watch_notices(
    service: Arc<HealthServiceState>,
    request: Request<credentials_pb::WatchNoticesRequest>,
) -> Result<Response<NoticeStream>, Status> {
    let scope = service.caller(&request)?;
    let req = request.into_inner();
    if req.lead_id.is_empty() || req.lead_id.len() > 128 {
        return Err(CredentialHealthError::invalid("lead_id", "must be 1-128 bytes").into());
    }
    // Notices are keyed by (org, lead): the org comes from an org token, or is named
    // by an operator, never guessed.
    let org = match scope
        .org_for(&req.org_id)
        .map_err(CredentialHealthError::from)?
    {
        Some(org) => org.to_owned(),
        // An operator acts in every org, but watches one org's lead.
        None => return Err(CredentialHealthError::invalid("org_id", "is required").into()),
    };
    if scope == OrgScope::Any {
        name("org_id", &org, true)?;
    }
    let heartbeat = runplane_grpc::heartbeat::interval(req.heartbeat_interval.as_ref())
        .map_err(|why| CredentialHealthError::invalid("heartbeat_interval", why))?;
    let mut cursor = match req.after_cursor.as_str() {
        "" => 0,
        c => parse_cursor(c, service.store.last_notice_seq(&org, &req.lead_id).await?)?,
    };
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(async move {
        let mut wake = service
            .notices
            .subscribe(&crate::store::notices::notice_key(&org, &req.lead_id));
        let mut closing = service.closing.subscribe();
        let due = runplane_grpc::heartbeat::Due::new(heartbeat);
        loop {
            let batch = match service
                .store
                .notices_after(&org, &req.lead_id, cursor, 100)
                .await
            {
                Ok(batch) => batch,
                Err(e) => {
                    let _ = tx.send(Err(Status::from(e))).await;
                    return;
                }
            };
            let full = batch.len() == 100;
            let mut missed = 0u32;
            for n in batch {
                // Notices deleted past retention leave a hole in the lead's sequence.
                missed += u32::try_from(n.seq - cursor - 1).unwrap_or(0);
                cursor = n.seq;
                if n.pruned {
                    missed += 1;
                    continue;
                }
                if missed > 0 {
                    let gap = credentials_pb::watch_notices_response::Item::Gap(
                        credentials_pb::NoticesGap { missed },
                    );
                    due.sent();
                    if tx.send(Ok(item(gap))).await.is_err() {
                        return;
                    }
                    missed = 0;
                }
                let notice = credentials_pb::watch_notices_response::Item::Notice(notice_view(&n));
                due.sent();
                if tx.send(Ok(item(notice))).await.is_err() {
                    return;
                }
            }
            if missed > 0 {
                let gap =
                    credentials_pb::watch_notices_response::Item::Gap(credentials_pb::NoticesGap {
                        missed,
                    });
                due.sent();
                if tx.send(Ok(item(gap))).await.is_err() {
                    return;
                }
            }
            if full {
                continue;
            }
            if *closing.borrow() {
                return;
            }
            wake.seen(cursor);
            // Read again only when the lead got a notice; heartbeats cost no query.
            loop {
                let woken = tokio::select! {
                    woken = wake.changed(due.at()) => woken,
                    _ = closing.wait_for(|c| *c) => return,
                    () = tx.closed() => return,
                };
                if woken {
                    break;
                }
                // Nothing sent for an interval: say the stream is alive, and where it is.
                due.sent();
                let heartbeat = credentials_pb::watch_notices_response::Item::Heartbeat(
                    credentials_pb::Heartbeat {
                        cursor: if cursor > 0 {
                            cursor.to_string()
                        } else {
                            String::new()
                        },
                        server_time: Some(timestamp(service.store.now_ms())),
                    },
                );
                if tx.send(Ok(item(heartbeat))).await.is_err() {
                    return;
                }
            }
        }
    });
    Ok(Response::new(Box::pin(
        tokio_stream::wrappers::ReceiverStream::new(rx),
    )))
}

fn item(
    item: credentials_pb::watch_notices_response::Item,
) -> credentials_pb::WatchNoticesResponse {
    credentials_pb::WatchNoticesResponse { item: Some(item) }
}

/// A cursor is the decimal seq of the lead's last notice received; one past the last seq
/// issued to the lead was never issued by this service.
fn parse_cursor(cursor: &str, last_issued: i64) -> Result<i64, CredentialHealthError> {
    match cursor.parse::<i64>() {
        Ok(seq) if (1..=last_issued).contains(&seq) => Ok(seq),
        _ => Err(CredentialHealthError::CursorInvalid(
            "after_cursor was not issued by this service".into(),
        )),
    }
}

fn notice_view(n: &crate::store::entities::notice::Model) -> credentials_pb::Notice {
    credentials_pb::Notice {
        id: n.id.clone(),
        cursor: n.seq.to_string(),
        org_id: n.org_id.clone(),
        lead_id: n.lead_id.clone(),
        kind: match n.kind.as_str() {
            "incident_opened" => credentials_pb::NoticeKind::IncidentOpened,
            _ => credentials_pb::NoticeKind::CredentialQuarantined,
        } as i32,
        credential_id: n.credential_id.clone(),
        incident_id: n.incident_id.clone(),
        affected_run_ids: serde_json::from_str(&n.affected_run_ids).unwrap_or_default(),
        message: n.message.clone(),
        cooling_off_for_seconds: n.cooling_off_for_seconds.max(0) as u32,
        quarantined_for_seconds: n.quarantined_for_seconds.max(0) as u32,
        created_at: Some(timestamp(n.created_at_ms)),
        affected_orgs: serde_json::from_str(&n.affected_orgs).unwrap_or_default(),
    }
}
