//! Keyed in-process notification for long polls and watch streams (a sandbox *wake* is
//! something else: the restore of a suspended sandbox).
//!
//! A waiter subscribes to the one key it waits on (a run id, say) before it reads, so a
//! change between its read and its wait is not lost. Waking a key wakes that key's
//! subscribers and no one else: an idle waiter costs nothing, however many changes other
//! keys see. Each subscriber may also record what it last read (`V`), so a periodic
//! re-check can compare that with the stored state and wake only the stale ones.
//! Closing wakes everyone for good: long polls answer and watches end instead of
//! holding a shutdown up.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;
use tokio::time::Instant;

/// Who waits on which key. Cheap to clone; clones share the waiters.
#[derive(Debug, Clone)]
pub struct Notifier<V = ()> {
    inner: Arc<Inner<V>>,
    closing: watch::Sender<bool>,
}

#[derive(Debug)]
struct Inner<V> {
    keys: Mutex<HashMap<String, Key<V>>>,
    next_id: AtomicU64,
}

#[derive(Debug)]
struct Key<V> {
    /// Bumped at every notification; each subscriber waits for it to move.
    notified: watch::Sender<u64>,
    /// Subscriber id → what it last read (none until it says).
    seen: HashMap<u64, Option<V>>,
}

impl<V> Default for Notifier<V> {
    fn default() -> Self {
        Self {
            inner: Arc::new(Inner {
                keys: Mutex::default(),
                next_id: AtomicU64::new(0),
            }),
            closing: watch::channel(false).0,
        }
    }
}

impl<V: Clone> Notifier<V> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Wakes whoever waits on `key`.
    pub fn notify(&self, key: &str) {
        if let Some(k) = self.inner.keys.lock().expect("notifier").get(key) {
            k.notified.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Wakes every waiter (what they waited for may have been missed).
    pub fn notify_all(&self) {
        for k in self.inner.keys.lock().expect("notifier").values() {
            k.notified.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// The keys waited on whose subscribers said what they read, with what they read.
    pub fn seen(&self) -> HashMap<String, Vec<V>> {
        self.inner
            .keys
            .lock()
            .expect("notifier")
            .iter()
            .filter_map(|(key, k)| {
                let seen: Vec<V> = k.seen.values().flatten().cloned().collect();
                (!seen.is_empty()).then(|| (key.clone(), seen))
            })
            .collect()
    }

    /// The safety net for wake-ups that may never come (another replica's, lost): every
    /// `every`, reads the stored state of every key whose subscribers said what they read,
    /// `batch` keys per `read`, and wakes the keys a subscriber is behind on. One read
    /// per batch, however many subscribers. Returns once closed.
    pub async fn recheck<F, Fut, E>(&self, every: std::time::Duration, batch: usize, read: F)
    where
        V: PartialEq,
        F: Fn(Vec<String>) -> Fut,
        Fut: Future<Output = Result<Vec<(String, V)>, E>>,
        E: std::fmt::Display,
    {
        loop {
            tokio::select! {
                () = self.closed() => return,
                () = tokio::time::sleep(every) => {}
            }
            let seen = self.seen();
            let keys: Vec<String> = seen.keys().cloned().collect();
            for chunk in keys.chunks(batch.max(1)) {
                let stored = match read(chunk.to_vec()).await {
                    Ok(stored) => stored,
                    Err(e) => {
                        tracing::debug!(error = %e, keys = chunk.len(), "not re-checked; the next re-check reads them");
                        continue;
                    }
                };
                for (key, value) in stored {
                    if seen
                        .get(&key)
                        .is_some_and(|s| s.iter().any(|v| *v != value))
                    {
                        self.notify(&key);
                    }
                }
            }
        }
    }

    /// Every waiter returns now and does not wait again.
    pub fn close(&self) {
        self.closing.send_replace(true);
    }

    pub fn is_closing(&self) -> bool {
        *self.closing.borrow()
    }

    /// Returns once [`close`](Self::close) was called.
    pub async fn closed(&self) {
        let _ = self.closing.subscribe().wait_for(|c| *c).await;
    }

    /// Subscribes to `key`. Subscribe before reading, so a change between the read and
    /// the wait is not lost.
    pub fn subscribe(&self, key: &str) -> Subscription<V> {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let mut keys = self.inner.keys.lock().expect("notifier");
        let k = keys.entry(key.to_owned()).or_insert_with(|| Key {
            notified: watch::channel(0).0,
            seen: HashMap::new(),
        });
        k.seen.insert(id, None);
        Subscription {
            inner: self.inner.clone(),
            key: key.to_owned(),
            id,
            notified: k.notified.subscribe(),
            closing: self.closing.subscribe(),
        }
    }
}

/// One waiter's hold on a key; dropping it unsubscribes.
#[derive(Debug)]
pub struct Subscription<V = ()> {
    inner: Arc<Inner<V>>,
    key: String,
    id: u64,
    notified: watch::Receiver<u64>,
    closing: watch::Receiver<bool>,
}

impl<V> Subscription<V> {
    /// Records what the holder just read, for a re-check to compare with.
    pub fn seen(&self, value: V) {
        if let Some(k) = self.inner.keys.lock().expect("notifier").get_mut(&self.key) {
            k.seen.insert(self.id, Some(value));
        }
    }

    /// Returns true when the key was woken since subscribing or since the last call that
    /// returned true; false at `deadline` or once the wake-ups are closed.
    pub async fn changed(&mut self, deadline: Instant) -> bool {
        if *self.closing.borrow() {
            return false;
        }
        let closing = &mut self.closing;
        let notified = &mut self.notified;
        tokio::time::timeout_at(deadline, async {
            tokio::select! {
                _ = closing.wait_for(|c| *c) => false,
                changed = notified.changed() => changed.is_ok(),
            }
        })
        .await
        .unwrap_or(false)
    }
}

impl<V> Drop for Subscription<V> {
    fn drop(&mut self) {
        let mut keys = self.inner.keys.lock().expect("notifier");
        if let Some(k) = keys.get_mut(&self.key) {
            k.seen.remove(&self.id);
            if k.seen.is_empty() {
                keys.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn soon() -> Instant {
        Instant::now() + Duration::from_millis(50)
    }

    #[tokio::test]
    async fn a_wake_reaches_its_key_only() {
        let w = Notifier::<()>::new();
        let mut a = w.subscribe("a");
        let mut b = w.subscribe("b");
        w.notify("a");
        assert!(a.changed(soon()).await);
        assert!(!b.changed(soon()).await);
        // Consumed: the same wake is not seen twice.
        assert!(!a.changed(soon()).await);
    }

    #[tokio::test]
    async fn a_wake_before_the_wait_is_kept() {
        let w = Notifier::<()>::new();
        let mut a = w.subscribe("a");
        w.notify("a");
        w.notify_all();
        assert!(a.changed(soon()).await);
    }

    #[tokio::test]
    async fn what_was_seen_is_listed_until_unsubscribed() {
        let w = Notifier::<u32>::new();
        let a = w.subscribe("a");
        let _quiet = w.subscribe("b");
        a.seen(7);
        assert_eq!(w.seen(), HashMap::from([("a".to_owned(), vec![7])]));
        drop(a);
        assert!(w.seen().is_empty());
        assert_eq!(w.inner.keys.lock().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn closing_ends_every_wait() {
        let w = Notifier::<()>::new();
        let mut a = w.subscribe("a");
        w.close();
        assert!(!a.changed(Instant::now() + Duration::from_secs(60)).await);
        assert!(w.is_closing());
    }
}
