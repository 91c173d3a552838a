//! `runplane receipt`: make a signing key, verify a receipt offline.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, bail};
use base64::Engine;
use runplane_proto::runstore::v1::Receipt;
use runplane_run_store::domain::ids::hex;
use runplane_run_store::domain::receipt::{ReceiptSigner, verify};

/// Prints a new receipt signing key and its public key.
pub fn keygen(out: &mut impl Write) -> anyhow::Result<()> {
    let signer = ReceiptSigner::generate();
    writeln!(out, "receipt_signing_key = \"{}\"", signer.seed_hex())?;
    writeln!(out, "# key id:     {}", signer.key_id())?;
    writeln!(out, "# public key: {}", hex(&signer.public_key()))?;
    writeln!(
        out,
        "# keep the signing key secret (RUNPLANE_RUN_STORE__RECEIPT_SIGNING_KEY); share the public key"
    )?;
    Ok(())
}

/// Verifies the receipt in `file` (grpcurl's JSON of GetReceipt, or of a Receipt) against
/// `public_key` (64 hex digits or base64, as GetReceiptPublicKey prints it).
pub fn verify_file(file: &Path, public_key: &str, out: &mut impl Write) -> anyhow::Result<()> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", file.display()))?;
    let receipt_json = json.get("receipt").unwrap_or(&json);
    let bytes = |field: &str| -> anyhow::Result<Vec<u8>> {
        let value = receipt_json
            .get(field)
            .and_then(|v| v.as_str())
            .with_context(|| format!("the receipt has no {field}"))?;
        base64::engine::general_purpose::STANDARD
            .decode(value)
            .with_context(|| format!("{field} is not base64"))
    };
    let receipt = Receipt {
        body: None,
        signed_payload: bytes("signedPayload")?,
        signature: bytes("signature")?,
        key_id: receipt_json
            .get("keyId")
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_owned(),
    };
    let key = parse_public_key(public_key)?;
    let body = verify(&receipt, &key)?;
    let verdict = body.verdict.clone().unwrap_or_default();
    writeln!(out, "receipt verified: signed by {}", body.key_id)?;
    writeln!(out, "  run      {} (org {})", body.run_id, body.org_id)?;
    let exit = verdict
        .exit_code
        .map(|c| format!(", exit code {c}"))
        .unwrap_or_default();
    writeln!(
        out,
        "  verdict  {} ({}{exit})",
        verdict
            .outcome()
            .as_str_name()
            .trim_start_matches("VERDICT_OUTCOME_")
            .to_lowercase(),
        verdict.reason
    )?;
    writeln!(
        out,
        "  events   {} ({} checks)",
        body.event_count,
        body.check_events.len()
    )?;
    for check in &body.check_events {
        writeln!(
            out,
            "    check #{} {} {}",
            check.sequence,
            check.name,
            hex(&check.digest)
        )?;
    }
    writeln!(out, "  chain    {}", hex(&body.chain_head))?;
    if let Some(sealed) = body
        .sealed_at
        .and_then(|t| chrono::DateTime::from_timestamp(t.seconds, t.nanos as u32))
    {
        writeln!(out, "  sealed   {}", sealed.to_rfc3339())?;
    }
    Ok(())
}

fn parse_public_key(text: &str) -> anyhow::Result<[u8; 32]> {
    let text = text.trim();
    let raw = if text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit()) {
        (0..32)
            .map(|i| u8::from_str_radix(&text[2 * i..2 * i + 2], 16))
            .collect::<Result<Vec<u8>, _>>()?
    } else {
        base64::engine::general_purpose::STANDARD
            .decode(text)
            .context("the public key is neither 64 hex digits nor base64")?
    };
    match <[u8; 32]>::try_from(raw.as_slice()) {
        Ok(key) => Ok(key),
        Err(_) => bail!(
            "an Ed25519 public key is 32 bytes, this one is {}",
            raw.len()
        ),
    }
}
