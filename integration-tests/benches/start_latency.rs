//! How long a run of `true` takes from CreateRun to its verdict and receipt, stage by
//! stage, on `runplane dev` (one process, SQLite) and on the split topology (one
//! `runplane serve <service>` per service, Postgres and Redis, the reconciler's round at
//! its production default of 2 s so only the event-driven dispatch can be fast).
//!
//! Runs are sequential, one warm-up run first, [`RUNS`] measured per topology, through one
//! client connection per service kept open across runs (as a long-lived client would).
//! Each run's stage boundaries, in order, and the clock each comes from:
//!
//! | boundary | recorded by | clock |
//! |---|---|---|
//! | CreateRun sent | this bench, just before the call | bench `SystemTime` |
//! | run created | run store: `Run.created_at`, stamped after admission | run store |
//! | sandbox placed | reconciler: `Sandbox.created_at` (SandboxService.ListSandboxes), stamped after ClaimSlots | reconciler |
//! | sandbox spawned | process driver: modification time of `<state_dir>/<sandbox>/pid`, written once the sandbox shell is exec'd | kernel file timestamp |
//! | Hello claimed | run store: `Run.started_at`, the runner's first Hello | run store |
//! | verdict recorded | run store: `Run.ended_at`, the SubmitResult that made it terminal | run store |
//! | verdict seen | this bench: WatchRun (states only) delivered the terminal snapshot | bench `SystemTime` |
//! | receipt fetched | this bench: GetReceipt returned the signed receipt | bench `SystemTime` |
//!
//! Every process runs on this machine, so all of them read the same realtime clock; the
//! file timestamp is the kernel's, which may lag that clock by up to one tick (a few ms).
//! The stages are the gaps between consecutive boundaries: admission (incl. the
//! credential-health call), dispatch (WaitForRuns wake-up, ClaimSlots, the sandbox row),
//! spawn (IssueRunKey, the workspace, fork/exec), hello (the runner binary starting,
//! connecting and claiming its key), verdict (the agent in its sandbox, the output drain,
//! the stream lease, SubmitResult) and receipt (WatchRun's wake-up and GetReceipt). No
//! record splits the verdict stage further: a `true` agent writes no events.
//!
//! Run: `cargo build --release -p runplane && cargo bench -p runplane-integration-tests
//! --bench start_latency` (the split half needs the local Postgres and Redis). Prints one
//! table, in ms, with the goal (p50 ≤ 100 ms from CreateRun to the verdict, on dev)
//! beside its figure.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use runplane_integration_tests::split::{self, Split};
use runplane_integration_tests::{Process, channel, start_dev_with_env};
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::reconciler::v1::sandbox_service_client::SandboxServiceClient;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_testkit::authed;
use tonic::transport::Channel;

const RUNS: usize = 200;
const GOAL_P50_MS: f64 = 100.0;
/// A run that has not ended by then is a broken system, not a slow one.
const RUN_TIMEOUT: Duration = Duration::from_secs(30);
/// The split topology's profile; `runplane dev` embeds the same one.
const PROFILE_CONFIG: &str = r#"
[[credential_health.profiles]]
name = "default"
credential_id = "local"
capacity = 8
error_pattern = "API Error:"
exhausted_pattern = "quota exceeded"
"#;

/// The stages, each the gap between two consecutive boundaries of [`Boundaries`].
const STAGES: [(&str, &str); 6] = [
    ("admission", "CreateRun sent → run created_at"),
    ("dispatch", "created_at → sandbox created_at"),
    ("spawn", "sandbox created_at → pid file written"),
    ("hello", "pid file → run started_at"),
    ("verdict", "started_at → run ended_at"),
    ("receipt", "ended_at → GetReceipt returned"),
];

/// One topology as the bench drives it.
struct Target {
    runs: RunServiceClient<Channel>,
    sandboxes: SandboxServiceClient<Channel>,
    token: String,
    /// The reconciler's `state_dir`, where each sandbox has a directory named by its id.
    state_dir: PathBuf,
    org_id: &'static str,
}

/// When one run crossed each boundary, in order (see the module doc for the clocks).
struct Boundaries {
    sent: SystemTime,
    created: SystemTime,
    placed: SystemTime,
    spawned: SystemTime,
    hello: SystemTime,
    ended: SystemTime,
    verdict_seen: SystemTime,
    receipt_fetched: SystemTime,
}

/// One run's stage durations and client-side totals, in ms.
struct Sample {
    stages: [f64; STAGES.len()],
    to_verdict: f64,
    total: f64,
}

/// `later - earlier` in ms, negative when the clocks' granularity puts them the other way.
fn ms_between(earlier: SystemTime, later: SystemTime) -> f64 {
    match later.duration_since(earlier) {
        Ok(d) => d.as_secs_f64() * 1e3,
        Err(e) => -e.duration().as_secs_f64() * 1e3,
    }
}

impl Boundaries {
    fn sample(&self) -> Sample {
        let order = [
            self.sent,
            self.created,
            self.placed,
            self.spawned,
            self.hello,
            self.ended,
            self.receipt_fetched,
        ];
        let mut stages = [0.0; STAGES.len()];
        for (stage, pair) in stages.iter_mut().zip(order.windows(2)) {
            *stage = ms_between(pair[0], pair[1]);
        }
        Sample {
            stages,
            to_verdict: ms_between(self.sent, self.verdict_seen),
            total: ms_between(self.sent, self.receipt_fetched),
        }
    }
}

fn timestamp(ts: Option<prost_types::Timestamp>, what: &str) -> SystemTime {
    ts.and_then(|ts| SystemTime::try_from(ts).ok())
        .unwrap_or_else(|| panic!("{what} is not recorded"))
}

impl Target {
    async fn new(
        run_store: &str,
        reconciler: &str,
        token: String,
        state_dir: &Path,
        org_id: &'static str,
    ) -> Self {
        Self {
            runs: RunServiceClient::new(channel(run_store).await),
            sandboxes: SandboxServiceClient::new(channel(reconciler).await),
            token,
            state_dir: state_dir.to_owned(),
            org_id,
        }
    }

    /// Runs `true` once to its receipt and reads back when each stage ended.
    async fn run_true(&mut self, request_id: String) -> Boundaries {
        let sent = SystemTime::now();
        let run = self
            .runs
            .create_run(authed(
                runstore_pb::CreateRunRequest {
                    client_request_id: request_id,
                    org_id: self.org_id.into(),
                    target: Some(runstore_pb::create_run_request::Target::Profile(
                        "default".into(),
                    )),
                    command: "true".into(),
                    ..Default::default()
                },
                &self.token,
            ))
            .await
            .expect("CreateRun")
            .into_inner()
            .run
            .expect("CreateRun answers the run");
        let ended = tokio::time::timeout(RUN_TIMEOUT, self.watch_to_end(&run.id))
            .await
            .unwrap_or_else(|_| panic!("run {} did not end within {RUN_TIMEOUT:?}", run.id));
        let verdict_seen = SystemTime::now();
        assert_eq!(ended.state(), runstore_pb::RunState::Succeeded, "{ended:?}");
        self.runs
            .get_receipt(authed(
                runstore_pb::GetReceiptRequest {
                    run_id: run.id.clone(),
                },
                &self.token,
            ))
            .await
            .expect("GetReceipt")
            .into_inner()
            .receipt
            .expect("a sealed receipt");
        let receipt_fetched = SystemTime::now();
        let sandbox = self.only_sandbox(&run.id).await;
        Boundaries {
            sent,
            created: timestamp(ended.created_at, "run created_at"),
            placed: timestamp(sandbox.created_at, "sandbox created_at"),
            spawned: self.spawned_at(&sandbox.id),
            hello: timestamp(ended.started_at, "run started_at"),
            ended: timestamp(ended.ended_at, "run ended_at"),
            verdict_seen,
            receipt_fetched,
        }
    }

    /// Follows the run's state snapshots until the terminal one.
    async fn watch_to_end(&mut self, run_id: &str) -> runstore_pb::Run {
        let mut stream = self
            .runs
            .watch_run(authed(
                runstore_pb::WatchRunRequest {
                    run_id: run_id.into(),
                    states_only: true,
                    ..Default::default()
                },
                &self.token,
            ))
            .await
            .expect("WatchRun")
            .into_inner();
        while let Some(item) = stream.next().await {
            if let Some(runstore_pb::watch_run_response::Update::Run(run)) =
                item.expect("WatchRun item").update
                && run.state().is_terminal()
            {
                return run;
            }
        }
        panic!("WatchRun of {run_id} ended before the terminal snapshot")
    }

    /// The run's one sandbox; a second would mean a relaunch, which a run of `true`
    /// must not need.
    async fn only_sandbox(&mut self, run_id: &str) -> reconciler_pb::Sandbox {
        let mut sandboxes = self
            .sandboxes
            .list_sandboxes(authed(
                reconciler_pb::ListSandboxesRequest {
                    run_id: run_id.into(),
                    ..Default::default()
                },
                &self.token,
            ))
            .await
            .expect("ListSandboxes")
            .into_inner()
            .sandboxes;
        assert_eq!(sandboxes.len(), 1, "run {run_id}: {sandboxes:?}");
        sandboxes.remove(0)
    }

    /// When the process driver wrote the sandbox's pid file, right after the spawn.
    fn spawned_at(&self, sandbox_id: &str) -> SystemTime {
        let pid_file = self.state_dir.join(sandbox_id).join("pid");
        std::fs::metadata(&pid_file)
            .and_then(|m| m.modified())
            .unwrap_or_else(|e| panic!("{}: {e}", pid_file.display()))
    }

    /// One warm-up run, then [`RUNS`] measured ones.
    async fn measure(&mut self, topology: &str) -> Vec<Sample> {
        self.run_true(format!("start-latency-{topology}-warm-up"))
            .await;
        let mut samples = Vec::with_capacity(RUNS);
        for i in 0..RUNS {
            samples.push(
                self.run_true(format!("start-latency-{topology}-{i}"))
                    .await
                    .sample(),
            );
        }
        samples
    }
}

/// `runplane dev` on a fresh data directory, with its embedded default profile.
async fn measure_dev() -> Vec<Sample> {
    let data = tempfile::tempdir().expect("temp dir");
    let mut dev = start_dev_with_env(data.path(), &[]).await;
    let token = std::fs::read_to_string(data.path().join("operator-token"))
        .expect("dev keeps its operator token");
    // dev canonicalises its data directory; its sandboxes live under it.
    let state_dir = data.path().canonicalize().unwrap().join("sandboxes");
    let mut target = Target::new(
        &dev.endpoint(),
        &dev.endpoint(),
        token.trim().to_owned(),
        &state_dir,
        "dev",
    )
    .await;
    let samples = target.measure("dev").await;
    stop(&mut dev).await;
    samples
}

/// The split topology with the profile, on fresh databases and Redis keys.
async fn measure_split() -> Vec<Sample> {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("runplane.toml");
    std::fs::write(&config, PROFILE_CONFIG).expect("write the profile config");
    let state_dir = dir.path().join("sandboxes");
    let mut split = Split::start(
        Some(&config),
        &state_dir,
        &[("RUNPLANE_SANDBOX_RECONCILER__TICK_INTERVAL_MS", "2000")],
    )
    .await;
    let mut target = Target::new(
        &split.url("run-store"),
        &split.url("sandbox-reconciler"),
        split::TOKEN.to_owned(),
        &state_dir,
        "acme",
    )
    .await;
    let samples = target.measure("split").await;
    // The reconciler first, so nothing it does races the services it calls going away.
    for service in split::SERVICES.iter().rev() {
        stop(split.processes.get_mut(service).expect("started")).await;
    }
    samples
}

async fn stop(process: &mut Process) {
    let status = process.terminate().await;
    if !status.success() {
        eprintln!("{}", process.stderr().await);
        panic!("runplane exited with {status} on SIGTERM");
    }
}

/// Nearest-rank percentile of `values` (sorted in place).
fn percentile(values: &mut [f64], p: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    let rank = ((p * values.len() as f64).ceil() as usize).clamp(1, values.len());
    values[rank - 1]
}

/// p50, p99 and the share of the mean end-to-end time, of one figure over `samples`.
fn figures(samples: &[Sample], figure: impl Fn(&Sample) -> f64) -> (f64, f64, f64) {
    let mut values: Vec<f64> = samples.iter().map(&figure).collect();
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    let mean_total = samples.iter().map(|s| s.total).sum::<f64>() / samples.len() as f64;
    let share = 100.0 * mean / mean_total;
    (
        percentile(&mut values, 0.50),
        percentile(&mut values, 0.99),
        share,
    )
}

/// The stage with the largest mean, by name.
fn dominant(samples: &[Sample]) -> (&'static str, f64) {
    STAGES
        .iter()
        .enumerate()
        .map(|(i, (name, _))| (*name, figures(samples, |s| s.stages[i]).2))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .expect("stages")
}

fn print_table(dev: &[Sample], split: &[Sample]) {
    println!();
    println!(
        "start latency of `true`: {RUNS} sequential runs per topology after one warm-up, ms (% = share of the mean end to end)"
    );
    println!();
    println!(
        "| stage | from → to | dev p50 | dev p99 | dev % | split p50 | split p99 | split % | goal |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let row = |name: &str, span: &str, figure: &dyn Fn(&Sample) -> f64, goal: &str| {
        let (d50, d99, dshare) = figures(dev, figure);
        let (s50, s99, sshare) = figures(split, figure);
        println!(
            "| {name} | {span} | {d50:.1} | {d99:.1} | {dshare:.0} | {s50:.1} | {s99:.1} | {sshare:.0} | {goal} |"
        );
    };
    for (i, (name, span)) in STAGES.iter().enumerate() {
        row(name, span, &|s| s.stages[i], "—");
    }
    let (dev_p50, _, _) = figures(dev, |s| s.to_verdict);
    let met = if dev_p50 <= GOAL_P50_MS {
        "met"
    } else {
        "missed"
    };
    row(
        "**to verdict**",
        "CreateRun sent → WatchRun saw the verdict",
        &|s| s.to_verdict,
        &format!("dev p50 ≤ {GOAL_P50_MS:.0}: {met}"),
    );
    row(
        "**end to end**",
        "CreateRun sent → GetReceipt returned",
        &|s| s.total,
        "—",
    );
    println!();
    let (dev_stage, dev_share) = dominant(dev);
    let (split_stage, split_share) = dominant(split);
    println!(
        "dominant stage: {dev_stage} on dev ({dev_share:.0} % of the mean), {split_stage} on split ({split_share:.0} %)"
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let dev = measure_dev().await;
    let split = measure_split().await;
    print_table(&dev, &split);
}
