//! Messages as JSON the way grpcurl prints them (protobuf's canonical JSON: lowerCamelCase
//! names, enums by name, 64-bit integers and bytes as strings, default values left out),
//! through the descriptor set the build embeds. What `--json` and `receipt get` print is
//! therefore what a grpcurl user already has, and `receipt verify` reads both.

use std::sync::LazyLock;

use anyhow::Context;
use prost::Message;
use prost_reflect::{DescriptorPool, DeserializeOptions, DynamicMessage, MessageDescriptor};

static POOL: LazyLock<DescriptorPool> = LazyLock::new(|| {
    DescriptorPool::decode(runplane_proto::FILE_DESCRIPTOR_SET)
        .expect("the embedded descriptor set decodes")
});

fn descriptor(full_name: &str) -> MessageDescriptor {
    POOL.get_message_by_name(full_name)
        .unwrap_or_else(|| panic!("{full_name} is in the descriptor set"))
}

/// `message` (of the proto type `full_name`) as canonical JSON.
pub fn to_value(message: &impl Message, full_name: &str) -> serde_json::Value {
    let dynamic = DynamicMessage::decode(descriptor(full_name), message.encode_to_vec().as_slice())
        .expect("a message decodes as its own type");
    serde_json::to_value(&dynamic).expect("a message serializes")
}

/// Parses canonical JSON of the proto type `full_name` (either field spelling, as any
/// protobuf JSON parser does) into `M`.
pub fn from_value<M: Message + Default>(
    value: serde_json::Value,
    full_name: &str,
) -> anyhow::Result<M> {
    let dynamic = DynamicMessage::deserialize_with_options(
        descriptor(full_name),
        value,
        &DeserializeOptions::new().deny_unknown_fields(false),
    )
    .with_context(|| format!("not a {full_name}"))?;
    Ok(M::decode(dynamic.encode_to_vec().as_slice())?)
}

#[cfg(test)]
mod tests {
    use runplane_proto::runstore::v1 as runstore_pb;

    use super::*;

    #[test]
    fn prints_what_grpcurl_prints() {
        let run = runstore_pb::Run {
            id: "0190".into(),
            state: runstore_pb::RunState::Running as i32,
            last_sequence: 7,
            created_at: Some(prost_types::Timestamp {
                seconds: 1_800_000_000,
                nanos: 0,
            }),
            ..Default::default()
        };
        assert_eq!(
            to_value(&run, "runplane.runstore.v1.Run"),
            serde_json::json!({
                "id": "0190",
                "state": "RUN_STATE_RUNNING",
                "lastSequence": "7",
                "createdAt": "2027-01-15T08:00:00Z",
            })
        );
    }

    #[test]
    fn reads_back_what_it_prints_and_proto_field_names_too() {
        let receipt = runstore_pb::GetReceiptResponse {
            receipt: Some(runstore_pb::Receipt {
                signed_payload: vec![1, 2, 3],
                signature: vec![4, 5],
                key_id: "ed25519:ab".into(),
                body: None,
            }),
        };
        let name = "runplane.runstore.v1.GetReceiptResponse";
        let value = to_value(&receipt, name);
        assert_eq!(value["receipt"]["signedPayload"], "AQID");
        assert_eq!(
            from_value::<runstore_pb::GetReceiptResponse>(value, name).unwrap(),
            receipt
        );
        let snake = serde_json::json!({"receipt": {
            "signed_payload": "AQID", "signature": "BAU=", "key_id": "ed25519:ab"
        }});
        assert_eq!(
            from_value::<runstore_pb::GetReceiptResponse>(snake, name).unwrap(),
            receipt
        );
    }
}
