//! Name resolution for the agent's dials, with a small, bounded cache of answers.
//!
//! A target given by name (`my-svc.my-ns.svc:8080`, the default API server
//! `kubernetes.default.svc:443`) used to be resolved on every dial: `getaddrinfo` on tokio's
//! blocking pool, one thread hand-off per stream, and inside a pod one DNS query per search
//! domain the name is tried with (`ndots:5`), each a round trip to the cluster's DNS. A tunnel
//! serving many short streams to the same few services paid that for each of them.
//!
//! [`Resolver`] keeps each name's addresses for `dns_cache.ttl` (default 5 s, the default DNS
//! refresh interval of Envoy's strict-DNS clusters; `0s` turns the cache off). `getaddrinfo`
//! does not report the records' TTLs, so the cache uses its own, short one, and forgets a name
//! as soon as no address of it could be connected ([`Resolver::forget`]): a Service whose
//! endpoints moved is re-resolved on the next dial, not after the TTL. Failures are not cached.
//! The cache holds at most `dns_cache.max_entries` names; a full cache first drops expired
//! entries, then the one closest to expiry. Literal addresses skip all of it.
//!
//! The policy check (`policy.allow` / `deny`) is on the name the broker asked for, before
//! resolution, as without the cache.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use prometheus::IntCounterVec;

use crate::config::DnsCacheSettings;

/// Addresses of one name, shared by the cache and the dials using them.
pub type Addrs = Arc<[SocketAddr]>;

struct Entry {
    addrs: Addrs,
    expires: Instant,
}

/// The agent's resolver (one per agent, shared by its tunnels).
pub struct Resolver {
    settings: DnsCacheSettings,
    entries: Mutex<HashMap<String, Entry>>,
    /// `tether_agent_dial_resolutions_total` by result (`cached`, `resolved`, `failed`).
    resolutions: Option<IntCounterVec>,
}

impl Resolver {
    pub fn new(settings: DnsCacheSettings, resolutions: Option<IntCounterVec>) -> Self {
        Self {
            settings,
            entries: Mutex::new(HashMap::new()),
            resolutions,
        }
    }

    fn count(&self, result: &str) {
        if let Some(c) = &self.resolutions {
            c.with_label_values(&[result]).inc();
        }
    }

    /// The addresses of `dest` (`host:port`): parsed when literal, else from the cache, else
    /// from the system resolver (then cached).
    pub async fn resolve(&self, dest: &str) -> std::io::Result<Addrs> {
        if let Ok(a) = dest.parse::<SocketAddr>() {
            return Ok(Arc::from([a]));
        }
        if let Some(addrs) = self.cached(dest, Instant::now()) {
            self.count("cached");
            return Ok(addrs);
        }
        let looked_up = tokio::net::lookup_host(dest)
            .await
            .map(|a| a.collect::<Vec<_>>());
        let addrs: Addrs = match looked_up {
            Ok(a) if !a.is_empty() => a.into(),
            Ok(_) => {
                self.count("failed");
                return Err(std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "the name has no addresses",
                ));
            }
            Err(e) => {
                self.count("failed");
                return Err(e);
            }
        };
        self.count("resolved");
        self.insert(dest, Arc::clone(&addrs), Instant::now());
        Ok(addrs)
    }

    /// `dest`'s cached addresses if they have not expired at `now`.
    fn cached(&self, dest: &str, now: Instant) -> Option<Addrs> {
        if self.settings.ttl.is_zero() {
            return None;
        }
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries
            .get(dest)
            .filter(|e| e.expires > now)
            .map(|e| Arc::clone(&e.addrs))
    }

    fn insert(&self, dest: &str, addrs: Addrs, now: Instant) {
        if self.settings.ttl.is_zero() {
            return;
        }
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if entries.len() >= self.settings.max_entries && !entries.contains_key(dest) {
            entries.retain(|_, e| e.expires > now);
            if entries.len() >= self.settings.max_entries {
                // Still full of live entries: drop the one closest to expiry (a scan of at
                // most `max_entries`, only when the cache is full).
                if let Some(oldest) = entries
                    .iter()
                    .min_by_key(|(_, e)| e.expires)
                    .map(|(k, _)| k.clone())
                {
                    entries.remove(&oldest);
                }
            }
        }
        entries.insert(
            dest.to_owned(),
            Entry {
                addrs,
                expires: now + self.settings.ttl,
            },
        );
    }

    /// No address of `dest` could be connected: its next dial resolves it again.
    pub fn forget(&self, dest: &str) {
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.remove(dest);
    }

    /// Names cached now (expired ones included until they are replaced or dropped).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn resolver(ttl_ms: u64, max_entries: usize) -> (Resolver, IntCounterVec) {
        let c = IntCounterVec::new(prometheus::Opts::new("r", "r"), &["result"]).unwrap();
        let r = Resolver::new(
            DnsCacheSettings {
                ttl: Duration::from_millis(ttl_ms),
                max_entries,
            },
            Some(c.clone()),
        );
        (r, c)
    }

    fn addrs(port: u16) -> Addrs {
        Arc::from([SocketAddr::from(([127, 0, 0, 1], port))])
    }

    #[tokio::test]
    async fn a_name_is_resolved_once_then_served_from_the_cache_until_forgotten() {
        let (r, c) = resolver(60_000, 8);
        let first = r.resolve("localhost:7").await.unwrap();
        assert!(first.iter().all(|a| a.port() == 7 && a.ip().is_loopback()));
        assert_eq!(c.with_label_values(&["resolved"]).get(), 1);
        let again = r.resolve("localhost:7").await.unwrap();
        assert!(
            Arc::ptr_eq(&first, &again),
            "the second dial used the cache"
        );
        assert_eq!(c.with_label_values(&["cached"]).get(), 1);
        r.forget("localhost:7");
        r.resolve("localhost:7").await.unwrap();
        assert_eq!(c.with_label_values(&["resolved"]).get(), 2);
    }

    #[tokio::test]
    async fn literals_skip_the_cache_and_failures_are_not_cached() {
        let (r, c) = resolver(60_000, 8);
        let a = r.resolve("10.1.2.3:80").await.unwrap();
        assert_eq!(&a[..], &[SocketAddr::from(([10, 1, 2, 3], 80))]);
        assert_eq!(r.len(), 0);
        // A name the system resolver refuses without asking any DNS server (tests send no
        // traffic off the machine): the port is out of range.
        for _ in 0..2 {
            assert!(r.resolve("localhost:99999").await.is_err());
        }
        assert_eq!(c.with_label_values(&["failed"]).get(), 2);
        assert_eq!(r.len(), 0);
        assert_eq!(c.with_label_values(&["cached"]).get(), 0);
    }

    #[test]
    fn entries_expire_after_the_ttl() {
        let (r, _) = resolver(100, 8);
        let now = Instant::now();
        r.insert("svc:1", addrs(1), now);
        assert!(r.cached("svc:1", now + Duration::from_millis(99)).is_some());
        assert!(
            r.cached("svc:1", now + Duration::from_millis(100))
                .is_none()
        );
    }

    #[test]
    fn a_zero_ttl_caches_nothing() {
        let (r, _) = resolver(0, 8);
        let now = Instant::now();
        r.insert("svc:1", addrs(1), now);
        assert!(r.len() == 0 && r.cached("svc:1", now).is_none());
    }

    #[test]
    fn a_full_cache_drops_expired_entries_then_the_one_closest_to_expiry() {
        let (r, _) = resolver(1_000, 3);
        let t0 = Instant::now();
        r.insert("a:1", addrs(1), t0);
        r.insert("b:1", addrs(2), t0 + Duration::from_millis(10));
        r.insert("c:1", addrs(3), t0 + Duration::from_millis(20));
        // Full, nothing expired: `a` (closest to expiry) goes.
        r.insert("d:1", addrs(4), t0 + Duration::from_millis(30));
        assert_eq!(r.len(), 3);
        let at = t0 + Duration::from_millis(40);
        assert!(r.cached("a:1", at).is_none());
        assert!(
            ["b:1", "c:1", "d:1"]
                .iter()
                .all(|k| r.cached(k, at).is_some())
        );
        // Later, `b`, `c` and `d` expired: all three are dropped for `e`.
        let later = t0 + Duration::from_millis(1_025);
        r.insert("e:1", addrs(5), later);
        assert_eq!(
            r.len(),
            2,
            "b and c expired and were dropped; d and e remain"
        );
        // Replacing a cached name never evicts another.
        r.insert("e:1", addrs(6), later);
        assert_eq!(r.len(), 2);
    }
}
