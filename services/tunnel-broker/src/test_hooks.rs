//! Test-only fault injection, for the supervision tests (tests/tests/supervision.rs): the
//! shared [`tether_runtime::test_hooks`], with tunnels named by `cluster`.
//!
//! Off unless the config says `test_hooks: true` (never set it in production): then the admin
//! listener answers `GET /debug/test/panic-tunnel?cluster=<name>&task=<actor|connection>`, which
//! makes one tunnel of `cluster` panic — in its tunnel actor (`actor`) or in the task driving
//! its HTTP/2 connection (`connection`). Each tunnel actor adds itself to the table when it
//! starts and removes itself when it is dropped.

pub use tether_runtime::test_hooks::{PANIC_TUNNEL_PATH, Panic, TestHooks};

/// The broker's table: tunnels are named by their cluster.
pub fn new() -> TestHooks {
    TestHooks::new("cluster")
}
