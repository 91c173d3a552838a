//! runplane's identifiers, each with one parse and one message, and the org scope of a
//! caller. Every service checks ids through these, so a rule and the words that refuse
//! it are written once. Services keep their own errors: they put an [`IdError`]'s
//! message on the field it is about, and turn [`OrgDenied`] into their
//! PERMISSION_DENIED.

use std::fmt;

/// Why a string is not the id it was given as. The message says what the id must be,
/// for the field that held it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("must be a run id (a lowercase UUID)")]
    RunId,
    #[error("must be a sandbox id (a UUID)")]
    SandboxId,
    #[error("must be 1-128 characters of A-Z a-z 0-9 . _ : -")]
    Name,
}

/// A run id: a lowercase hyphenated UUID, the only form the run store mints.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RunId(String);

impl RunId {
    /// `id` when it is a lowercase hyphenated UUID; any other spelling of a UUID (upper
    /// case, braces, no hyphens) names no run.
    pub fn parse(id: &str) -> Result<Self, IdError> {
        let canonical = id.len() == 36
            && uuid::Uuid::parse_str(id).is_ok_and(|u| u.hyphenated().to_string() == id);
        if canonical {
            Ok(Self(id.to_owned()))
        } else {
            Err(IdError::RunId)
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A sandbox id: a UUID in any form `uuid` reads, kept as given (the reconciler stores
/// and compares the client's spelling).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SandboxId(String);

impl SandboxId {
    pub fn parse(id: &str) -> Result<Self, IdError> {
        match uuid::Uuid::parse_str(id) {
            Ok(_) => Ok(Self(id.to_owned())),
            Err(_) => Err(IdError::SandboxId),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A name: the id of an org, lead, credential, profile or node, everywhere runplane
/// takes one. 1–128 bytes of `[A-Za-z0-9._:-]`, so it is safe in keys, URLs and logs.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Name(String);

impl Name {
    pub fn parse(value: &str) -> Result<Self, IdError> {
        let valid = (1..=128).contains(&value.len())
            && value
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b));
        if valid {
            Ok(Self(value.to_owned()))
        } else {
            Err(IdError::Name)
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

macro_rules! string_id {
    ($($id:ident),*) => {$(
        impl fmt::Display for $id {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl AsRef<str> for $id {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl From<$id> for String {
            fn from(id: $id) -> String {
                id.0
            }
        }
    )*};
}

string_id!(RunId, SandboxId, Name);

/// Which orgs a caller may act in: the operator and service tokens in any, an org token
/// only in its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OrgScope {
    Any,
    Only(String),
}

/// A caller scoped to one org asked about another; `org` is the org it may not act in.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the caller may not act in org {org}")]
pub struct OrgDenied {
    pub org: String,
}

impl OrgScope {
    /// The org a call acts in when it names `asked` (empty: none). An org token acts in
    /// its own org, whether named or not, and is refused any other; the operator acts in
    /// the org it names, or in every org (`None`) when it names none.
    pub fn org_for<'a>(&'a self, asked: &'a str) -> Result<Option<&'a str>, OrgDenied> {
        match self {
            OrgScope::Any => Ok((!asked.is_empty()).then_some(asked)),
            OrgScope::Only(own) if asked.is_empty() || asked == own => Ok(Some(own)),
            OrgScope::Only(_) => Err(OrgDenied {
                org: asked.to_owned(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RUN: &str = "0190a5c4-7b3e-7cde-8f01-23456789abcd";

    #[test]
    fn a_run_id_is_only_the_lowercase_hyphenated_form() {
        assert_eq!(RunId::parse(RUN).unwrap().as_str(), RUN);
        for bad in [
            String::new(),
            "not-a-run".into(),
            RUN.to_uppercase(),
            RUN.replace('-', ""),
            format!("{{{RUN}}}"),
            format!("urn:uuid:{RUN}"),
            format!("{RUN}0"),
            RUN.replacen('a', "g", 1),
        ] {
            assert_eq!(RunId::parse(&bad), Err(IdError::RunId), "{bad}");
        }
    }

    #[test]
    fn a_sandbox_id_is_any_spelling_of_a_uuid_kept_as_given() {
        for good in [RUN.to_owned(), RUN.to_uppercase(), RUN.replace('-', "")] {
            assert_eq!(SandboxId::parse(&good).unwrap().as_str(), good);
        }
        for bad in ["", "sandbox-1", &RUN[1..]] {
            assert_eq!(SandboxId::parse(bad), Err(IdError::SandboxId), "{bad}");
        }
    }

    #[test]
    fn a_name_is_1_to_128_bytes_of_its_alphabet() {
        for good in ["a", "acme", "org:acme.eu-1_b", &"x".repeat(128)] {
            assert_eq!(Name::parse(good).unwrap().as_str(), good);
        }
        for bad in ["", &"x".repeat(129), "a b", "a/b", "é", "a\n"] {
            assert_eq!(Name::parse(bad), Err(IdError::Name), "{bad:?}");
        }
    }

    #[test]
    fn each_rule_has_its_one_message() {
        assert_eq!(
            IdError::RunId.to_string(),
            "must be a run id (a lowercase UUID)"
        );
        assert_eq!(
            IdError::SandboxId.to_string(),
            "must be a sandbox id (a UUID)"
        );
        assert_eq!(
            IdError::Name.to_string(),
            "must be 1-128 characters of A-Z a-z 0-9 . _ : -"
        );
    }

    #[test]
    fn an_org_token_acts_only_in_its_org() {
        let acme = OrgScope::Only("acme".into());
        assert_eq!(acme.org_for("acme"), Ok(Some("acme")));
        assert_eq!(acme.org_for(""), Ok(Some("acme")));
        assert_eq!(
            acme.org_for("globex"),
            Err(OrgDenied {
                org: "globex".into()
            })
        );
    }

    #[test]
    fn the_operator_acts_in_the_org_it_names_or_in_every_org() {
        assert_eq!(OrgScope::Any.org_for("globex"), Ok(Some("globex")));
        assert_eq!(OrgScope::Any.org_for(""), Ok(None));
    }
}
