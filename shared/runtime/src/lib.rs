//! Process plumbing shared by every Tether service.
//!
//! - [`backoff`]: jittered exponential backoff with a reset after a healthy period, used by every
//!   retry loop (agent connectors, NATS reconnects, registration), and [`retry`] for start-up
//!   steps whose dependency may come up later.
//! - [`process`]: the actix system on a multi-thread tokio runtime (the data plane's on one
//!   thread with idle polling, [`tether_idlepoll`]), binding listeners (errors
//!   naming the config field), ready files, and the glibc
//!   tunable launchers give data-plane processes, atomic file writes with a mode, the command
//!   line of a service run from a config file ([`ConfigFileArgs`]).
//! - [`data_plane_allocator!`]: mimalloc as the broker's and the agent's global allocator.
//! - [`service`]: the service skeleton's [`Drain`]: every long-lived task and open work item of a
//!   service is tracked, and shutdown waits for them up to a named deadline.
//! - [`test_hooks`]: test-only fault injection (a tunnel's actor or connection task panics) for
//!   the supervision tests; off unless a service's config says `test_hooks: true`.
//! - [`shutdown`]: a root [`CancellationToken`](tokio_util::sync::CancellationToken) cancelled on
//!   SIGTERM or SIGINT, from which every component derives its own child token.

pub use tether_backoff as backoff;
pub mod process;
pub mod service;
pub mod shutdown;
pub mod test_hooks;

pub use backoff::{Backoff, BackoffConfig, RetryError, retry};
pub use process::{
    ConfigFileArgs, DEFAULT_IDLE_POLL_US, GLIBC_TUNABLES_DATA_PLANE, IdlePollArgs, ProcessArgs,
    StartError, actix_system, actix_system_data_plane, bind, bind_admin, data_plane_workers,
    glibc_tunables_for_child, parse_worker_threads, write_atomic, write_ready_file,
};
pub use service::{DEFAULT_TASK_DRAIN_DEADLINE, Drain, DrainReport, DrainToken};
pub use shutdown::shutdown_token;

#[doc(hidden)]
pub use mimalloc::MiMalloc;

/// Makes mimalloc the global allocator of a data-plane binary (broker, agent, `tetherctl` for
/// `proxy connect`, an application moving bulk data through the SDK); invoke it once at the top
/// of its `main.rs`.
///
/// Why: h2 allocates a buffer per received DATA frame, and glibc malloc trims and re-faults
/// that memory constantly (~110k page faults per 3 s of one-stream traffic, 15–25 % of the
/// tunnel's CPU per GB; see docs/benchmarks.md). A macro, not a function, because the
/// `#[global_allocator]` static has to be declared in the binary; the control-plane services
/// keep glibc's allocator.
#[macro_export]
macro_rules! data_plane_allocator {
    () => {
        #[global_allocator]
        static GLOBAL: $crate::MiMalloc = $crate::MiMalloc;
    };
}
