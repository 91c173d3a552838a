//! The build-time check, run on fixture protos: it must reject each kind of bad
//! classification, naming the method, and accept a good one.

use std::path::PathBuf;

use runplane_proto_policy::check::{CheckError, check, render_table};
use runplane_proto_policy::{OutageBudget, ReplaySafety};

fn pool(fixture: &str) -> prost_reflect::DescriptorPool {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let includes = [here.join("tests/fixtures"), here.join("../../proto")];
    protox::Compiler::new(includes)
        .expect("fixture include paths")
        .include_imports(true)
        .open_file(fixture)
        .unwrap_or_else(|e| panic!("compile {fixture}: {e:?}"))
        .descriptor_pool()
}

fn rejected(fixture: &str) -> CheckError {
    match check(&pool(fixture)) {
        Ok(methods) => panic!("{fixture} passed the check: {methods:?}"),
        Err(e) => e,
    }
}

fn problems_of(err: &CheckError, method: &str) -> Vec<String> {
    err.violations
        .iter()
        .filter(|v| v.method == method)
        .map(|v| v.problem.clone())
        .collect()
}

#[test]
fn accepts_a_fully_classified_service_and_sorts_it_by_path() {
    let methods = check(&pool("good.proto")).expect("good.proto is classified");
    let paths: Vec<_> = methods.iter().map(|m| m.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/fixture.good.v1.Widgets/CreateWidget",
            "/fixture.good.v1.Widgets/GetWidget",
            "/fixture.good.v1.Widgets/Poke",
        ]
    );
    let create = &methods[0];
    assert_eq!(create.replay_safety, ReplaySafety::Keyed);
    assert_eq!(create.key_field.as_deref(), Some("request_id"));
    assert_eq!(create.outage_budget, OutageBudget::Terminal);
    assert_eq!(methods[2].replay_safety, ReplaySafety::Unsafe);
    assert_eq!(methods[2].justification, "each poke is counted");

    let table = render_table(&methods);
    assert!(table.contains("path: \"/fixture.good.v1.Widgets/CreateWidget\""));
    assert!(table.contains("key_field: Some(\"request_id\")"));
}

#[test]
fn rejects_an_unclassified_method_by_name() {
    let err = rejected("unclassified.proto");
    let problems = problems_of(&err, "/fixture.unclassified.v1.Widgets/DeleteWidget");
    assert_eq!(problems.len(), 1, "{err}");
    assert!(problems[0].starts_with("unclassified"), "{err}");
    assert!(
        err.to_string()
            .contains("/fixture.unclassified.v1.Widgets/DeleteWidget: unclassified")
    );
}

#[test]
fn rejects_a_keyed_method_without_a_string_key_field() {
    let err = rejected("keyed_not_string.proto");
    assert_eq!(
        problems_of(&err, "/fixture.keyed.v1.Widgets/CreateWidget"),
        [
            "key_field `request_number` of fixture.keyed.v1.CreateWidgetRequest is not a singular string field"
        ]
    );
    assert_eq!(
        problems_of(&err, "/fixture.keyed.v1.Widgets/RenameWidget"),
        ["key_field `no_such_field` is not a field of fixture.keyed.v1.RenameWidgetRequest"]
    );
    assert_eq!(
        problems_of(&err, "/fixture.keyed.v1.Widgets/TagWidget"),
        ["keyed method names no key_field"]
    );
}

#[test]
fn rejects_an_unsafe_method_without_a_justification() {
    let err = rejected("unsafe_unjustified.proto");
    let problems = problems_of(&err, "/fixture.unsafe.v1.Widgets/Poke");
    assert_eq!(problems.len(), 1, "{err}");
    assert!(problems[0].contains("gives no justification"), "{err}");
}

#[test]
fn rejects_contradictions_shared_messages_and_missing_budgets() {
    let err = rejected("inconsistent.proto");
    assert_eq!(
        problems_of(&err, "/fixture.inconsistent.v1.Widgets/Poke"),
        ["idempotency_level must be IDEMPOTENCY_UNKNOWN (unset) for unsafe methods"]
    );
    let prod = problems_of(&err, "/fixture.inconsistent.v1.Widgets/Prod");
    assert!(
        prod.iter()
            .any(|p| p.contains("already used by /fixture.inconsistent.v1.Widgets/Poke")),
        "{err}"
    );
    assert!(
        prod.iter().any(|p| p.contains("google.protobuf.Empty")),
        "{err}"
    );
    assert_eq!(
        problems_of(&err, "/fixture.inconsistent.v1.Widgets/Peek"),
        ["outage_budget is unspecified"]
    );
}

#[test]
fn rejects_a_method_that_names_no_caller_or_a_caller_twice() {
    let err = rejected("uncalled.proto");
    assert_eq!(
        problems_of(&err, "/fixture.uncalled.v1.Widgets/Poke"),
        ["callers is empty: name who may call it (CALLER_OPERATOR, …)"]
    );
    assert_eq!(
        problems_of(&err, "/fixture.uncalled.v1.Widgets/Prod"),
        [
            "callers names CALLER_UNSPECIFIED or an unknown caller",
            "callers is empty: name who may call it (CALLER_OPERATOR, …)"
        ]
    );
    assert_eq!(
        problems_of(&err, "/fixture.uncalled.v1.Widgets/Nudge"),
        ["callers names a caller twice"]
    );
}

#[test]
fn the_table_carries_each_methods_callers() {
    let methods = check(&pool("good.proto")).expect("good.proto passes");
    assert!(
        methods
            .iter()
            .all(|m| m.callers == [runplane_proto_policy::Caller::Operator])
    );
    let table = render_table(&methods);
    assert!(table.contains("callers: ::runplane_proto_policy::Callers::of(&[::runplane_proto_policy::Caller::Operator])"), "{table}");
}

#[test]
fn rejects_a_method_that_names_the_shared_service_caller() {
    let err = rejected("shared_service.proto");
    assert_eq!(
        problems_of(&err, "/fixture.shared_service.v1.Widgets/Poke"),
        [
            "callers names CALLER_SERVICE, which no method names any more: name the service roles that call it (CALLER_RUN_STORE, CALLER_SANDBOX_RECONCILER, CALLER_STREAM_RECOVERY, CALLER_CREDENTIAL_HEALTH)"
        ]
    );
    assert!(
        problems_of(&err, "/fixture.shared_service.v1.Widgets/Prod").is_empty(),
        "{err}"
    );
}
