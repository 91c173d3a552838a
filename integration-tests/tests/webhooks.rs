//! Lifecycle webhooks end to end: `runplane dev` configured with `[[run_store.webhooks]]`
//! (a config file, as an operator writes it) POSTs to a real HTTP server in the test;
//! every delivery's signature is checked by an independent implementation of Standard
//! Webhooks (Python's `hmac`), and an endpoint that is down for a minute gets every
//! event once it is back.

use std::path::Path;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use runplane_integration_tests::webhook_receiver::{Received, Receiver, verify_with_python};
use runplane_integration_tests::{Process, runplane_bin, start_dev_on};
use runplane_testkit::free_local_addr;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const FAILED_ONLY_SECRET: &str = "whsec_c2Vjb25kLWVuZHBvaW50LXNlY3JldC0zMmJ5dGVzISE=";

struct Dev {
    process: Process,
    data: tempfile::TempDir,
}

impl Dev {
    /// `runplane dev` with `config` (TOML) as its config file.
    async fn start(config: &str) -> Self {
        let data = tempfile::tempdir().unwrap();
        let file = data.path().join("runplane.toml");
        std::fs::write(&file, config).unwrap();
        let process = start_dev_on(
            data.path(),
            &free_local_addr().to_string(),
            &[("RUNPLANE_CONFIG", file.to_str().unwrap())],
        )
        .await;
        Self { process, data }
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(runplane_bin());
        command
            .args(args)
            .arg("--endpoint")
            .arg(self.process.endpoint())
            .arg("--token-file")
            .arg(self.data.path().join("operator-token"))
            .env_remove("RUNPLANE_CONFIG")
            .env_remove("RUNPLANE_TOKEN")
            .stdin(Stdio::null())
            .kill_on_drop(true);
        command
    }

    async fn cli(&self, args: &[&str]) -> Output {
        tokio::time::timeout(Duration::from_secs(90), self.command(args).output())
            .await
            .unwrap_or_else(|_| panic!("runplane {args:?} ended within 90 s"))
            .unwrap()
    }

    /// `runplane run [flags] -- command` to its end; the run's id and the exit code.
    async fn run(&self, flags: &[&str], command: &[&str]) -> (String, Option<i32>) {
        let mut args = vec!["run"];
        args.extend_from_slice(flags);
        let mut line = self.command(&args);
        line.arg("--").args(command);
        let out = tokio::time::timeout(Duration::from_secs(90), line.output())
            .await
            .expect("the run ends within 90 s")
            .unwrap();
        (run_id(&text(&out.stderr)), out.status.code())
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn run_id(stderr: &str) -> String {
    stderr
        .lines()
        .find_map(|l| l.strip_prefix("runplane: run ")?.strip_suffix(" created"))
        .unwrap_or_else(|| panic!("runplane run names its run: {stderr}"))
        .to_owned()
}

/// The (run, event) pairs received, in order.
fn events(received: &[Received]) -> Vec<(String, String)> {
    received
        .iter()
        .map(|r| {
            let body = r.json();
            (
                body["data"]["run_id"].as_str().unwrap().to_owned(),
                body["type"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn has(received: &[Received], run: &str, event: &str) -> bool {
    events(received).iter().any(|(r, e)| r == run && e == event)
}

fn webhook_config(entries: &[(&str, &str, &str)], delivery: &str) -> String {
    let mut config = String::new();
    for (url, secret, extra) in entries {
        config.push_str(&format!(
            "[[run_store.webhooks]]\nurl = \"{url}\"\nsecret = \"{secret}\"\nallow_private_targets = true\n{extra}\n"
        ));
    }
    config.push_str(&format!("[run_store.webhook_delivery]\n{delivery}\n"));
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_lifecycle_events_are_delivered_signed_to_the_endpoints_that_take_them() {
    let all = Receiver::start("127.0.0.1:0").await;
    let failed_only = Receiver::start("127.0.0.1:0").await;
    let mut dev = Dev::start(&webhook_config(
        &[
            (&all.url(), SECRET, ""),
            (
                &failed_only.url(),
                FAILED_ONLY_SECRET,
                "events = [\"run.failed\"]\norgs = [\"dev\"]",
            ),
        ],
        "",
    ))
    .await;

    let (succeeded, code) = dev.run(&["--label", "team=a"], &["echo", "hi"]).await;
    assert_eq!(code, Some(0));
    let (failed, code) = dev.run(&[], &["sh", "-c", "exit 3"]).await;
    assert_eq!(code, Some(3), "runplane run exits with the agent's status");
    // A run cancelled while it works.
    let mut sleeper = dev
        .command(&["run"])
        .args(["--", "sleep", "60"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(sleeper.stderr.take().unwrap()).lines();
    let cancelled = loop {
        let line = stderr
            .next_line()
            .await
            .unwrap()
            .expect("runplane run says its run");
        if line.contains(" created") {
            break run_id(&line);
        }
    };
    all.wait_for(Duration::from_secs(60), |r| {
        has(r, &cancelled, "run.started")
    })
    .await;
    let out = dev
        .cli(&["cancel", &cancelled, "--reason", "webhook test"])
        .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let _ = sleeper.wait().await;

    let expected = [
        (&succeeded, "run.started"),
        (&succeeded, "run.succeeded"),
        (&failed, "run.started"),
        (&failed, "run.failed"),
        (&cancelled, "run.started"),
        (&cancelled, "run.cancelled"),
    ];
    let got = all
        .wait_for(Duration::from_secs(30), |r| {
            expected.iter().all(|(run, event)| has(r, run, event))
        })
        .await;
    for delivery in &got {
        assert_eq!(
            (delivery.method.as_str(), delivery.path.as_str()),
            ("POST", "/hook")
        );
        assert_eq!(delivery.header("content-type"), "application/json");
        assert!(
            delivery.header("webhook-id").starts_with("msg_"),
            "{delivery:?}"
        );
        assert!(
            verify_with_python(SECRET, delivery),
            "the signature verifies independently: {delivery:?}"
        );
        assert!(
            !verify_with_python(FAILED_ONLY_SECRET, delivery),
            "and only with its own endpoint's secret"
        );
    }
    let body_of = |run: &str, event: &str| {
        got.iter()
            .map(Received::json)
            .find(|b| b["data"]["run_id"] == run && b["type"] == event)
            .unwrap()
    };
    let body = body_of(&succeeded, "run.succeeded");
    assert_eq!(body["data"]["org_id"], "dev");
    assert_eq!(body["data"]["lead_id"], "cli");
    assert_eq!(body["data"]["labels"]["team"], "a");
    assert_eq!(body["data"]["state"], "succeeded");
    assert_eq!(body["data"]["verdict"]["reason"], "exit_zero");
    assert_eq!(body["data"]["attempt"], 1);
    assert!(body["timestamp"].as_str().unwrap().ends_with('Z'), "{body}");
    let body = body_of(&failed, "run.failed");
    assert_eq!(body["data"]["verdict"]["exit_code"], 3);
    assert_eq!(
        body_of(&cancelled, "run.cancelled")["data"]["verdict"]["message"],
        "webhook test"
    );
    let started = body_of(&succeeded, "run.started");
    assert!(started["data"]["verdict"].is_null(), "{started}");

    // The second endpoint takes run.failed only.
    let only = failed_only
        .wait_for(Duration::from_secs(30), |r| has(r, &failed, "run.failed"))
        .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        events(&failed_only.received()),
        [(failed.clone(), "run.failed".to_owned())],
        "{only:?}"
    );
    assert!(verify_with_python(FAILED_ONLY_SECRET, &only[0]));

    // `runplane webhooks` lists both, never a secret.
    let out = dev.cli(&["webhooks"]).await;
    let listing = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(listing.contains(&all.url()), "{listing}");
    assert!(listing.contains("run.failed"), "{listing}");
    let row = listing
        .lines()
        .find(|l| l.contains(&all.url()))
        .unwrap()
        .split_whitespace()
        .collect::<Vec<_>>();
    assert_eq!(&row[2..7], ["all", "all", "0", "6", "0"], "{listing}");
    assert!(dev.process.terminate().await.success());
    let logs = dev.process.stderr().await;
    for secret in [SECRET, FAILED_ONLY_SECRET] {
        let key = secret.trim_start_matches("whsec_");
        assert!(!listing.contains(key));
        assert!(!logs.contains(key), "logs hold no secret");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_down_for_a_minute_then_receives_every_event() {
    let address = free_local_addr();
    let url = format!("http://{address}/hook");
    let dev = Dev::start(&webhook_config(
        &[(&url, SECRET, "")],
        "max_backoff_seconds = 5",
    ))
    .await;
    let down_since = Instant::now();
    let mut runs = Vec::new();
    for i in 0..3 {
        let (id, code) = dev.run(&[], &["echo", &i.to_string()]).await;
        assert_eq!(code, Some(0), "runs end while their endpoint is down");
        runs.push(id);
    }
    // The listing says the endpoint fails and what waits.
    let out = dev.cli(&["webhooks"]).await;
    let listing = text(&out.stdout);
    assert!(listing.contains("cannot connect"), "{listing}");
    let row: Vec<&str> = listing
        .lines()
        .find(|l| l.contains(&url))
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(
        &row[4..7],
        ["6", "0", "0"],
        "six deliveries wait: {listing}"
    );

    tokio::time::sleep(Duration::from_secs(60).saturating_sub(down_since.elapsed())).await;
    let receiver = Receiver::start(&address.to_string()).await;
    let got = receiver
        .wait_for(Duration::from_secs(30), |r| {
            runs.iter()
                .all(|run| has(r, run, "run.started") && has(r, run, "run.succeeded"))
        })
        .await;
    for delivery in &got {
        assert!(verify_with_python(SECRET, delivery), "{delivery:?}");
    }
    let out = dev.cli(&["webhooks"]).await;
    let listing = text(&out.stdout);
    let row: Vec<&str> = listing
        .lines()
        .find(|l| l.contains(&url))
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(&row[4..7], ["0", "6", "0"], "{listing}");
}

/// An endpoint that accepts connections and never answers holds only its own
/// deliveries: runs end as usual and another endpoint gets every event meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_that_never_answers_delays_no_run_and_no_other_endpoint() {
    let black_hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_url = format!("http://{}/hook", black_hole.local_addr().unwrap());
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((socket, _)) = black_hole.accept().await {
            open.push(socket);
        }
    });
    let receiver = Receiver::start("127.0.0.1:0").await;
    let dev = Dev::start(&webhook_config(
        &[
            (&silent_url, FAILED_ONLY_SECRET, ""),
            (&receiver.url(), SECRET, ""),
        ],
        "timeout_ms = 60000\nmax_in_flight = 2",
    ))
    .await;
    let mut runs = Vec::new();
    for i in 0..3 {
        let (id, code) = dev.run(&[], &["echo", &i.to_string()]).await;
        assert_eq!(code, Some(0));
        runs.push(id);
    }
    receiver
        .wait_for(Duration::from_secs(30), |r| {
            runs.iter()
                .all(|run| has(r, run, "run.started") && has(r, run, "run.succeeded"))
        })
        .await;
    let out = dev.cli(&["webhooks"]).await;
    let listing = text(&out.stdout);
    let row: Vec<&str> = listing
        .lines()
        .find(|l| l.contains(&silent_url))
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(
        &row[4..7],
        ["6", "0", "0"],
        "the silent endpoint's wait: {listing}"
    );
    held.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_that_is_not_http_or_targets_a_private_address_stops_the_start() {
    for (entry, expected) in [
        (
            "url = \"ftp://hooks.example.com/\"\nsecret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"",
            "run_store.webhooks[0].url: must be an http:// or https:// URL",
        ),
        (
            "url = \"http://169.254.169.254/latest\"\nsecret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"",
            "run_store.webhooks[0].url: targets a loopback, private or link-local address",
        ),
        (
            "url = \"https://hooks.example.com/\"\nsecret = \"hunter2-not-a-whsec\"",
            "run_store.webhooks[0].secret: must start with whsec_",
        ),
    ] {
        let data = tempfile::tempdir().unwrap();
        let file = data.path().join("runplane.toml");
        std::fs::write(&file, format!("[[run_store.webhooks]]\n{entry}\n")).unwrap();
        let out = start_refused(data.path(), &file).await;
        assert!(out.contains(expected), "{out}");
        assert!(!out.contains("hunter2"), "the secret is not echoed: {out}");
    }
}

async fn start_refused(data: &Path, config: &Path) -> String {
    let out = Command::new(runplane_bin())
        .args(["dev", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data)
        .env("RUNPLANE_CONFIG", config)
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    text(&out.stderr)
}
