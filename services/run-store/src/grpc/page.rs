//! ListRuns' page tokens: bound to the filters they were issued for.

use base64::Engine;
use runplane_ids::RunId;

use crate::domain::ids::digest_hex;
use crate::error::RunStoreError;
use crate::store::RunFilter;

type Result<T> = std::result::Result<T, RunStoreError>;

pub(super) fn page_filter_digest(filter: &RunFilter) -> String {
    digest_hex(
        format!(
            "{:?}|{:?}|{:?}|{:?}|{:?}|{:?}|{}|{:?}|{}",
            filter.org_id,
            filter.lead_id,
            filter.credential_id,
            filter.profile,
            filter.states.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
            filter.run_ids,
            filter.with_pending_messages,
            filter.labels,
            filter.paused_only
        )
        .as_bytes(),
    )[..16]
        .to_owned()
}

pub(super) fn encode_page_token(filter_digest: &str, created_at_us: i64, id: &str) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .encode(format!("v1|{filter_digest}|{created_at_us}|{id}"))
}

pub(super) fn decode_page_token(token: &str, filter_digest: &str) -> Result<(i64, String)> {
    let invalid = || RunStoreError::CursorInvalid;
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(token)
        .map_err(|_| invalid())?;
    let raw = String::from_utf8(raw).map_err(|_| invalid())?;
    let mut parts = raw.splitn(4, '|');
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some("v1"), Some(digest), Some(created), Some(id)) if digest == filter_digest => {
            let created = created.parse().map_err(|_| invalid())?;
            if RunId::parse(id).is_err() {
                return Err(invalid());
            }
            Ok((created, id.to_owned()))
        }
        _ => Err(invalid()),
    }
}
