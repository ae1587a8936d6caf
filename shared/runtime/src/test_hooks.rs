//! Test-only fault injection for the supervision tests (tests/tests/supervision.rs), shared by
//! the broker and the agent.
//!
//! Off unless a service's config says `test_hooks: true` (never set it in production): then
//! its admin listener answers
//! `GET /debug/test/panic-tunnel?<key>=<name>&task=<actor|connection>` — `key` is `cluster` on
//! the broker (one tunnel of that cluster) and `endpoint` on the agent (the tunnel of that
//! broker endpoint) — which makes the oldest live tunnel of `name` panic: in the actor that owns
//! it (`actor`) or in the task driving its connection (`connection`). Nothing a peer or a hub
//! client sends reaches these panics; the admin listener is the only way in.
//!
//! [`TestHooks`] is the table of live tunnels that can be told to panic: the owner of each
//! tunnel adds it when it starts and removes it when it ends.

use std::collections::BTreeMap;
use std::sync::Mutex;

use actix::prelude::*;
use tokio_util::sync::CancellationToken;

/// Admin path of the panic hook.
pub const PANIC_TUNNEL_PATH: &str = "/debug/test/panic-tunnel";

/// Makes the actor that receives it panic.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Panic;

/// Where the panic happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PanicIn {
    /// The actor owning the tunnel (its message handler).
    Actor,
    /// The task driving the tunnel's connection.
    Connection,
}

/// Why a panic request was not carried out.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HookError {
    #[error("query needs {key}=<name> and task=<actor|connection>")]
    BadQuery { key: &'static str },
    #[error("no tunnel of {key} {name}")]
    NoTunnel { key: &'static str, name: String },
}

struct Hooked {
    name: String,
    actor: Recipient<Panic>,
    /// Cancelling it makes the connection task panic.
    connection: CancellationToken,
}

/// The tunnels that can be told to panic (tunnel id → hooks), named by `key` (`cluster`,
/// `endpoint`).
pub struct TestHooks {
    key: &'static str,
    tunnels: Mutex<BTreeMap<u64, Hooked>>,
}

impl TestHooks {
    /// An empty table whose tunnels are named by the query parameter `key`.
    pub fn new(key: &'static str) -> Self {
        Self {
            key,
            tunnels: Mutex::default(),
        }
    }

    /// Adds tunnel `id` of `name`.
    pub fn add(&self, id: u64, name: &str, actor: Recipient<Panic>, connection: CancellationToken) {
        if let Ok(mut t) = self.tunnels.lock() {
            t.insert(
                id,
                Hooked {
                    name: name.to_owned(),
                    actor,
                    connection,
                },
            );
        }
    }

    /// Tunnel `id` is now named `name` (its agent endpoint was renamed by a config reload).
    pub fn rename(&self, id: u64, name: &str) {
        if let Ok(mut t) = self.tunnels.lock()
            && let Some(h) = t.get_mut(&id)
        {
            name.clone_into(&mut h.name);
        }
    }

    /// Removes tunnel `id`.
    pub fn remove(&self, id: u64) {
        if let Ok(mut t) = self.tunnels.lock() {
            t.remove(&id);
        }
    }

    fn no_tunnel(&self, name: &str) -> HookError {
        HookError::NoTunnel {
            key: self.key,
            name: name.to_owned(),
        }
    }

    /// Makes the oldest live tunnel of `name` panic in `task`; returns its id.
    pub fn panic(&self, name: &str, task: PanicIn) -> Result<u64, HookError> {
        let t = self.tunnels.lock().map_err(|_| self.no_tunnel(name))?;
        let (id, hooked) = t
            .iter()
            .find(|(_, h)| h.name == name)
            .ok_or_else(|| self.no_tunnel(name))?;
        tracing::warn!(key = self.key, %name, tunnel = id, ?task, "test hook: making the tunnel panic");
        match task {
            PanicIn::Actor => hooked.actor.do_send(Panic),
            PanicIn::Connection => hooked.connection.cancel(),
        }
        Ok(*id)
    }

    /// The admin route: parses `<key>=…&task=…` and answers `{"tunnel": id}` or
    /// `{"error": "…"}`.
    pub fn answer(&self, query: Option<&str>) -> String {
        let result = self
            .parse(query)
            .and_then(|(name, task)| self.panic(name, task));
        match result {
            Ok(id) => serde_json::json!({ "tunnel": id }),
            Err(e) => serde_json::json!({ "error": e.to_string() }),
        }
        .to_string()
    }

    fn parse<'q>(&self, query: Option<&'q str>) -> Result<(&'q str, PanicIn), HookError> {
        let (mut name, mut task) = (None, None);
        for pair in query.unwrap_or_default().split('&') {
            match pair.split_once('=') {
                Some((k, v)) if k == self.key && !v.is_empty() => name = Some(v),
                Some(("task", "actor")) => task = Some(PanicIn::Actor),
                Some(("task", "connection")) => task = Some(PanicIn::Connection),
                _ => {}
            }
        }
        name.zip(task).ok_or(HookError::BadQuery { key: self.key })
    }
}

/// `tunnel`, made to panic when `panic` is cancelled (the [`PanicIn::Connection`] hook); just
/// `tunnel` without a token. The panic drops `tunnel` with the task running it, as a bug in its
/// code would.
pub async fn panics_on<T>(
    tunnel: impl std::future::Future<Output = T>,
    panic: Option<CancellationToken>,
) -> T {
    let Some(panic) = panic else {
        return tunnel.await;
    };
    tokio::select! {
        out = tunnel => out,
        () = panic.cancelled() => panic!("test hook: the tunnel's connection task panics"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_names_a_tunnel_and_a_task() {
        let hooks = TestHooks::new("cluster");
        assert_eq!(
            hooks.parse(Some("cluster=sa&task=actor")),
            Ok(("sa", PanicIn::Actor))
        );
        assert_eq!(
            hooks.parse(Some("task=connection&cluster=c-1")),
            Ok(("c-1", PanicIn::Connection))
        );
        let bad = Err(HookError::BadQuery { key: "cluster" });
        assert_eq!(hooks.parse(Some("cluster=sa")), bad);
        assert_eq!(hooks.parse(Some("cluster=&task=actor")), bad);
        assert_eq!(hooks.parse(Some("cluster=sa&task=other")), bad);
        assert_eq!(hooks.parse(Some("endpoint=sa&task=actor")), bad);
        assert_eq!(hooks.parse(None), bad);
        let agent = TestHooks::new("endpoint");
        assert_eq!(
            agent.parse(Some("endpoint=127.0.0.1:1&task=connection")),
            Ok(("127.0.0.1:1", PanicIn::Connection))
        );
    }

    #[test]
    fn a_name_without_a_tunnel_is_an_error() {
        let hooks = TestHooks::new("cluster");
        assert_eq!(
            hooks.panic("sa", PanicIn::Connection),
            Err(HookError::NoTunnel {
                key: "cluster",
                name: "sa".into()
            })
        );
        assert!(
            hooks
                .answer(Some("cluster=sa&task=actor"))
                .contains("no tunnel of cluster sa")
        );
    }

    #[tokio::test]
    async fn the_connection_hook_panics_the_task_and_only_then() {
        let token = CancellationToken::new();
        let quiet = tokio::spawn(panics_on(async { 7 }, Some(token.clone())));
        assert_eq!(quiet.await.ok(), Some(7));
        let stuck = tokio::spawn(panics_on(std::future::pending::<()>(), Some(token.clone())));
        token.cancel();
        assert!(stuck.await.is_err_and(|e| e.is_panic()));
        assert_eq!(panics_on(async { 8 }, None).await, 8);
    }
}
