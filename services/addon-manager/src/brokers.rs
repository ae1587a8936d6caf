//! The live broker set, in one place: which brokers are serving (live in `tether-brokers`, not
//! draining, with agent addresses), what the add-on agents are told to dial, which serving
//! brokers hold a tunnel of a cluster (add-on Available), `BrokersAvailable` on the
//! ManagedProxyConfigurations, and when the set changed (agents are notified).
//!
//! Pure functions over the [`Store`] trait and a given `now`; the tasks that act on a change
//! live with their callers (the `addons` actor, the `delivery` broker watcher).

use std::collections::HashMap;
use std::time::SystemTime;

use tether_control::ControlError;
use tether_control::addons::{AgentBrokerEndpoint, Entrypoint, ManagedProxyConfiguration};
use tether_control::brokers::BrokerPresence;
use tether_control::resources::set_condition;
use tether_control::store::{Bucket, Store};

/// ManagedProxyConfiguration condition: how many brokers are live.
pub const BROKERS_AVAILABLE: &str = "BrokersAvailable";

/// Live, non-draining brokers with agent addresses, sorted by id.
pub async fn serving_brokers(
    store: &impl Store,
    now: SystemTime,
) -> Result<Vec<BrokerPresence>, ControlError> {
    brokers_where(store, |b| b.is_serving(now)).await
}

/// The brokers the tunnel-agent config lists ([`BrokerPresence::is_listed`]: a longer window
/// than [`serving_brokers`], so a NATS failover on a broker's side does not make every agent
/// drop its tunnels to it), sorted by id.
pub async fn listed_brokers(
    store: &impl Store,
    now: SystemTime,
) -> Result<Vec<BrokerPresence>, ControlError> {
    brokers_where(store, |b| b.is_listed(now)).await
}

/// Every announced broker (one listing of `tether-brokers`), whatever its state.
pub async fn announced(store: &impl Store) -> Result<Vec<BrokerPresence>, ControlError> {
    Ok(store
        .list::<BrokerPresence>(Bucket::Brokers)
        .await?
        .into_iter()
        .map(|(_, b, _)| b)
        .collect())
}

/// [`listed_brokers`] among an earlier listing `all` ([`announced`]).
pub fn listed_among(all: Vec<BrokerPresence>, now: SystemTime) -> Vec<BrokerPresence> {
    select(all, |b| b.is_listed(now))
}

/// Announced brokers with agent addresses that pass `keep`, sorted by id.
async fn brokers_where(
    store: &impl Store,
    keep: impl Fn(&BrokerPresence) -> bool,
) -> Result<Vec<BrokerPresence>, ControlError> {
    Ok(select(announced(store).await?, keep))
}

/// The brokers of `all` (a listing, [`announced`]) with agent addresses that pass `keep`
/// (e.g. `|b| b.is_serving(now)`), sorted by id.
pub fn select(
    all: impl IntoIterator<Item = BrokerPresence>,
    keep: impl Fn(&BrokerPresence) -> bool,
) -> Vec<BrokerPresence> {
    let mut out: Vec<BrokerPresence> = all
        .into_iter()
        .filter(|b| keep(b) && !b.agent_addresses.is_empty())
        .collect();
    out.sort_by(|a, b| a.id.cmp(&b.id));
    out
}

/// What an add-on agent dials: the serving brokers, else (none announced yet) the
/// ManagedProxyConfiguration's entrypoints.
pub fn agent_endpoints(
    serving: Vec<BrokerPresence>,
    entrypoints: &[Entrypoint],
) -> Vec<AgentBrokerEndpoint> {
    if serving.is_empty() {
        entrypoints
            .iter()
            .enumerate()
            .map(|(i, e)| AgentBrokerEndpoint {
                id: format!("entrypoint-{i}"),
                addresses: vec![format!("{}:{}", e.host, e.port)],
                server_name: e.host.trim_matches(['[', ']']).to_string(),
            })
            .collect()
    } else {
        serving
            .into_iter()
            .map(|b| AgentBrokerEndpoint {
                id: b.id,
                addresses: b.agent_addresses,
                server_name: b.server_name,
            })
            .collect()
    }
}

/// The serving brokers that report (presence `clusters`) holding a tunnel of `cluster`, and
/// those that do not.
pub fn holders<'a>(serving: &'a [BrokerPresence], cluster: &str) -> (Vec<&'a str>, Vec<&'a str>) {
    let (with, without): (Vec<_>, Vec<_>) = serving
        .iter()
        .partition(|b| b.clusters.iter().any(|c| c == cluster));
    let ids = |v: Vec<&'a BrokerPresence>| v.into_iter().map(|b| b.id.as_str()).collect();
    (ids(with), ids(without))
}

/// Sets `BrokersAvailable` on every ManagedProxyConfiguration; returns the writes.
pub async fn update_proxy_configuration_status(
    store: &impl Store,
    mpcs: &HashMap<String, (ManagedProxyConfiguration, u64)>,
    serving: &[BrokerPresence],
) -> Result<usize, ControlError> {
    let mut writes = 0;
    for (key, (mpc, rev)) in mpcs {
        let mut m = mpc.clone();
        let ids: Vec<&str> = serving.iter().map(|b| b.id.as_str()).collect();
        let changed = if ids.is_empty() {
            set_condition(
                &mut m.status.conditions,
                BROKERS_AVAILABLE,
                "False",
                "NoLiveBrokers",
                &format!(
                    "no broker has announced itself; agents use the {} entrypoint(s)",
                    m.spec.proxy_server.entrypoints.len()
                ),
            )
        } else {
            set_condition(
                &mut m.status.conditions,
                BROKERS_AVAILABLE,
                "True",
                "BrokersLive",
                &format!("{} live broker(s): {}", ids.len(), ids.join(", ")),
            )
        };
        if changed {
            m.metadata.resource_version = None;
            if store
                .update(Bucket::ProxyConfigurations, key, &m, *rev)
                .await?
                .is_some()
            {
                writes += 1;
            }
        }
    }
    Ok(writes)
}

/// A change of the serving set seen by [`BrokerSet::observe`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerSetChange {
    /// The first observation (agents need no notification: they read their config anyway).
    pub first: bool,
    /// The serving brokers now, by id.
    pub ids: Vec<String>,
}

/// The last serving set seen, to tell when it changes.
#[derive(Debug, Default)]
pub struct BrokerSet {
    last: Option<Vec<AgentBrokerEndpoint>>,
}

impl BrokerSet {
    /// Takes the serving set now; `Some` when it differs from the last one.
    pub fn observe(&mut self, serving: Vec<BrokerPresence>) -> Option<BrokerSetChange> {
        let now = agent_endpoints(serving, &[]);
        if self.last.as_ref() == Some(&now) {
            return None;
        }
        let change = BrokerSetChange {
            first: self.last.is_none(),
            ids: now.iter().map(|b| b.id.clone()).collect(),
        };
        self.last = Some(now);
        Some(change)
    }
}

/// What add-on Available is computed from on the data-plane side: the serving brokers and,
/// per cluster, which of them report holding a tunnel of it. The add-on controller must
/// re-evaluate a cluster's add-ons when this changes — a broker's presence renewal that first
/// lists a new tunnel is no write the controller watches (the agent's lease may not be
/// written again for a whole persist interval), so without this an add-on that joined waits
/// for an unrelated write or the safety resync (`RESYNC_INTERVAL` of the `addons` module).
#[derive(Debug, Default)]
pub struct TunnelHolders {
    /// The serving broker ids and, per cluster, the ids of those holding a tunnel of it.
    last: Option<(Vec<String>, Holders)>,
}

/// Cluster → ids of the serving brokers that hold a tunnel of it.
type Holders = HashMap<String, Vec<String>>;

/// A change seen by [`TunnelHolders::observe`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HoldersChange {
    /// The serving set itself changed (or the first observation): every add-on.
    All,
    /// Only these clusters' holders changed.
    Clusters(std::collections::BTreeSet<String>),
}

impl TunnelHolders {
    /// Takes the serving brokers now; `Some` when what Available depends on changed.
    pub fn observe(&mut self, serving: &[BrokerPresence]) -> Option<HoldersChange> {
        let ids: Vec<String> = serving.iter().map(|b| b.id.clone()).collect();
        let mut by_cluster: Holders = HashMap::new();
        for b in serving {
            for c in &b.clusters {
                by_cluster.entry(c.clone()).or_default().push(b.id.clone());
            }
        }
        let change = match &self.last {
            None => Some(HoldersChange::All),
            Some((last_ids, _)) if *last_ids != ids => Some(HoldersChange::All),
            Some((_, last)) => {
                let changed: std::collections::BTreeSet<String> = last
                    .iter()
                    .filter(|(c, h)| by_cluster.get(*c) != Some(*h))
                    .map(|(c, _)| c.clone())
                    .chain(
                        by_cluster
                            .keys()
                            .filter(|c| !last.contains_key(*c))
                            .cloned(),
                    )
                    .collect();
                (!changed.is_empty()).then_some(HoldersChange::Clusters(changed))
            }
        };
        self.last = Some((ids, by_cluster));
        change
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tether_control::resources::rfc3339;
    use tether_control::store::MemoryStore;

    fn presence(id: &str, renewed: SystemTime, clusters: &[&str]) -> BrokerPresence {
        BrokerPresence {
            id: id.into(),
            agent_addresses: vec![format!("{id}:8443")],
            server_name: id.into(),
            clusters: clusters.iter().map(|c| c.to_string()).collect(),
            renew_time: rfc3339(renewed),
            lease_duration_seconds: 2,
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn serving_set_holders_and_changes() {
        let store = MemoryStore::new();
        let now = SystemTime::now();
        store
            .put(Bucket::Brokers, "b2", &presence("b2", now, &["c1"]))
            .await
            .unwrap();
        store
            .put(Bucket::Brokers, "b1", &presence("b1", now, &["c1", "c2"]))
            .await
            .unwrap();
        let mut draining = presence("b3", now, &["c1"]);
        draining.draining = true;
        store.put(Bucket::Brokers, "b3", &draining).await.unwrap();
        let dead = presence("b4", now - Duration::from_secs(60), &[]);
        store.put(Bucket::Brokers, "b4", &dead).await.unwrap();

        let serving = serving_brokers(&store, now).await.unwrap();
        let ids: Vec<&str> = serving.iter().map(|b| b.id.as_str()).collect();
        assert_eq!(ids, ["b1", "b2"], "live, not draining, sorted");
        assert_eq!(holders(&serving, "c1"), (vec!["b1", "b2"], vec![]));
        assert_eq!(holders(&serving, "c2"), (vec!["b1"], vec!["b2"]));

        let mut set = BrokerSet::default();
        let first = set.observe(serving.clone()).unwrap();
        assert!(first.first);
        assert_eq!(set.observe(serving.clone()), None, "unchanged");
        // b2 stops renewing: 3 × 2 s later it is gone from the set.
        let later = now + Duration::from_secs(7);
        store
            .put(Bucket::Brokers, "b1", &presence("b1", later, &["c1"]))
            .await
            .unwrap();
        let serving = serving_brokers(&store, later).await.unwrap();
        let change = set.observe(serving).unwrap();
        assert_eq!(
            change,
            BrokerSetChange {
                first: false,
                ids: vec!["b1".into()]
            }
        );
        // No broker at all: agents fall back to the entrypoints.
        let eps = agent_endpoints(
            vec![],
            &[Entrypoint {
                host: "[::1]".into(),
                port: 8443,
            }],
        );
        assert_eq!(eps[0].addresses, ["[::1]:8443"]);
        assert_eq!(eps[0].server_name, "::1");
    }

    #[test]
    fn holders_changes_name_the_clusters() {
        let now = SystemTime::now();
        let mut h = TunnelHolders::default();
        let b1 = presence("b1", now, &["c1"]);
        let b2 = presence("b2", now, &[]);
        assert_eq!(
            h.observe(&[b1.clone(), b2.clone()]),
            Some(HoldersChange::All),
            "first"
        );
        assert_eq!(h.observe(&[b1.clone(), b2.clone()]), None, "unchanged");
        // b2's presence now lists c1 and c2 (tunnels registered): only those clusters.
        let b2 = presence("b2", now, &["c1", "c2"]);
        assert_eq!(
            h.observe(&[b1.clone(), b2.clone()]),
            Some(HoldersChange::Clusters(
                ["c1".to_string(), "c2".to_string()].into()
            ))
        );
        // b1 drops c1: c1 only.
        let b1 = presence("b1", now, &[]);
        assert_eq!(
            h.observe(&[b1.clone(), b2.clone()]),
            Some(HoldersChange::Clusters(["c1".to_string()].into()))
        );
        // A renewal that changes nothing else: nothing.
        let b1 = presence("b1", now + Duration::from_secs(2), &[]);
        assert_eq!(h.observe(&[b1.clone(), b2.clone()]), None);
        // b2 stops serving: everything.
        assert_eq!(h.observe(&[b1]), Some(HoldersChange::All));
    }
}
