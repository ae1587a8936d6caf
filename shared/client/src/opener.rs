//! How the SDK opens a connection to a broker, for both of its protocols (`raw`: HTTP/2, `mux`:
//! `tether-dial/1`): the endpoint parsed once from [`DialerConfig`], TCP with `TCP_NODELAY`, TLS
//! with the broker's CA, the expected name, the client certificate if any and the protocol's
//! ALPN, all within the connect timeout; every error names the step and the address.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use crate::{ClientError, DialerConfig};

/// Which protocol a connection is for (its ALPN over TLS).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Alpn {
    /// HTTP/2: `DialRaw` and the framed `Dial`.
    H2,
    /// `tether-dial/1`.
    Dial,
}

/// A connection to the broker, TLS or plain.
pub(crate) trait BrokerIo: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> BrokerIo for T {}

/// How to open a connection to the broker (parsed once from [`DialerConfig`]).
pub(crate) struct Opener {
    host: String,
    port: u16,
    /// `https://…:port` or `http://…:port`: the `:scheme` and `:authority` of each request.
    base: String,
    /// With `https://`: a TLS client per protocol, and the name the broker's certificate must
    /// carry.
    tls: Option<Tls>,
    timeout: Duration,
}

struct Tls {
    h2: tokio_rustls::TlsConnector,
    dial: tokio_rustls::TlsConnector,
    name: rustls::pki_types::ServerName<'static>,
}

impl Opener {
    pub(crate) fn new(cfg: &DialerConfig, uri: &http::Uri) -> Result<Self, ClientError> {
        let bad = |reason: String| ClientError::Endpoint {
            endpoint: cfg.endpoint.clone(),
            reason,
        };
        let host = uri
            .host()
            .ok_or_else(|| bad("no host".into()))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let https = uri.scheme_str() == Some("https");
        let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
        let authority = uri
            .authority()
            .map(|a| a.as_str().to_owned())
            .unwrap_or_default();
        let tls = if https {
            let (config, name) = tls_config(cfg).map_err(bad)?;
            let with = |alpn: &[u8]| {
                let mut c = config.clone();
                c.alpn_protocols = vec![alpn.to_vec()];
                tokio_rustls::TlsConnector::from(Arc::new(c))
            };
            Some(Tls {
                h2: with(b"h2"),
                dial: with(tether_tls::ALPN_DIAL),
                name,
            })
        } else {
            None
        };
        Ok(Self {
            host,
            port,
            base: format!("{}://{authority}", if https { "https" } else { "http" }),
            tls,
            timeout: cfg.connect_timeout,
        })
    }

    /// `https://…:port` or `http://…:port`.
    pub(crate) fn base(&self) -> &str {
        &self.base
    }

    /// Whether connections are TLS (`https://`).
    pub(crate) fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// A connection error naming `what` failed and the broker's address.
    pub(crate) fn fail(&self, what: &str, e: &dyn std::fmt::Display) -> ClientError {
        ClientError::Connect(self.describe(what, e))
    }

    /// [`Self::fail`] for a broker that could not be reached at all (TCP, a connection closed
    /// before the TLS handshake got an answer, or the timeout).
    fn unreachable(&self, what: &str, e: &dyn std::fmt::Display) -> ClientError {
        ClientError::Unreachable(self.describe(what, e))
    }

    /// A failed TLS handshake: [`ClientError::Certificate`] when a certificate was the reason
    /// (ours verifying the broker's, or the broker's alert about ours);
    /// [`ClientError::Unreachable`] when the connection was reset or closed before the broker
    /// said anything (a broker closing its listener as its drain begins: a connection still in
    /// the backlog is reset); else [`ClientError::Connect`] (an older broker may refuse
    /// `tether-dial/1`'s ALPN, with an alert, and still speak HTTP/2).
    fn tls_failed(&self, what: &str, e: &std::io::Error) -> ClientError {
        use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
        let tls = e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>());
        match tls {
            Some(t) if is_certificate_error(t) => ClientError::Certificate(self.describe(what, e)),
            None if matches!(
                e.kind(),
                ConnectionReset | ConnectionAborted | UnexpectedEof | BrokenPipe
            ) =>
            {
                self.unreachable(what, e)
            }
            _ => self.fail(what, e),
        }
    }

    fn describe(&self, what: &str, e: &dyn std::fmt::Display) -> String {
        format!("{what} {}:{}: {e}", self.host, self.port)
    }

    /// TCP, TLS (ALPN of `alpn`) for `https://`, then `then` on the connection (the protocol's
    /// own handshake), all within the connect timeout.
    pub(crate) async fn open<T, Fut>(
        &self,
        alpn: Alpn,
        then: impl FnOnce(Box<dyn BrokerIo>) -> Fut,
    ) -> Result<T, ClientError>
    where
        Fut: Future<Output = Result<T, ClientError>>,
    {
        let work = async {
            let tcp = TcpStream::connect((self.host.as_str(), self.port))
                .await
                .map_err(|e| self.unreachable("TCP connect to", &e))?;
            let _ = tcp.set_nodelay(true);
            let io: Box<dyn BrokerIo> = match &self.tls {
                Some(t) => {
                    let (connector, what) = match alpn {
                        Alpn::H2 => (&t.h2, "TLS handshake with"),
                        Alpn::Dial => (&t.dial, "TLS handshake (ALPN tether-dial/1) with"),
                    };
                    let mut tls = connector
                        .connect(t.name.clone(), tcp)
                        .await
                        .map_err(|e| self.tls_failed(what, &e))?;
                    // Large writes go to the socket whole, not in rustls's 64 KiB pieces.
                    tls.get_mut()
                        .1
                        .set_buffer_limit(Some(tether_tunnel::settings::DEFAULT_TLS_SEND_BUFFER));
                    Box::new(tls)
                }
                None => Box::new(tcp),
            };
            then(io).await
        };
        tokio::time::timeout(self.timeout, work)
            .await
            .map_err(|_| {
                self.unreachable(
                    "timed out connecting to",
                    &format_args!("{:?}", self.timeout),
                )
            })?
    }
}

/// rustls client configuration for the broker's client TLS listener: its CA, the expected name,
/// the client certificate if any (ALPN set by the caller).
fn tls_config(
    cfg: &DialerConfig,
) -> Result<(rustls::ClientConfig, rustls::pki_types::ServerName<'static>), String> {
    let mut roots = rustls::RootCertStore::empty();
    let cas = tether_tls::pem::certs_from_pem(cfg.ca_pem.as_bytes())
        .map_err(|e| format!("CA bundle: {e}"))?;
    for ca in cas {
        roots
            .add(ca)
            .map_err(|e| format!("CA bundle: certificate not usable as a root: {e}"))?;
    }
    let builder = tether_tls::client_config_builder().with_root_certificates(roots);
    let config = match &cfg.client_cert {
        Some(c) => {
            let chain = tether_tls::pem::certs_from_pem(c.cert_pem.as_bytes())
                .map_err(|e| format!("client certificate: {e}"))?;
            let key = tether_tls::pem::key_from_pem(c.key_pem.as_bytes())
                .map_err(|e| format!("client key: {e}"))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| format!("client certificate and key: {e}"))?
        }
        None => builder.with_no_client_auth(),
    };
    let name = rustls::pki_types::ServerName::try_from(cfg.server_name.clone())
        .map_err(|e| format!("server name {:?}: {e}", cfg.server_name))?;
    Ok((config, name))
}

/// Whether a TLS handshake failed over a certificate, which no other protocol on the same port
/// would get past.
fn is_certificate_error(e: &rustls::Error) -> bool {
    use rustls::AlertDescription as A;
    match e {
        rustls::Error::InvalidCertificate(_) | rustls::Error::NoCertificatesPresented => true,
        rustls::Error::AlertReceived(a) => matches!(
            a,
            A::BadCertificate
                | A::UnsupportedCertificate
                | A::CertificateRevoked
                | A::CertificateExpired
                | A::CertificateUnknown
                | A::UnknownCA
                | A::CertificateRequired
                | A::AccessDenied
        ),
        _ => false,
    }
}
