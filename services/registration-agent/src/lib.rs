//! The managed cluster's registration agent (OCM klusterlet registration agent).
//!
//! Layout:
//! - [`agent`]: the state machine: bootstrap through the forward proxy, CSR with OCM's subject,
//!   wait for acceptance, hub credentials, lease renewal with jitter, rotation at a random
//!   20–25 % of remaining life, re-bootstrap on bootstrap-kubeconfig change or invalid
//!   credentials.
//! - [`secret`]: the narrow storage interface for the hub credentials (directory or Kubernetes
//!   Secret).
//! - [`supervisor`]: the actix actor that owns an agent's run loop and answers status queries.
//! - [`metrics`]: Prometheus metrics.
#![forbid(unsafe_code)]

pub mod agent;
pub mod metrics;
pub mod secret;
pub mod supervisor;
