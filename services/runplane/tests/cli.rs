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
    for command in ["serve", "dev", "policies"] {
        assert!(
            help.contains(&format!("  {command} ")),
            "{command} missing:\n{help}"
        );
    }
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
