//! Profiles and the one place a failure tail is read: classification.
//!
//! A failed turn's tail is classified here, once, into a [`TurnOutcome`]; everything
//! downstream (the outage policy, quarantine, the run's durable outcome, notices) works
//! on the typed outcome and never reads the text again.

use std::collections::HashMap;

use regex::Regex;
use runplane_config::Config;
use runplane_proto::credentials::v1::TurnOutcome;

use crate::error::CredentialHealthError;

/// Longest `reason` kept: the matching line, cut at a character boundary.
pub const MAX_REASON_BYTES: usize = 512;

/// One configured profile with its patterns compiled.
#[derive(Debug, Clone)]
pub struct Profile {
    pub name: String,
    pub credential_id: String,
    pub capacity: u32,
    /// The deadline of a run admitted through this profile without one of its own (s; 0 none).
    pub max_run_seconds: u32,
    /// The priority of a run admitted through this profile without one of its own.
    pub priority: u32,
    /// The orgs whose runs may use it; empty: every org (a shared credential).
    pub orgs: Vec<String>,
    error: Regex,
    exhausted: Regex,
}

impl Profile {
    /// Whether a run of `org` may use the credential through this profile. An empty org
    /// (a caller that named none) is admitted only by a shared profile.
    pub fn admits(&self, org: &str) -> bool {
        self.orgs.is_empty() || self.orgs.iter().any(|o| o == org)
    }

    /// Classifies `tail`: exhaustion first (a tail matching both means the credential is
    /// spent, which must not be mistaken for a blip), then a backend error, else a member
    /// problem. The reason is the first matching line.
    pub fn classify(&self, tail: &str) -> (TurnOutcome, String) {
        for (pattern, outcome) in [
            (&self.exhausted, TurnOutcome::BackendExhausted),
            (&self.error, TurnOutcome::BackendError),
        ] {
            let matched = match tail.lines().find(|line| pattern.is_match(line)) {
                Some(line) => Some(line),
                // A pattern may span lines (e.g. `(?s)`): match the whole tail too.
                None => pattern.find(tail).map(|m| m.as_str()),
            };
            if let Some(text) = matched {
                let reason = match bounded(text.trim()) {
                    // A pattern that matches an empty line still needs a reason to show.
                    empty if empty.is_empty() => format!("{} (empty line)", outcome.as_str_name()),
                    reason => reason,
                };
                return (outcome, reason);
            }
        }
        (TurnOutcome::Other, String::new())
    }
}

fn bounded(s: &str) -> String {
    let mut end = s.len().min(MAX_REASON_BYTES);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// Every configured profile, compiled once at start and indexed by name and credential.
#[derive(Debug, Clone)]
pub struct Profiles {
    all: Vec<Profile>,
    by_name: HashMap<String, Vec<usize>>,
    by_credential: HashMap<String, Vec<usize>>,
}

impl Profiles {
    /// Compiles every pattern; the first invalid one stops the start with an error naming
    /// the profile, the field and the pattern.
    pub fn compile<'a>(config: &'a Config) -> Result<Self, CredentialHealthError> {
        let mut all = Vec::new();
        // Fleets share a few patterns across many profiles: compile each once (a
        // `Regex` clone shares the compiled program).
        let mut compiled: HashMap<&'a str, Regex> = HashMap::new();
        for p in &config.credential_health.profiles {
            let mut compile = |field: &'static str, pattern: &'a str| {
                if let Some(re) = compiled.get(pattern) {
                    return Ok(re.clone());
                }
                let re = Regex::new(pattern).map_err(|e| CredentialHealthError::Pattern {
                    profile: p.name.clone(),
                    credential_id: p.credential_id.clone(),
                    field,
                    pattern: pattern.to_owned(),
                    reason: e.to_string(),
                })?;
                compiled.insert(pattern, re.clone());
                Ok::<_, CredentialHealthError>(re)
            };
            let error = compile("error_pattern", &p.error_pattern)?;
            let exhausted = compile("exhausted_pattern", &p.exhausted_pattern)?;
            all.push(Profile {
                name: p.name.clone(),
                credential_id: p.credential_id.clone(),
                capacity: p.capacity,
                max_run_seconds: p.max_run_seconds,
                priority: p.priority,
                orgs: p.orgs.clone(),
                error,
                exhausted,
            });
        }
        all.sort_by(|a, b| (&a.name, &a.credential_id).cmp(&(&b.name, &b.credential_id)));
        let mut by_name: HashMap<String, Vec<usize>> = HashMap::new();
        let mut by_credential: HashMap<String, Vec<usize>> = HashMap::new();
        for (i, p) in all.iter().enumerate() {
            by_name.entry(p.name.clone()).or_default().push(i);
            by_credential
                .entry(p.credential_id.clone())
                .or_default()
                .push(i);
        }
        Ok(Self {
            all,
            by_name,
            by_credential,
        })
    }

    pub fn all(&self) -> &[Profile] {
        &self.all
    }

    /// The entries of profile `name` (one per credential), in credential order.
    pub fn named<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Profile> + 'a {
        self.by_name
            .get(name)
            .into_iter()
            .flatten()
            .map(|&i| &self.all[i])
    }

    /// The entries naming `credential_id`, in profile order.
    pub fn on_credential<'a>(
        &'a self,
        credential_id: &'a str,
    ) -> impl Iterator<Item = &'a Profile> + 'a {
        self.by_credential
            .get(credential_id)
            .into_iter()
            .flatten()
            .map(|&i| &self.all[i])
    }

    /// Whether `credential_id` is shared by several orgs: some profile on it admits every
    /// org, or its profiles name more than one org. Failures on a shared credential
    /// penalise only the org whose runs reported them until a second org's do too
    /// (`store::turn_failures`).
    pub fn shared(&self, credential_id: &str) -> bool {
        let mut orgs = std::collections::BTreeSet::new();
        for p in self.on_credential(credential_id) {
            if p.orgs.is_empty() {
                return true;
            }
            orgs.extend(p.orgs.iter().map(String::as_str));
        }
        orgs.len() > 1
    }

    /// Every credential id, sorted, once each.
    pub fn credential_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.all.iter().map(|p| p.credential_id.clone()).collect();
        ids.sort();
        ids.dedup();
        ids
    }

    /// The profile whose patterns classify a failure of a run on `credential_id` asked
    /// for through `profile` (empty: the credential's first profile).
    pub fn for_failure<'a>(
        &'a self,
        profile: &'a str,
        credential_id: &'a str,
    ) -> Option<&'a Profile> {
        if profile.is_empty() {
            self.on_credential(credential_id).next()
        } else {
            self.named(profile)
                .find(|p| p.credential_id == credential_id)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profiles(error: &str, exhausted: &str) -> Result<Profiles, CredentialHealthError> {
        let mut config = Config::default();
        config.credential_health.profiles[0].error_pattern = error.into();
        config.credential_health.profiles[0].exhausted_pattern = exhausted.into();
        Profiles::compile(&config)
    }

    #[test]
    fn the_default_profile_reads_the_outage_of_the_field_report() {
        let p = Profiles::compile(&Config::default()).unwrap();
        let p = &p.all()[0];
        let tail = "thinking…\nAPI Error: No response from API\n$ ";
        assert_eq!(
            p.classify(tail),
            (
                TurnOutcome::BackendError,
                "API Error: No response from API".into()
            )
        );
        assert_eq!(
            p.classify("Error: Your credit balance is too low to access the API")
                .0,
            TurnOutcome::BackendExhausted
        );
        assert_eq!(
            p.classify("error[E0308]: mismatched types").0,
            TurnOutcome::Other
        );
    }

    #[test]
    fn exhaustion_is_checked_first() {
        let p = profiles("API Error", "quota").unwrap();
        let (outcome, reason) = p.all()[0].classify("API Error: quota exceeded");
        assert_eq!(outcome, TurnOutcome::BackendExhausted);
        assert_eq!(reason, "API Error: quota exceeded");
    }

    #[test]
    fn the_reason_is_bounded_at_a_character_boundary() {
        let p = profiles("é", "never-matches-anything").unwrap();
        let (_, reason) = p.all()[0].classify(&"é".repeat(1000));
        assert!(reason.len() <= MAX_REASON_BYTES && reason.len() >= MAX_REASON_BYTES - 1);
    }

    #[test]
    fn an_invalid_pattern_names_the_profile_field_and_pattern() {
        let e = profiles("API Error: (unclosed", "x")
            .unwrap_err()
            .to_string();
        assert!(e.contains("profile `default`"), "{e}");
        assert!(e.contains("error_pattern"), "{e}");
        assert!(e.contains("(unclosed"), "{e}");
    }
}
