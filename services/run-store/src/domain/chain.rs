//! The per-run hash chain over events.
//!
//! `digest_0 = SHA-256("runplane.chain.v1\0" || run_id)` and
//! `digest_n = SHA-256(digest_{n-1} || canonical(event_n))`, where `canonical` is
//!
//! ```text
//! u64be(sequence) u32be(kind) u8(check) lp(name) lp(text) lp(data) i64be(observed_at_us | -1)
//! ```
//!
//! with `lp(x) = u32be(len(x)) || x` and `data` the event's structured data as JSON with
//! keys sorted (empty when absent). A duplicated, dropped or reordered event changes
//! every later digest, so the receipt's chain head pins the exact event history.

use sha2::{Digest, Sha256};

/// The fields of an event that the chain covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainedEvent<'a> {
    pub sequence: u64,
    pub kind: i32,
    pub check: bool,
    pub name: &'a str,
    pub text: &'a str,
    pub data: &'a str,
    pub observed_at_us: Option<i64>,
}

/// The chain head of a run with no events.
pub fn genesis(run_id: &str) -> Vec<u8> {
    let mut h = Sha256::new();
    h.update(b"runplane.chain.v1\0");
    h.update(run_id.as_bytes());
    h.finalize().to_vec()
}

/// The digest after `event`, given the digest before it.
pub fn extend(previous: &[u8], event: &ChainedEvent<'_>) -> Vec<u8> {
    let mut h = Sha256::new();
    h.update(previous);
    h.update(event.sequence.to_be_bytes());
    h.update(event.kind.to_be_bytes());
    h.update([u8::from(event.check)]);
    for field in [event.name, event.text, event.data] {
        h.update((field.len() as u32).to_be_bytes());
        h.update(field.as_bytes());
    }
    h.update(event.observed_at_us.unwrap_or(-1).to_be_bytes());
    h.finalize().to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(sequence: u64, text: &str) -> ChainedEvent<'_> {
        ChainedEvent {
            sequence,
            kind: 1,
            check: false,
            name: "",
            text,
            data: "",
            observed_at_us: None,
        }
    }

    #[test]
    fn the_chain_pins_order_and_count() {
        let g = genesis("run-1");
        assert_ne!(g, genesis("run-2"));
        let ab = extend(&extend(&g, &event(1, "a")), &event(2, "b"));
        let ba = extend(&extend(&g, &event(1, "b")), &event(2, "a"));
        let abb = extend(&ab, &event(3, "b"));
        assert_ne!(ab, ba);
        assert_ne!(ab, abb);
        assert_eq!(ab, extend(&extend(&g, &event(1, "a")), &event(2, "b")));
    }

    #[test]
    fn field_boundaries_are_unambiguous() {
        let g = genesis("r");
        let mut one = event(1, "bc");
        one.name = "a";
        let mut two = event(1, "c");
        two.name = "ab";
        assert_ne!(extend(&g, &one), extend(&g, &two));
    }
}
