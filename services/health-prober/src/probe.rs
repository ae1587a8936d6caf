//! Probing one cluster, reusing its connection.
//!
//! A [`ClusterProber`] keeps one HTTP/1.1 connection to its target open across rounds: a
//! tunnel stream (one `Dial` on the broker's native API — never a new tunnel, and not even a new
//! stream per probe), TLS to the API server on top, then `GET /livez` (falling back to
//! `/healthz` when the server has no `/livez`). Only when that connection breaks is a new stream
//! dialled. Latency is split into the tunnel's round trip (the broker's last HTTP/2 PING
//! measurement, returned with the dial) and the remainder, the target's time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Empty};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use rustls::ClientConfig;
use tether_client::Dialer;

use crate::config::ProbeTarget;

/// Largest probe response body read.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// Shared by all probers.
pub struct ProbeContext {
    pub dialer: Dialer,
    /// TLS for API servers (verifying with the configured CA, or not verifying).
    pub tls: Arc<ClientConfig>,
    pub tls_verified: bool,
    pub apiserver_name: String,
    /// A probe connection older than this is replaced, which also refreshes the tunnel's
    /// round-trip sample (taken when the stream is dialled).
    pub connection_max_age: Duration,
}

/// What one probe found.
#[derive(Debug, Clone)]
pub struct ProbeOutcome {
    pub ok: bool,
    pub status: Option<u16>,
    pub error: Option<String>,
    pub latency: Duration,
    pub tunnel_rtt: Option<Duration>,
    pub path: String,
    pub new_connection: bool,
}

/// Probe state of one cluster.
pub struct ClusterProber {
    pub cluster: String,
    target: Option<ProbeTarget>,
    conn: Option<SendRequest<Empty<Bytes>>>,
    conn_since: Option<Instant>,
    tunnel_rtt: Option<Duration>,
    path: String,
}

/// Why a probe got no HTTP status.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error(transparent)]
    Dial(#[from] tether_client::ClientError),
    #[error("server name: {0}")]
    ServerName(#[source] rustls::pki_types::InvalidDnsNameError),
    #[error("TLS to target: {0}")]
    Tls(#[source] std::io::Error),
    #[error("HTTP handshake: {0}")]
    Handshake(#[source] hyper::Error),
    #[error("no connection")]
    NoConnection,
    #[error("connection: {0}")]
    Connection(#[source] hyper::Error),
    #[error(transparent)]
    BuildRequest(#[from] http::Error),
    #[error("request: {0}")]
    Request(#[source] hyper::Error),
    #[error("body: {0}")]
    Body(#[source] hyper::Error),
}

impl ClusterProber {
    pub fn new(cluster: String, target: Option<ProbeTarget>) -> Self {
        let path = target
            .as_ref()
            .map(|t| t.path.clone())
            .unwrap_or_else(|| "/livez".into());
        Self {
            cluster,
            target,
            conn: None,
            conn_since: None,
            tunnel_rtt: None,
            path,
        }
    }

    /// Forgets the connection (after a timeout, the next probe dials again).
    pub fn reset(&mut self) {
        self.conn = None;
    }

    async fn connect(&mut self, ctx: &ProbeContext) -> Result<(), ProbeError> {
        let (stream, tls) = match &self.target {
            None => (ctx.dialer.dial_api_server(&self.cluster).await, true),
            Some(t) => {
                let via = t.via_cluster.as_deref().unwrap_or(&self.cluster);
                (ctx.dialer.dial(via, &t.host, t.port).await, t.tls)
            }
        };
        let stream = stream?;
        self.tunnel_rtt = stream.tunnel_rtt();
        let sender = if tls {
            let name = match &self.target {
                Some(t) => t.host.clone(),
                None => ctx.apiserver_name.clone(),
            };
            let name =
                rustls::pki_types::ServerName::try_from(name).map_err(ProbeError::ServerName)?;
            let tls = tokio_rustls::TlsConnector::from(Arc::clone(&ctx.tls))
                .connect(name, stream)
                .await
                .map_err(ProbeError::Tls)?;
            let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
                .await
                .map_err(ProbeError::Handshake)?;
            tokio::spawn(async move {
                let _ = conn.await;
            });
            sender
        } else {
            let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .map_err(ProbeError::Handshake)?;
            tokio::spawn(async move {
                let _ = conn.await;
            });
            sender
        };
        self.conn = Some(sender);
        self.conn_since = Some(Instant::now());
        Ok(())
    }

    async fn get(&mut self, host: &str) -> Result<u16, ProbeError> {
        let conn = self.conn.as_mut().ok_or(ProbeError::NoConnection)?;
        conn.ready().await.map_err(ProbeError::Connection)?;
        let req = http::Request::get(self.path.as_str())
            .header(http::header::HOST, host)
            .header(http::header::USER_AGENT, "tether-health-prober")
            .body(Empty::new())?;
        let resp = conn.send_request(req).await.map_err(ProbeError::Request)?;
        let status = resp.status().as_u16();
        // Drain a bounded body so the connection can be reused.
        let mut body = resp.into_body();
        let mut read = 0usize;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(ProbeError::Body)?;
            if let Some(d) = frame.data_ref() {
                read += d.len();
                if read > MAX_BODY_BYTES {
                    self.conn = None;
                    break;
                }
            }
        }
        Ok(status)
    }

    /// Runs one probe. The caller bounds it with a timeout and calls [`Self::reset`] on expiry.
    pub async fn probe(&mut self, ctx: &ProbeContext) -> ProbeOutcome {
        let started = Instant::now();
        let mut new_connection = false;
        let host = match &self.target {
            Some(t) => t.host.clone(),
            None => ctx.apiserver_name.clone(),
        };
        let mut result = Err(ProbeError::NoConnection);
        for attempt in 0..2 {
            let expired = self
                .conn_since
                .is_some_and(|t| t.elapsed() >= ctx.connection_max_age);
            if expired || self.conn.as_ref().is_none_or(|c| c.is_closed()) {
                new_connection = true;
                if let Err(e) = self.connect(ctx).await {
                    result = Err(e);
                    break;
                }
            }
            result = self.get(&host).await;
            match &result {
                // A reused connection may have died since the last round: redial once.
                Err(_) if attempt == 0 && !new_connection => self.conn = None,
                // No /livez (older API servers): fall back to /healthz once.
                Ok(404) if self.target.is_none() && self.path == "/livez" => {
                    self.path = "/healthz".into()
                }
                _ => break,
            }
        }
        let latency = started.elapsed();
        let (ok, status, error) = match result {
            Ok(s) if (200..300).contains(&s) => (true, Some(s), None),
            Ok(s) => (
                false,
                Some(s),
                Some(format!("{} answered HTTP {s}", self.path)),
            ),
            Err(e) => {
                self.conn = None;
                (false, None, Some(e.to_string()))
            }
        };
        ProbeOutcome {
            ok,
            status,
            error,
            latency,
            tunnel_rtt: self.tunnel_rtt,
            path: self.path.clone(),
            new_connection,
        }
    }
}

/// Accepts any API server certificate but still checks handshake signatures; used only when no
/// CA is configured. The probe sends no credentials, so nothing secret is exposed.
#[derive(Debug)]
pub struct UnverifiedProbeTls(pub Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for UnverifiedProbeTls {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
