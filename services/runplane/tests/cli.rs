//! The command line as an operator uses it. (Being an integration test of the `runplane`
//! package also makes cargo build the binary that `integration-tests/` starts.)

use std::process::Command;

fn runplane(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_runplane"))
        .args(args)
        .env_remove("RUNPLANE_CONFIG")
        .output()
        .expect("run runplane")
}

#[test]
fn help_names_every_command() {
    let out = runplane(&["--help"]);
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for command in [
        "serve",
        "dev",
        "policies",
        "run",
        "runs",
        "get",
        "logs",
        "cancel",
        "steer",
        "interrupt",
        "receipt",
    ] {
        assert!(
            help.contains(&format!("  {command} ")),
            "{command} missing:\n{help}"
        );
    }
    assert!(help.contains("Exit status:\n  0  success\n  1  "), "{help}");
    let out = runplane(&["receipt", "--help"]);
    let help = String::from_utf8(out.stdout).unwrap();
    for command in ["get", "keygen", "verify"] {
        assert!(
            help.contains(&format!("  {command} ")),
            "{command}:\n{help}"
        );
    }
}

/// A usage error exits 2 and names what was wrong, before anything is sent.
fn assert_usage_error(args: &[&str], expected: &[&str]) {
    let out = runplane(args);
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
    for text in expected {
        assert!(stderr.contains(text), "{args:?}: no {text:?} in {stderr}");
    }
}

#[test]
fn a_bad_state_is_a_usage_error_naming_the_accepted_values() {
    assert_usage_error(
        &["runs", "--state", "runing"],
        &[
            "invalid value 'runing' for '--state <STATE>'",
            "[possible values: queued, starting, running, succeeded, failed, cancelled, backend_error]",
        ],
    );
}

#[test]
fn a_zero_or_garbled_duration_is_a_usage_error() {
    for bad in ["0", "0s", "soon", "90", "1h30"] {
        assert_usage_error(
            &["run", "--max-duration", bad, "--", "true"],
            &[&format!("invalid value '{bad}' for '--max-duration <DUR>'")],
        );
    }
    assert_usage_error(
        &["interrupt", "some-run", "--grace", "5 seconds"],
        &["'--grace <DUR>'", "like 90s, 10m, 2h or 1h30m"],
    );
    assert_usage_error(&["runs", "--limit", "0"], &["'--limit <N>'"]);
    assert_usage_error(&["get"], &["<RUN>"]);
    assert_usage_error(&["steer", "some-run"], &["<TEXT>"]);
}

#[test]
fn policies_prints_every_method_of_the_generated_table() {
    let out = runplane(&["policies"]);
    assert!(out.status.success());
    let table = String::from_utf8(out.stdout).unwrap();
    let rows: Vec<&str> = table.lines().skip(1).collect();
    assert_eq!(rows.len(), runplane_proto_rows());
    let append = rows
        .iter()
        .find(|r| r.starts_with("/runplane.runstore.v1.RunnerService/AppendEvents "))
        .expect("AppendEvents row");
    let columns: Vec<&str> = append.split_whitespace().take(4).collect();
    assert_eq!(
        columns,
        [
            "/runplane.runstore.v1.RunnerService/AppendEvents",
            "keyed",
            "batch_key",
            "ordinary"
        ]
    );
}

/// Counted from the protos themselves, independently of the generated table.
fn runplane_proto_rows() -> usize {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../../proto/runplane");
    let mut count = 0;
    let mut dirs = vec![std::path::PathBuf::from(root)];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "proto") {
                let text = std::fs::read_to_string(&path).unwrap();
                count += text
                    .lines()
                    .filter(|l| l.trim_start().starts_with("rpc "))
                    .count();
            }
        }
    }
    count
}

#[test]
fn an_unknown_service_is_refused_with_the_choices() {
    let out = runplane(&["serve", "billing"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(stderr.contains("invalid value 'billing'"), "{stderr}");
    assert!(stderr.contains("run-store"), "{stderr}");
}

#[test]
fn receipt_keygen_and_verify_work_offline() {
    use base64::Engine;
    use runplane_proto::runstore::v1::{ReceiptBody, Verdict};
    use runplane_run_store::domain::receipt::ReceiptSigner;

    let out = runplane(&["receipt", "keygen"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let seed = text
        .lines()
        .find_map(|l| l.strip_prefix("receipt_signing_key = \""))
        .and_then(|rest| rest.strip_suffix('"'))
        .expect("keygen prints the key as a config line");
    let public_hex = text
        .lines()
        .find_map(|l| l.strip_prefix("# public key: "))
        .expect("keygen prints the public key")
        .trim()
        .to_owned();

    let signer = ReceiptSigner::from_hex(seed).unwrap();
    let receipt = signer.seal(ReceiptBody {
        run_id: "01a22b9d-7bd7-76e7-a072-4dd6efe3ec58".into(),
        org_id: "acme".into(),
        verdict: Some(Verdict {
            outcome: 1,
            reason: "exit_zero".into(),
            exit_code: Some(0),
            ..Default::default()
        }),
        event_count: 7,
        ..Default::default()
    });
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("receipt.json");
    let write = |payload: &[u8]| {
        std::fs::write(
            &file,
            serde_json::json!({"receipt": {
                "signedPayload": b64(payload),
                "signature": b64(&receipt.signature),
                "keyId": receipt.key_id,
            }})
            .to_string(),
        )
        .unwrap();
    };

    write(&receipt.signed_payload);
    let public_b64 = b64(&signer.public_key());
    for key in [public_hex.as_str(), public_b64.as_str()] {
        let out = runplane(&[
            "receipt",
            "verify",
            file.to_str().unwrap(),
            "--public-key",
            key,
        ]);
        let stdout = String::from_utf8(out.stdout).unwrap();
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.starts_with("receipt verified: signed by ed25519:"),
            "{stdout}"
        );
        assert!(stdout.contains("events   7 (0 checks)"), "{stdout}");
    }

    let mut tampered = receipt.signed_payload.clone();
    *tampered.last_mut().unwrap() ^= 1;
    write(&tampered);
    let out = runplane(&[
        "receipt",
        "verify",
        file.to_str().unwrap(),
        "--public-key",
        &public_hex,
    ]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("the signature does not match"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A TCP server that accepts and never says a word: `runplane run` must not hang on it.
#[test]
fn run_at_a_silent_endpoint_fails_within_its_budget_with_a_clear_error() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for socket in listener.incoming() {
            held.push(socket);
        }
    });
    let started = std::time::Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_runplane"))
        .args([
            "run",
            "--endpoint",
            &format!("http://{addr}"),
            "--retry-for",
            "1s",
            "--",
            "true",
        ])
        .env_remove("RUNPLANE_CONFIG")
        .env("RUNPLANE_TOKEN", "silent-endpoint-test-token")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Generous: the budget is 1 s, each attempt a few seconds at most.
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > std::time::Duration::from_secs(40) {
            child.kill().unwrap();
            panic!("runplane run hung on a silent endpoint");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("UNAVAILABLE: no answer from http://{addr}"))
            && stderr.contains("handshake timeout"),
        "a clear error: {stderr}"
    );
}
