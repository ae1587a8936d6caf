//! Dialling through HTTP or HTTPS forward proxies (HTTP CONNECT).
//!
//! Used by the registration-agent (hub NATS) and the tunnel-agent (broker tunnels). [`env`]
//! decides which proxy, if any, a connection uses (`HTTP(S)_PROXY`, `NO_PROXY`).
//!
//! async-nats has no proxy support, so [`ProxyForwarder`] listens on `127.0.0.1:0` and, for each
//! connection the NATS client opens, dials the proxy (TCP, or TLS to an `https://` proxy verified
//! with the merged CA bundle), sends `CONNECT host:port` (with `Proxy-Authorization: Basic` when
//! the proxy URL carries credentials), and splices bytes. End-to-end TLS to NATS runs inside the
//! tunnel, so the proxy never sees plaintext.
//!
//! [`ProxyDialer::dial`] is also used as a pre-flight probe so that proxy failures surface as
//! named errors ([`ProxyError`]) instead of an opaque "connection closed" inside async-nats.

pub mod env;

pub use env::ProxySettings;

use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_rustls::TlsConnector;
use tokio_util::sync::CancellationToken;

/// TCP connect to the proxy.
pub const DEFAULT_PROXY_DIAL_TIMEOUT: Duration = Duration::from_secs(5);
/// TLS handshake with an https:// proxy, then the CONNECT exchange.
pub const DEFAULT_PROXY_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest CONNECT response header accepted from a proxy.
const MAX_CONNECT_RESPONSE_BYTES: usize = 16 * 1024;
/// At most this many NATS connections forwarded at once per forwarder (normally 1).
pub const MAX_FORWARDED_CONNECTIONS: usize = 8;

/// `http` or `https` proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyScheme {
    Http,
    Https,
}

/// A parsed `proxy-url`. The password is masked in `Debug` and `Display`.
#[derive(Clone, PartialEq, Eq)]
pub struct ProxyUrl {
    pub scheme: ProxyScheme,
    pub host: String,
    pub port: u16,
    pub username: Option<String>,
    password: Option<String>,
}

impl fmt::Debug for ProxyUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ProxyUrl({self})")
    }
}

impl fmt::Display for ProxyUrl {
    /// The URL with the password replaced by `***` (safe for logs and errors).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = match self.scheme {
            ProxyScheme::Http => "http",
            ProxyScheme::Https => "https",
        };
        write!(f, "{scheme}://")?;
        if let Some(u) = &self.username {
            write!(f, "{u}")?;
            if self.password.is_some() {
                write!(f, ":***")?;
            }
            write!(f, "@")?;
        }
        write!(f, "{}:{}", host_for_authority(&self.host), self.port)
    }
}

fn host_for_authority(host: &str) -> String {
    if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}

/// Why a proxy URL or a proxy exchange failed. Every message names the proxy (password masked).
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("invalid proxy-url {url:?}: {reason}")]
    InvalidUrl { url: String, reason: String },
    #[error("proxy down: cannot connect to proxy {proxy}: {source}")]
    Unreachable {
        proxy: String,
        #[source]
        source: std::io::Error,
    },
    #[error("proxy down: timed out after {timeout:?} connecting to proxy {proxy}")]
    DialTimeout { proxy: String, timeout: Duration },
    #[error(
        "wrong proxy CA: TLS handshake with https proxy {proxy} failed ({source}); append the proxy's CA to certificate-authority-data"
    )]
    Tls {
        proxy: String,
        #[source]
        source: std::io::Error,
    },
    #[error("proxy {proxy} requires authentication (407 Proxy Authentication Required){hint}")]
    AuthRequired { proxy: String, hint: &'static str },
    #[error("proxy {proxy} refused CONNECT to {target} (403 Forbidden)")]
    Forbidden { proxy: String, target: String },
    #[error("proxy {proxy} refused CONNECT to {target}: HTTP {status} {reason}")]
    Refused {
        proxy: String,
        target: String,
        status: u16,
        reason: String,
    },
    #[error("proxy {proxy}: timed out after {timeout:?} waiting for the CONNECT response")]
    HandshakeTimeout { proxy: String, timeout: Duration },
    #[error("proxy {proxy}: malformed CONNECT response: {reason}")]
    BadResponse { proxy: String, reason: String },
    #[error("proxy {proxy}: {source}")]
    Io {
        proxy: String,
        #[source]
        source: std::io::Error,
    },
}

impl ProxyError {
    /// A short label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            ProxyError::InvalidUrl { .. } => "invalid_url",
            ProxyError::Unreachable { .. } | ProxyError::DialTimeout { .. } => "proxy_down",
            ProxyError::Tls { .. } => "proxy_tls",
            ProxyError::AuthRequired { .. } => "proxy_auth_required",
            ProxyError::Forbidden { .. } => "proxy_forbidden",
            ProxyError::Refused { .. } => "proxy_refused",
            ProxyError::HandshakeTimeout { .. } | ProxyError::BadResponse { .. } => {
                "proxy_protocol"
            }
            ProxyError::Io { .. } => "proxy_io",
        }
    }
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let h = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(h, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

fn percent_encode_userinfo(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl ProxyUrl {
    /// Parses `http://[user[:password]@]host[:port][/]` or `https://...`.
    pub fn parse(url: &str) -> Result<Self, ProxyError> {
        let bad = |reason: &str| ProxyError::InvalidUrl {
            url: mask_url_password(url),
            reason: reason.to_string(),
        };
        let (scheme, rest) = if let Some(r) = url.strip_prefix("http://") {
            (ProxyScheme::Http, r)
        } else if let Some(r) = url.strip_prefix("https://") {
            (ProxyScheme::Https, r)
        } else {
            return Err(bad("scheme must be http:// or https://"));
        };
        let rest = rest.trim_end_matches('/');
        if rest.contains('/') || rest.contains('?') || rest.contains('#') {
            return Err(bad("a proxy URL has no path, query or fragment"));
        }
        let (userinfo, hostport) = match rest.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, rest),
        };
        let (username, password) = match userinfo {
            None => (None, None),
            Some(u) => {
                let (user, pass) = match u.split_once(':') {
                    Some((a, b)) => (a, Some(b)),
                    None => (u, None),
                };
                let user = percent_decode(user).ok_or_else(|| bad("bad %-escape in user"))?;
                let pass = match pass {
                    Some(p) => {
                        Some(percent_decode(p).ok_or_else(|| bad("bad %-escape in password"))?)
                    }
                    None => None,
                };
                (Some(user), pass)
            }
        };
        let default_port = match scheme {
            ProxyScheme::Http => 80,
            ProxyScheme::Https => 443,
        };
        let (host, port) = if let Some(v6) = hostport.strip_prefix('[') {
            let (h, after) = v6
                .split_once(']')
                .ok_or_else(|| bad("unclosed '[' in host"))?;
            let port = match after.strip_prefix(':') {
                Some(p) => p.parse().map_err(|_| bad("port is not a number"))?,
                None if after.is_empty() => default_port,
                None => return Err(bad("junk after ']'")),
            };
            (h.to_string(), port)
        } else {
            match hostport.rsplit_once(':') {
                Some((h, p)) => (
                    h.to_string(),
                    p.parse().map_err(|_| bad("port is not a number"))?,
                ),
                None => (hostport.to_string(), default_port),
            }
        };
        if host.is_empty() {
            return Err(bad("no host"));
        }
        Ok(Self {
            scheme,
            host,
            port,
            username,
            password,
        })
    }

    /// The full URL including the password (for writing kubeconfigs only).
    pub fn to_url_with_secret(&self) -> String {
        let scheme = match self.scheme {
            ProxyScheme::Http => "http",
            ProxyScheme::Https => "https",
        };
        let mut s = format!("{scheme}://");
        if let Some(u) = &self.username {
            s.push_str(&percent_encode_userinfo(u));
            if let Some(p) = &self.password {
                s.push(':');
                s.push_str(&percent_encode_userinfo(p));
            }
            s.push('@');
        }
        s.push_str(&format!("{}:{}", host_for_authority(&self.host), self.port));
        s
    }

    fn basic_auth(&self) -> Option<String> {
        let u = self.username.as_ref()?;
        let p = self.password.as_deref().unwrap_or("");
        Some(base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}")))
    }
}

/// Replaces the password in a URL-ish string with `***` (for error messages).
pub fn mask_url_password(url: &str) -> String {
    if let Some((scheme, rest)) = url.split_once("://")
        && let Some((userinfo, host)) = rest.rsplit_once('@')
        && let Some((user, _)) = userinfo.split_once(':')
    {
        return format!("{scheme}://{user}:***@{host}");
    }
    url.to_string()
}

/// Anything a proxied connection can be.
pub trait ProxyStream: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> ProxyStream for T {}

/// Dials targets through one forward proxy.
#[derive(Clone)]
pub struct ProxyDialer {
    proxy: ProxyUrl,
    /// TLS to an https:// proxy, verified with the merged bundle (hub CA + proxy CA).
    tls: Option<TlsConnector>,
    dial_timeout: Duration,
    handshake_timeout: Duration,
}

impl fmt::Debug for ProxyDialer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProxyDialer")
            .field("proxy", &self.proxy)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl ProxyDialer {
    /// `roots` verifies an https:// proxy's certificate (the merged CA bundle).
    pub fn new(proxy: ProxyUrl, roots: Arc<rustls::RootCertStore>) -> Self {
        let tls = (proxy.scheme == ProxyScheme::Https).then(|| {
            let cfg = tether_tls::client_config_builder()
                .with_root_certificates(roots)
                .with_no_client_auth();
            TlsConnector::from(Arc::new(cfg))
        });
        Self {
            proxy,
            tls,
            dial_timeout: DEFAULT_PROXY_DIAL_TIMEOUT,
            handshake_timeout: DEFAULT_PROXY_HANDSHAKE_TIMEOUT,
        }
    }

    pub fn with_timeouts(mut self, dial: Duration, handshake: Duration) -> Self {
        self.dial_timeout = dial;
        self.handshake_timeout = handshake;
        self
    }

    pub fn proxy(&self) -> &ProxyUrl {
        &self.proxy
    }

    /// Opens a tunnel to `host:port` through the proxy.
    pub async fn dial(&self, host: &str, port: u16) -> Result<Box<dyn ProxyStream>, ProxyError> {
        let proxy = self.proxy.to_string();
        let addr = format!(
            "{}:{}",
            host_for_authority(&self.proxy.host),
            self.proxy.port
        );
        let tcp = match tokio::time::timeout(self.dial_timeout, TcpStream::connect(&addr)).await {
            Err(_) => {
                return Err(ProxyError::DialTimeout {
                    proxy,
                    timeout: self.dial_timeout,
                });
            }
            Ok(Err(source)) => return Err(ProxyError::Unreachable { proxy, source }),
            Ok(Ok(s)) => s,
        };
        let _ = tcp.set_nodelay(true);
        let target = format!("{}:{port}", host_for_authority(host));
        let fut = async {
            let mut stream: Box<dyn ProxyStream> = match &self.tls {
                None => Box::new(tcp),
                Some(tls) => {
                    let name = rustls::pki_types::ServerName::try_from(self.proxy.host.clone())
                        .map_err(|e| ProxyError::InvalidUrl {
                            url: proxy.clone(),
                            reason: e.to_string(),
                        })?;
                    let s = tls
                        .connect(name, tcp)
                        .await
                        .map_err(|source| ProxyError::Tls {
                            proxy: proxy.clone(),
                            source,
                        })?;
                    Box::new(s)
                }
            };
            let mut req = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n");
            if let Some(b) = self.proxy.basic_auth() {
                req.push_str(&format!("Proxy-Authorization: Basic {b}\r\n"));
            }
            req.push_str("\r\n");
            let io = |source| ProxyError::Io {
                proxy: proxy.clone(),
                source,
            };
            stream.write_all(req.as_bytes()).await.map_err(io)?;
            stream.flush().await.map_err(io)?;
            // Read byte by byte up to the blank line so no tunnelled byte is consumed.
            let mut head = Vec::with_capacity(256);
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") {
                if head.len() >= MAX_CONNECT_RESPONSE_BYTES {
                    return Err(ProxyError::BadResponse {
                        proxy: proxy.clone(),
                        reason: "response header too long".into(),
                    });
                }
                let n = stream
                    .read(&mut byte)
                    .await
                    .map_err(|source| match &self.tls {
                        Some(_) if head.is_empty() => ProxyError::Tls {
                            proxy: proxy.clone(),
                            source,
                        },
                        _ => ProxyError::Io {
                            proxy: proxy.clone(),
                            source,
                        },
                    })?;
                if n == 0 {
                    return Err(ProxyError::BadResponse {
                        proxy: proxy.clone(),
                        reason: "connection closed before the CONNECT response ended".into(),
                    });
                }
                head.push(byte[0]);
            }
            let text = String::from_utf8_lossy(&head);
            let status_line = text.lines().next().unwrap_or_default();
            let mut parts = status_line.splitn(3, ' ');
            let version = parts.next().unwrap_or_default();
            let status: u16 = parts.next().and_then(|s| s.parse().ok()).ok_or_else(|| {
                ProxyError::BadResponse {
                    proxy: proxy.clone(),
                    reason: format!("status line {status_line:?}"),
                }
            })?;
            if !version.starts_with("HTTP/1.") {
                return Err(ProxyError::BadResponse {
                    proxy: proxy.clone(),
                    reason: format!("status line {status_line:?}"),
                });
            }
            let reason = parts.next().unwrap_or_default().trim().to_string();
            match status {
                200..=299 => Ok(stream),
                407 => Err(ProxyError::AuthRequired {
                    proxy: proxy.clone(),
                    hint: if self.proxy.username.is_some() {
                        "; the user/password in proxy-url were rejected"
                    } else {
                        "; put user:password in proxy-url"
                    },
                }),
                403 => Err(ProxyError::Forbidden {
                    proxy: proxy.clone(),
                    target: target.clone(),
                }),
                _ => Err(ProxyError::Refused {
                    proxy: proxy.clone(),
                    target: target.clone(),
                    status,
                    reason,
                }),
            }
        };
        match tokio::time::timeout(self.handshake_timeout, fut).await {
            Ok(r) => r,
            Err(_) => Err(ProxyError::HandshakeTimeout {
                proxy: self.proxy.to_string(),
                timeout: self.handshake_timeout,
            }),
        }
    }
}

/// A local listener that forwards every accepted connection through the proxy to one target.
/// Dropping it (or cancelling its token) stops accepting and closes forwarded connections.
pub struct ProxyForwarder {
    local_addr: SocketAddr,
    /// Last error seen while forwarding; read by the connection code to explain failures.
    last_error: Arc<Mutex<Option<String>>>,
    cancel: CancellationToken,
}

impl fmt::Debug for ProxyForwarder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProxyForwarder")
            .field("local_addr", &self.local_addr)
            .finish()
    }
}

impl Drop for ProxyForwarder {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl ProxyForwarder {
    /// Binds `127.0.0.1:0` and starts forwarding to `host:port` through `dialer`.
    pub async fn start(
        dialer: ProxyDialer,
        host: String,
        port: u16,
    ) -> std::io::Result<ProxyForwarder> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let local_addr = listener.local_addr()?;
        let last_error = Arc::new(Mutex::new(None));
        let cancel = CancellationToken::new();
        let permits = Arc::new(Semaphore::new(MAX_FORWARDED_CONNECTIONS));
        let task_cancel = cancel.clone();
        let task_err = last_error.clone();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = task_cancel.cancelled() => break,
                    a = listener.accept() => a,
                };
                let Ok((mut local, _)) = accepted else {
                    continue;
                };
                let Ok(permit) = permits.clone().try_acquire_owned() else {
                    tracing::warn!(
                        max = MAX_FORWARDED_CONNECTIONS,
                        "proxy forwarder: too many connections, dropping one"
                    );
                    continue;
                };
                let _ = local.set_nodelay(true);
                let dialer = dialer.clone();
                let host = host.clone();
                let err_slot = task_err.clone();
                let conn_cancel = task_cancel.child_token();
                tokio::spawn(async move {
                    let _permit = permit;
                    match dialer.dial(&host, port).await {
                        Ok(mut remote) => {
                            if let Ok(mut e) = err_slot.lock() {
                                *e = None;
                            }
                            tokio::select! {
                                _ = conn_cancel.cancelled() => {}
                                r = tokio::io::copy_bidirectional(&mut local, &mut remote) => {
                                    if let Err(e) = r {
                                        tracing::debug!(error = %e, "proxied NATS connection ended");
                                    }
                                }
                            }
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "forwarding NATS connection through proxy failed");
                            if let Ok(mut slot) = err_slot.lock() {
                                *slot = Some(e.to_string());
                            }
                        }
                    }
                });
            }
        });
        Ok(ProxyForwarder {
            local_addr,
            last_error,
            cancel,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The last forwarding error, if the most recent attempt failed.
    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().ok().and_then(|e| e.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proxy_urls() {
        let p = ProxyUrl::parse("http://proxy.example:3128").unwrap();
        assert_eq!(p.scheme, ProxyScheme::Http);
        assert_eq!((p.host.as_str(), p.port), ("proxy.example", 3128));
        let p = ProxyUrl::parse("https://u%40x:p%3Ass@10.0.0.1:3129/").unwrap();
        assert_eq!(p.scheme, ProxyScheme::Https);
        assert_eq!(p.username.as_deref(), Some("u@x"));
        assert_eq!(p.password.as_deref(), Some("p:ss"));
        assert_eq!(p.to_string(), "https://u@x:***@10.0.0.1:3129");
        assert!(!format!("{p:?}").contains("p:ss"));
        assert_eq!(
            ProxyUrl::parse(&p.to_url_with_secret()).unwrap(),
            p,
            "round trip"
        );
        let p = ProxyUrl::parse("http://[::1]:8080").unwrap();
        assert_eq!((p.host.as_str(), p.port), ("::1", 8080));
        assert_eq!(ProxyUrl::parse("https://proxy").unwrap().port, 443);
        for bad in [
            "socks5://x:1",
            "http://",
            "http://h:port",
            "http://h:1/path",
        ] {
            assert!(ProxyUrl::parse(bad).is_err(), "{bad}");
        }
        let e = ProxyUrl::parse("ftp://u:secret@h").unwrap_err().to_string();
        assert!(!e.contains("secret"), "{e}");
    }

    async fn fake_proxy(response: &'static str) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let mut buf = vec![0u8; 1024];
                let _ = s.read(&mut buf).await;
                let _ = s.write_all(response.as_bytes()).await;
            }
        });
        addr
    }

    fn dialer_for(addr: SocketAddr, userinfo: &str) -> ProxyDialer {
        let url = ProxyUrl::parse(&format!("http://{userinfo}{addr}")).unwrap();
        ProxyDialer::new(url, Arc::new(rustls::RootCertStore::empty()))
    }

    #[tokio::test]
    async fn names_proxy_failures() {
        let a = fake_proxy("HTTP/1.1 407 Proxy Authentication Required\r\n\r\n").await;
        let e = dialer_for(a, "").dial("hub", 4222).await.err().unwrap();
        assert!(matches!(e, ProxyError::AuthRequired { .. }), "{e}");
        assert!(e.to_string().contains("407"));
        let a = fake_proxy("HTTP/1.1 403 Forbidden\r\n\r\n").await;
        let e = dialer_for(a, "u:pw@")
            .dial("hub", 4222)
            .await
            .err()
            .unwrap();
        assert!(matches!(e, ProxyError::Forbidden { .. }), "{e}");
        assert!(!e.to_string().contains("pw"));
        let a = fake_proxy("HTTP/1.0 200 Connection established\r\n\r\n").await;
        assert!(dialer_for(a, "").dial("hub", 4222).await.is_ok());
        // Nothing listens on a port we just closed.
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let closed = l.local_addr().unwrap();
        drop(l);
        let e = dialer_for(closed, "")
            .dial("hub", 4222)
            .await
            .err()
            .unwrap();
        assert!(e.to_string().starts_with("proxy down"), "{e}");
    }
}
