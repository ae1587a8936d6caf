//! Process plumbing shared by every Tether service.
//!
//! - [`backoff`]: jittered exponential backoff with a reset after a healthy period, used by every
//!   retry loop (agent connectors, NATS reconnects, registration).
//! - [`process`]: the actix system on a multi-thread tokio runtime, binding listeners (errors
//!   naming the config field), ready files, and the glibc
//!   tunable launchers give data-plane processes, atomic file writes with a mode.
//! - [`service`]: the service skeleton's [`Drain`]: every long-lived task and open work item of a
//!   service is tracked, and shutdown waits for them up to a named deadline.
//! - [`shutdown`]: a root [`CancellationToken`](tokio_util::sync::CancellationToken) cancelled on
//!   SIGTERM or SIGINT, from which every component derives its own child token.

pub mod backoff;
pub mod process;
pub mod service;
pub mod shutdown;

pub use backoff::{Backoff, BackoffConfig};
pub use process::{
    GLIBC_TUNABLES_DATA_PLANE, ProcessArgs, StartError, actix_system, bind, bind_admin,
    data_plane_workers, glibc_tunables_for_child, write_atomic, write_ready_file,
};
pub use service::{DEFAULT_TASK_DRAIN_DEADLINE, Drain, DrainReport, DrainToken};
pub use shutdown::shutdown_token;
