//! An in-memory [`Store`] with the semantics of the JetStream one, for unit tests of the
//! control-plane logic without a nats-server:
//!
//! - one revision counter per bucket (like a KV stream's sequence): every put, create, update
//!   and delete takes the next one;
//! - `create` answers `None` when the key exists, `update` answers `None` when the revision
//!   moved (compare-and-swap);
//! - `watch` yields the current values, then every change (`None` = deleted), through a
//!   bounded broadcast ([`WATCH_BUFFER`] changes; a watcher that falls further behind logs and
//!   skips, where JetStream would redeliver);
//! - events are kept in order (at most [`MAX_EVENTS`], oldest dropped) for assertions;
//! - every operation yields to the scheduler once before acting, as a network round trip
//!   would, so concurrent callers (two "hub replicas" sharing one store) interleave and really
//!   race on compare-and-swap.
//!
//! Values are stored JSON-encoded, so a type that does not round-trip fails here as it would
//! against JetStream.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use futures::StreamExt;
use serde::de::DeserializeOwned;
use tokio::sync::broadcast;

use bytes::Bytes;

use super::{Bucket, Raw, RawEntry, Store, StoreResult, Write, Written, decode_or_skip};
use crate::resources::Event;

/// Changes buffered per bucket for watchers.
pub const WATCH_BUFFER: usize = 4096;
/// Events kept (oldest dropped).
pub const MAX_EVENTS: usize = 10_000;

type Change = (String, Option<Bytes>);
/// A stored value: JSON and revision.
type Stored = (Bytes, u64);

#[derive(Default)]
struct BucketState {
    /// key → (JSON, revision)
    entries: BTreeMap<String, Stored>,
    last_revision: u64,
    watchers: Option<broadcast::Sender<Change>>,
}

impl BucketState {
    fn write(&mut self, key: &str, value: Option<Bytes>) -> u64 {
        self.last_revision += 1;
        let rev = self.last_revision;
        match &value {
            Some(v) => {
                self.entries.insert(key.to_string(), (v.clone(), rev));
            }
            None => {
                self.entries.remove(key);
            }
        }
        if let Some(tx) = &self.watchers {
            // No receiver left is not an error.
            let _ = tx.send((key.to_string(), value));
        }
        rev
    }
}

#[derive(Default)]
struct State {
    buckets: HashMap<&'static str, BucketState>,
    events: std::collections::VecDeque<Event>,
}

/// The in-memory store; clones share state.
#[derive(Clone, Default)]
pub struct MemoryStore {
    state: Arc<Mutex<State>>,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MemoryStore")
    }
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking test thread must not hide the state from the others.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn with_bucket<R>(&self, b: Bucket, f: impl FnOnce(&mut BucketState) -> R) -> R {
        let mut st = self.lock();
        f(st.buckets.entry(b.name()).or_default())
    }

    /// The events published so far, oldest first.
    pub fn events(&self) -> Vec<Event> {
        self.lock().events.iter().cloned().collect()
    }

    /// The reasons of the events published so far for object `name`, oldest first.
    pub fn event_reasons(&self, name: &str) -> Vec<String> {
        self.lock()
            .events
            .iter()
            .filter(|e| e.involved_object.name == name)
            .map(|e| e.reason.clone())
            .collect()
    }

    /// The last revision of bucket `b` (0 when nothing was written).
    pub fn last_revision(&self, b: Bucket) -> u64 {
        self.with_bucket(b, |s| s.last_revision)
    }
}

impl Store for MemoryStore {
    async fn get_raw(&self, b: Bucket, key: &str) -> StoreResult<Raw> {
        tokio::task::yield_now().await;
        Ok(self.with_bucket(b, |s| s.entries.get(key).cloned()))
    }

    async fn write_raw(&self, b: Bucket, key: &str, v: Bytes, how: Write) -> Written {
        tokio::task::yield_now().await;
        Ok(self.with_bucket(b, |s| {
            let current = s.entries.get(key).map(|(_, r)| *r);
            let allowed = match how {
                Write::Put => true,
                Write::Create => current.is_none(),
                Write::Update(rev) => current.unwrap_or(0) == rev,
            };
            allowed.then(|| s.write(key, Some(v)))
        }))
    }

    async fn delete(&self, b: Bucket, key: &str) -> StoreResult<()> {
        tokio::task::yield_now().await;
        self.with_bucket(b, |s| {
            if s.entries.contains_key(key) {
                s.write(key, None);
            }
        });
        Ok(())
    }

    async fn keys_matching(&self, b: Bucket, filter: &str) -> StoreResult<Vec<String>> {
        tokio::task::yield_now().await;
        Ok(self.with_bucket(b, |s| {
            s.entries
                .keys()
                .filter(|k| subject_matches(filter, k))
                .cloned()
                .collect()
        }))
    }

    async fn list_raw(&self, b: Bucket, filter: &str) -> StoreResult<Vec<RawEntry>> {
        tokio::task::yield_now().await;
        Ok(self.with_bucket(b, |s| {
            s.entries
                .iter()
                .filter(|(k, _)| subject_matches(filter, k))
                .map(|(k, (v, rev))| (k.clone(), v.clone(), *rev))
                .collect()
        }))
    }

    async fn watch<T: DeserializeOwned + Send + 'static>(
        &self,
        b: Bucket,
    ) -> StoreResult<futures::stream::BoxStream<'static, (String, Option<T>)>> {
        tokio::task::yield_now().await;
        // Snapshot and subscription under one lock: no change is missed or seen twice.
        let (current, rx) = self.with_bucket(b, |s| {
            let tx = s
                .watchers
                .get_or_insert_with(|| broadcast::channel(WATCH_BUFFER).0);
            let current: Vec<Change> = s
                .entries
                .iter()
                .map(|(k, (v, _))| (k.clone(), Some(v.clone())))
                .collect();
            (current, tx.subscribe())
        });
        let changes = futures::stream::unfold(rx, move |mut rx| async move {
            loop {
                match rx.recv().await {
                    Ok(c) => return Some((c, rx)),
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!(bucket = b.name(), skipped = n, "memory watch lagged");
                    }
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        });
        Ok(futures::stream::iter(current)
            .chain(changes)
            .filter_map(move |(k, v)| async move {
                match v {
                    None => Some((k, None)),
                    Some(bytes) => decode_or_skip::<T>(b, &k, &bytes).map(|t| (k, Some(t))),
                }
            })
            .boxed())
    }

    async fn publish_event(&self, ev: &Event) -> StoreResult<()> {
        tokio::task::yield_now().await;
        let mut st = self.lock();
        if st.events.len() >= MAX_EVENTS {
            st.events.pop_front();
        }
        st.events.push_back(ev.clone());
        Ok(())
    }
}

/// NATS subject matching of a key against `filter`: `*` matches one token, a final `>` one or
/// more.
fn subject_matches(filter: &str, key: &str) -> bool {
    let mut keys = key.split('.');
    for f in filter.split('.') {
        match (f, keys.next()) {
            (">", Some(_)) => return true,
            ("*", Some(_)) => {}
            (f, Some(k)) if f == k => {}
            _ => return false,
        }
    }
    keys.next().is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subject_filters_match_like_nats() {
        assert!(subject_matches("c1.>", "c1.cluster-proxy"));
        assert!(subject_matches("c1.>", "c1.a.b"));
        assert!(!subject_matches("c1.>", "c1"));
        assert!(!subject_matches("c1.>", "c10.cluster-proxy"));
        assert!(subject_matches("*.cluster-proxy", "c2.cluster-proxy"));
        assert!(!subject_matches("*.cluster-proxy", "c2.other"));
        assert!(subject_matches(">", "c1"));
        assert!(subject_matches("c1", "c1"));
        assert!(!subject_matches("c1", "c1.x"));
    }

    #[tokio::test]
    async fn revisions_cas_and_create_conflicts() {
        let s = MemoryStore::new();
        let r1 = s.create(Bucket::Clusters, "a", &1u32).await.unwrap();
        assert_eq!(r1, Some(1));
        assert_eq!(s.create(Bucket::Clusters, "a", &2u32).await.unwrap(), None);
        let r2 = s.put(Bucket::Clusters, "b", &3u32).await.unwrap();
        assert_eq!(r2, 2, "one revision counter per bucket");
        assert_eq!(s.put(Bucket::Leases, "a", &0u32).await.unwrap(), 1);
        // CAS: a stale revision loses, the current one wins.
        assert_eq!(
            s.update(Bucket::Clusters, "a", &4u32, 1).await.unwrap(),
            Some(3)
        );
        assert_eq!(
            s.update(Bucket::Clusters, "a", &5u32, 1).await.unwrap(),
            None
        );
        assert_eq!(
            s.get::<u32>(Bucket::Clusters, "a").await.unwrap(),
            Some((4, 3))
        );
        s.delete(Bucket::Clusters, "a").await.unwrap();
        assert_eq!(s.get::<u32>(Bucket::Clusters, "a").await.unwrap(), None);
        assert_eq!(s.keys(Bucket::Clusters).await.unwrap(), vec!["b"]);
        let listed = s.list::<u32>(Bucket::Clusters).await.unwrap();
        assert_eq!(listed, vec![("b".to_string(), 3, 2)]);
        // A value of the wrong type is a codec error naming bucket and key.
        let err = s.get::<String>(Bucket::Clusters, "b").await.unwrap_err();
        assert!(
            err.to_string().contains("tether-managedclusters/b"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn watch_yields_current_then_changes() {
        let s = MemoryStore::new();
        s.put(Bucket::Tokens, "t1", &"one").await.unwrap();
        let mut w = s.watch::<String>(Bucket::Tokens).await.unwrap();
        assert_eq!(w.next().await, Some(("t1".into(), Some("one".into()))));
        s.put(Bucket::Tokens, "t2", &"two").await.unwrap();
        s.delete(Bucket::Tokens, "t1").await.unwrap();
        assert_eq!(w.next().await, Some(("t2".into(), Some("two".into()))));
        assert_eq!(w.next().await, Some(("t1".into(), None)));
    }
}
