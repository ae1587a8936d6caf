//! Test-only fault injection, for the supervision tests (tests/tests/supervision.rs).
//!
//! Off unless the config says `test_hooks: true` (never set it in production): then the admin
//! listener answers `GET /debug/test/panic-tunnel?cluster=<name>&task=<actor|connection>`, which
//! makes one tunnel of `cluster` panic — in its tunnel actor (`actor`) or in
//! the task driving its HTTP/2 connection (`connection`). Nothing an agent or a hub client sends
//! reaches these panics; the admin listener is the only way in.
//!
//! [`TestHooks`] is the table of live agent tunnels that can be told to panic: each tunnel actor
//! adds itself when it starts and removes itself when it is dropped.

use std::collections::BTreeMap;
use std::sync::Mutex;

use actix::prelude::*;
use tokio_util::sync::CancellationToken;

/// Admin path of the panic hook.
pub const PANIC_TUNNEL_PATH: &str = "/debug/test/panic-tunnel";

/// Makes the tunnel actor that receives it panic.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Panic;

/// Where the panic happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PanicIn {
    /// The tunnel's actor (its message handler).
    Actor,
    /// The task driving the tunnel's HTTP/2 connection.
    Connection,
}

/// Why a panic request was not carried out.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HookError {
    #[error("query needs cluster=<name> and task=<actor|connection>")]
    BadQuery,
    #[error("no tunnel of cluster {0}")]
    NoTunnel(String),
}

struct Hooked {
    cluster: String,
    actor: Recipient<Panic>,
    /// Cancelling it makes the connection task panic.
    connection: CancellationToken,
}

/// The tunnels that can be told to panic (tunnel id → hooks).
#[derive(Default)]
pub struct TestHooks {
    tunnels: Mutex<BTreeMap<u64, Hooked>>,
}

impl TestHooks {
    /// Adds tunnel `id` of `cluster`.
    pub fn add(
        &self,
        id: u64,
        cluster: &str,
        actor: Recipient<Panic>,
        connection: CancellationToken,
    ) {
        if let Ok(mut t) = self.tunnels.lock() {
            t.insert(
                id,
                Hooked {
                    cluster: cluster.to_owned(),
                    actor,
                    connection,
                },
            );
        }
    }

    /// Removes tunnel `id`.
    pub fn remove(&self, id: u64) {
        if let Ok(mut t) = self.tunnels.lock() {
            t.remove(&id);
        }
    }

    /// Makes the oldest live tunnel of `cluster` panic in `task`; returns its id.
    pub fn panic(&self, cluster: &str, task: PanicIn) -> Result<u64, HookError> {
        let t = self
            .tunnels
            .lock()
            .map_err(|_| HookError::NoTunnel(cluster.to_owned()))?;
        let (id, hooked) = t
            .iter()
            .find(|(_, h)| h.cluster == cluster)
            .ok_or_else(|| HookError::NoTunnel(cluster.to_owned()))?;
        tracing::warn!(%cluster, tunnel = id, ?task, "test hook: making the tunnel panic");
        match task {
            PanicIn::Actor => hooked.actor.do_send(Panic),
            PanicIn::Connection => hooked.connection.cancel(),
        }
        Ok(*id)
    }

    /// The admin route: parses `cluster=…&task=…` and answers `{"tunnel": id}` or
    /// `{"error": "…"}`.
    pub fn answer(&self, query: Option<&str>) -> String {
        let result = parse(query).and_then(|(cluster, task)| self.panic(cluster, task));
        match result {
            Ok(id) => serde_json::json!({ "tunnel": id }),
            Err(e) => serde_json::json!({ "error": e.to_string() }),
        }
        .to_string()
    }
}

fn parse(query: Option<&str>) -> Result<(&str, PanicIn), HookError> {
    let (mut cluster, mut task) = (None, None);
    for pair in query.unwrap_or_default().split('&') {
        match pair.split_once('=') {
            Some(("cluster", c)) if !c.is_empty() => cluster = Some(c),
            Some(("task", "actor")) => task = Some(PanicIn::Actor),
            Some(("task", "connection")) => task = Some(PanicIn::Connection),
            _ => {}
        }
    }
    cluster.zip(task).ok_or(HookError::BadQuery)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_names_a_cluster_and_a_task() {
        assert_eq!(
            parse(Some("cluster=sa&task=actor")),
            Ok(("sa", PanicIn::Actor))
        );
        assert_eq!(
            parse(Some("task=connection&cluster=c-1")),
            Ok(("c-1", PanicIn::Connection))
        );
        assert_eq!(parse(Some("cluster=sa")), Err(HookError::BadQuery));
        assert_eq!(parse(Some("cluster=&task=actor")), Err(HookError::BadQuery));
        assert_eq!(
            parse(Some("cluster=sa&task=other")),
            Err(HookError::BadQuery)
        );
        assert_eq!(parse(None), Err(HookError::BadQuery));
    }

    #[test]
    fn a_cluster_without_a_tunnel_is_an_error() {
        let hooks = TestHooks::default();
        assert_eq!(
            hooks.panic("sa", PanicIn::Connection),
            Err(HookError::NoTunnel("sa".into()))
        );
        assert!(
            hooks
                .answer(Some("cluster=sa&task=actor"))
                .contains("no tunnel of cluster sa")
        );
    }
}
