//! Labels and bulk actions through the `runplane` CLI against `runplane dev`, as an
//! operator of two orgs would use them: each org acts with its own org token, and a bulk
//! action touches only the caller's org's live runs that the selector picks.

use std::process::{Output, Stdio};
use std::time::Duration;

use runplane_integration_tests::{Process, runplane_bin, start_dev_with_env};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const ACME: &str = "acme-org-token-0123456789abcdef0123456789";
const BETA: &str = "beta-org-token-0123456789abcdef0123456789";

struct Dev {
    process: Process,
    data: tempfile::TempDir,
}

impl Dev {
    async fn start() -> Self {
        let data = tempfile::tempdir().unwrap();
        let config = data.path().join("runplane.toml");
        std::fs::write(
            &config,
            format!("[auth.org_tokens]\nacme = \"{ACME}\"\nbeta = \"{BETA}\"\n"),
        )
        .unwrap();
        let config = config.display().to_string();
        let process = start_dev_with_env(
            &data.path().join("data"),
            &[("RUNPLANE_CONFIG", config.as_str())],
        )
        .await;
        Self { process, data }
    }

    /// `runplane <args> --endpoint …` acting with `token`.
    fn command(&self, token: &str, args: &[&str]) -> Command {
        let mut command = Command::new(runplane_bin());
        command
            .args(args)
            .arg("--endpoint")
            .arg(self.process.endpoint())
            .current_dir(self.data.path())
            .env_remove("RUNPLANE_CONFIG")
            .env("RUNPLANE_TOKEN", token)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        command
    }

    async fn cli(&self, token: &str, args: &[&str]) -> Output {
        let output = self.command(token, args).output();
        tokio::time::timeout(Duration::from_secs(60), output)
            .await
            .unwrap_or_else(|_| panic!("runplane {args:?} ended within 60 s"))
            .unwrap()
    }

    /// `runplane run --org ORG --label … -- sh -c SCRIPT` in the background; its first
    /// line of output once the agent printed it.
    async fn run(&self, token: &str, org: &str, labels: &[&str], script: &str) -> (Child, String) {
        let mut args = vec!["run", "--org", org];
        for label in labels {
            args.extend(["--label", label]);
        }
        let mut child = self
            .command(token, &args)
            .args(["--", "sh", "-c", script])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .expect("the agent printed within 60 s")
            .unwrap()
            .expect("a line");
        (child, first)
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The ids of the runs `runplane runs --label SELECTOR` lists for `token`.
async fn listed(dev: &Dev, token: &str, selector: &str) -> Vec<String> {
    let out = dev
        .cli(token, &["runs", "--label", selector, "--json"])
        .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let runs: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut ids: Vec<String> = runs
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_str().unwrap().to_owned())
        .collect();
    ids.sort();
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_cancel_by_label_acts_on_the_callers_org_only_once_and_within_its_cap() {
    let dev = Dev::start().await;
    // Each agent prints its labels, then waits.
    let script = "echo \"$RUNPLANE_LABELS\"; exec sleep 300";
    let (_a1, labels) = dev
        .run(ACME, "acme", &["tier=gold", "team=infra"], script)
        .await;
    assert_eq!(labels, "team=infra,tier=gold");
    let (_a2, _) = dev.run(ACME, "acme", &["team=infra"], script).await;
    let (_a3, _) = dev.run(ACME, "acme", &["team=web"], script).await;
    let (_b1, _) = dev.run(BETA, "beta", &["team=infra"], script).await;

    let acme_infra = listed(&dev, ACME, "team=infra").await;
    assert_eq!(acme_infra.len(), 2);
    let beta_infra = listed(&dev, BETA, "team=infra").await;
    assert_eq!(beta_infra.len(), 1);

    // --dry-run lists and does nothing.
    let out = dev
        .cli(ACME, &["cancel", "--label", "team=infra", "--dry-run"])
        .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    assert!(
        said.starts_with("2 live runs match \"team=infra\"; dry run"),
        "{said}"
    );
    for id in &acme_infra {
        assert!(said.contains(id.as_str()), "{said}");
    }
    assert_eq!(listed(&dev, ACME, "team=infra").await, acme_infra);

    // A token of every org names the one it acts in: across two orgs, refused.
    let operator =
        std::fs::read_to_string(dev.data.path().join("data").join("operator-token")).unwrap();
    let out = dev
        .cli(operator.trim(), &["cancel", "--label", "team=infra"])
        .await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    assert!(
        text(&out.stderr).contains(
            "live runs of 2 orgs match \"team=infra\" (acme, beta): nothing was done; name one with --org"
        ),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(listed(&dev, ACME, "team=infra").await, acme_infra);
    let out = dev
        .cli(
            operator.trim(),
            &[
                "cancel",
                "--label",
                "team=infra",
                "--org",
                "beta",
                "--dry-run",
            ],
        )
        .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).starts_with("1 live runs match \"team=infra\"; dry run"),
        "{}",
        text(&out.stdout)
    );

    // Past the cap: refused, nothing done.
    let out = dev
        .cli(ACME, &["cancel", "--label", "team=infra", "--max", "1"])
        .await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    assert!(
        text(&out.stderr)
            .contains("more than 1 live runs match \"team=infra\" (--max 1): nothing was done"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(listed(&dev, ACME, "team=infra").await, acme_infra);

    // The cancel: acme's two, reported one by one; beta's and acme's web run go on.
    let out = dev
        .cli(
            ACME,
            &["cancel", "--label", "team=infra", "--reason", "bulk test"],
        )
        .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    assert!(
        said.starts_with("2 live runs match \"team=infra\"\n"),
        "{said}"
    );
    for id in &acme_infra {
        assert!(said.contains(&format!("run {id}: cancelled")), "{said}");
    }
    let live = |selector: &'static str, token: &'static str| {
        let dev = &dev;
        async move {
            let out = dev
                .cli(
                    token,
                    &["runs", "--label", selector, "--state", "running", "--json"],
                )
                .await;
            let runs: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            runs.as_array().unwrap().len()
        }
    };
    assert_eq!(live("team=infra", BETA).await, 1, "beta's run goes on");
    assert_eq!(live("team=web", ACME).await, 1, "acme's web run goes on");
    assert_eq!(live("team=infra", ACME).await, 0);

    // A retried bulk steer acts once: the second is a replay of the first, per run.
    let steer = || dev.cli(ACME, &["steer", "--label", "team=web", "hello"]);
    let first = steer().await;
    let again = steer().await;
    assert!(first.status.success(), "{}", text(&first.stderr));
    assert_eq!(text(&first.stdout), text(&again.stdout));
    assert!(
        text(&first.stdout).contains(": steer "),
        "{}",
        text(&first.stdout)
    );
}
