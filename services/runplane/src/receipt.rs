//! `runplane receipt`: make a signing key, verify a receipt offline.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use base64::Engine;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::Receipt;
use runplane_run_store::domain::ids::hex;
use runplane_run_store::domain::receipt::{self, ReceiptSigner};

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

/// `runplane receipt get RUN`: GetReceipt's answer on `out`, as grpcurl prints it (what
/// [`verify_file`] reads), and on stderr the signer's public key and the command that
/// checks the receipt with it.
pub async fn get(
    config_file: Option<&Path>,
    args: ReceiptGetArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let mut client = crate::connect::run_store(config_file, &args.connect)?;
    let answer = client
        .get_receipt(runstore_pb::GetReceiptRequest {
            run_id: args.run.clone(),
        })
        .await
        .map_err(crate::connect::rpc)?
        .into_inner();
    let json = crate::protojson::to_value(&answer, GET_RECEIPT_RESPONSE);
    writeln!(out, "{}", serde_json::to_string_pretty(&json)?)?;
    out.flush()?;
    let key_id = answer.receipt.map(|r| r.key_id).unwrap_or_default();
    // A hint only: the receipt is printed whether or not the key can be fetched.
    match client
        .get_receipt_public_key(runstore_pb::GetReceiptPublicKeyRequest {
            key_id: key_id.clone(),
        })
        .await
    {
        Ok(key) => eprintln!(
            "runplane: signed by {key_id}, public key {key}; check with: runplane receipt verify FILE --public-key {key}",
            key = hex(&key.into_inner().public_key)
        ),
        Err(status) => eprintln!(
            "runplane: signed by {key_id}; its public key is not available: {}",
            crate::connect::rpc(status)
        ),
    }
    Ok(())
}

#[derive(Debug, clap::Args)]
pub struct ReceiptGetArgs {
    #[command(flatten)]
    connect: crate::connect::RunStoreConnect,
    /// Run id; the run must have ended (its receipt is sealed then).
    run: String,
}

const GET_RECEIPT_RESPONSE: &str = "runplane.runstore.v1.GetReceiptResponse";

#[derive(Debug, clap::Args)]
pub struct ReceiptVerifyArgs {
    /// The receipt as JSON: what `runplane receipt get` prints (grpcurl's output of
    /// RunService/GetReceipt).
    file: PathBuf,
    /// The signer's public key, 64 hex digits or base64 (GetReceiptPublicKey prints it):
    /// the receipt is then checked offline. Without it the key is fetched from the run
    /// store by the receipt's key id.
    #[arg(long, value_name = "KEY")]
    public_key: Option<String>,
    #[command(flatten)]
    connect: crate::connect::RunStoreConnect,
}

/// `runplane receipt verify FILE`: [`verify_file`] with the key given, or the one the run
/// store serves for the receipt's key id.
pub async fn verify(
    config_file: Option<&Path>,
    args: ReceiptVerifyArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let receipt = read_receipt(&args.file)?;
    let public_key = match args.public_key {
        Some(key) => parse_public_key(&key)?,
        None => {
            if receipt.key_id.is_empty() {
                bail!("the receipt names no keyId: give its signer's key with --public-key");
            }
            let mut client = crate::connect::run_store(config_file, &args.connect)?;
            let answer = client
                .get_receipt_public_key(runstore_pb::GetReceiptPublicKeyRequest {
                    key_id: receipt.key_id.clone(),
                })
                .await
                .map_err(crate::connect::rpc)?
                .into_inner();
            <[u8; 32]>::try_from(answer.public_key.as_slice()).map_err(|_| {
                anyhow::anyhow!(
                    "the run store served a public key of {} bytes for {}",
                    answer.public_key.len(),
                    receipt.key_id
                )
            })?
        }
    };
    print_verified(&receipt, &public_key, out)
}

/// The receipt in `file`: what `receipt get` prints (grpcurl's JSON of GetReceipt), or
/// a Receipt alone. Only the signed payload is trusted: the body shown is the one the
/// signature covers, not the file's `body` field.
fn read_receipt(file: &Path) -> anyhow::Result<Receipt> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", file.display()))?;
    let receipt = if json.get("receipt").is_some() {
        crate::protojson::from_value::<runstore_pb::GetReceiptResponse>(json, GET_RECEIPT_RESPONSE)?
            .receipt
            .unwrap_or_default()
    } else {
        crate::protojson::from_value::<Receipt>(json, "runplane.runstore.v1.Receipt")?
    };
    if receipt.signed_payload.is_empty() {
        bail!("the receipt has no signedPayload");
    }
    if receipt.signature.is_empty() {
        bail!("the receipt has no signature");
    }
    Ok(receipt)
}

fn print_verified(receipt: &Receipt, key: &[u8; 32], out: &mut impl Write) -> anyhow::Result<()> {
    let body = receipt::verify(receipt, key)?;
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
    if !body.attempts.is_empty() {
        writeln!(out, "  attempts {}", body.attempts.len())?;
        for attempt in &body.attempts {
            writeln!(
                out,
                "    attempt {} {} (sandbox {} on {})",
                attempt.number, attempt.end_reason, attempt.sandbox_id, attempt.node_id
            )?;
        }
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
