//! The prober on hub NATS (config section `nats`):
//!
//! - **cluster list**: a KV watch on `tether-managedclusters`; the accepted clusters
//!   (`spec.hubAcceptsClient: true`) replace the static list (new ones are probed at once);
//! - **results**: every probe result is put in KV bucket `tether-health` (key `<cluster>`,
//!   [`HealthRecord`]); clusters no longer probed are deleted from it;
//! - **transitions** of the damped verdict (and a first verdict that is unhealthy) become events
//!   on `tether.v1.events.health.<cluster>` (stream `TETHER_EVENTS`);
//! - **`tether.v1.health.get`**: answered from memory, queue group `tether-health`, so several
//!   probers share the requests.
//!
//! Each part is a tokio task that ends with the shutdown token; a KV watch that ends is
//! re-opened after [`REWATCH_DELAY`].

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use actix::Addr;
use async_nats::jetstream::{self, kv};
use futures::StreamExt as _;
use tether_control::connect::{
    self, ConnectConfig, ControlError, Credentials, ERROR_HEADER, NatsConnection,
};
use tether_control::health::{
    HealthGetReply, HealthGetRequest, HealthRecord, REASON_HEALTHY, REASON_UNHEALTHY,
};
use tether_control::hub::HubDir;
use tether_control::resources::{Event, ManagedCluster};
use tether_control::store::{Bucket, HubStore};
use tether_control::subjects;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::ProberError;
use crate::config::NatsAccess;
use crate::engine::{Published, Scheduler, SetClusters};
use crate::health::HealthTable;
use crate::metrics::ProberMetrics;

/// Pause before re-opening a KV watch that ended or failed.
pub const REWATCH_DELAY: Duration = Duration::from_secs(1);
/// Cluster changes folded into one update of the scheduler's list.
pub const WATCH_BATCH: usize = 1024;
/// Budget of one KV put or event publish (with its ack).
pub const PUBLISH_TIMEOUT: Duration = Duration::from_secs(5);

fn nats_err(e: impl std::fmt::Display) -> ProberError {
    ProberError::Nats(e.to_string())
}

/// Whether a failure to reach hub NATS may pass by itself (the server is down or restarting,
/// JetStream has no leader yet): [`crate::run`] retries those and gives up on the rest (a
/// refused password, a CA that does not verify the server).
pub fn transient(e: &ProberError) -> bool {
    matches!(e, ProberError::Nats(_))
}

/// How to reach hub NATS as a hub process: reads the hub directory or the explicit fields.
pub fn hub_connect_config(access: &NatsAccess) -> Result<ConnectConfig, ProberError> {
    let (endpoint, password) = match &access.hub_dir {
        Some(dir) => {
            let hub = HubDir::load(dir).map_err(nats_err)?;
            let mut endpoint = hub.endpoint(access.url.as_deref()).map_err(nats_err)?;
            if let Some(ca) = &access.ca {
                endpoint.ca_pem = crate::read(ca)?;
            }
            if let Some(n) = &access.server_name {
                endpoint.tls_server_name = Some(n.clone());
            }
            let password = match &access.password_file {
                Some(p) => crate::read(p)?,
                None => hub
                    .read(&hub.config.nats.hub_password_file)
                    .map_err(nats_err)?,
            };
            (endpoint, password)
        }
        None => {
            let url = access.url.clone().unwrap_or_default();
            let (host, port) = tether_control::kubeconfig::parse_server(&url)
                .ok_or_else(|| nats_err(format!("nats.url {url:?} is not tls://host:port")))?;
            let ca = access
                .ca
                .as_ref()
                .ok_or_else(|| nats_err("nats.ca is required"))?;
            let pw = access
                .password_file
                .as_ref()
                .ok_or_else(|| nats_err("nats.password_file is required"))?;
            (
                tether_control::kubeconfig::HubEndpoint {
                    server: url.clone(),
                    host,
                    port,
                    ca_pem: crate::read(ca)?,
                    proxy: None,
                    tls_server_name: access.server_name.clone(),
                },
                crate::read(pw)?,
            )
        }
    };
    Ok(ConnectConfig::new(
        endpoint,
        Credentials::HubUser {
            user: access.user.clone(),
            password: password.trim().to_string(),
        },
        "prober",
    ))
}

/// Connects to hub NATS; a refusal that retrying cannot mend is [`ProberError::NatsRefused`].
pub async fn connect_hub(cfg: &ConnectConfig) -> Result<NatsConnection, ProberError> {
    connect::connect(cfg).await.map_err(|e| match e {
        ControlError::Unauthorized { .. }
        | ControlError::HubTls { .. }
        | ControlError::CaBundle(_) => ProberError::NatsRefused(e.to_string()),
        e => nats_err(e),
    })
}

/// Everything the NATS side needs.
pub struct NatsSide {
    pub conn: NatsConnection,
    pub store: HubStore,
    pub health_kv: kv::Store,
}

/// Creates (or opens) the `tether-health` bucket: memory storage, since results are soft state
/// that the next round rebuilds; after a NATS restart it is created again. On a NATS cluster
/// it has 3 replicas, so losing one server does not lose the bucket.
pub async fn health_bucket(js: &jetstream::Context) -> Result<kv::Store, ProberError> {
    js.create_or_update_key_value(kv::Config {
        bucket: subjects::BUCKET_HEALTH.to_string(),
        description: "health-prober results, key = cluster".into(),
        history: 1,
        storage: jetstream::stream::StorageType::Memory,
        num_replicas: tether_control::store::default_replicas(&js.client()),
        ..Default::default()
    })
    .await
    .map_err(nats_err)
}

impl NatsSide {
    /// Opens the hub buckets and the `tether-health` bucket.
    pub async fn open(conn: NatsConnection) -> Result<Self, ProberError> {
        let store = HubStore::open(conn.client.clone())
            .await
            .map_err(nats_err)?;
        let js = jetstream::new(conn.client.clone());
        let health_kv = health_bucket(&js).await?;
        Ok(Self {
            conn,
            store,
            health_kv,
        })
    }

    /// Starts the watch, publisher and responder tasks in `tasks`; they end on `shutdown`.
    #[allow(clippy::too_many_arguments)]
    pub fn spawn(
        self,
        tasks: &tether_runtime::Drain,
        scheduler: Addr<Scheduler>,
        table: HealthTable,
        results: mpsc::Receiver<Published>,
        prober_id: String,
        interval: Duration,
        metrics: ProberMetrics,
        shutdown: CancellationToken,
    ) {
        tasks.spawn(
            "cluster watch",
            watch_clusters(
                self.store.clone(),
                self.health_kv.clone(),
                scheduler,
                shutdown.clone(),
            ),
        );
        tasks.spawn(
            "result publisher",
            publish_results(
                self.store.jetstream().clone(),
                self.health_kv,
                results,
                prober_id.clone(),
                metrics.clone(),
                shutdown.clone(),
            ),
        );
        tasks.spawn(
            "health.get responder",
            answer_health_get(self.conn, table, prober_id, interval, metrics, shutdown),
        );
    }
}

/// Keeps the scheduler's cluster list equal to the accepted ManagedClusters.
async fn watch_clusters(
    store: HubStore,
    health_kv: kv::Store,
    scheduler: Addr<Scheduler>,
    shutdown: CancellationToken,
) {
    let mut accepted: BTreeMap<String, bool> = BTreeMap::new();
    let mut current: BTreeSet<String> = BTreeSet::new();
    while !shutdown.is_cancelled() {
        let watch = match store.watch::<ManagedCluster>(Bucket::Clusters).await {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch managed clusters; retrying");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(REWATCH_DELAY) => continue,
                }
            }
        };
        let mut batches = Box::pin(watch.ready_chunks(WATCH_BATCH));
        loop {
            let batch = tokio::select! {
                _ = shutdown.cancelled() => return,
                b = batches.next() => b,
            };
            let Some(batch) = batch else { break };
            for (name, mc) in batch {
                match mc {
                    Some(mc) => accepted.insert(name, mc.spec.hub_accepts_client),
                    None => accepted.remove(&name),
                };
            }
            let wanted: BTreeSet<String> = accepted
                .iter()
                .filter(|(_, a)| **a)
                .map(|(n, _)| n.clone())
                .collect();
            if wanted == current {
                continue;
            }
            for gone in current.difference(&wanted) {
                if let Err(e) = health_kv.purge(gone).await {
                    tracing::warn!(cluster = %gone, error = %e, "cannot remove health record");
                }
            }
            tracing::info!(clusters = wanted.len(), "cluster list from the hub changed");
            scheduler.do_send(SetClusters(wanted.iter().cloned().collect()));
            current = wanted;
        }
        tracing::warn!("managed cluster watch ended; re-opening");
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(REWATCH_DELAY) => {}
        }
    }
}

/// Puts every result in KV and publishes verdict transitions as events.
async fn publish_results(
    js: jetstream::Context,
    health_kv: kv::Store,
    mut results: mpsc::Receiver<Published>,
    prober_id: String,
    metrics: ProberMetrics,
    shutdown: CancellationToken,
) {
    let mut seen: BTreeSet<String> = BTreeSet::new();
    let mut health_kv = health_kv;
    let mut last_reopen: Option<std::time::Instant> = None;
    loop {
        let p = tokio::select! {
            _ = shutdown.cancelled() => return,
            p = results.recv() => p,
        };
        let Some(p) = p else { return };
        let record = p.record.to_record(&prober_id);
        let first = seen.insert(record.cluster.clone());
        let bytes = match serde_json::to_vec(&record) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "cannot encode health record");
                continue;
            }
        };
        let put = tokio::time::timeout(
            PUBLISH_TIMEOUT,
            health_kv.put(record.cluster.as_str(), bytes.clone().into()),
        )
        .await;
        let mut ok = matches!(put, Ok(Ok(_)));
        // The memory bucket is gone after a NATS restart: create it again (at most once per
        // REWATCH_DELAY) and retry once.
        if !ok && last_reopen.is_none_or(|t| t.elapsed() >= REWATCH_DELAY) {
            last_reopen = Some(std::time::Instant::now());
            if let Ok(Ok(kv)) = tokio::time::timeout(PUBLISH_TIMEOUT, health_bucket(&js)).await {
                tracing::info!("re-created the {} bucket", subjects::BUCKET_HEALTH);
                health_kv = kv;
                let retry = tokio::time::timeout(
                    PUBLISH_TIMEOUT,
                    health_kv.put(record.cluster.as_str(), bytes.into()),
                )
                .await;
                ok = matches!(retry, Ok(Ok(_)));
            }
        }
        metrics
            .published
            .with_label_values(&["kv", if ok { "ok" } else { "error" }])
            .inc();
        if !ok {
            tracing::warn!(cluster = %record.cluster, "cannot put health record");
        }
        if p.changed || (first && !record.healthy) {
            let ok = publish_event(&js, &record).await;
            metrics
                .published
                .with_label_values(&["event", if ok { "ok" } else { "error" }])
                .inc();
        }
    }
}

/// The event for a verdict transition of `record`.
pub fn health_event(record: &HealthRecord) -> Event {
    let (type_, reason, message) = if record.healthy {
        (
            "Normal",
            REASON_HEALTHY,
            format!(
                "cluster {} is healthy again: {} answered in {:.2}ms",
                record.cluster, record.path, record.latency.total_ms
            ),
        )
    } else {
        (
            "Warning",
            REASON_UNHEALTHY,
            format!(
                "cluster {} failed {} consecutive probe(s): {}: {}",
                record.cluster, record.consecutive_failures, record.reason, record.message
            ),
        )
    };
    Event::new(
        ManagedCluster::KIND,
        &record.cluster,
        type_,
        reason,
        message,
    )
}

async fn publish_event(js: &jetstream::Context, record: &HealthRecord) -> bool {
    let ev = health_event(record);
    let Ok(bytes) = serde_json::to_vec(&ev) else {
        return false;
    };
    let subject = subjects::health_event(&record.cluster);
    let sent = tokio::time::timeout(PUBLISH_TIMEOUT, async {
        js.publish(subject, bytes.into())
            .await
            .map_err(nats_err)?
            .await
            .map_err(nats_err)
    })
    .await;
    match sent {
        Ok(Ok(_)) => true,
        Ok(Err(e)) => {
            tracing::warn!(cluster = %record.cluster, error = %e, "cannot publish health event");
            false
        }
        Err(_) => {
            tracing::warn!(cluster = %record.cluster, "health event not acknowledged in time");
            false
        }
    }
}

/// Answers `tether.v1.health.get` from the in-memory table.
async fn answer_health_get(
    conn: NatsConnection,
    table: HealthTable,
    prober_id: String,
    interval: Duration,
    metrics: ProberMetrics,
    shutdown: CancellationToken,
) {
    let client = conn.client.clone();
    let mut sub = match client
        .queue_subscribe(
            subjects::HEALTH_GET,
            subjects::HEALTH_QUEUE_GROUP.to_string(),
        )
        .await
    {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot subscribe to {}", subjects::HEALTH_GET);
            return;
        }
    };
    loop {
        let msg = tokio::select! {
            _ = shutdown.cancelled() => break,
            m = sub.next() => m,
        };
        let Some(msg) = msg else { break };
        let Some(reply) = msg.reply.clone() else {
            continue;
        };
        metrics.health_requests.inc();
        let req: Result<HealthGetRequest, _> = if msg.payload.is_empty() {
            Ok(HealthGetRequest::default())
        } else {
            serde_json::from_slice(&msg.payload)
        };
        let result = match req {
            Ok(req) => {
                let mut clusters: Vec<HealthRecord> = table
                    .snapshot()
                    .iter()
                    .filter(|h| req.cluster.as_deref().is_none_or(|c| c == h.cluster))
                    .map(|h| h.to_record(&prober_id))
                    .collect();
                clusters.sort_by(|a, b| a.cluster.cmp(&b.cluster));
                let body = HealthGetReply {
                    prober: prober_id.clone(),
                    interval_seconds: interval.as_secs_f64(),
                    clusters,
                };
                client
                    .publish(reply, serde_json::to_vec(&body).unwrap_or_default().into())
                    .await
            }
            Err(e) => {
                let message = format!("invalid HealthGetRequest: {e}");
                let mut headers = async_nats::HeaderMap::new();
                headers.insert(ERROR_HEADER, message.as_str());
                let body = serde_json::json!({ "error": message });
                client
                    .publish_with_headers(reply, headers, body.to_string().into())
                    .await
            }
        };
        if let Err(e) = result {
            tracing::warn!(error = %e, "cannot answer health request");
        }
    }
    drop(conn);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transition_events_name_cluster_and_cause() {
        let mut r = HealthRecord {
            cluster: "edge-1".into(),
            healthy: false,
            reason: "NoTunnel".into(),
            message: "no tunnel".into(),
            consecutive_failures: 2,
            ..Default::default()
        };
        let ev = health_event(&r);
        assert_eq!(
            (ev.type_.as_str(), ev.reason.as_str()),
            ("Warning", REASON_UNHEALTHY)
        );
        assert_eq!(ev.involved_object.name, "edge-1");
        assert!(ev.message.contains("2 consecutive") && ev.message.contains("NoTunnel"));
        r.healthy = true;
        r.path = "/livez".into();
        let ev = health_event(&r);
        assert_eq!(
            (ev.type_.as_str(), ev.reason.as_str()),
            ("Normal", REASON_HEALTHY)
        );
        assert_eq!(
            subjects::health_event("edge-1"),
            "tether.v1.events.health.edge-1"
        );
    }
}
