//! [`AbortReason`]: why a tunnel stream was aborted, whatever carried it (HTTP/2 or
//! `tether-tunnel/2`); `metric_label` names it in metrics.

use std::time::Duration;

/// Why a spliced connection was aborted; `metric_label` names it in metrics.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AbortReason {
    #[error("peer reset the stream: {0}")]
    PeerReset(String),
    #[error("socket error: {0}")]
    Socket(String),
    #[error("socket write made no progress for {0:?}")]
    WriteStalled(Duration),
    #[error("tunnel error: {0}")]
    Tunnel(String),
    #[error("cancelled: {0}")]
    Cancelled(String),
}

impl AbortReason {
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::PeerReset(_) => "peer_reset",
            Self::Socket(_) => "socket_error",
            Self::WriteStalled(_) => "write_stalled",
            Self::Tunnel(_) => "tunnel_error",
            Self::Cancelled(_) => "cancelled",
        }
    }
}
