//! The build-time check: every RPC carries a consistent `runplane.options.v1.policy`,
//! callers included.
//!
//! Custom options are read through a prost-reflect descriptor pool because prost's own
//! descriptor types drop extensions.

use std::collections::HashMap;
use std::fmt;

use prost_reflect::{DescriptorPool, DynamicMessage, Kind, MethodDescriptor, Value};

use crate::{Caller, Callers, OutageBudget, ReplaySafety};

/// Full name of the method option the check reads.
pub const POLICY_EXTENSION: &str = "runplane.options.v1.policy";

// `google.protobuf.MethodOptions.IdempotencyLevel` numbers.
const IDEMPOTENCY_UNKNOWN: i32 = 0;
const NO_SIDE_EFFECTS: i32 = 1;
const IDEMPOTENT: i32 = 2;

/// One classified method, owned, as the check produces it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassifiedMethod {
    pub path: String,
    pub replay_safety: ReplaySafety,
    pub key_field: Option<String>,
    pub outage_budget: OutageBudget,
    pub justification: String,
    pub client_streaming: bool,
    pub server_streaming: bool,
    /// The number of the request's `google.protobuf.Duration wait` field of a unary
    /// method: a long poll.
    pub long_poll_wait_field: Option<u32>,
    pub callers: Vec<Caller>,
}

/// One reason a method's classification is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// `/package.Service/Method`, or the extension name when the option is missing.
    pub method: String,
    pub problem: String,
}

/// Every violation found; the build prints them all, not just the first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckError {
    pub violations: Vec<Violation>,
}

impl fmt::Display for CheckError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} RPC classification problem(s) ({POLICY_EXTENSION}):",
            self.violations.len()
        )?;
        for v in &self.violations {
            writeln!(f, "  {}: {}", v.method, v.problem)?;
        }
        Ok(())
    }
}

impl std::error::Error for CheckError {}

/// Checks every method of every service in `pool` and returns them classified, sorted
/// by path.
pub fn check(pool: &DescriptorPool) -> Result<Vec<ClassifiedMethod>, CheckError> {
    let Some(extension) = pool.get_extension_by_name(POLICY_EXTENSION) else {
        return Err(CheckError {
            violations: vec![Violation {
                method: POLICY_EXTENSION.to_owned(),
                problem: "the option is not defined; compile runplane/options/v1/options.proto \
                          with the service protos"
                    .to_owned(),
            }],
        });
    };

    let mut violations = Vec::new();
    let mut classified = Vec::new();
    // Message full name -> the first method that used it as a request or response.
    let mut message_owner: HashMap<String, String> = HashMap::new();

    for service in pool.services() {
        for method in service.methods() {
            let path = format!("/{}/{}", service.full_name(), method.name());
            let mut problem = |p: String| {
                violations.push(Violation {
                    method: path.clone(),
                    problem: p,
                })
            };

            for (role, message) in [("request", method.input()), ("response", method.output())] {
                let name = message.full_name().to_owned();
                if name.starts_with("google.protobuf.") {
                    problem(format!(
                        "{role} is {name}; every RPC has its own request and response messages"
                    ));
                } else if let Some(owner) = message_owner.get(&name) {
                    problem(format!(
                        "{role} {name} is already used by {owner}; every RPC has its own messages"
                    ));
                } else {
                    message_owner.insert(name, path.clone());
                }
            }

            match classify(&method, &extension) {
                Ok(c) => classified.push(ClassifiedMethod {
                    path: path.clone(),
                    client_streaming: method.is_client_streaming(),
                    server_streaming: method.is_server_streaming(),
                    long_poll_wait_field: long_poll_wait_field(&method),
                    ..c
                }),
                Err(problems) => problems.into_iter().for_each(&mut problem),
            }
        }
    }

    if violations.is_empty() {
        classified.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(classified)
    } else {
        Err(CheckError { violations })
    }
}

fn classify(
    method: &MethodDescriptor,
    extension: &prost_reflect::ExtensionDescriptor,
) -> Result<ClassifiedMethod, Vec<String>> {
    let options = method.options();
    if !options.has_extension(extension) {
        return Err(vec![format!(
            "unclassified: add `option ({POLICY_EXTENSION}) = {{ replay_safety: …, outage_budget: …, justification: \"…\" }};`"
        )]);
    }
    let policy = options.get_extension(extension);
    let Some(policy) = policy.as_message() else {
        return Err(vec![format!("{POLICY_EXTENSION} is not a message")]);
    };

    let mut problems = Vec::new();
    let replay_safety = match enum_field(policy, "replay_safety") {
        1 => Some(ReplaySafety::ReadOnly),
        2 => Some(ReplaySafety::Idempotent),
        3 => Some(ReplaySafety::Keyed),
        4 => Some(ReplaySafety::Unsafe),
        _ => {
            problems.push("replay_safety is unspecified".to_owned());
            None
        }
    };
    let outage_budget = match enum_field(policy, "outage_budget") {
        1 => Some(OutageBudget::Ordinary),
        2 => Some(OutageBudget::Terminal),
        _ => {
            problems.push("outage_budget is unspecified".to_owned());
            None
        }
    };
    let key_field = string_field(policy, "key_field");
    let justification = string_field(policy, "justification");

    if justification.trim().is_empty() {
        problems.push(match replay_safety {
            Some(ReplaySafety::Unsafe) => {
                "unsafe method gives no justification (say why it cannot be made replay-safe)"
                    .to_owned()
            }
            _ => "justification is empty".to_owned(),
        });
    } else if justification.contains('\n') {
        problems.push("justification must be one line".to_owned());
    }

    match replay_safety {
        Some(ReplaySafety::Keyed) => {
            if key_field.is_empty() {
                problems.push("keyed method names no key_field".to_owned());
            } else {
                match method.input().get_field_by_name(&key_field) {
                    None => problems.push(format!(
                        "key_field `{key_field}` is not a field of {}",
                        method.input().full_name()
                    )),
                    Some(f) if f.kind() != Kind::String || f.is_list() || f.is_map() => problems
                        .push(format!(
                            "key_field `{key_field}` of {} is not a singular string field",
                            method.input().full_name()
                        )),
                    Some(_) => {}
                }
            }
        }
        Some(_) if !key_field.is_empty() => problems.push(format!(
            "key_field `{key_field}` is set but the method is not REPLAY_SAFETY_KEYED"
        )),
        _ => {}
    }

    let mut callers = Vec::new();
    if let Some(list) = policy.get_field_by_name("callers")
        && let Some(values) = list.as_list()
    {
        for value in values {
            match value.as_enum_number() {
                Some(1) => callers.push(Caller::Operator),
                // The shared token is admitted wherever a service role is named; a method
                // names the roles that call it, so one role's token reaches no more.
                Some(2) => problems.push(
                    "callers names CALLER_SERVICE, which no method names any more: name the \
                     service roles that call it (CALLER_RUN_STORE, CALLER_SANDBOX_RECONCILER, \
                     CALLER_STREAM_RECOVERY, CALLER_CREDENTIAL_HEALTH)"
                        .into(),
                ),
                Some(3) => callers.push(Caller::Org),
                Some(4) => callers.push(Caller::Runner),
                Some(5) => callers.push(Caller::Node),
                Some(6) => callers.push(Caller::Route),
                Some(7) => callers.push(Caller::RunStore),
                Some(8) => callers.push(Caller::SandboxReconciler),
                Some(9) => callers.push(Caller::StreamRecovery),
                Some(10) => callers.push(Caller::CredentialHealth),
                _ => problems.push("callers names CALLER_UNSPECIFIED or an unknown caller".into()),
            }
        }
    }
    if callers.is_empty() {
        problems.push("callers is empty: name who may call it (CALLER_OPERATOR, …)".into());
    }
    if Callers::of(&callers).iter().count() != callers.len() {
        problems.push("callers names a caller twice".into());
    }

    let level = enum_field(&options, "idempotency_level");
    let expected = match replay_safety {
        Some(ReplaySafety::ReadOnly) => Some((NO_SIDE_EFFECTS, "NO_SIDE_EFFECTS")),
        Some(ReplaySafety::Idempotent | ReplaySafety::Keyed) => Some((IDEMPOTENT, "IDEMPOTENT")),
        Some(ReplaySafety::Unsafe) => Some((IDEMPOTENCY_UNKNOWN, "IDEMPOTENCY_UNKNOWN (unset)")),
        None => None,
    };
    if let Some((want, name)) = expected
        && level != want
    {
        problems.push(format!(
            "idempotency_level must be {name} for {} methods",
            replay_safety.map(ReplaySafety::as_str).unwrap_or_default()
        ));
    }

    match (replay_safety, outage_budget, problems.is_empty()) {
        (Some(replay_safety), Some(outage_budget), true) => Ok(ClassifiedMethod {
            path: String::new(),
            replay_safety,
            key_field: (!key_field.is_empty()).then_some(key_field),
            outage_budget,
            justification,
            client_streaming: false,
            server_streaming: false,
            long_poll_wait_field: None,
            callers,
        }),
        _ => Err(problems),
    }
}

/// A unary method whose request has a `google.protobuf.Duration wait` is a long poll.
fn long_poll_wait_field(method: &MethodDescriptor) -> Option<u32> {
    if method.is_client_streaming() || method.is_server_streaming() {
        return None;
    }
    let field = method.input().get_field_by_name("wait")?;
    match field.kind() {
        Kind::Message(m) if m.full_name() == "google.protobuf.Duration" && !field.is_list() => {
            Some(field.number())
        }
        _ => None,
    }
}

fn enum_field(message: &DynamicMessage, name: &str) -> i32 {
    message
        .get_field_by_name(name)
        .and_then(|v| v.as_enum_number())
        .unwrap_or(0)
}

fn string_field(message: &DynamicMessage, name: &str) -> String {
    message
        .get_field_by_name(name)
        .and_then(|v| match v.as_ref() {
            Value::String(s) => Some(s.clone()),
            _ => None,
        })
        .unwrap_or_default()
}

/// Renders the classified methods as Rust source: a `METHOD_POLICIES` static sorted by
/// path, made of [`crate::MethodPolicy`] values.
pub fn render_table(methods: &[ClassifiedMethod]) -> String {
    let mut out = String::from(
        "// @generated by runplane-proto's build script from runplane.options.v1.policy.\n\
         /// Every runplane RPC's replay-safety policy, sorted by full method path.\n\
         pub static METHOD_POLICIES: &[::runplane_proto_policy::MethodPolicy] = &[\n",
    );
    for m in methods {
        let replay_safety = match m.replay_safety {
            ReplaySafety::ReadOnly => "ReadOnly",
            ReplaySafety::Idempotent => "Idempotent",
            ReplaySafety::Keyed => "Keyed",
            ReplaySafety::Unsafe => "Unsafe",
        };
        let outage_budget = match m.outage_budget {
            OutageBudget::Ordinary => "Ordinary",
            OutageBudget::Terminal => "Terminal",
        };
        let callers: Vec<String> = m
            .callers
            .iter()
            .map(|c| format!("::runplane_proto_policy::Caller::{c:?}"))
            .collect();
        out.push_str(&format!(
            "    ::runplane_proto_policy::MethodPolicy {{\n        path: {:?},\n        replay_safety: ::runplane_proto_policy::ReplaySafety::{replay_safety},\n        key_field: {:?},\n        outage_budget: ::runplane_proto_policy::OutageBudget::{outage_budget},\n        justification: {:?},\n        client_streaming: {},\n        server_streaming: {},\n        long_poll_wait_field: {:?},\n        callers: ::runplane_proto_policy::Callers::of(&[{}]),\n    }},\n",
            m.path,
            m.key_field,
            m.justification,
            m.client_streaming,
            m.server_streaming,
            m.long_poll_wait_field,
            callers.join(", ")
        ));
    }
    out.push_str("];\n");
    out
}
