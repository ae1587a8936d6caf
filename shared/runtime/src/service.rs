//! The service skeleton every Tether service shares: `bind(cfg)` → `run(cfg, listeners,
//! shutdown)` → [`Drain::finish`].
//!
//! A service spawns each long-lived task through its [`Drain`] ([`Drain::spawn`]), never with a
//! bare `tokio::spawn` whose `JoinHandle` is dropped. On shutdown the tasks see their cancellation
//! tokens, and [`Drain::finish`] waits for all of them up to a named deadline; whatever is still
//! running at the deadline is logged by name (and counted in the returned [`DrainReport`]), so a
//! task that ignores its token shows up in the log instead of hanging the process or vanishing.
//!
//! Work items that are not tasks (an open client stream, a connection served inside another
//! task) hold a [`DrainToken`] from [`Drain::token`]: the drain waits for them the same way.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use tokio_util::task::{TaskTracker, task_tracker::TaskTrackerToken};

/// Default time [`Drain::finish`] waits for a service's background tasks after shutdown (NATS
/// sessions flushing, admin servers closing, leader leases being released). Services with open
/// client streams wait for those first within their own configured grace.
pub const DEFAULT_TASK_DRAIN_DEADLINE: Duration = Duration::from_secs(5);

/// The set of a service's running tasks and work items, with the names of those still running.
#[derive(Clone)]
pub struct Drain {
    service: &'static str,
    tracker: TaskTracker,
    running: Arc<Mutex<BTreeMap<&'static str, usize>>>,
}

/// A tracked work item (an open stream, a served connection): the drain waits until it is
/// dropped.
pub struct DrainToken {
    _token: TaskTrackerToken,
    name: &'static str,
    running: Arc<Mutex<BTreeMap<&'static str, usize>>>,
}

impl Drop for DrainToken {
    fn drop(&mut self) {
        if let Ok(mut m) = self.running.lock()
            && let Some(n) = m.get_mut(self.name)
        {
            *n -= 1;
            if *n == 0 {
                m.remove(self.name);
            }
        }
    }
}

/// What [`Drain::finish`] found: whether everything ended in time and what was left.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrainReport {
    /// Every tracked task and token ended before the deadline.
    pub complete: bool,
    /// Still running at the deadline: name → count (empty when `complete`).
    pub still_running: BTreeMap<&'static str, usize>,
}

impl Drain {
    /// An empty drain for `service` (the name in its log lines).
    pub fn new(service: &'static str) -> Self {
        Self {
            service,
            tracker: TaskTracker::new(),
            running: Arc::default(),
        }
    }

    /// A token that keeps the drain waiting until it is dropped; `name` says what it stands for.
    pub fn token(&self, name: &'static str) -> DrainToken {
        if let Ok(mut m) = self.running.lock() {
            *m.entry(name).or_default() += 1;
        }
        DrainToken {
            _token: self.tracker.token(),
            name,
            running: Arc::clone(&self.running),
        }
    }

    /// Spawns a tracked task; `name` is what the drain logs if it is still running at the
    /// deadline. The task must end on its own on shutdown (it watches a cancellation token).
    pub fn spawn<F>(&self, name: &'static str, fut: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tracker.spawn(self.tracked(name, fut))
    }

    /// `fut` holding a [`DrainToken`] until it completes. A combinator, not an `async` block
    /// around `fut.await`: such a block keeps the captured future and the awaited one in separate
    /// fields (rust-lang/rust#62958), which doubled every task spawned here (the broker's
    /// per-connection tasks: ~4 KiB more per idle CONNECT stream).
    fn tracked<F: Future>(
        &self,
        name: &'static str,
        fut: F,
    ) -> impl Future<Output = F::Output> + use<F> {
        let token = self.token(name);
        fut.map(move |out| {
            drop(token);
            out
        })
    }

    /// Tracked work items and tasks currently running.
    pub fn len(&self) -> usize {
        self.tracker.len()
    }

    /// Whether nothing tracked is running.
    pub fn is_empty(&self) -> bool {
        self.tracker.is_empty()
    }

    /// Running items by name.
    pub fn running(&self) -> BTreeMap<&'static str, usize> {
        self.running.lock().map(|m| m.clone()).unwrap_or_default()
    }

    /// Closes the set and waits up to `deadline` for every tracked task and token to end. What
    /// is still running at the deadline is logged by name and reported; those tasks are left to
    /// end with the runtime.
    pub async fn finish(self, deadline: Duration) -> DrainReport {
        self.tracker.close();
        let complete = tokio::time::timeout(deadline, self.tracker.wait())
            .await
            .is_ok();
        let still_running = if complete {
            BTreeMap::new()
        } else {
            self.running()
        };
        if complete {
            tracing::info!(service = self.service, "drain complete");
        } else {
            tracing::warn!(
                service = self.service,
                deadline = ?deadline,
                still_running = ?still_running,
                "drain deadline passed with tasks still running"
            );
        }
        DrainReport {
            complete,
            still_running,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_util::sync::CancellationToken;

    #[tokio::test(start_paused = true)]
    async fn finish_waits_for_tasks_that_end_on_shutdown() {
        let drain = Drain::new("test");
        let stop = CancellationToken::new();
        for _ in 0..3 {
            let stop = stop.clone();
            drain.spawn("worker", async move { stop.cancelled().await });
        }
        assert_eq!(drain.running().get("worker"), Some(&3));
        stop.cancel();
        let report = drain.finish(Duration::from_secs(1)).await;
        assert!(report.complete);
        assert!(report.still_running.is_empty());
    }

    #[test]
    fn a_tracked_future_is_stored_once() {
        let drain = Drain::new("test");
        let big = async {
            let buf = [7u8; 4096];
            std::future::pending::<()>().await;
            std::hint::black_box(&buf);
        };
        let size = std::mem::size_of_val(&big);
        assert!(size >= 4096);
        let tracked = drain.tracked("big", big);
        assert!(
            std::mem::size_of_val(&tracked) <= size + 64,
            "{} bytes for a {size}-byte future",
            std::mem::size_of_val(&tracked)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn finish_names_what_is_still_running_at_the_deadline() {
        let drain = Drain::new("test");
        let stop = CancellationToken::new();
        {
            let stop = stop.clone();
            drain.spawn("polite", async move { stop.cancelled().await });
        }
        drain.spawn("stubborn", std::future::pending::<()>());
        let stream = drain.token("stream");
        stop.cancel();
        let started = tokio::time::Instant::now();
        let report = drain.finish(Duration::from_secs(2)).await;
        assert_eq!(started.elapsed(), Duration::from_secs(2));
        assert!(!report.complete);
        assert_eq!(
            report.still_running.into_iter().collect::<Vec<_>>(),
            vec![("stream", 1), ("stubborn", 1)]
        );
        drop(stream);
    }
}
