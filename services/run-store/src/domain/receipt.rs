//! Receipts: the signed seal of a terminal run.
//!
//! The signed bytes are the protobuf encoding of `ReceiptBody` (no maps, so the encoding
//! is deterministic). Verifiers check the Ed25519 signature over exactly those bytes and
//! decode the body from them; they never re-encode.

use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};
use prost::Message;
use runplane_proto::runstore::v1::{Receipt, ReceiptBody};
use sha2::{Digest, Sha256};

use super::ids::hex;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReceiptKeyError {
    #[error("a receipt signing key is 64 hex digits (a 32-byte Ed25519 seed)")]
    Malformed,
    #[error("a receipt public key is 64 hex digits of a valid Ed25519 public key")]
    MalformedPublic,
}

/// The public key written as 64 hex digits, with its key id: a retired key that still
/// verifies the receipts it signed.
pub fn public_key_from_hex(public_hex: &str) -> Result<(String, [u8; 32]), ReceiptKeyError> {
    let raw = decode_hex_32(public_hex.trim()).ok_or(ReceiptKeyError::MalformedPublic)?;
    let key = VerifyingKey::from_bytes(&raw).map_err(|_| ReceiptKeyError::MalformedPublic)?;
    Ok((key_id_of(&key), raw))
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum VerifyError {
    #[error("the receipt has no signed payload or signature")]
    Incomplete,
    #[error("the public key is not a valid Ed25519 key")]
    BadPublicKey,
    #[error("the receipt was signed by key {receipt} but the public key given is {given}")]
    WrongKey { receipt: String, given: String },
    #[error("the signature does not match the signed payload")]
    BadSignature,
    #[error("the signed payload is not a receipt body")]
    BadPayload,
}

/// The Ed25519 key receipts are signed with.
#[derive(Clone)]
pub struct ReceiptSigner {
    key: SigningKey,
    key_id: String,
}

impl std::fmt::Debug for ReceiptSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReceiptSigner")
            .field("key_id", &self.key_id)
            .finish_non_exhaustive()
    }
}

/// `ed25519:` and the first 16 hex digits of SHA-256(public key).
pub fn key_id_of(public_key: &VerifyingKey) -> String {
    format!(
        "ed25519:{}",
        &hex(&Sha256::digest(public_key.as_bytes()))[..16]
    )
}

impl ReceiptSigner {
    /// From the 32-byte seed written as 64 hex digits.
    pub fn from_hex(seed_hex: &str) -> Result<Self, ReceiptKeyError> {
        let seed = decode_hex_32(seed_hex.trim()).ok_or(ReceiptKeyError::Malformed)?;
        Ok(Self::from_seed(seed))
    }

    pub fn from_seed(seed: [u8; 32]) -> Self {
        let key = SigningKey::from_bytes(&seed);
        let key_id = key_id_of(&key.verifying_key());
        Self { key, key_id }
    }

    /// A new random key, as `runplane receipt keygen` and `runplane dev` make one.
    pub fn generate() -> Self {
        use rand::RngCore;
        let mut seed = [0u8; 32];
        rand::rng().fill_bytes(&mut seed);
        Self::from_seed(seed)
    }

    /// The seed as 64 hex digits, for writing the key down once.
    pub fn seed_hex(&self) -> String {
        hex(self.key.as_bytes())
    }

    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    pub fn public_key(&self) -> [u8; 32] {
        self.key.verifying_key().to_bytes()
    }

    /// Signs `body` (whose `key_id` is set to this key's id).
    pub fn seal(&self, mut body: ReceiptBody) -> Receipt {
        body.key_id = self.key_id.clone();
        let signed_payload = body.encode_to_vec();
        let signature = self.key.sign(&signed_payload).to_bytes().to_vec();
        Receipt {
            body: Some(body),
            signed_payload,
            signature,
            key_id: self.key_id.clone(),
        }
    }
}

/// Checks `receipt` against `public_key` and returns the body decoded from the signed
/// bytes.
pub fn verify(receipt: &Receipt, public_key: &[u8; 32]) -> Result<ReceiptBody, VerifyError> {
    if receipt.signed_payload.is_empty() || receipt.signature.is_empty() {
        return Err(VerifyError::Incomplete);
    }
    let key = VerifyingKey::from_bytes(public_key).map_err(|_| VerifyError::BadPublicKey)?;
    let given = key_id_of(&key);
    if !receipt.key_id.is_empty() && receipt.key_id != given {
        return Err(VerifyError::WrongKey {
            receipt: receipt.key_id.clone(),
            given,
        });
    }
    let signature =
        Signature::from_slice(&receipt.signature).map_err(|_| VerifyError::BadSignature)?;
    key.verify(&receipt.signed_payload, &signature)
        .map_err(|_| VerifyError::BadSignature)?;
    ReceiptBody::decode(receipt.signed_payload.as_slice()).map_err(|_| VerifyError::BadPayload)
}

fn decode_hex_32(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, chunk) in s.as_bytes().chunks(2).enumerate() {
        let pair = std::str::from_utf8(chunk).ok()?;
        out[i] = u8::from_str_radix(pair, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body() -> ReceiptBody {
        ReceiptBody {
            run_id: "r".into(),
            org_id: "o".into(),
            event_count: 3,
            chain_head: vec![7; 32],
            ..Default::default()
        }
    }

    #[test]
    fn a_sealed_receipt_verifies_and_a_tampered_one_does_not() {
        let signer = ReceiptSigner::generate();
        let receipt = signer.seal(body());
        let decoded = verify(&receipt, &signer.public_key()).expect("verifies");
        assert_eq!(decoded.event_count, 3);
        assert_eq!(decoded.key_id, signer.key_id());

        let mut tampered = receipt.clone();
        let last = tampered.signed_payload.len() - 1;
        tampered.signed_payload[last] ^= 1;
        assert_eq!(
            verify(&tampered, &signer.public_key()),
            Err(VerifyError::BadSignature)
        );

        let other = ReceiptSigner::generate();
        assert!(matches!(
            verify(&receipt, &other.public_key()),
            Err(VerifyError::WrongKey { .. })
        ));
    }

    #[test]
    fn the_seed_round_trips_through_hex() {
        let signer = ReceiptSigner::generate();
        let again = ReceiptSigner::from_hex(&signer.seed_hex()).unwrap();
        assert_eq!(again.key_id(), signer.key_id());
        assert_eq!(
            ReceiptSigner::from_hex("abc").unwrap_err(),
            ReceiptKeyError::Malformed
        );
    }
}
