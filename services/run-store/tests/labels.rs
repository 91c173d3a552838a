//! Run labels over real gRPC, on Postgres and on SQLite: checked at CreateRun, shown by
//! GetRun, and selected by ListRuns' label selector, page by page, within the caller's
//! org; a label or selector that breaks the rules is refused by name and writes nothing.

#[macro_use]
mod common;

use common::*;
use runplane_grpc::{ErrorReason, error_info};
use runplane_proto::runstore::v1 as runstore_pb;
use tonic::Code;

runplane_testkit::on_both_backends!(
    Harness::start =>
    a_label_selector_picks_the_runs_it_says_page_by_page,
    bad_labels_and_selectors_are_refused_by_name_and_write_nothing,
);

async fn create_labelled(h: &Harness, org: &str, id: &str, labels: &[(&str, &str)]) -> String {
    let mut request = create_request(id);
    request.org_id = org.into();
    request.labels = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    h.operator()
        .await
        .create_run(request)
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap()
        .id
}

/// The ids `selector` lists for `token`'s caller, reading pages of 2.
async fn selected(h: &Harness, token: &str, org: &str, selector: &str) -> Vec<String> {
    let mut op = h.operator_with(token).await;
    let mut ids = Vec::new();
    let mut page_token = String::new();
    loop {
        let page = op
            .list_runs(runstore_pb::ListRunsRequest {
                org_id: org.into(),
                label_selector: selector.into(),
                page_size: 2,
                page_token,
                view: runstore_pb::RunView::Basic as i32,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        ids.extend(page.runs.into_iter().map(|r| r.id));
        page_token = page.next_page_token;
        if page_token.is_empty() {
            ids.sort();
            return ids;
        }
    }
}

fn sorted(mut ids: Vec<&String>) -> Vec<String> {
    ids.sort();
    ids.into_iter().cloned().collect()
}

async fn a_label_selector_picks_the_runs_it_says_page_by_page(h: Harness) {
    let infra_gold = create_labelled(
        &h,
        "acme",
        "labels-0001",
        &[("team", "infra"), ("tier", "gold")],
    )
    .await;
    let infra = create_labelled(&h, "acme", "labels-0002", &[("team", "infra")]).await;
    let web = create_labelled(&h, "acme", "labels-0003", &[("team", "web")]).await;
    let bare = create_labelled(&h, "acme", "labels-0004", &[]).await;
    let other_org = create_labelled(&h, "beta", "labels-0005", &[("team", "infra")]).await;

    let got = h.get_run(&infra_gold).await;
    assert_eq!(got.labels.get("tier").map(String::as_str), Some("gold"));

    let cases: [(&str, Vec<&String>); 7] = [
        ("team=infra", vec![&infra_gold, &infra]),
        ("team=infra,tier=gold", vec![&infra_gold]),
        ("team!=infra", vec![&web, &bare]),
        ("team", vec![&infra_gold, &infra, &web]),
        ("!team", vec![&bare]),
        ("!tier,team=infra", vec![&infra]),
        ("", vec![&infra_gold, &infra, &web, &bare]),
    ];
    for (selector, expected) in cases {
        assert_eq!(
            selected(&h, SERVICE_TOKEN, "acme", selector).await,
            sorted(expected),
            "{selector}"
        );
    }
    // Across orgs for a token of every org; an org token sees its own org's only.
    assert_eq!(
        selected(&h, SERVICE_TOKEN, "", "team=infra").await,
        sorted(vec![&infra_gold, &infra, &other_org])
    );
    assert_eq!(
        selected(&h, ACME_TOKEN, "acme", "team=infra").await,
        sorted(vec![&infra_gold, &infra])
    );
    // A page token is for its selector only.
    let first = h
        .operator()
        .await
        .list_runs(runstore_pb::ListRunsRequest {
            org_id: "acme".into(),
            label_selector: "team".into(),
            page_size: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let refused = h
        .operator()
        .await
        .list_runs(runstore_pb::ListRunsRequest {
            org_id: "acme".into(),
            label_selector: "team=web".into(),
            page_size: 1,
            page_token: first.next_page_token,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_reason(&refused, Code::InvalidArgument, ErrorReason::CursorInvalid);
}

async fn bad_labels_and_selectors_are_refused_by_name_and_write_nothing(h: Harness) {
    let too_many: Vec<(String, String)> = (0..33).map(|i| (format!("k{i}"), "v".into())).collect();
    let bad: [Vec<(String, String)>; 4] = [
        vec![("Team".into(), "infra".into())],
        vec![("team".into(), "in fra".into())],
        vec![("team".into(), "v".repeat(64))],
        too_many,
    ];
    for (i, labels) in bad.into_iter().enumerate() {
        let mut request = create_request(&format!("bad-labels-{i:04}"));
        request.labels = labels.into_iter().collect();
        let refused = h.operator().await.create_run(request).await.unwrap_err();
        assert_reason(&refused, Code::InvalidArgument, ErrorReason::InvalidField);
        assert_eq!(error_info(&refused).unwrap().metadata["field"], "labels");
    }
    assert!(selected(&h, SERVICE_TOKEN, "acme", "").await.is_empty());
    for selector in ["team=in fra", "Team", "a,,b", "k=v=w"] {
        let refused = h
            .operator()
            .await
            .list_runs(runstore_pb::ListRunsRequest {
                org_id: "acme".into(),
                label_selector: selector.into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_reason(&refused, Code::InvalidArgument, ErrorReason::InvalidField);
        let info = error_info(&refused).unwrap();
        assert_eq!(info.metadata["field"], "label_selector", "{selector}");
        assert!(refused.message().contains("term"), "{refused:?}");
    }
}
