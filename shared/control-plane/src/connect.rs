//! Connecting to hub NATS: directly or through the forward proxy, always TLS to NATS, with one
//! of three credentials (hub user, bootstrap token, cluster certificate).
//!
//! Before handing the address to async-nats we probe the path once ourselves, so that a proxy
//! that is down, refuses CONNECT (403/407), presents a certificate the bundle does not trust, or
//! a NATS server that is down, each surfaces as a named [`ControlError`]. When a proxy is used,
//! async-nats talks to a local [`ProxyForwarder`]; TLS is verified against the real NATS host
//! name (not 127.0.0.1) by [`FixedNameVerifier`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use async_nats::{ConnectErrorKind, ConnectOptions};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};

use crate::auth::{self, CertCredential};
use crate::kubeconfig::{HubEndpoint, Token};
use crate::proxy::{ProxyDialer, ProxyError, ProxyForwarder};
use crate::subjects;

/// TCP + TLS + NATS CONNECT.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Per request/reply exchange.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Client PING interval: a server that vanished without FIN (partition, frozen host) is given
/// up after about three intervals and another seed is tried.
pub const DEFAULT_PING_INTERVAL: Duration = Duration::from_secs(5);
/// PING interval of the hub services and brokers (roles [`HUB_SERVICE_ROLES`]): a silent
/// server is left after ~6 s instead of ~15 s. While an addon-manager stays on a frozen node,
/// the requests NATS hands it (queue groups: CSRs, renewals, add-on configs) are lost and time
/// out at the requester, and its writes and watches stall; a join during a NATS node
/// partition took 20 s. Few connections (not the 10,000 agents'), so the extra PINGs cost
/// nothing measurable.
pub const HUB_SERVICE_PING_INTERVAL: Duration = Duration::from_secs(2);
/// Connection roles that use [`HUB_SERVICE_PING_INTERVAL`].
pub const HUB_SERVICE_ROLES: [&str; 2] = ["hub", "broker"];
/// Server errors kept for inspection.
const RECENT_ERRORS_CAP: usize = 32;

/// Errors reaching or using the control plane. Each message names the failing step.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error(transparent)]
    Proxy(#[from] ProxyError),
    #[error("NATS down: hub NATS at {server} is not reachable: {reason}")]
    NatsUnreachable { server: String, reason: String },
    #[error("hub TLS failed for {server}: {reason} (is the hub CA in certificate-authority-data?)")]
    HubTls { server: String, reason: String },
    #[error("hub refused the {credential}: {reason}")]
    Unauthorized {
        credential: &'static str,
        reason: String,
    },
    #[error("connecting to {server}: {reason}")]
    Connect { server: String, reason: String },
    #[error("request on {subject} failed: {reason}")]
    Request { subject: String, reason: String },
    #[error("hub answered {subject} with an error: {message}")]
    Remote { subject: String, message: String },
    #[error("invalid CA bundle: {0}")]
    CaBundle(String),
    #[error("JetStream: {0}")]
    JetStream(String),
    #[error("encoding: {0}")]
    Codec(String),
}

impl ControlError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            ControlError::Proxy(p) => p.metric_label(),
            ControlError::NatsUnreachable { .. } => "nats_down",
            ControlError::HubTls { .. } => "hub_tls",
            ControlError::Unauthorized { .. } => "unauthorized",
            ControlError::Connect { .. } => "connect",
            ControlError::Request { .. } => "request",
            ControlError::Remote { .. } => "remote",
            ControlError::CaBundle(_) => "ca_bundle",
            ControlError::JetStream(_) => "jetstream",
            ControlError::Codec(_) => "codec",
        }
    }

    /// True when retrying cannot help without new credentials (re-bootstrap).
    pub fn is_unauthorized(&self) -> bool {
        matches!(self, ControlError::Unauthorized { .. })
    }
}

/// Which credential to present.
#[derive(Clone)]
pub enum Credentials {
    /// Hub services and `tetherctl` (listed in NATS `auth_users`, bypass the callout).
    HubUser { user: String, password: String },
    /// A bootstrap token from the bootstrap kubeconfig.
    Bootstrap(Token),
    /// An accepted cluster: its certificate and key (shared so rotation is picked up on the
    /// next reconnect).
    Cert(Arc<RwLock<CertMaterial>>),
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credentials::HubUser { user, .. } => write!(f, "HubUser({user})"),
            Credentials::Bootstrap(_) => write!(f, "Bootstrap(<masked>)"),
            Credentials::Cert(_) => write!(f, "Cert"),
        }
    }
}

impl Credentials {
    fn label(&self) -> &'static str {
        match self {
            Credentials::HubUser { .. } => "hub user credential",
            Credentials::Bootstrap(_) => {
                "bootstrap credential (unknown or expired bootstrap token)"
            }
            Credentials::Cert(_) => {
                "cluster credentials (certificate expired, revoked, not accepted or signed by another CA)"
            }
        }
    }
}

/// A cluster's certificate, key and identity.
#[derive(Debug)]
pub struct CertMaterial {
    pub cert_pem: String,
    pub key: tether_pki::AgentKey,
    /// The certificate's CN (`system:open-cluster-management:<cluster>:<agent>`).
    pub user: String,
}

/// How to connect.
#[derive(Debug, Clone)]
pub struct ConnectConfig {
    pub endpoint: HubEndpoint,
    pub credentials: Credentials,
    /// `hub`, `tetherctl`, `bootstrap`, `agent`: part of the client name.
    pub role: &'static str,
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
    pub ping_interval: Duration,
}

impl ConnectConfig {
    pub fn new(endpoint: HubEndpoint, credentials: Credentials, role: &'static str) -> Self {
        Self {
            endpoint,
            credentials,
            role,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            ping_interval: if HUB_SERVICE_ROLES.contains(&role) {
                HUB_SERVICE_PING_INTERVAL
            } else {
                DEFAULT_PING_INTERVAL
            },
        }
    }
}

/// A live connection. Dropping it closes the forwarder (if any); the client closes when its
/// last clone is dropped.
pub struct NatsConnection {
    pub client: async_nats::Client,
    /// Per-connection id: inbox prefix `_INBOX.<id>` and client name `tether/<role>/<id>`.
    pub connection_id: String,
    /// Authorization errors the server reported since connecting (e.g. credentials revoked,
    /// expired or permissions violated); owned by the event callback.
    pub auth_errors: Arc<AtomicU64>,
    recent_errors: Arc<Mutex<std::collections::VecDeque<String>>>,
    /// One per seed server when connecting through a forward proxy.
    forwarders: Vec<ProxyForwarder>,
}

impl std::fmt::Debug for NatsConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConnection")
            .field("connection_id", &self.connection_id)
            .field("forwarders", &self.forwarders)
            .finish()
    }
}

impl NatsConnection {
    /// Server errors seen recently (newest last), e.g. "Permissions Violation for Publish ...".
    pub fn recent_errors(&self) -> Vec<String> {
        self.recent_errors
            .lock()
            .map(|q| q.iter().cloned().collect())
            .unwrap_or_default()
    }

    pub fn auth_error_count(&self) -> u64 {
        self.auth_errors.load(Ordering::Relaxed)
    }

    /// A forwarder's last error, if a forwarded connection failed.
    pub fn forwarder_error(&self) -> Option<String> {
        self.forwarders.iter().find_map(|f| f.last_error())
    }
}

/// Verifies the server certificate against a fixed name: the real NATS host, whatever address
/// async-nats thinks it dialled (127.0.0.1 when going through the local forwarder).
#[derive(Debug)]
pub struct FixedNameVerifier {
    inner: Arc<rustls::client::WebPkiServerVerifier>,
    name: ServerName<'static>,
}

impl ServerCertVerifier for FixedNameVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.inner
            .verify_server_cert(end_entity, intermediates, &self.name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// Root store from a PEM bundle.
pub fn root_store(ca_pem: &str) -> Result<Arc<rustls::RootCertStore>, ControlError> {
    let mut roots = rustls::RootCertStore::empty();
    for c in tether_pki::pem_certificates(ca_pem) {
        roots
            .add(c)
            .map_err(|e| ControlError::CaBundle(e.to_string()))?;
    }
    if roots.is_empty() {
        return Err(ControlError::CaBundle("no certificates".into()));
    }
    Ok(Arc::new(roots))
}

fn tls_config(
    endpoint: &HubEndpoint,
    roots: Arc<rustls::RootCertStore>,
) -> Result<rustls::ClientConfig, ControlError> {
    let inner = rustls::client::WebPkiServerVerifier::builder_with_provider(
        roots,
        tether_tls::crypto_provider(),
    )
    .build()
    .map_err(|e| ControlError::CaBundle(e.to_string()))?;
    let name = ServerName::try_from(endpoint.tls_name().to_string()).map_err(|e| {
        ControlError::Connect {
            server: endpoint.server.clone(),
            reason: format!("invalid host name: {e}"),
        }
    })?;
    Ok(tether_tls::client_config_builder()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(FixedNameVerifier { inner, name }))
        .with_no_client_auth())
}

fn jittered_reconnect_delay(attempts: usize) -> Duration {
    if attempts <= 1 {
        return Duration::from_millis(rand::random_range(0..100));
    }
    let exp = 100u64.saturating_mul(1u64 << attempts.min(10));
    let cap = exp.min(5_000);
    Duration::from_millis(cap / 2 + rand::random_range(0..=cap / 2))
}

/// Probes the network path (proxy and NATS port) once, returning a named error. With a seed
/// list, one reachable seed is enough; otherwise the first seed's error is returned.
pub async fn probe(endpoint: &HubEndpoint, timeout: Duration) -> Result<(), ControlError> {
    let mut first_err = None;
    for (host, port) in endpoint.seeds() {
        match probe_one(endpoint, &host, port, timeout).await {
            Ok(()) => return Ok(()),
            Err(e) => {
                tracing::debug!(seed = %format!("{host}:{port}"), error = %e, "NATS seed unreachable");
                first_err.get_or_insert(e);
            }
        }
    }
    Err(first_err.unwrap_or_else(|| ControlError::NatsUnreachable {
        server: endpoint.server.clone(),
        reason: "no seed server".into(),
    }))
}

async fn probe_one(
    endpoint: &HubEndpoint,
    host: &str,
    port: u16,
    timeout: Duration,
) -> Result<(), ControlError> {
    match &endpoint.proxy {
        Some(p) => {
            let dialer = ProxyDialer::new(p.clone(), root_store(&endpoint.ca_pem)?);
            match dialer.dial(host, port).await {
                Ok(_) => Ok(()),
                Err(ProxyError::Refused {
                    status: status @ (500 | 502 | 503 | 504),
                    reason,
                    proxy,
                    ..
                }) => Err(ControlError::NatsUnreachable {
                    server: endpoint.server.clone(),
                    reason: format!("proxy {proxy} answered {status} {reason}"),
                }),
                Err(e) => Err(e.into()),
            }
        }
        None => {
            let addr = format!("{host}:{port}");
            match tokio::time::timeout(timeout, tokio::net::TcpStream::connect(&addr)).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(ControlError::NatsUnreachable {
                    server: endpoint.server.clone(),
                    reason: e.to_string(),
                }),
                Err(_) => Err(ControlError::NatsUnreachable {
                    server: endpoint.server.clone(),
                    reason: format!("timed out after {timeout:?}"),
                }),
            }
        }
    }
}

/// Connects (after a probe). Reconnects later are automatic, with jittered backoff.
pub async fn connect(cfg: &ConnectConfig) -> Result<NatsConnection, ControlError> {
    let endpoint = &cfg.endpoint;
    probe(endpoint, cfg.connect_timeout).await?;
    let roots = root_store(&endpoint.ca_pem)?;
    // One URL per seed: async-nats picks another seed when the one it talks to dies. Through a
    // proxy each seed gets its own local forwarder.
    let mut forwarders = Vec::new();
    let mut urls = Vec::new();
    for (host, port) in endpoint.seeds() {
        match &endpoint.proxy {
            Some(p) => {
                let dialer = ProxyDialer::new(p.clone(), roots.clone());
                let f = ProxyForwarder::start(dialer, host, port)
                    .await
                    .map_err(|e| ControlError::Connect {
                        server: endpoint.server.clone(),
                        reason: format!("local proxy forwarder: {e}"),
                    })?;
                urls.push(format!("tls://{}", f.local_addr()));
                forwarders.push(f);
            }
            None => urls.push(format!("tls://{host}:{port}")),
        }
    }
    let addrs = urls
        .iter()
        .map(|u| u.parse::<async_nats::ServerAddr>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ControlError::Connect {
            server: endpoint.server.clone(),
            reason: format!("invalid server address: {e}"),
        })?;
    let connection_id = auth::new_connection_id();
    let auth_errors = Arc::new(AtomicU64::new(0));
    let recent_errors = Arc::new(Mutex::new(std::collections::VecDeque::new()));

    let mut opts = match &cfg.credentials {
        Credentials::HubUser { user, password } => {
            ConnectOptions::with_user_and_password(user.clone(), password.clone())
        }
        Credentials::Bootstrap(token) => ConnectOptions::with_token(token.expose().to_string()),
        Credentials::Cert(material) => {
            let material = material.clone();
            ConnectOptions::with_auth_callback(move |_nonce| {
                let material = material.clone();
                async move {
                    let m = material
                        .read()
                        .map_err(|_| async_nats::AuthError::new("credential lock poisoned"))?;
                    let pass = CertCredential::build(&m.cert_pem, &m.key, &m.user)
                        .map_err(async_nats::AuthError::new)?;
                    let mut a = async_nats::Auth::new();
                    a.username = Some(m.user.clone());
                    a.password = Some(pass);
                    Ok(a)
                }
            })
        }
    };
    let errs = auth_errors.clone();
    let recent = recent_errors.clone();
    let role = cfg.role;
    opts = opts
        .name(auth::client_name(cfg.role, &connection_id))
        .custom_inbox_prefix(subjects::inbox_prefix(&connection_id))
        .require_tls(true)
        .tls_client_config(tls_config(endpoint, roots)?)
        .ignore_discovered_servers()
        .connection_timeout(cfg.connect_timeout)
        .request_timeout(Some(cfg.request_timeout))
        .ping_interval(cfg.ping_interval)
        .reconnect_delay_callback(jittered_reconnect_delay)
        .event_callback(move |ev| {
            let errs = errs.clone();
            let recent = recent.clone();
            async move {
                match &ev {
                    async_nats::Event::ServerError(
                        async_nats::ServerError::AuthorizationViolation,
                    ) => {
                        errs.fetch_add(1, Ordering::Relaxed);
                    }
                    async_nats::Event::ServerError(async_nats::ServerError::Other(s))
                        if s.to_ascii_lowercase().contains("authorization") =>
                    {
                        errs.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {}
                }
                if let async_nats::Event::ServerError(e) = &ev
                    && let Ok(mut q) = recent.lock()
                {
                    if q.len() >= RECENT_ERRORS_CAP {
                        q.pop_front();
                    }
                    q.push_back(e.to_string());
                }
                tracing::debug!(role, event = %ev, "nats event");
            }
        });
    let client = opts.connect(addrs).await.map_err(|e| {
        let server = endpoint.server.clone();
        let fwd = forwarders.iter().find_map(|f| f.last_error());
        match e.kind() {
            ConnectErrorKind::AuthorizationViolation => ControlError::Unauthorized {
                credential: cfg.credentials.label(),
                reason: "authorization violation".into(),
            },
            ConnectErrorKind::Tls => ControlError::HubTls {
                server,
                reason: e.to_string(),
            },
            ConnectErrorKind::Io | ConnectErrorKind::TimedOut => match fwd {
                Some(f) => ControlError::Connect { server, reason: f },
                None => ControlError::NatsUnreachable {
                    server,
                    reason: e.to_string(),
                },
            },
            _ => ControlError::Connect {
                server,
                reason: e.to_string(),
            },
        }
    })?;
    Ok(NatsConnection {
        client,
        connection_id,
        auth_errors,
        recent_errors,
        forwarders,
    })
}

/// Header carrying an error string on replies.
pub const ERROR_HEADER: &str = "Tether-Error";

/// JSON request/reply with trace context in the headers. A reply with a `Tether-Error` header
/// becomes [`ControlError::Remote`].
pub async fn request_json<Req: serde::Serialize, Resp: serde::de::DeserializeOwned>(
    client: &async_nats::Client,
    subject: String,
    body: &Req,
) -> Result<Resp, ControlError> {
    let payload = serde_json::to_vec(body).map_err(|e| ControlError::Codec(e.to_string()))?;
    let mut headers = async_nats::HeaderMap::new();
    crate::trace::inject_current(&mut headers);
    let msg = client
        .request_with_headers(subject.clone(), headers, payload.into())
        .await
        .map_err(|e| ControlError::Request {
            subject: subject.clone(),
            reason: match e.kind() {
                async_nats::RequestErrorKind::NoResponders => {
                    "no responders (is the hub's addon-manager running?)".into()
                }
                async_nats::RequestErrorKind::TimedOut => {
                    "timed out (no reply; a permissions violation also looks like this)".into()
                }
                _ => e.to_string(),
            },
        })?;
    if let Some(err) = msg.headers.as_ref().and_then(|h| h.get(ERROR_HEADER)) {
        return Err(ControlError::Remote {
            subject,
            message: err.as_str().to_string(),
        });
    }
    serde_json::from_slice(&msg.payload)
        .map_err(|e| ControlError::Codec(format!("reply on {subject}: {e}")))
}
