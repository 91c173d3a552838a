//! Lifecycle webhooks: which endpoints an event goes to, the body sent, its Standard
//! Webhooks signature and the retry backoff. Pure; the store writes deliveries and
//! `crate::webhooks` sends them.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use super::ids::hex;
use super::state::RunState;
use super::verdict::Verdict;

/// Where one configured endpoint wants events: its id and its filters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// `wh_` and 12 hex digits of SHA-256(url): stable across restarts and config order.
    pub endpoint_id: String,
    /// Empty: every event.
    pub events: BTreeSet<String>,
    /// Empty: every org.
    pub orgs: BTreeSet<String>,
}

/// The configured endpoints' routes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Routes(pub Vec<Route>);

impl Routes {
    /// The endpoints that want `event` of a run of `org`.
    pub fn matching<'a>(&'a self, event: &'a str, org: &'a str) -> impl Iterator<Item = &'a str> {
        self.0
            .iter()
            .filter(move |r| r.events.is_empty() || r.events.contains(event))
            .filter(move |r| r.orgs.is_empty() || r.orgs.contains(org))
            .map(|r| r.endpoint_id.as_str())
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// An endpoint's id: `wh_` and 12 hex digits of SHA-256(url).
pub fn endpoint_id(url: &str) -> String {
    format!("wh_{}", &hex(&Sha256::digest(url.as_bytes()))[..12])
}

/// The `webhook-id` of `event` of `run_id` for `endpoint`: the same on every attempt and
/// for the same event decided twice, so a receiver dedupes on it.
pub fn message_id(endpoint: &str, run_id: &str, event: &str) -> String {
    format!(
        "msg_{}",
        &hex(&Sha256::digest(
            format!("{endpoint}|{run_id}|{event}").as_bytes()
        ))[..32]
    )
}

/// The lifecycle event a run's new state is, when it is one.
pub fn event_of(state: RunState) -> Option<&'static str> {
    match state {
        RunState::Running => Some("run.started"),
        RunState::Succeeded => Some("run.succeeded"),
        RunState::Failed => Some("run.failed"),
        RunState::Cancelled => Some("run.cancelled"),
        RunState::BackendError => Some("run.backend_error"),
        RunState::Queued | RunState::Starting => None,
    }
}

/// What a body says about its run.
#[derive(Debug, Clone)]
pub struct RunFacts<'a> {
    pub run_id: &'a str,
    pub org_id: &'a str,
    pub lead_id: &'a str,
    pub labels: BTreeMap<String, String>,
    pub state: RunState,
    pub verdict: Option<Verdict>,
}

/// The JSON body: `type`, `timestamp` (RFC 3339, the event's time) and `data`.
pub fn body(event: &str, at_us: i64, run: &RunFacts<'_>) -> String {
    let timestamp = chrono::DateTime::from_timestamp_micros(at_us)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    let verdict = run.verdict.as_ref().map(|v| {
        serde_json::json!({
            "outcome": v.outcome.as_str(),
            "reason": v.reason,
            "message": v.message,
            "exit_code": v.exit_code,
            "signal": v.signal,
        })
    });
    serde_json::json!({
        "type": event,
        "timestamp": timestamp,
        "data": {
            "run_id": run.run_id,
            "org_id": run.org_id,
            "lead_id": run.lead_id,
            "labels": run.labels,
            "state": run.state.as_str(),
            "verdict": verdict,
            // Every run has one attempt until runs retry in new sandboxes.
            "attempt": 1,
        },
    })
    .to_string()
}

/// `webhook-signature`'s value: `v1,` and the base64 of HMAC-SHA256(key, "id.timestamp.body").
pub fn signature(key: &[u8], message_id: &str, timestamp: i64, body: &str) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes any key length");
    mac.update(format!("{message_id}.{timestamp}.{body}").as_bytes());
    format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
    )
}

/// The wait before attempt `attempts + 1`: 1 s doubling, capped at `max`, with up to a
/// fifth taken off at random so endpoints that failed together do not retry together.
pub fn backoff(attempts: i32, max: Duration) -> Duration {
    let base = Duration::from_secs(1u64 << attempts.clamp(0, 20)).min(max);
    let jitter = base.mul_f64(rand::random::<f64>() * 0.2);
    base - jitter
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_is_the_standard_webhooks_example() {
        // The example of the Standard Webhooks specification.
        let key = base64::engine::general_purpose::STANDARD
            .decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
            .unwrap();
        assert_eq!(
            signature(
                &key,
                "msg_p5jXN8AQM9LWM0D4loKWxJek",
                1614265330,
                r#"{"test": 2432232314}"#
            ),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
    }

    #[test]
    fn routes_filter_by_event_and_org() {
        let routes = Routes(vec![
            Route {
                endpoint_id: "all".into(),
                events: BTreeSet::new(),
                orgs: BTreeSet::new(),
            },
            Route {
                endpoint_id: "acme-ends".into(),
                events: ["run.succeeded".to_owned()].into(),
                orgs: ["acme".to_owned()].into(),
            },
        ]);
        let ids = |event, org| routes.matching(event, org).collect::<Vec<_>>();
        assert_eq!(ids("run.succeeded", "acme"), ["all", "acme-ends"]);
        assert_eq!(ids("run.started", "acme"), ["all"]);
        assert_eq!(ids("run.succeeded", "other"), ["all"]);
    }

    #[test]
    fn backoff_doubles_to_its_cap() {
        let max = Duration::from_secs(300);
        for (attempts, full) in [(0, 1), (1, 2), (3, 8), (8, 256), (9, 300), (40, 300)] {
            let wait = backoff(attempts, max);
            let full = Duration::from_secs(full);
            assert!(
                wait <= full && wait >= full.mul_f64(0.8),
                "{attempts}: {wait:?}"
            );
        }
    }
}
