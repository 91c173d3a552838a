//! Checks of requests before anything is written. Every failure names the field; a
//! request that fails any check writes nothing.

use prost_types::value::Kind;
use runplane_ids::{Name, RunId};
use runplane_proto::runstore::v1::{EventInput, EventKind};

use crate::domain::limits::Limits;
use crate::domain::verdict::Verdict;
use crate::error::RunStoreError;

/// Client-chosen keys (request ids, batch keys, nonces): 16–128 printable ASCII bytes.
pub fn client_key(field: &'static str, value: &str) -> Result<(), RunStoreError> {
    if !(16..=128).contains(&value.len()) {
        return Err(RunStoreError::invalid(field, "must be 16 to 128 bytes"));
    }
    if !value.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(RunStoreError::invalid(
            field,
            "must be printable ASCII without spaces",
        ));
    }
    Ok(())
}

pub fn bounded(
    field: &'static str,
    value: &str,
    min: usize,
    max: usize,
) -> Result<(), RunStoreError> {
    if value.len() < min || value.len() > max {
        let reason = if min == 0 {
            format!("must be at most {max} bytes")
        } else {
            format!("must be {min} to {max} bytes")
        };
        return Err(RunStoreError::invalid(field, reason));
    }
    Ok(())
}

/// Ids of orgs, leads, credentials, profiles: a [`Name`].
pub fn name(field: &'static str, value: &str) -> Result<(), RunStoreError> {
    Name::parse(value)
        .map(|_| ())
        .map_err(|e| RunStoreError::invalid(field, e.to_string()))
}

/// A client's unsigned number as the signed column it is compared with or stored in:
/// past `i64::MAX` it would wrap to a negative value, so it is refused instead.
pub fn int64(field: &'static str, value: u64) -> Result<i64, RunStoreError> {
    i64::try_from(value)
        .map_err(|_| RunStoreError::invalid(field, format!("must be at most {}", i64::MAX)))
}

/// A [`RunId`], in the field `run_id`.
pub fn run_id(value: &str) -> Result<(), RunStoreError> {
    RunId::parse(value)
        .map(|_| ())
        .map_err(|e| RunStoreError::invalid("run_id", e.to_string()))
}

/// Stable snake_case reasons (verdicts, failures, aborts): 1–64 bytes of `[a-z0-9_]`.
pub fn snake_reason(field: &'static str, value: &str) -> Result<(), RunStoreError> {
    bounded(field, value, 1, 64)?;
    if !value
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    {
        return Err(RunStoreError::invalid(field, "must be snake_case"));
    }
    Ok(())
}

/// A runner's verdict, its outcome already known (see `convert`).
pub fn verdict(v: &Verdict) -> Result<(), RunStoreError> {
    snake_reason("verdict.reason", &v.reason)?;
    bounded("verdict.message", &v.message, 0, 512)?;
    Ok(())
}

/// Structured event data as JSON with sorted keys; empty when absent.
pub fn data_json(data: Option<&prost_types::Struct>) -> Result<String, String> {
    match data {
        None => Ok(String::new()),
        Some(s) => serde_json::to_string(&struct_to_json(s)?).map_err(|e| e.to_string()),
    }
}

fn struct_to_json(s: &prost_types::Struct) -> Result<serde_json::Value, String> {
    let mut map = serde_json::Map::new();
    for (k, v) in &s.fields {
        map.insert(k.clone(), value_to_json(v)?);
    }
    Ok(serde_json::Value::Object(map))
}

fn value_to_json(v: &prost_types::Value) -> Result<serde_json::Value, String> {
    Ok(match &v.kind {
        None | Some(Kind::NullValue(_)) => serde_json::Value::Null,
        Some(Kind::BoolValue(b)) => serde_json::Value::Bool(*b),
        Some(Kind::NumberValue(n)) => serde_json::Number::from_f64(*n)
            .map(serde_json::Value::Number)
            .ok_or("data holds a number that is not finite")?,
        Some(Kind::StringValue(s)) => serde_json::Value::String(s.clone()),
        Some(Kind::ListValue(l)) => serde_json::Value::Array(
            l.values
                .iter()
                .map(value_to_json)
                .collect::<Result<_, _>>()?,
        ),
        Some(Kind::StructValue(s)) => struct_to_json(s)?,
    })
}

/// The stored JSON back as a `Struct`.
pub fn json_to_struct(json: &str) -> Option<prost_types::Struct> {
    if json.is_empty() {
        return None;
    }
    match serde_json::from_str::<serde_json::Value>(json).ok()? {
        serde_json::Value::Object(map) => Some(prost_types::Struct {
            fields: map
                .into_iter()
                .map(|(k, v)| (k, json_to_value(v)))
                .collect(),
        }),
        _ => None,
    }
}

fn json_to_value(v: serde_json::Value) -> prost_types::Value {
    let kind = match v {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(b),
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or_default()),
        serde_json::Value::String(s) => Kind::StringValue(s),
        serde_json::Value::Array(a) => Kind::ListValue(prost_types::ListValue {
            values: a.into_iter().map(json_to_value).collect(),
        }),
        serde_json::Value::Object(map) => Kind::StructValue(prost_types::Struct {
            fields: map
                .into_iter()
                .map(|(k, v)| (k, json_to_value(v)))
                .collect(),
        }),
    };
    prost_types::Value { kind: Some(kind) }
}

/// An event ready to store: validated, its data canonicalised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckedEvent {
    pub kind: i32,
    pub text: String,
    pub data: String,
    pub check: bool,
    pub name: String,
    pub observed_at_us: Option<i64>,
}

/// Checks a runner's batch against the limits. `allow_empty` is for SubmitResult's
/// optional final batch.
pub fn batch(
    events: &[EventInput],
    limits: &Limits,
    allow_empty: bool,
) -> Result<Vec<CheckedEvent>, RunStoreError> {
    if events.is_empty() && !allow_empty {
        return Err(RunStoreError::invalid(
            "events",
            "must hold at least one event",
        ));
    }
    if events.len() > limits.max_batch_events as usize {
        return Err(RunStoreError::BatchTooLarge {
            unit: "events",
            limit: limits.max_batch_events.into(),
            actual: events.len() as u64,
        });
    }
    let bytes: usize = events.iter().map(prost::Message::encoded_len).sum();
    if bytes > limits.max_batch_bytes as usize {
        return Err(RunStoreError::BatchTooLarge {
            unit: "bytes",
            limit: limits.max_batch_bytes.into(),
            actual: bytes as u64,
        });
    }
    events
        .iter()
        .enumerate()
        .map(|(index, e)| {
            let malformed = |reason: String| RunStoreError::EventMalformed { index, reason };
            match EventKind::try_from(e.kind) {
                Ok(EventKind::Unspecified) | Err(_) => {
                    return Err(malformed("kind is unspecified or unknown".into()));
                }
                Ok(
                    kind @ (EventKind::SteerUndeliverable
                    | EventKind::AttemptEnded
                    | EventKind::AttemptStarted),
                ) => {
                    return Err(malformed(format!(
                        "{} is written by the run store, not by runners",
                        kind.as_str_name()
                    )));
                }
                Ok(_) => {}
            }
            if e.text.len() > limits.max_event_text_bytes as usize {
                return Err(malformed(format!(
                    "text is {} bytes, more than {}",
                    e.text.len(),
                    limits.max_event_text_bytes
                )));
            }
            if e.name.len() > 128 {
                return Err(malformed("name is more than 128 bytes".into()));
            }
            // PostgreSQL keeps no text with a NUL byte (SQLite would): refused here, the
            // same on both, rather than failing as storage would.
            if e.text.contains('\0') || e.name.contains('\0') {
                return Err(malformed(
                    "text or name holds a NUL byte, which no store keeps (the runner writes it as U+FFFD)".into(),
                ));
            }
            let data = data_json(e.data.as_ref()).map_err(malformed)?;
            if data.len() > limits.max_event_text_bytes as usize {
                return Err(malformed(format!(
                    "data is more than {} bytes",
                    limits.max_event_text_bytes
                )));
            }
            // Saturating: a client's far-off time must not overflow (and panic).
            let observed_at_us = match &e.observed_at {
                None => None,
                Some(t) => match runplane_clock::from_timestamp(t) {
                    Some(us) => Some(us),
                    None => return Err(malformed("observed_at has invalid nanos".into())),
                },
            };
            Ok(CheckedEvent {
                kind: e.kind,
                text: e.text.clone(),
                data,
                check: e.check,
                name: e.name.clone(),
                observed_at_us,
            })
        })
        .collect()
}

/// SHA-256 of a batch's checked events, to tell a replay from a reused key.
pub fn batch_digest(events: &[CheckedEvent]) -> String {
    let mut bytes = Vec::new();
    for e in events {
        bytes.extend_from_slice(&e.kind.to_be_bytes());
        bytes.push(u8::from(e.check));
        for f in [&e.name, &e.text, &e.data] {
            bytes.extend_from_slice(&(f.len() as u32).to_be_bytes());
            bytes.extend_from_slice(f.as_bytes());
        }
        bytes.extend_from_slice(&e.observed_at_us.unwrap_or(-1).to_be_bytes());
    }
    crate::domain::ids::digest_hex(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits::default()
    }

    fn line(text: &str) -> EventInput {
        EventInput {
            kind: EventKind::Stdout as i32,
            text: text.into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_batch_over_the_count_is_refused_whole() {
        let mut l = limits();
        l.max_batch_events = 2;
        let err = batch(&[line("a"), line("b"), line("c")], &l, false).unwrap_err();
        assert!(matches!(
            err,
            RunStoreError::BatchTooLarge { actual: 3, .. }
        ));
    }

    #[test]
    fn malformed_events_are_named_by_index() {
        let mut bad = line("x");
        bad.kind = EventKind::SteerUndeliverable as i32;
        let err = batch(&[line("ok"), bad], &limits(), false).unwrap_err();
        assert!(matches!(
            err,
            RunStoreError::EventMalformed { index: 1, .. }
        ));

        let nan = EventInput {
            kind: EventKind::Custom as i32,
            data: Some(prost_types::Struct {
                fields: [(
                    "x".to_owned(),
                    prost_types::Value {
                        kind: Some(Kind::NumberValue(f64::NAN)),
                    },
                )]
                .into(),
            }),
            ..Default::default()
        };
        assert!(matches!(
            batch(&[nan], &limits(), false).unwrap_err(),
            RunStoreError::EventMalformed { index: 0, .. }
        ));
    }

    #[test]
    fn data_round_trips_with_sorted_keys() {
        let json = r#"{"b":[1.0,true,null],"a":{"z":"y"}}"#;
        let s = json_to_struct(json).unwrap();
        assert_eq!(
            data_json(Some(&s)).unwrap(),
            r#"{"a":{"z":"y"},"b":[1.0,true,null]}"#
        );
    }

    #[test]
    fn client_keys_are_bounded_printable_ascii() {
        assert!(client_key("batch_key", "0123456789abcdef").is_ok());
        assert!(client_key("batch_key", "short").is_err());
        assert!(client_key("batch_key", "0123456789 abcdef").is_err());
    }
}
