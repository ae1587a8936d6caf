//! Leader election among hub replicas through a KV lease (`tether-leaders`, key = controller).
//!
//! The record names its holder and is renewed every `ttl / 3` (jittered) by compare-and-swap on
//! its revision. Another replica takes over only after it has watched the same revision stay
//! unchanged for a whole `ttl` on its own monotonic clock (no wall-clock comparison between
//! machines). The holder counts itself leader only until `2/3 ttl` after it *sent* its last
//! successful renewal, so it has stepped down before anyone can take over; a failed or
//! conflicting renewal steps it down at once. A graceful stop deletes the record (instant
//! failover); a SIGKILLed leader is replaced after `ttl`–`4/3 ttl`.
//!
//! [`spawn`] runs the loop and publishes leadership on a `watch` channel.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::connect::ControlError;
use crate::store::Store as _;
use crate::store::{Bucket, HubStore};

/// Default lease TTL of a controller leader.
pub const DEFAULT_LEADER_TTL: Duration = Duration::from_secs(6);

/// The `tether-leaders` value.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct LeaderRecord {
    /// Who leads (`<host>/<pid>/<random>`: unique per process).
    pub holder: String,
    /// RFC 3339, informational (takeover uses the revision, not this time).
    pub renew_time: String,
    pub ttl_ms: u64,
}

/// What to elect.
#[derive(Debug, Clone)]
pub struct LeaderConfig {
    /// Key in `tether-leaders` (the controller, e.g. `registration`).
    pub name: String,
    /// This replica's identity.
    pub holder: String,
    pub ttl: Duration,
}

/// Outcome of one round.
enum Round {
    /// Holds (or just took) the lease.
    Holding,
    NotHolding,
}

/// Takeover bookkeeping: a foreign record's revision and since when it is unchanged.
#[derive(Default)]
struct Observed(Option<(u64, Instant)>);

async fn round(
    store: &HubStore,
    cfg: &LeaderConfig,
    seen: &mut Observed,
) -> Result<Round, ControlError> {
    let record = LeaderRecord {
        holder: cfg.holder.clone(),
        renew_time: crate::resources::rfc3339(std::time::SystemTime::now()),
        ttl_ms: u64::try_from(cfg.ttl.as_millis()).unwrap_or(u64::MAX),
    };
    let held = match store
        .get::<LeaderRecord>(Bucket::Leaders, &cfg.name)
        .await?
    {
        None => store
            .create(Bucket::Leaders, &cfg.name, &record)
            .await?
            .is_some(),
        Some((cur, rev)) if cur.holder == cfg.holder => store
            .update(Bucket::Leaders, &cfg.name, &record, rev)
            .await?
            .is_some(),
        Some((cur, rev)) => {
            let ttl = Duration::from_millis(cur.ttl_ms).max(cfg.ttl);
            match seen.0 {
                Some((r, since)) if r == rev => {
                    since.elapsed() > ttl
                        && store
                            .update(Bucket::Leaders, &cfg.name, &record, rev)
                            .await?
                            .is_some()
                }
                _ => {
                    seen.0 = Some((rev, Instant::now()));
                    false
                }
            }
        }
    };
    if held {
        seen.0 = None;
        Ok(Round::Holding)
    } else {
        Ok(Round::NotHolding)
    }
}

fn jittered(d: Duration) -> Duration {
    d.mul_f64(rand::random_range(0.8..1.0))
}

/// Runs the election until `shutdown`; the receiver says whether this replica leads now.
pub fn spawn(
    store: HubStore,
    cfg: LeaderConfig,
    shutdown: CancellationToken,
) -> (watch::Receiver<bool>, tokio::task::JoinHandle<()>) {
    let (tx, rx) = watch::channel(false);
    let task = tokio::spawn(async move {
        let mut seen = Observed::default();
        let mut leading_until: Option<Instant> = None;
        loop {
            let sent = Instant::now();
            let r = tokio::time::timeout(cfg.ttl / 3, round(&store, &cfg, &mut seen)).await;
            match r {
                Ok(Ok(Round::Holding)) => leading_until = Some(sent + cfg.ttl * 2 / 3),
                Ok(Ok(Round::NotHolding)) => leading_until = None,
                Ok(Err(e)) => {
                    tracing::warn!(controller = %cfg.name, error = %e, "leader lease round failed")
                }
                Err(_) => tracing::warn!(controller = %cfg.name, "leader lease round timed out"),
            }
            let next = Instant::now() + jittered(cfg.ttl / 3);
            loop {
                let leads = leading_until.is_some_and(|t| Instant::now() < t);
                if *tx.borrow() != leads {
                    tracing::info!(controller = %cfg.name, holder = %cfg.holder, leads, "leadership changed");
                    tx.send_replace(leads);
                }
                let wake = match leading_until {
                    Some(t) if leads && t < next => t,
                    _ => next,
                };
                tokio::select! {
                    _ = shutdown.cancelled() => {
                        if *tx.borrow() {
                            tx.send_replace(false);
                            release(&store, &cfg).await;
                        }
                        return;
                    }
                    _ = tokio::time::sleep_until(wake.into()) => {}
                }
                if Instant::now() >= next {
                    break;
                }
            }
        }
    });
    (rx, task)
}

/// Deletes the record if this replica still holds it (best effort, bounded).
async fn release(store: &HubStore, cfg: &LeaderConfig) {
    let work = async {
        if let Ok(Some((cur, _))) = store.get::<LeaderRecord>(Bucket::Leaders, &cfg.name).await
            && cur.holder == cfg.holder
        {
            let _ = store.delete(Bucket::Leaders, &cfg.name).await;
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(2), work).await;
}
