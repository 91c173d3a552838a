//! Identifiers the run store mints, and the exact forms it accepts back.

use base64::Engine;
use rand::RngCore;
use sha2::{Digest, Sha256};

/// A run id: a UUID v7, so ids sort by creation time, in the form
/// [`runplane_ids::RunId`] accepts back.
pub fn new_run_id() -> String {
    uuid::Uuid::now_v7().to_string()
}

const MESSAGE_PREFIX: &str = "msg_";

/// A steering message id: `msg_` and 32 lowercase hex digits.
pub fn new_message_id() -> String {
    format!("{MESSAGE_PREFIX}{}", uuid::Uuid::new_v4().simple())
}

/// True only for the exact form [`new_message_id`] produces; acknowledgements of
/// anything else are refused.
pub fn is_message_id(id: &str) -> bool {
    id.len() == MESSAGE_PREFIX.len() + 32
        && id.starts_with(MESSAGE_PREFIX)
        && id[MESSAGE_PREFIX.len()..]
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// A run key's public id, safe to log.
pub fn new_key_id() -> String {
    let mut bytes = [0u8; 12];
    rand::rng().fill_bytes(&mut bytes);
    format!("key_{}", hex(&bytes))
}

/// A run key: 256 random bits, `rk_` + base64url. Shown once; only its hash is stored.
pub fn new_run_key() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    format!(
        "rk_{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    )
}

/// The stored form of a key or token: SHA-256, hex.
pub fn secret_hash(secret: &str) -> String {
    hex(&Sha256::digest(secret.as_bytes()))
}

/// SHA-256 of `bytes`, hex.
pub fn digest_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_ids_are_accepted_only_in_the_issued_form() {
        let id = new_message_id();
        assert!(is_message_id(&id));
        assert!(!is_message_id(&id.to_uppercase()));
        assert!(!is_message_id(&format!("{id}0")));
        assert!(!is_message_id("msg_' OR 1=1 --"));
        assert!(!is_message_id(&id.replace("msg_", "evt_")));
    }

    #[test]
    fn run_keys_are_256_bits_and_distinct() {
        let a = new_run_key();
        let b = new_run_key();
        assert_ne!(a, b);
        let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(&a[3..])
            .unwrap();
        assert_eq!(raw.len(), 32);
        assert_ne!(secret_hash(&a), a);
    }

    #[test]
    fn minted_run_ids_are_run_ids() {
        assert!(runplane_ids::RunId::parse(&new_run_id()).is_ok());
    }
}
