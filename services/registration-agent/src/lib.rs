//! The managed cluster's registration agent (OCM klusterlet registration agent).
//!
//! Layout:
//! - [`agent`]: the state machine: bootstrap through the forward proxy, CSR with OCM's subject,
//!   wait for acceptance, hub credentials, lease renewal with jitter, rotation at a random
//!   20–25 % of remaining life, re-bootstrap on bootstrap-kubeconfig change or invalid
//!   credentials.
//! - [`secret`]: the narrow storage interface for the hub credentials (directory or Kubernetes
//!   Secret).
//! - [`service`]: the service skeleton: [`service::bind`] → [`service::run`] → drain; the
//!   registration loops and add-on agents are tasks of one drain (no actor: they own no state
//!   that others query and nothing restarts them but their own backoff).
//! - [`addon`]: add-on agents started once joined (`--addon cluster-proxy`): desired config
//!   from the hub, add-on credentials, the tunnel-agent through the [`addon::runtime::AddOnRuntime`]
//!   interface, status report and add-on lease.
//! - [`metrics`]: Prometheus metrics.
#![forbid(unsafe_code)]

pub mod addon;
pub mod agent;
pub mod metrics;
pub mod secret;
pub mod service;
