//! Signed, short-lived route tokens: `base64url(payload).base64url(HMAC-SHA256(payload))`
//! with payload `sandbox|node|generation|session|expires_unix`. Nodes hold the same key
//! and refuse a token that is forged, expired, or for another sandbox or node.

use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteClaims {
    pub sandbox_id: String,
    pub node_id: String,
    pub execution_generation: u64,
    pub session_id: String,
    pub expires_unix: i64,
}

pub fn sign(key: &[u8], claims: &RouteClaims) -> String {
    let payload = format!(
        "{}|{}|{}|{}|{}",
        claims.sandbox_id,
        claims.node_id,
        claims.execution_generation,
        claims.session_id,
        claims.expires_unix
    );
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes keys of any length");
    mac.update(payload.as_bytes());
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    format!(
        "{}.{}",
        b64.encode(payload),
        b64.encode(mac.finalize().into_bytes())
    )
}

/// The claims of a token this key signed that has not expired at `now_unix`.
pub fn verify(key: &[u8], token: &str, now_unix: i64) -> Option<RouteClaims> {
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let (payload, signature) = token.split_once('.')?;
    let payload = b64.decode(payload).ok()?;
    let mut mac = HmacSha256::new_from_slice(key).ok()?;
    mac.update(&payload);
    mac.verify_slice(&b64.decode(signature).ok()?).ok()?;
    let text = String::from_utf8(payload).ok()?;
    let parts: Vec<&str> = text.split('|').collect();
    let [sandbox_id, node_id, generation, session_id, expires] = parts.as_slice() else {
        return None;
    };
    let claims = RouteClaims {
        sandbox_id: (*sandbox_id).to_owned(),
        node_id: (*node_id).to_owned(),
        execution_generation: generation.parse().ok()?,
        session_id: (*session_id).to_owned(),
        expires_unix: expires.parse().ok()?,
    };
    (claims.expires_unix > now_unix).then_some(claims)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_verify_until_they_expire_and_not_when_forged() {
        let claims = RouteClaims {
            sandbox_id: "s".into(),
            node_id: "n".into(),
            execution_generation: 3,
            session_id: "sess".into(),
            expires_unix: 1000,
        };
        let token = sign(b"key", &claims);
        assert_eq!(verify(b"key", &token, 999), Some(claims.clone()));
        assert_eq!(verify(b"key", &token, 1000), None);
        assert_eq!(verify(b"other", &token, 999), None);
        let forged = sign(
            b"key",
            &RouteClaims {
                node_id: "m".into(),
                ..claims
            },
        );
        let (_, sig) = token.split_once('.').unwrap();
        let (payload, _) = forged.split_once('.').unwrap();
        assert_eq!(verify(b"key", &format!("{payload}.{sig}"), 999), None);
    }
}
