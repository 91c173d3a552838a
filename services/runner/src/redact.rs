//! Redaction of keys and tokens from text the runner sends or prints.

/// Removes the run key, anything shaped like a run key, and bearer tokens.
#[derive(Debug, Clone)]
pub struct Redactor {
    run_key: String,
}

impl Redactor {
    pub fn new(run_key: &str) -> Self {
        Self {
            run_key: run_key.to_owned(),
        }
    }

    pub fn redact(&self, text: &str) -> String {
        let mut out = if self.run_key.is_empty() {
            text.to_owned()
        } else {
            text.replace(&self.run_key, "[redacted]")
        };
        out = redact_after(&out, "rk_", 16);
        for scheme in ["Bearer ", "bearer "] {
            out = redact_after(&out, scheme, 8);
        }
        out
    }
}

/// Replaces `marker` followed by at least `min` token characters with `[redacted]`.
fn redact_after(text: &str, marker: &str, min: usize) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(marker) {
        let (before, from) = rest.split_at(at);
        out.push_str(before);
        let token_len = from[marker.len()..]
            .bytes()
            .take_while(|b| {
                b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'=' | b'+' | b'/')
            })
            .count();
        if token_len >= min {
            out.push_str("[redacted]");
            rest = &from[marker.len() + token_len..];
        } else {
            out.push_str(marker);
            rest = &from[marker.len()..];
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_tokens_are_removed() {
        let r = Redactor::new("rk_secretsecretsecretsecret");
        let text = "key rk_secretsecretsecretsecret and rk_otherOTHERother-123456 and Authorization: Bearer abcdefghijkl; rk_x";
        let out = r.redact(text);
        assert!(!out.contains("secret"), "{out}");
        assert!(!out.contains("otherOTHER"), "{out}");
        assert!(!out.contains("abcdefghijkl"), "{out}");
        assert!(out.ends_with("rk_x"), "short look-alikes stay: {out}");
    }
}
