//! The failures the benchmark reports: which credential, which kind, and a ~2 KiB tail of
//! typical agent output ending in the line that decides it.

use runplane_proto::credentials::v1 as credentials_pb;

/// How many credentials (and profiles) the fleet has.
pub const CREDENTIALS: usize = 10_000;

/// SplitMix64: a fixed, well-spread hash, so every run measures the same workload.
pub fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The credential report `n` failed on: spread over the fleet, not round-robin.
pub fn credential_of(n: usize) -> usize {
    (splitmix(n as u64) % CREDENTIALS as u64) as usize
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Outage,
    Other,
    Spent,
}

/// 78% outage, 20% member problems, 2% exhaustion.
pub fn kind_of(n: usize) -> Kind {
    if n % 50 == 7 {
        Kind::Spent
    } else if n % 5 == 1 {
        Kind::Other
    } else {
        Kind::Outage
    }
}

/// Agent output of typical shape; no line matches either default pattern.
const BODY: &[&str] = &[
    "⏺ I'll check how the totals are rounded before the tax step is applied.",
    "⏺ Read(services/billing/src/invoice.rs)",
    "  ⎿  Read 214 lines (ctrl+r to expand)",
    "⏺ Search(pattern: \"fn round_half_even\", path: \"services/billing\")",
    "  ⎿  Found 3 files (ctrl+r to expand)",
    "✻ Thinking…",
    "⏺ Update(services/billing/src/invoice.rs)",
    "  ⎿  Updated services/billing/src/invoice.rs with 6 additions and 2 removals",
    "⏺ Bash(cargo test -p billing -- invoice::rounding)",
    "  ⎿     Compiling billing v0.3.1 (/workspace/services/billing)",
    "         Finished `test` profile [unoptimized + debuginfo] target(s) in 7.92s",
    "          Running unittests src/lib.rs (target/debug/deps/billing-5f1c0a7e2b9d4c11)",
    "     running 12 tests",
    "     test invoice::rounding::half_even ... ok",
    "     test invoice::rounding::negative_totals ... ok",
    "     test invoice::rounding::zero_rated_lines ... ok",
    "     test result: ok. 12 passed; 0 failed; 0 ignored; 0 measured; finished in 0.41s",
    "⏺ The rounding now happens once, after the tax lines are summed. Next, the export.",
    "⏺ Read(services/billing/src/export/csv.rs)",
    "  ⎿  Read 96 lines (ctrl+r to expand)",
];

const OTHER_ENDINGS: &[&str] = &[
    "error[E0308]: mismatched types: expected `Decimal`, found `f64`",
    "Error: process exited with code 1",
    "test result: FAILED. 11 passed; 1 failed; 0 ignored; 0 measured",
];

/// A ~2 KiB tail ending in `last`; `variant` rotates the body.
fn tail(variant: usize, last: &str) -> String {
    let mut out = String::with_capacity(2200);
    let mut i = variant;
    while out.len() + last.len() < 2000 {
        out.push_str(BODY[i % BODY.len()]);
        out.push('\n');
        i += 1;
    }
    out.push_str(last);
    out.push('\n');
    out
}

pub struct Tails {
    pub outage: Vec<String>,
    pub other: Vec<String>,
    pub spent: Vec<String>,
}

impl Tails {
    pub fn new() -> Self {
        Self {
            outage: (0..8)
                .map(|v| tail(v, "API Error: No response from API"))
                .collect(),
            other: (0..8)
                .map(|v| tail(v, OTHER_ENDINGS[v % OTHER_ENDINGS.len()]))
                .collect(),
            spent: (0..8)
                .map(|v| {
                    tail(
                        v,
                        "Error: Your credit balance is too low to access the API. Add credits to continue.",
                    )
                })
                .collect(),
        }
    }

    pub fn of(&self, n: usize) -> &str {
        let v = (n / 7) % 8;
        match kind_of(n) {
            Kind::Outage => &self.outage[v],
            Kind::Other => &self.other[v],
            Kind::Spent => &self.spent[v],
        }
    }
}

pub fn report_request(n: usize, tails: &Tails) -> credentials_pb::ReportTurnFailureRequest {
    credentials_pb::ReportTurnFailureRequest {
        turn_id: format!("run-{n:08}:result"),
        run_id: format!("run-{n:08}"),
        org_id: "acme".into(),
        lead_id: format!("lead-{}", n % 100),
        credential_id: format!("cred-{}", credential_of(n)),
        profile: String::new(),
        failure_tail: tails.of(n).to_owned(),
        failed_at: None,
    }
}
