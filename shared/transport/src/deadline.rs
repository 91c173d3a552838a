//! Each attempt's deadline, from its method's class in the proto options.
//!
//! - An ordinary unary call: [`RetryConfig::attempt_timeout`].
//! - A long poll (a unary request with a `google.protobuf.Duration wait`): the wait it
//!   asks for plus [`RetryConfig::long_poll_margin`], never less than an ordinary call.
//! - A server stream: none (its response headers are still bounded by the attempt
//!   timeout, and a stream silent past its heartbeat is broken by the reader).
//!
//! A deadline the caller set (`grpc-timeout`) wins when it is shorter.

use std::time::Duration;

use bytes::Buf;
use prost::Message as _;
use prost::encoding::{WireType, decode_key, decode_varint};
use runplane_proto::CallClass;

use crate::config::RetryConfig;

pub(crate) fn of(
    config: &RetryConfig,
    class: CallClass,
    headers: &http::HeaderMap,
    body: &[u8],
) -> Option<Duration> {
    let class_deadline = match class {
        CallClass::Stream => return None,
        CallClass::Unary => config.attempt_timeout,
        CallClass::LongPoll { wait_field } => (wait(body, wait_field).unwrap_or_default()
            + config.long_poll_margin)
            .max(config.attempt_timeout),
    };
    let caller = headers
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(parse);
    Some(caller.map_or(class_deadline, |c| c.min(class_deadline)))
}

/// `grpc-timeout` in milliseconds (at most 8 digits, as the spec allows).
pub(crate) fn header(d: Duration) -> http::HeaderValue {
    let ms = d.as_millis().clamp(1, 99_999_999);
    http::HeaderValue::from_str(&format!("{ms}m")).expect("digits and a unit")
}

fn parse(value: &str) -> Option<Duration> {
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The `wait` a long poll's request asks for, read from its gRPC frame.
fn wait(frame: &[u8], field: u32) -> Option<Duration> {
    // One uncompressed message: flag byte, 4-byte length, the message.
    if frame.len() < 5 || frame[0] != 0 {
        return None;
    }
    let mut buf = &frame[5..];
    let mut found = None;
    while buf.has_remaining() {
        let (tag, wire_type) = decode_key(&mut buf).ok()?;
        match wire_type {
            WireType::Varint => {
                decode_varint(&mut buf).ok()?;
            }
            WireType::SixtyFourBit => buf.advance(8.min(buf.remaining())),
            WireType::ThirtyTwoBit => buf.advance(4.min(buf.remaining())),
            WireType::LengthDelimited => {
                let len = decode_varint(&mut buf).ok()? as usize;
                if len > buf.remaining() {
                    return None;
                }
                if tag == field {
                    let d = prost_types::Duration::decode(&buf[..len]).ok()?;
                    found = Some(Duration::new(
                        d.seconds.max(0) as u64,
                        d.nanos.clamp(0, 999_999_999) as u32,
                    ));
                }
                buf.advance(len);
            }
            WireType::StartGroup | WireType::EndGroup => return None,
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use runplane_proto::runstore::v1 as runstore_pb;

    fn frame(message: &impl prost::Message) -> Vec<u8> {
        let encoded = message.encode_to_vec();
        let mut out = vec![0];
        out.extend_from_slice(&(encoded.len() as u32).to_be_bytes());
        out.extend_from_slice(&encoded);
        out
    }

    #[test]
    fn a_long_poll_gets_its_wait_plus_the_margin() {
        let config = RetryConfig::default();
        let policy =
            runplane_proto::policy_for("/runplane.runstore.v1.RunnerService/PollSteering").unwrap();
        let request = runstore_pb::PollSteeringRequest {
            run_id: "r".into(),
            wait: Some(prost_types::Duration {
                seconds: 25,
                nanos: 0,
            }),
            ..Default::default()
        };
        let got = of(
            &config,
            policy.call_class(),
            &http::HeaderMap::new(),
            &frame(&request),
        );
        assert_eq!(got, Some(Duration::from_secs(25) + config.long_poll_margin));
    }

    #[test]
    fn classes_come_from_the_policy_table() {
        let class = |p: &str| runplane_proto::policy_for(p).unwrap().call_class();
        assert_eq!(
            class("/runplane.runstore.v1.RunnerService/AppendEvents"),
            CallClass::Unary
        );
        assert_eq!(
            class("/runplane.runstore.v1.RunService/WatchRun"),
            CallClass::Stream
        );
        assert!(matches!(
            class("/runplane.runstore.v1.RunnerService/PollSteering"),
            CallClass::LongPoll { .. }
        ));
    }

    #[test]
    fn a_shorter_caller_deadline_wins() {
        let mut headers = http::HeaderMap::new();
        headers.insert("grpc-timeout", "250m".parse().unwrap());
        let got = of(&RetryConfig::default(), CallClass::Unary, &headers, &[]);
        assert_eq!(got, Some(Duration::from_millis(250)));
        assert_eq!(parse("3S"), Some(Duration::from_secs(3)));
        assert_eq!(header(Duration::from_secs(2)), "2000m");
    }
}
