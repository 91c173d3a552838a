//! Run labels and label selectors: what a run may carry, and how operators pick a group
//! of runs by them (`ListRuns.label_selector`, `runplane runs --label`, the bulk actions).
//!
//! A run has at most [`MAX_LABELS`] labels. A key is 1–63 of `[a-z0-9.-/]`, a value 0–63
//! of `[A-Za-z0-9._-]`, so a label fits a selector, an environment variable and a log
//! line without quoting. A selector is terms joined by commas, all of which must hold:
//! `k=v` (the run has label `k` with value `v`), `k!=v` (it has not: a run without `k`
//! matches), `k` (it has `k`) and `!k` (it has not).

use std::collections::BTreeMap;

/// Most labels one run carries.
pub const MAX_LABELS: usize = 32;
/// Most terms one selector holds.
pub const MAX_TERMS: usize = 32;

/// Why a label is refused, or `None` when it is well formed.
pub fn check(key: &str, value: &str) -> Option<String> {
    if !valid_key(key) {
        return Some(format!(
            "key {:?} must be 1 to 63 of a-z, 0-9, '.', '-' and '/'",
            truncated(key)
        ));
    }
    if !valid_value(value) {
        return Some(format!(
            "value of {key} must be 0 to 63 of A-Z, a-z, 0-9, '.', '_' and '-'"
        ));
    }
    None
}

fn valid_key(key: &str) -> bool {
    (1..=63).contains(&key.len())
        && key
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"./-".contains(&b))
}

fn valid_value(value: &str) -> bool {
    value.len() <= 63
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// At most 64 characters of what a client sent, for an error message.
fn truncated(s: &str) -> String {
    s.chars().take(64).collect()
}

/// One term of a selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Term {
    Equals(String, String),
    NotEquals(String, String),
    Exists(String),
    NotExists(String),
}

/// Terms that must all hold; empty selects every run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector {
    pub terms: Vec<Term>,
}

impl Selector {
    /// Parses `k=v,k!=v,k,!k`; the reason names the term that does not parse.
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.trim().is_empty() {
            return Ok(Self::default());
        }
        let mut terms = Vec::new();
        for raw in text.split(',') {
            let term = raw.trim();
            let parsed = if let Some((key, value)) = term.split_once("!=") {
                Term::NotEquals(key.trim().to_owned(), value.trim().to_owned())
            } else if let Some((key, value)) = term.split_once('=') {
                let value = value.strip_prefix('=').unwrap_or(value);
                Term::Equals(key.trim().to_owned(), value.trim().to_owned())
            } else if let Some(key) = term.strip_prefix('!') {
                Term::NotExists(key.trim().to_owned())
            } else {
                Term::Exists(term.to_owned())
            };
            let (key, value) = match &parsed {
                Term::Equals(k, v) | Term::NotEquals(k, v) => (k, v.as_str()),
                Term::Exists(k) | Term::NotExists(k) => (k, ""),
            };
            if let Some(why) = check(key, value) {
                return Err(format!("term {:?}: {why}", truncated(term)));
            }
            terms.push(parsed);
        }
        if terms.len() > MAX_TERMS {
            return Err(format!("at most {MAX_TERMS} terms, not {}", terms.len()));
        }
        Ok(Self { terms })
    }

    /// Whether a run with `labels` is selected.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.terms.iter().all(|term| match term {
            Term::Equals(k, v) => labels.get(k) == Some(v),
            Term::NotEquals(k, v) => labels.get(k) != Some(v),
            Term::Exists(k) => labels.contains_key(k),
            Term::NotExists(k) => !labels.contains_key(k),
        })
    }

    /// The selector in its one canonical form (terms as given, comma-joined), for page
    /// tokens.
    pub fn canonical(&self) -> String {
        self.terms
            .iter()
            .map(|t| match t {
                Term::Equals(k, v) => format!("{k}={v}"),
                Term::NotEquals(k, v) => format!("{k}!={v}"),
                Term::Exists(k) => k.clone(),
                Term::NotExists(k) => format!("!{k}"),
            })
            .collect::<Vec<_>>()
            .join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn labels_are_checked_by_their_rules() {
        assert_eq!(check("team", "infra"), None);
        assert_eq!(check("app.example/tier", "Gold_1.x-2"), None);
        assert_eq!(check("k", ""), None);
        assert!(check("", "v").is_some());
        assert!(check("Team", "v").is_some());
        assert!(check(&"k".repeat(64), "v").is_some());
        assert!(check("k", "a b").is_some());
        assert!(check("k", "a=b").is_some());
        assert!(check("k", &"v".repeat(64)).is_some());
    }

    #[test]
    fn selectors_parse_and_match_as_written() {
        let run = labels(&[("team", "infra"), ("tier", "gold")]);
        let cases = [
            ("", true),
            ("team=infra", true),
            ("team==infra", true),
            ("team=web", false),
            ("team!=web", true),
            ("team!=infra", false),
            ("owner!=bob", true),
            ("team", true),
            ("owner", false),
            ("!owner", true),
            ("!team", false),
            ("team=infra, tier=gold", true),
            ("team=infra,tier=silver", false),
        ];
        for (text, selected) in cases {
            let selector = Selector::parse(text).unwrap();
            assert_eq!(selector.matches(&run), selected, "{text}");
        }
        assert_eq!(
            Selector::parse(" team = infra ,!owner")
                .unwrap()
                .canonical(),
            "team=infra,!owner"
        );
    }

    #[test]
    fn a_selector_that_does_not_parse_names_its_term() {
        for text in ["team=in fra", "Team=x", "a,,b", "=x", "!", "k=v=w"] {
            let why = Selector::parse(text).unwrap_err();
            assert!(why.starts_with("term "), "{text}: {why}");
        }
        let many = (0..33)
            .map(|i| format!("k{i}"))
            .collect::<Vec<_>>()
            .join(",");
        assert!(Selector::parse(&many).unwrap_err().contains("at most 32"));
    }
}
