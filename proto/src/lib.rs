//! Generated gRPC code for Tether's client-facing APIs.
//!
//! - [`tunnel::v1`]: the native Dial API (`tether.tunnel.v1.Dialer/Dial`).
//! - [`konnectivity`]: the konnectivity-compatible `ProxyService/Proxy` (no proto package, as
//!   upstream), so existing konnectivity clients work unchanged.
//!
//! The broker↔agent tunnel itself is not gRPC: it is raw HTTP/2 (one stream per TCP
//! connection, DATA frames carry bytes unframed); see `tether-tunnel`.

pub mod tunnel {
    pub mod v1 {
        tonic::include_proto!("tether.tunnel.v1");
    }
}

#[allow(clippy::doc_lazy_continuation, clippy::large_enum_variant)]
pub mod konnectivity {
    tonic::include_proto!("_");
}
