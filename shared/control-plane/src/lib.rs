//! Tether's control plane on NATS (with JetStream).
//!
//! Layout:
//! - [`proxy`]: HTTP CONNECT through http:// and https:// forward proxies (basic auth), and the
//!   in-process forwarder async-nats connects to.
//! - [`connect`]: TLS connection to hub NATS (directly or through the proxy) with a hub user,
//!   bootstrap token or cluster certificate; named errors; JSON request/reply.
//! - [`kubeconfig`]: the hub endpoint types (crate `tether-kubeconfig`; reading and writing
//!   kubeconfig files is its `kube` feature).
//! - [`subjects`]: the versioned subject space (`tether.v1.…`), bucket and stream names.
//! - [`resources`]: OCM-shaped resources (ManagedCluster, Lease, CertificateSigningRequest,
//!   Event) and the registration protocol messages.
//! - [`auth`]: NATS auth callout (JWT request/response), bootstrap tokens, certificate
//!   credentials and per-identity permissions.
//! - [`addons`]: add-on resources (OCM-shaped), validation, and the agent ↔ hub add-on messages.
//! - [`brokers`]: broker presence (`tether-brokers` KV).
//! - [`clients`]: hub client credentials and access policy resources.
//! - [`service_proxy`]: the HTTP service proxy's allowlist (`ServiceProxyAllowlist`).
//! - [`health`]: health-prober results (`tether-health`, `tether.v1.health.get`) and the
//!   `proxy health` table.
//! - [`store`]: JetStream KV buckets and the events stream (replicated on a NATS cluster); the
//!   [`store::Store`] trait the control-plane logic is written against, and an in-memory
//!   implementation for unit tests.
//! - [`clock`]: wall-clock time behind a trait (tests follow tokio's paused clock).
//! - [`leader`]: leader election among hub replicas through a KV lease.
//! - [`trace`]: W3C `traceparent` in NATS headers.
//!
//! Subjects and message schemas are documented in `docs/control-plane.md`.
#![forbid(unsafe_code)]

pub mod addons;
pub mod auth;
pub mod brokers;
pub mod clients;
pub mod clock;
pub mod connect;
pub mod health;
pub mod hub;
/// Kubeconfig types live in their own crate (`kube` only with its `kube` feature);
/// re-exported under their old path.
pub use tether_kubeconfig as kubeconfig;
pub mod leader;
/// Forward-proxy dialling lives in its own crate; re-exported under its old path.
pub use tether_proxy as proxy;
pub mod resources;
pub mod service_proxy;
pub mod store;
pub mod subjects;
pub mod trace;

pub use connect::{ConnectConfig, ControlError, Credentials, NatsConnection};
