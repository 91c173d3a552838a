//! The outage policy of one credential: a pure state machine over a clock reading.
//!
//! The numbers are configuration (`[credential_health]`); the defaults and why:
//!
//! - **Threshold 2 distinct runs.** An outage is only visible across runs: one run that
//!   keeps failing is that run's problem (a bad prompt, a broken tool), and one backend
//!   error is often one bad turn. Two *different* runs failing the same way on the same
//!   credential is the smallest evidence that the backend, not a member, is at fault.
//!   Correlation is on the credential, never on the profile name or the error text:
//!   the credential is what the backend serves and what runs out.
//! - **Window 60 s, inclusive.** The field report's outage killed both running members
//!   within a minute; backend blips are seconds to tens of seconds long. A wider window
//!   joins unrelated bad turns hours apart into a false incident; a narrower one misses
//!   runs whose turns were simply at different points when the backend went away.
//! - **Cool-off 60 s.** Long enough that the next spawn does not walk into the same
//!   outage (and that several runs' retries do not pile onto a recovering backend),
//!   short enough that a 30-second blip costs a minute of capacity rather than the
//!   exhaustion quarantine's half hour. Errors during the cool-off neither extend it nor
//!   open a second incident; when it expires its evidence is cleared, so it takes two
//!   fresh failures to open another.
//! - **Quarantine 1800 s**, for an exhausted credential: it is spent, and retrying it
//!   soon only fails again. A separate state with a separate field; neither is ever
//!   reported as the other.
//!
//! Time is milliseconds of wall-clock time from the injected clock, not a process's
//! monotonic clock: the state is shared by every replica through the database, and
//! monotonic origins are per process. To keep the policy monotonic anyway, each
//! transition uses `max(now, last_seen)`: a replica whose clock lags cannot move a
//! window or a cool-off backwards.

use serde::{Deserialize, Serialize};

/// The policy's numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicyConfig {
    pub threshold: usize,
    pub window_ms: i64,
    pub cool_off_ms: i64,
    pub quarantine_ms: i64,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            threshold: 2,
            window_ms: 60_000,
            cool_off_ms: 60_000,
            quarantine_ms: 1_800_000,
        }
    }
}

/// One failure the policy is holding as evidence of an outage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Evidence {
    pub run_id: String,
    /// The run's org: its lead is told as a lead of this org. Empty in evidence written
    /// before orgs owned their credentials.
    #[serde(default)]
    pub org_id: String,
    pub lead_id: String,
    pub at_ms: i64,
}

/// What the policy knows about one credential.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CredentialState {
    /// Backend errors within the window, at most one per run (its latest).
    pub evidence: Vec<Evidence>,
    /// The open incident's cool-off ends here; 0 when none.
    pub cool_off_until_ms: i64,
    /// The open incident; `None` when none.
    pub open_incident: Option<String>,
    /// The exhaustion quarantine ends here; 0 when none.
    pub quarantine_until_ms: i64,
    /// The latest time the policy moved at; it never moves back.
    pub last_seen_ms: i64,
}

/// What a backend error did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ErrorEffect {
    /// Held as evidence; not (yet) an incident.
    Counted,
    /// Opened incident `incident_id`; `opening` are the failures that crossed the
    /// threshold, one per run.
    Opened {
        incident_id: String,
        opening: Vec<Evidence>,
    },
    /// Arrived during incident `incident_id`'s cool-off: absorbed, changes nothing.
    Absorbed { incident_id: String },
}

/// What settling the state at a time found expired.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Expired {
    /// The incident whose cool-off ended.
    pub closed_incident: Option<String>,
}

impl CredentialState {
    /// Time as the policy sees it: never before the last time it moved.
    fn at(&mut self, now_ms: i64) -> i64 {
        self.last_seen_ms = self.last_seen_ms.max(now_ms);
        self.last_seen_ms
    }

    /// Ends what expired by `now_ms`: a cool-off (closing its incident and clearing the
    /// evidence, so two fresh failures are needed to open another) and a quarantine.
    pub fn settle(&mut self, now_ms: i64) -> Expired {
        let now = self.at(now_ms);
        let mut expired = Expired::default();
        if self.cool_off_until_ms != 0 && now >= self.cool_off_until_ms {
            self.cool_off_until_ms = 0;
            self.evidence.clear();
            expired.closed_incident = self.open_incident.take();
        }
        if self.quarantine_until_ms != 0 && now >= self.quarantine_until_ms {
            self.quarantine_until_ms = 0;
        }
        expired
    }

    /// A backend error of `run_id` at `now_ms`. `new_incident_id` names the incident if
    /// this error opens one.
    pub fn backend_error(
        &mut self,
        config: &PolicyConfig,
        run_id: &str,
        org_id: &str,
        lead_id: &str,
        now_ms: i64,
        new_incident_id: impl FnOnce() -> String,
    ) -> ErrorEffect {
        self.settle(now_ms);
        let now = self.last_seen_ms;
        if let Some(incident_id) = &self.open_incident {
            return ErrorEffect::Absorbed {
                incident_id: incident_id.clone(),
            };
        }
        self.evidence.retain(|e| now - e.at_ms <= config.window_ms);
        match self.evidence.iter_mut().find(|e| e.run_id == run_id) {
            // The same run failing again is still one target: it refreshes its evidence.
            Some(e) => {
                e.at_ms = now;
                e.org_id = org_id.to_owned();
                e.lead_id = lead_id.to_owned();
            }
            None => self.evidence.push(Evidence {
                run_id: run_id.to_owned(),
                org_id: org_id.to_owned(),
                lead_id: lead_id.to_owned(),
                at_ms: now,
            }),
        }
        if self.evidence.len() < config.threshold {
            return ErrorEffect::Counted;
        }
        let incident_id = new_incident_id();
        self.open_incident = Some(incident_id.clone());
        self.cool_off_until_ms = now + config.cool_off_ms;
        ErrorEffect::Opened {
            incident_id,
            opening: std::mem::take(&mut self.evidence),
        }
    }

    /// An exhausted outcome at `now_ms`: quarantine from now for the full period. Returns
    /// whether the credential was not quarantined before (a new quarantine).
    pub fn exhausted(&mut self, config: &PolicyConfig, now_ms: i64) -> bool {
        self.settle(now_ms);
        let fresh = self.quarantine_until_ms == 0;
        self.quarantine_until_ms = self.last_seen_ms + config.quarantine_ms;
        fresh
    }

    /// Whole seconds of cool-off left at `now_ms`, rounded up; 0 when none.
    pub fn cooling_off_for_seconds(&self, now_ms: i64) -> u32 {
        seconds_left(self.cool_off_until_ms, now_ms.max(self.last_seen_ms))
    }

    /// Whole seconds of quarantine left at `now_ms`, rounded up; 0 when none.
    pub fn quarantined_for_seconds(&self, now_ms: i64) -> u32 {
        seconds_left(self.quarantine_until_ms, now_ms.max(self.last_seen_ms))
    }
}

fn seconds_left(until_ms: i64, now_ms: i64) -> u32 {
    if until_ms <= now_ms {
        return 0;
    }
    u32::try_from((until_ms - now_ms + 999) / 1000).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: PolicyConfig = PolicyConfig {
        threshold: 2,
        window_ms: 60_000,
        cool_off_ms: 60_000,
        quarantine_ms: 1_800_000,
    };

    fn error(s: &mut CredentialState, run: &str, at_ms: i64) -> ErrorEffect {
        s.backend_error(&C, run, "org", "lead", at_ms, || format!("inc-{at_ms}"))
    }

    #[test]
    fn two_distinct_runs_within_the_inclusive_window_open_one_incident() {
        let mut s = CredentialState::default();
        assert_eq!(error(&mut s, "a", 0), ErrorEffect::Counted);
        let opened = error(&mut s, "b", 60_000);
        assert!(
            matches!(opened, ErrorEffect::Opened { ref incident_id, ref opening }
            if incident_id == "inc-60000" && opening.len() == 2)
        );
        assert_eq!(s.cooling_off_for_seconds(60_000), 60);
        assert_eq!(s.cooling_off_for_seconds(60_001), 60);
        assert_eq!(s.cooling_off_for_seconds(119_001), 1);
    }

    #[test]
    fn failures_just_outside_the_window_are_not_an_incident() {
        let mut s = CredentialState::default();
        error(&mut s, "a", 0);
        assert_eq!(error(&mut s, "b", 60_001), ErrorEffect::Counted);
    }

    #[test]
    fn one_run_failing_repeatedly_is_not_an_incident() {
        let mut s = CredentialState::default();
        for t in 0..10 {
            assert_eq!(error(&mut s, "a", t * 1000), ErrorEffect::Counted);
        }
        assert_eq!(s.cooling_off_for_seconds(10_000), 0);
    }

    #[test]
    fn errors_during_cool_off_neither_extend_it_nor_open_another() {
        let mut s = CredentialState::default();
        error(&mut s, "a", 0);
        error(&mut s, "b", 1000);
        for (run, t) in [("c", 2000), ("d", 30_000), ("e", 60_999)] {
            assert_eq!(
                error(&mut s, run, t),
                ErrorEffect::Absorbed {
                    incident_id: "inc-1000".into()
                }
            );
        }
        assert_eq!(s.cool_off_until_ms, 61_000);
    }

    #[test]
    fn expiry_clears_the_evidence_so_one_fresh_error_does_not_reopen_and_two_do() {
        let mut s = CredentialState::default();
        error(&mut s, "a", 0);
        error(&mut s, "b", 1000);
        error(&mut s, "c", 50_000); // absorbed; must not be evidence afterwards
        let expired = s.settle(61_000);
        assert_eq!(expired.closed_incident.as_deref(), Some("inc-1000"));
        assert_eq!(error(&mut s, "d", 61_500), ErrorEffect::Counted);
        assert!(matches!(
            error(&mut s, "e", 62_000),
            ErrorEffect::Opened { .. }
        ));
    }

    #[test]
    fn time_never_moves_back() {
        let mut s = CredentialState::default();
        error(&mut s, "a", 10_000);
        // A replica whose clock lags by 9 s reports the second failure at "1 s".
        assert!(matches!(
            error(&mut s, "b", 1000),
            ErrorEffect::Opened { .. }
        ));
        assert_eq!(s.cool_off_until_ms, 70_000);
    }

    #[test]
    fn quarantine_is_separate_from_cool_off() {
        let mut s = CredentialState::default();
        assert!(s.exhausted(&C, 0));
        assert_eq!(s.quarantined_for_seconds(0), 1800);
        assert_eq!(s.cooling_off_for_seconds(0), 0);
        assert!(!s.exhausted(&C, 10_000));
        assert_eq!(s.quarantined_for_seconds(10_000), 1800);
        error(&mut s, "a", 10_000);
        error(&mut s, "b", 10_000);
        assert_eq!(s.cooling_off_for_seconds(10_000), 60);
        assert_eq!(s.quarantined_for_seconds(10_000), 1800);
        s.settle(1_810_000);
        assert_eq!(s.quarantined_for_seconds(1_810_000), 0);
    }
}
