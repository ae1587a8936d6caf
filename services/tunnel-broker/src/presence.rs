//! This broker's entry in `tether-brokers` ([`BrokerPresence`]) and the relay peers built from
//! the other brokers' entries ([`PeerManager`]).
//!
//! The entry is written on start, renewed every [`PRESENCE_RENEW`] with the current load
//! (tunnels, open streams), rewritten at once with `draining: true` on SIGTERM, and deleted on
//! a clean exit. A SIGKILLed broker cannot delete it: readers treat it as dead once
//! `renewTime + PRESENCE_MISSES × leaseDurationSeconds` has passed.
//!
//! Peers: every other live broker with a `relayAddress` gets a [`PeerConnector`]; one whose entry
//! is deleted or goes stale is dropped. Peers from the static `peers` config are never touched.
//! While NATS is unreachable the peer set is frozen (stale checks need fresh renewals).
//! After a pause of this broker's process (a paused VM, SIGSTOP) no peer is judged stale for a
//! whole grace (`control::PRESENCE_GRACE`): the renewals that came due meanwhile must be seen first
//! (`tether_tunnel::pause::Settle`).

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::SystemTime;

use actix::prelude::*;
use tether_control::brokers::{BrokerPresence, PRESENCE_RENEW};
use tether_control::resources::rfc3339;
use tether_tls::TlsMaterial;

use crate::config::{Advertise, PeerConfig};
use crate::dial::Broker;
use crate::peers::{PeerConnector, PeerTable, StopPeer};

/// The addresses this broker announces, from `advertise` or else the bound listeners.
pub fn template(
    id: &str,
    advertise: &Advertise,
    agent: SocketAddr,
    client: Option<SocketAddr>,
    client_tls: Option<SocketAddr>,
) -> BrokerPresence {
    let agent_addresses = if advertise.agent_addresses.is_empty() {
        vec![agent.to_string()]
    } else {
        advertise.agent_addresses.clone()
    };
    let server_name = advertise.server_name.clone().unwrap_or_else(|| {
        agent_addresses[0]
            .rsplit_once(':')
            .map(|(h, _)| h.trim_start_matches('[').trim_end_matches(']').to_owned())
            .unwrap_or_default()
    });
    let client_addresses = if advertise.client_addresses.is_empty() {
        client
            .map(|a| format!("http://{a}"))
            .into_iter()
            .chain(client_tls.map(|a| format!("https://{a}")))
            .collect()
    } else {
        advertise.client_addresses.clone()
    };
    let relay_address = advertise
        .relay_address
        .clone()
        .unwrap_or_else(|| agent_addresses[0].clone());
    let now = rfc3339(SystemTime::now());
    BrokerPresence {
        id: id.to_owned(),
        agent_addresses,
        server_name,
        client_addresses,
        relay_address,
        draining: false,
        tunnels: 0,
        streams: 0,
        clusters: Vec::new(),
        started_at: now.clone(),
        renew_time: now,
        lease_duration_seconds: PRESENCE_RENEW.as_secs().max(1) as u32,
    }
}

/// The clusters `routes` holds a tunnel of, sorted (presence `clusters`).
pub fn held_clusters(routes: &crate::registry::RouteTable) -> Vec<String> {
    let mut v: Vec<String> = routes
        .clusters
        .iter()
        .filter(|(_, t)| !t.is_empty())
        .map(|(c, _)| c.clone())
        .collect();
    v.sort();
    v
}

/// The relay peers discovered from presence.
pub struct PeerManager {
    me: String,
    static_ids: HashSet<String>,
    tls: Arc<TlsMaterial>,
    broker: Arc<Broker>,
    table: PeerTable,
    max_pending_dials: usize,
    arbiter: ArbiterHandle,
    peers: HashMap<String, (PeerConfig, Addr<PeerConnector>)>,
    seen: HashMap<String, BrokerPresence>,
    gauge: prometheus::IntGauge,
    /// Where the connectors it starts run their tasks.
    tasks: crate::peers::PeerTasks,
}

impl PeerManager {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        me: String,
        static_peers: &[PeerConfig],
        tls: Arc<TlsMaterial>,
        broker: Arc<Broker>,
        table: PeerTable,
        max_pending_dials: usize,
        arbiter: ArbiterHandle,
        gauge: prometheus::IntGauge,
    ) -> Self {
        Self {
            me,
            static_ids: static_peers.iter().map(|p| p.id.clone()).collect(),
            tls,
            broker,
            table,
            max_pending_dials,
            arbiter,
            peers: HashMap::new(),
            seen: HashMap::new(),
            gauge,
            tasks: Default::default(),
        }
    }

    /// Runs the connectors' tasks in `t`'s drain, ended by its close token.
    pub fn with_tasks(mut self, t: crate::peers::PeerTasks) -> Self {
        self.tasks = t;
        self
    }

    /// A presence entry was written (or read in a listing).
    pub fn upsert(&mut self, p: BrokerPresence, now: SystemTime) {
        if p.id == self.me || self.static_ids.contains(&p.id) {
            return;
        }
        if !p.is_live(now) || p.relay_address.is_empty() {
            self.remove(&p.id);
            return;
        }
        let want = PeerConfig {
            id: p.id.clone(),
            address: p.relay_address.clone(),
            server_name: p.server_name.clone(),
        };
        self.seen.insert(p.id.clone(), p);
        if let Some((have, _)) = self.peers.get(&want.id)
            && have.address == want.address
            && have.server_name == want.server_name
        {
            return;
        }
        if let Some((_, old)) = self.peers.remove(&want.id) {
            old.do_send(StopPeer);
        }
        tracing::info!(peer = %want.id, address = %want.address, "relay peer discovered");
        let c = PeerConnector::new(
            want.clone(),
            Arc::clone(&self.tls),
            Arc::clone(&self.broker),
            self.table.clone(),
            self.max_pending_dials,
        )
        .with_tasks(&self.tasks);
        let addr = PeerConnector::start_in_arbiter(&self.arbiter, move |_| c);
        self.peers.insert(want.id.clone(), (want, addr));
        self.gauge.set(self.peers.len() as i64);
    }

    /// A presence entry was deleted.
    pub fn remove(&mut self, id: &str) {
        self.seen.remove(id);
        if let Some((_, addr)) = self.peers.remove(id) {
            tracing::info!(peer = %id, "relay peer gone");
            addr.do_send(StopPeer);
        }
        self.gauge.set(self.peers.len() as i64);
    }

    /// Drops peers whose entry was not renewed in time (a killed broker).
    pub fn prune(&mut self, now: SystemTime) {
        let stale: Vec<String> = self
            .seen
            .iter()
            .filter(|(_, p)| !p.is_live(now))
            .map(|(id, _)| id.clone())
            .collect();
        for id in stale {
            tracing::info!(peer = %id, "relay peer's presence went stale");
            self.remove(&id);
        }
    }

    /// Replaces the whole set from a listing (after (re)connecting to NATS).
    pub fn reconcile(&mut self, all: Vec<BrokerPresence>, now: SystemTime) {
        let ids: HashSet<String> = all.iter().map(|p| p.id.clone()).collect();
        let gone: Vec<String> = self
            .peers
            .keys()
            .filter(|id| !ids.contains(*id))
            .cloned()
            .collect();
        for id in gone {
            self.remove(&id);
        }
        for p in all {
            self.upsert(p, now);
        }
    }

    /// Ids of the discovered peers.
    pub fn ids(&self) -> Vec<String> {
        let mut v: Vec<String> = self.peers.keys().cloned().collect();
        v.sort();
        v
    }
}
