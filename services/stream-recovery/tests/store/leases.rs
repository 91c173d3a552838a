//! The stream lease: granted to a run's first controller only, and afresh to the first
//! controller of each later attempt of the run.

use std::sync::Arc;

use runplane_stream_recovery::store::{RecoveryStore, StoreError};

use super::{T0, TTL};

pub(crate) async fn only_the_first_controller_acquires_and_the_holder_gets_its_token_back(
    s: Arc<dyn RecoveryStore>,
) {
    let first = s
        .acquire("run-1", "ctl-a", "token-a", TTL, T0, 1)
        .await
        .unwrap();
    assert_eq!((first.token.as_str(), first.next_sequence), ("token-a", 1));
    let again = s
        .acquire("run-1", "ctl-a", "token-other", TTL, T0 + 5, 1)
        .await
        .unwrap();
    assert_eq!(
        again.token, "token-a",
        "the holder asking again gets its own token"
    );
    assert_eq!(
        s.acquire("run-1", "ctl-b", "token-b", TTL, T0 + 10, 1)
            .await,
        Err(StoreError::Held {
            controller: "ctl-a".into()
        })
    );
    // Once the lease lapsed, a new controller still cannot acquire: it must be claimed.
    assert_eq!(
        s.acquire("run-1", "ctl-b", "token-b", TTL, T0 + TTL + 100, 1)
            .await,
        Err(StoreError::TakeoverRequired)
    );
}

pub(crate) async fn a_later_attempts_runner_gets_a_fresh_lease_without_a_takeover(
    s: Arc<dyn RecoveryStore>,
) {
    s.acquire("run-a", "attempt-1", "token-1", TTL, T0, 1)
        .await
        .unwrap();
    // Attempt 1's runner still holds a live lease when attempt 2's says hello.
    let second = s
        .acquire("run-a", "attempt-2", "token-2", TTL, T0 + 10, 2)
        .await
        .unwrap();
    assert_eq!(second.token, "token-2", "a fresh lease for the new attempt");
    let budget = s.budget("run-a", T0 + 20).await.unwrap();
    assert_eq!(
        budget.attempts, 0,
        "a new attempt spends no takeover budget"
    );
    assert_eq!(
        budget.lease.map(|(holder, _)| holder).as_deref(),
        Some("attempt-2")
    );
    assert_eq!(
        s.renew("run-a", "token-1", TTL, T0 + 30).await,
        Err(StoreError::Fenced),
        "the earlier attempt's token is fenced"
    );
    // The same attempt cannot be granted twice: a second controller of attempt 2, and
    // any of attempt 1, get what they got before attempts.
    assert_eq!(
        s.acquire("run-a", "other", "token-x", TTL, T0 + 40, 2)
            .await,
        Err(StoreError::Held {
            controller: "attempt-2".into()
        })
    );
    assert_eq!(
        s.acquire("run-a", "attempt-1", "token-y", TTL, T0 + TTL + 100, 1)
            .await,
        Err(StoreError::TakeoverRequired)
    );
}
