//! Watch streams are heartbeated, and a silent one is re-opened from its cursor.
//!
//! - `runplane run` watching through a connection that wedges (a proxy that stops
//!   forwarding without closing, and keeps answering h2 PINGs, so a keepalive sees
//!   nothing wrong) hears no heartbeat, drops the stream, re-opens it after the last
//!   event it printed on a new connection, prints every line exactly once and finishes.
//! - `runplane notices` through such a connection re-opens from its cursor the same way
//!   and prints the incident's notice once.
//! - An idle WatchRun, Tail and WatchNotices each send heartbeats carrying where the
//!   stream is; an interval outside 1 s to 60 s is INVALID_ARGUMENT.

use std::process::Stdio;
use std::time::Duration;

use runplane_integration_tests::wedge::WedgeProxy;
use runplane_integration_tests::{channel, runplane_bin, start_dev};
use runplane_proto::credentials::v1 as credentials_pb;
use runplane_proto::credentials::v1::credential_health_service_client::CredentialHealthServiceClient;
use runplane_proto::recovery::v1 as recovery_pb;
use runplane_proto::recovery::v1::stream_recovery_service_client::StreamRecoveryServiceClient;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_testkit::authed;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

fn seconds(s: i64) -> Option<prost_types::Duration> {
    Some(prost_types::Duration {
        seconds: s,
        nanos: 0,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_watched_through_a_wedged_connection_is_reopened_from_its_cursor() {
    let data = tempfile::tempdir().unwrap();
    let dev = start_dev(data.path()).await;
    let token = std::fs::read_to_string(data.path().join("operator-token")).unwrap();
    let proxy = WedgeProxy::start(std::slice::from_ref(&dev.address)).await;
    let marker = format!("wedged-watch-{}", std::process::id());
    let _reap = Reap(marker.clone());
    // Twenty lines, then (once a steer arrives, after the watch is wedged) twenty more
    // and the end.
    let script = format!(
        "for i in $(seq 1 20); do echo $i; done; read go; \
         for i in $(seq 21 40); do echo $i; done; : {marker}"
    );
    let mut cli = Command::new(runplane_bin())
        .args(["run", "--endpoint", &proxy.endpoint(), "--heartbeat", "1s"])
        .arg("--token-file")
        .arg(data.path().join("operator-token"))
        .args(["--", "sh", "-c", &script])
        .env_remove("RUNPLANE_CONFIG")
        .env_remove("RUNPLANE_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start runplane run");
    let (created_tx, created) = tokio::sync::oneshot::channel();
    let stderr = {
        let mut lines = BufReader::new(cli.stderr.take().unwrap()).lines();
        tokio::spawn(async move {
            let mut created_tx = Some(created_tx);
            let mut text = String::new();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(id) = line
                    .strip_prefix("runplane: run ")
                    .and_then(|l| l.strip_suffix(" created"))
                    && let Some(tx) = created_tx.take()
                {
                    let _ = tx.send(id.to_owned());
                }
                text.push_str(&line);
                text.push('\n');
            }
            text
        })
    };
    let run_id = tokio::time::timeout(Duration::from_secs(60), created)
        .await
        .expect("runplane run creates the run")
        .unwrap();
    let mut out = BufReader::new(cli.stdout.take().unwrap()).lines();
    let mut lines = Vec::new();
    while lines.last().map(String::as_str) != Some("20") {
        let line = tokio::time::timeout(Duration::from_secs(60), out.next_line())
            .await
            .expect("the first twenty lines arrive")
            .unwrap()
            .expect("more output");
        lines.push(line);
    }

    // The watch's connection goes silent (PINGs still answered); only then, steered
    // directly (not through the proxy), does the agent print the other twenty lines.
    proxy.wedge_open_connections();
    let wedged = proxy.connections();
    RunServiceClient::new(channel(&dev.endpoint()).await)
        .steer(authed(
            runstore_pb::SteerRequest {
                run_id: run_id.clone(),
                text: "go".into(),
                idempotency_key: format!("wedged-watch-steer-{marker}"),
            },
            token.trim(),
        ))
        .await
        .unwrap();

    while let Some(line) = tokio::time::timeout(Duration::from_secs(90), out.next_line())
        .await
        .expect("the watcher re-opens the silent stream and prints the rest")
        .unwrap()
    {
        lines.push(line);
    }
    let status = tokio::time::timeout(Duration::from_secs(60), cli.wait())
        .await
        .expect("runplane run exits after the run ends")
        .unwrap();
    let err = stderr.await.unwrap();
    assert!(status.success(), "runplane run exit {status:?}: {err}");
    let expected: Vec<String> = (1..=40).map(|i| i.to_string()).collect();
    assert_eq!(lines, expected, "every line once, in order: {err}");
    assert!(
        err.contains("runplane: stream silent (nothing, not even a heartbeat, for 3s")
            && err.contains("on a new connection"),
        "the silence is what ended the stream: {err}"
    );
    assert!(
        proxy.connections() > wedged,
        "the re-open went out on a new connection"
    );
    assert!(err.contains("receipt: "), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notices_watched_through_a_wedged_connection_are_reopened_from_the_cursor() {
    let data = tempfile::tempdir().unwrap();
    let dev = start_dev(data.path()).await;
    let proxy = WedgeProxy::start(std::slice::from_ref(&dev.address)).await;
    let cli = |subcommand: &str, endpoint: &str| {
        let mut command = Command::new(runplane_bin());
        command
            .args([subcommand, "--endpoint", endpoint])
            .arg("--token-file")
            .arg(data.path().join("operator-token"))
            .env_remove("RUNPLANE_CONFIG")
            .env_remove("RUNPLANE_TOKEN")
            .stdin(Stdio::null())
            .kill_on_drop(true);
        command
    };
    let mut notices = cli("notices", &proxy.endpoint());
    notices
        .args(["--lead", "me", "--count", "1", "--heartbeat", "1s"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let watcher = notices.spawn().expect("start runplane notices");
    // Its stream is open (the server sent the response headers); then it goes silent.
    runplane_integration_tests::wait_for(
        "the notice stream opens",
        Duration::from_secs(60),
        async || proxy.headers_forwarded() > 0,
    )
    .await;
    proxy.wedge_open_connections();
    let wedged = proxy.connections();

    // Two runs of the lead die on a backend error: one incident, one notice, while the
    // watcher's connection forwards nothing.
    for _ in 0..2 {
        let mut run = cli("run", &dev.endpoint());
        run.args(["--lead", "me", "--", "sh", "-c"])
            .arg("echo 'API Error: No response from API' >&2; exit 1")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let status = run.status().await.unwrap();
        assert_eq!(status.code(), Some(1));
    }

    let output = tokio::time::timeout(Duration::from_secs(90), watcher.wait_with_output())
        .await
        .expect("the watcher re-opens the silent stream and gets the notice")
        .unwrap();
    let out = String::from_utf8_lossy(&output.stdout);
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{err}");
    assert_eq!(out.lines().count(), 1, "the notice once: {out}");
    assert!(
        out.contains("incident_opened") && out.contains("(cursor 1)"),
        "{out}"
    );
    assert!(
        err.contains("notice stream silent (nothing, not even a heartbeat, for 3s")
            && err.contains("on a new connection"),
        "the silence is what ended the stream: {err}"
    );
    assert!(
        proxy.connections() > wedged,
        "the re-open went out on a new connection"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_watches_send_heartbeats_with_their_cursor() {
    let data = tempfile::tempdir().unwrap();
    let dev = start_dev(data.path()).await;
    let token = std::fs::read_to_string(data.path().join("operator-token")).unwrap();
    let token = token.trim();
    let ch = channel(&dev.endpoint()).await;
    let mut runs = RunServiceClient::new(ch.clone());
    let marker = format!("heartbeat-{}", std::process::id());
    let _reap = Reap(marker.clone());
    let run = runs
        .create_run(authed(
            runstore_pb::CreateRunRequest {
                client_request_id: format!("watch-heartbeat-{marker}"),
                org_id: "dev".into(),
                lead_id: "cli".into(),
                target: Some(runstore_pb::create_run_request::Target::CredentialId(
                    "local".into(),
                )),
                command: "sh".into(),
                args: vec!["-c".into(), format!("echo started; sleep 60; : {marker}")],
                ..Default::default()
            },
            token,
        ))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();

    // WatchRun: once the agent printed its line the run is quiet; the stream says so,
    // at the last sequence it sent.
    let mut watch = runs
        .watch_run(authed(
            runstore_pb::WatchRunRequest {
                run_id: run.id.clone(),
                after_sequence: 0,
                states_only: false,
                heartbeat_interval: seconds(1),
            },
            token,
        ))
        .await
        .unwrap()
        .into_inner();
    let mut last_sequence = 0;
    let mut printed = false;
    let heartbeat = loop {
        let item = tokio::time::timeout(Duration::from_secs(30), watch.message())
            .await
            .expect("a quiet WatchRun heartbeats")
            .unwrap()
            .expect("the run is still going");
        match item.update.unwrap() {
            runstore_pb::watch_run_response::Update::Event(e) => {
                last_sequence = e.sequence;
                printed |= e.text == "started";
            }
            runstore_pb::watch_run_response::Update::Heartbeat(h) if printed => break h,
            _ => {}
        }
    };
    assert_eq!(heartbeat.last_sequence, last_sequence, "{heartbeat:?}");
    assert!(heartbeat.server_time.is_some_and(|t| t.seconds > 0));

    // Tail: after the replay caught up, heartbeats name the next frame it will send.
    let mut recovery = StreamRecoveryServiceClient::new(ch.clone());
    let mut tail = recovery
        .tail(authed(
            recovery_pb::TailRequest {
                run_id: run.id.clone(),
                from_sequence: 0,
                follow: true,
                heartbeat_interval: seconds(1),
            },
            token,
        ))
        .await
        .unwrap()
        .into_inner();
    let mut next_sequence = None;
    let heartbeat = loop {
        let item = tokio::time::timeout(Duration::from_secs(30), tail.message())
            .await
            .expect("a quiet Tail heartbeats")
            .unwrap()
            .expect("the run is still going");
        match item.item.unwrap() {
            recovery_pb::tail_response::Item::CaughtUp(c) => next_sequence = Some(c.next_sequence),
            recovery_pb::tail_response::Item::Frame(f) => next_sequence = Some(f.sequence + 1),
            recovery_pb::tail_response::Item::Heartbeat(h) if next_sequence.is_some() => break h,
            _ => {}
        }
    };
    assert_eq!(
        Some(heartbeat.next_sequence),
        next_sequence,
        "{heartbeat:?}"
    );
    assert!(heartbeat.server_time.is_some());

    // WatchNotices of a lead with no notice: heartbeats with an empty cursor.
    let mut credentials = CredentialHealthServiceClient::new(ch.clone());
    let mut notices = credentials
        .watch_notices(authed(
            credentials_pb::WatchNoticesRequest {
                lead_id: "nobody".into(),
                after_cursor: String::new(),
                org_id: "dev".into(),
                heartbeat_interval: seconds(1),
            },
            token,
        ))
        .await
        .unwrap()
        .into_inner();
    let item = tokio::time::timeout(Duration::from_secs(30), notices.message())
        .await
        .expect("a quiet WatchNotices heartbeats")
        .unwrap()
        .expect("the watch follows");
    let Some(credentials_pb::watch_notices_response::Item::Heartbeat(h)) = item.item else {
        panic!("a heartbeat, not {item:?}")
    };
    assert_eq!(h.cursor, "");
    assert!(h.server_time.is_some());

    // An interval outside 1 s to 60 s is refused, naming the field.
    let refused = runs
        .watch_run(authed(
            runstore_pb::WatchRunRequest {
                run_id: run.id.clone(),
                heartbeat_interval: Some(prost_types::Duration {
                    seconds: 0,
                    nanos: 500_000_000,
                }),
                ..Default::default()
            },
            token,
        ))
        .await
        .unwrap_err();
    assert_invalid_heartbeat(&refused);
    let refused = recovery
        .tail(authed(
            recovery_pb::TailRequest {
                run_id: run.id.clone(),
                follow: true,
                heartbeat_interval: seconds(61),
                ..Default::default()
            },
            token,
        ))
        .await
        .unwrap_err();
    assert_invalid_heartbeat(&refused);
    let refused = credentials
        .watch_notices(authed(
            credentials_pb::WatchNoticesRequest {
                lead_id: "nobody".into(),
                org_id: "dev".into(),
                heartbeat_interval: seconds(-1),
                ..Default::default()
            },
            token,
        ))
        .await
        .unwrap_err();
    assert_invalid_heartbeat(&refused);

    // End the run so its sandbox does not outlive the test.
    runs.cancel_run(authed(
        runstore_pb::CancelRunRequest {
            run_id: run.id.clone(),
            reason: "test over".into(),
            idempotency_key: format!("watch-heartbeat-cancel-{marker}"),
        },
        token,
    ))
    .await
    .unwrap();
    runplane_integration_tests::wait_for("the agent stops", Duration::from_secs(60), async || {
        !agent_alive(&marker)
    })
    .await;
}

fn assert_invalid_heartbeat(status: &tonic::Status) {
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    let info = runplane_grpc::error::error_info(status).expect("ErrorInfo");
    assert_eq!(info.reason, "INVALID_FIELD", "{status:?}");
    assert!(
        status.message().contains("heartbeat_interval"),
        "{status:?}"
    );
}

/// Kills, when dropped, every sandbox session with a process whose command line holds
/// the marker, so a failing test leaves no agent behind.
struct Reap(String);

impl Drop for Reap {
    fn drop(&mut self) {
        // Sandboxes run in sessions of their own; never this test's (its `runplane run`
        // carries the marker too).
        let own = session_of(std::process::id());
        for sid in marked(&self.0).into_iter().filter_map(session_of) {
            if Some(sid) == own {
                continue;
            }
            for member in runplane_integration_tests::sandboxes::session_members(sid) {
                let _ = std::process::Command::new("kill")
                    .args(["-KILL", &member.to_string()])
                    .status();
            }
        }
    }
}

fn session_of(pid: u32) -> Option<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()?
        .rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(3)?
        .parse()
        .ok()
}

/// Live processes whose command line holds `marker`.
fn marked(marker: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(marker))
                && runplane_integration_tests::process_alive(*pid as i32)
        })
        .collect()
}

/// Whether a process whose command line holds `marker` is alive.
fn agent_alive(marker: &str) -> bool {
    !marked(marker).is_empty()
}
