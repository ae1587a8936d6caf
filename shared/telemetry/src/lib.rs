//! Observability shared by every Tether process.
//!
//! - [`tracing_setup`]: `init_tracing` installs EnvFilter + fmt, and an OpenTelemetry (OTLP
//!   gRPC) layer when the standard `OTEL_EXPORTER_OTLP_ENDPOINT` is set. The W3C trace-context
//!   propagator is installed so [`propagation`] can carry a span's context across process
//!   boundaries (HTTP/2 headers on the tunnel, gRPC metadata, NATS headers).
//! - [`admin`]: the admin HTTP server: `/healthz` (process alive), `/readyz` (driven by a
//!   [`admin::Readiness`]), `/metrics` (Prometheus text format), and optional JSON debug routes.

pub mod admin;
pub mod propagation;
pub mod tracing_setup;

pub use admin::{AdminServer, Readiness, Registered};
pub use tracing_setup::{TelemetryGuard, init_tracing, use_colour};
