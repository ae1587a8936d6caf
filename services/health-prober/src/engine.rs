//! The scheduler actor: one probe round per interval, probes run concurrently in tokio tasks
//! bounded by a semaphore, each cluster's prober reused across rounds. A round that is still
//! running when the next is due is not doubled up: the overrun is counted instead, so a slow
//! fleet shows up in metrics rather than as a growing backlog.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use tokio::sync::{Mutex, Semaphore};

use crate::config::ProbeTarget;
use crate::health::{ClusterHealth, Damping, HealthTable};
use crate::metrics::ProberMetrics;
use crate::probe::{ClusterProber, ProbeContext, ProbeOutcome};

/// Results queued towards the NATS publisher before probe tasks wait.
pub const PUBLISH_QUEUE: usize = 4096;
/// Longest a probe task waits for room in the publish queue before dropping its result
/// (the next round publishes the cluster again; dropped results are counted).
pub const PUBLISH_WAIT: Duration = Duration::from_secs(5);

/// One probe result for the publisher: the record and whether the damped verdict flipped.
#[derive(Debug, Clone)]
pub struct Published {
    pub record: ClusterHealth,
    pub changed: bool,
}

pub struct Scheduler {
    pub ctx: Arc<ProbeContext>,
    pub clusters: Vec<String>,
    pub targets: BTreeMap<String, ProbeTarget>,
    pub interval: Duration,
    pub timeout: Duration,
    pub concurrency: usize,
    pub damping: Damping,
    pub table: HealthTable,
    pub metrics: ProberMetrics,
    probers: BTreeMap<String, Arc<Mutex<ClusterProber>>>,
    running: bool,
    publish: Option<tokio::sync::mpsc::Sender<Published>>,
}

impl Scheduler {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ctx: Arc<ProbeContext>,
        clusters: Vec<String>,
        targets: BTreeMap<String, ProbeTarget>,
        interval: Duration,
        timeout: Duration,
        concurrency: usize,
        damping: Damping,
        table: HealthTable,
        metrics: ProberMetrics,
    ) -> Self {
        Self {
            ctx,
            clusters,
            targets,
            interval,
            timeout,
            concurrency,
            damping,
            table,
            metrics,
            probers: BTreeMap::new(),
            running: false,
            publish: None,
        }
    }

    /// Sends every result to `tx` (the NATS publisher), bounded by [`PUBLISH_QUEUE`].
    pub fn with_publisher(mut self, tx: tokio::sync::mpsc::Sender<Published>) -> Self {
        self.publish = Some(tx);
        self
    }

    fn round(&mut self, ctx: &mut Context<Self>) {
        if self.running {
            self.metrics.rounds_overrun.inc();
            tracing::warn!("previous probe round still running; skipping this tick");
            return;
        }
        self.running = true;
        let wanted: std::collections::BTreeSet<&String> = self.clusters.iter().collect();
        self.probers.retain(|k, _| wanted.contains(k));
        self.table.retain(|k| wanted.contains(&k.to_owned()));
        let jobs: Vec<(String, Arc<Mutex<ClusterProber>>)> = self
            .clusters
            .iter()
            .map(|c| {
                let p = self.probers.entry(c.clone()).or_insert_with(|| {
                    Arc::new(Mutex::new(ClusterProber::new(
                        c.clone(),
                        self.targets.get(c).cloned(),
                    )))
                });
                (c.clone(), Arc::clone(p))
            })
            .collect();
        let (pctx, timeout, damping, table, metrics, publish) = (
            Arc::clone(&self.ctx),
            self.timeout,
            self.damping,
            self.table.clone(),
            self.metrics.clone(),
            self.publish.clone(),
        );
        let limit = Arc::new(Semaphore::new(self.concurrency));
        let me = ctx.address();
        tokio::spawn(async move {
            let started = Instant::now();
            let mut tasks = tokio::task::JoinSet::new();
            for (cluster, prober) in jobs {
                let (pctx, table, metrics, limit, publish) = (
                    Arc::clone(&pctx),
                    table.clone(),
                    metrics.clone(),
                    Arc::clone(&limit),
                    publish.clone(),
                );
                tasks.spawn(async move {
                    let _permit = limit.acquire_owned().await.expect("semaphore open");
                    let mut p = prober.lock().await;
                    let span = tracing::debug_span!("probe", cluster = %cluster);
                    let outcome = match tokio::time::timeout(timeout, tracing::Instrument::instrument(p.probe(&pctx), span)).await {
                        Ok(o) => o,
                        Err(_) => {
                            p.reset();
                            ProbeOutcome {
                                ok: false,
                                status: None,
                                error: Some(format!("probe timed out after {timeout:?}")),
                                latency: timeout,
                                tunnel_rtt: None,
                                path: String::new(),
                                new_connection: false,
                            }
                        }
                    };
                    metrics.observe(&cluster, &outcome);
                    let (rec, changed) = table.record(&cluster, &outcome, damping, pctx.tls_verified);
                    if changed {
                        tracing::warn!(cluster = %cluster, healthy = rec.healthy, error = ?rec.error, "cluster health changed");
                    }
                    if let Some(tx) = publish {
                        let sent = tokio::time::timeout(
                            PUBLISH_WAIT,
                            tx.send(Published { record: rec, changed }),
                        )
                        .await;
                        if !matches!(sent, Ok(Ok(()))) {
                            metrics.publish_dropped.inc();
                        }
                    }
                });
            }
            while tasks.join_next().await.is_some() {}
            me.do_send(RoundDone(started.elapsed()));
        });
    }
}

#[derive(Message)]
#[rtype(result = "()")]
struct RoundDone(Duration);

/// Replaces the set of clusters to probe (from the hub's cluster list).
#[derive(Message)]
#[rtype(result = "()")]
pub struct SetClusters(pub Vec<String>);

impl Actor for Scheduler {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        self.round(ctx);
        ctx.run_interval(self.interval, |act, ctx| act.round(ctx));
    }
}

impl Handler<RoundDone> for Scheduler {
    type Result = ();
    fn handle(&mut self, msg: RoundDone, _: &mut Context<Self>) {
        self.running = false;
        self.metrics.round_duration.set(msg.0.as_secs_f64());
        tracing::debug!(duration = ?msg.0, clusters = self.clusters.len(), "probe round finished");
    }
}

impl Handler<SetClusters> for Scheduler {
    type Result = ();
    fn handle(&mut self, msg: SetClusters, ctx: &mut Context<Self>) {
        let added = msg.0.iter().any(|c| !self.clusters.contains(c));
        self.clusters = msg.0;
        // A newly accepted cluster is probed at once rather than at the next tick.
        if added && !self.running {
            self.round(ctx);
        }
    }
}
