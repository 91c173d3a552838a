//! Signed, short-lived route tokens: `base64url(payload).base64url(HMAC-SHA256(payload))`
//! with payload `sandbox|node|generation|session|expires_unix`.
//!
//! A token for node N is signed with N's own key, [`node_key`]: an HMAC of the
//! reconciler's route-signing key and N's id. The reconciler hands N that key at
//! registration and no other, so a node verifies the tokens naming it and cannot mint one
//! that another node would accept. The verifier is the node agent's session endpoint
//! (`runplane_node_agent::session`), which also refuses a token for another sandbox, node or
//! generation.

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

/// Node `node_id`'s route key, derived from the route-signing key `key`.
pub fn node_key(key: &[u8], node_id: &str) -> Vec<u8> {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes keys of any length");
    mac.update(b"runplane route token key for node ");
    mac.update(node_id.as_bytes());
    mac.finalize().into_bytes().to_vec()
}

/// The route-signing key when `[sandbox_reconciler].route_token_key` is not set: derived
/// from the service token, so it is never a bearer token itself, and every reconciler
/// replica of one deployment derives the same.
pub fn default_key(service_token: &str) -> Vec<u8> {
    let mut mac = HmacSha256::new_from_slice(service_token.as_bytes())
        .expect("HMAC takes keys of any length");
    mac.update(b"runplane route-signing key");
    mac.finalize().into_bytes().to_vec()
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
    fn each_node_verifies_only_tokens_signed_for_it() {
        let claims = RouteClaims {
            sandbox_id: "s".into(),
            node_id: "a".into(),
            execution_generation: 1,
            session_id: String::new(),
            expires_unix: 1000,
        };
        let key = default_key("service-token");
        let (a, b) = (node_key(&key, "a"), node_key(&key, "b"));
        assert_ne!(a, b);
        assert_ne!(key, node_key(&key, ""));
        let token = sign(&a, &claims);
        assert_eq!(verify(&a, &token, 999), Some(claims));
        assert_eq!(
            verify(&b, &token, 999),
            None,
            "node b's key refuses node a's token"
        );
        assert_eq!(verify(&key, &token, 999), None);
    }

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
