//! Certificates and CA bundles that can be replaced on disk while connections stay up.
//!
//! [`TlsMaterial`] holds the current `(certificate chain, key, CA roots)` behind a lock. The
//! rustls configs it builds do not copy them: their certificate resolver and peer verifier read
//! the current snapshot on every handshake. A watcher task polls the files (content hash, not
//! mtime, so an atomic rename or an in-place write are both seen); a change that fails to parse
//! or whose key does not match its certificate is logged, counted and ignored, so the last good
//! material stays in use and nothing breaks.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use prometheus::{IntCounter, IntGauge, Registry};
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{
    ClientConfig, DigitallySignedStruct, DistinguishedName, RootCertStore, ServerConfig,
    SignatureScheme,
};
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use crate::pem;

/// Default interval between checks of the certificate files.
pub const DEFAULT_RELOAD_INTERVAL: Duration = Duration::from_secs(10);

pub use crate::error::TlsError;

/// Where a component's certificate, key and trusted CA bundle live (the `tls:` section of
/// every service's config).
#[derive(Clone, PartialEq, Eq, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

struct Snapshot {
    key: Arc<CertifiedKey>,
    client_verifier: Arc<dyn ClientCertVerifier>,
    optional_client_verifier: Arc<dyn ClientCertVerifier>,
    server_verifier: Arc<WebPkiServerVerifier>,
    digest: [u8; 32],
    not_after_unix: i64,
}

/// Current TLS material of one component, reloadable from disk.
pub struct TlsMaterial {
    files: TlsFiles,
    current: RwLock<Arc<Snapshot>>,
    reloads: IntCounter,
    reload_failures: IntCounter,
    expiry: IntGauge,
}

impl std::fmt::Debug for TlsMaterial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsMaterial")
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

impl TlsMaterial {
    /// Loads the files; fails with an error naming the bad file.
    pub fn load(files: TlsFiles) -> Result<Arc<Self>, TlsError> {
        let snap = load_snapshot(&files)?;
        let expiry = IntGauge::new(
            "tether_tls_certificate_expiry_timestamp_seconds",
            "Unix time at which the component's own certificate expires.",
        )
        .expect("valid metric");
        expiry.set(snap.not_after_unix);
        Ok(Arc::new(Self {
            files,
            current: RwLock::new(Arc::new(snap)),
            reloads: IntCounter::new(
                "tether_tls_reloads_total",
                "Certificate/CA reloads from disk that took effect.",
            )
            .expect("valid metric"),
            reload_failures: IntCounter::new(
                "tether_tls_reload_failures_total",
                "Changed certificate files that could not be loaded (old material kept).",
            )
            .expect("valid metric"),
            expiry,
        }))
    }

    /// Registers this material's metrics.
    pub fn register(&self, registry: &Registry) -> prometheus::Result<()> {
        registry.register(Box::new(self.reloads.clone()))?;
        registry.register(Box::new(self.reload_failures.clone()))?;
        registry.register(Box::new(self.expiry.clone()))?;
        Ok(())
    }

    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// Number of reloads that took effect so far.
    pub fn reload_count(&self) -> u64 {
        self.reloads.get()
    }

    fn snapshot(&self) -> Arc<Snapshot> {
        self.current.read().expect("tls lock poisoned").clone()
    }

    /// The current end-entity certificate.
    pub fn certificate(&self) -> CertificateDer<'static> {
        self.snapshot().key.cert[0].clone()
    }

    /// Re-reads the files; swaps the material in if their content changed and is valid.
    /// Returns whether a new snapshot took effect.
    pub fn reload_if_changed(&self) -> Result<bool, TlsError> {
        let digest = files_digest(&self.files)?;
        if digest == self.snapshot().digest {
            return Ok(false);
        }
        match load_snapshot(&self.files) {
            Ok(snap) => {
                self.expiry.set(snap.not_after_unix);
                *self.current.write().expect("tls lock poisoned") = Arc::new(snap);
                self.reloads.inc();
                tracing::info!(cert = %self.files.cert.display(), "TLS material reloaded");
                Ok(true)
            }
            Err(e) => {
                self.reload_failures.inc();
                Err(e)
            }
        }
    }

    /// Polls the files every `interval` until `shutdown`.
    pub fn spawn_watcher(self: &Arc<Self>, interval: Duration, shutdown: CancellationToken) {
        let this = Arc::clone(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let this2 = Arc::clone(&this);
                let res = tokio::task::spawn_blocking(move || this2.reload_if_changed()).await;
                if let Ok(Err(e)) = res {
                    tracing::error!(error = %e, "changed TLS files are invalid; keeping the previous certificate");
                }
            }
        });
    }

    /// A TLS 1.3 server config presenting the current certificate. With
    /// `require_client_cert`, clients must present a certificate signed by the CA; otherwise a
    /// certificate is optional (and verified when given) so that token clients can connect.
    pub fn server_config(
        self: &Arc<Self>,
        require_client_cert: bool,
        alpn: &[&[u8]],
    ) -> Result<ServerConfig, TlsError> {
        let verifier = Arc::new(ReloadingClientVerifier {
            material: Arc::clone(self),
            required: require_client_cert,
        });
        let mut cfg = ServerConfig::builder_with_provider(crate::crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_cert_resolver(Arc::new(ReloadingResolver(Arc::clone(self))));
        cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(cfg)
    }

    /// A TLS 1.3 client config presenting the current certificate and verifying servers
    /// against the current CA bundle.
    pub fn client_config(self: &Arc<Self>, alpn: &[&[u8]]) -> Result<ClientConfig, TlsError> {
        let mut cfg = ClientConfig::builder_with_provider(crate::crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| TlsError::Config(e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(ReloadingServerVerifier(Arc::clone(self))))
            .with_client_cert_resolver(Arc::new(ReloadingResolver(Arc::clone(self))));
        cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(cfg)
    }
}

fn files_digest(files: &TlsFiles) -> Result<[u8; 32], TlsError> {
    let mut h = Sha256::new();
    for p in [&files.cert, &files.key, &files.ca] {
        let data = pem::read(p)?;
        h.update((data.len() as u64).to_le_bytes());
        h.update(&data);
    }
    Ok(h.finalize().into())
}

fn load_snapshot(files: &TlsFiles) -> Result<Snapshot, TlsError> {
    let digest = files_digest(files)?;
    let chain = pem::read_certs(&files.cert)?;
    let key_der = pem::read_key(&files.key)?;
    let provider = crate::crypto_provider();
    let signing = provider
        .key_provider
        .load_private_key(key_der)
        .map_err(|e| TlsError::Pem {
            path: files.key.clone(),
            reason: format!("unsupported private key: {e}"),
        })?;
    let key = CertifiedKey::new(chain.clone(), signing);
    key.keys_match().map_err(|e| TlsError::KeyMismatch {
        cert: files.cert.clone(),
        key: files.key.clone(),
        reason: e.to_string(),
    })?;
    let not_after_unix = not_after(&chain[0]).map_err(|source| TlsError::BadCertificate {
        path: files.cert.clone(),
        source,
    })?;
    let roots = Arc::new(load_roots(&files.ca)?);
    let ca_err = |e: &dyn std::fmt::Display| TlsError::Ca {
        path: files.ca.clone(),
        reason: e.to_string(),
    };
    let client_verifier =
        WebPkiClientVerifier::builder_with_provider(Arc::clone(&roots), Arc::clone(&provider))
            .build()
            .map_err(|e| ca_err(&e))?;
    let optional_client_verifier =
        WebPkiClientVerifier::builder_with_provider(Arc::clone(&roots), Arc::clone(&provider))
            .allow_unauthenticated()
            .build()
            .map_err(|e| ca_err(&e))?;
    let server_verifier =
        WebPkiServerVerifier::builder_with_provider(Arc::clone(&roots), Arc::clone(&provider))
            .build()
            .map_err(|e| ca_err(&e))?;
    Ok(Snapshot {
        key: Arc::new(key),
        client_verifier,
        optional_client_verifier,
        server_verifier,
        digest,
        not_after_unix,
    })
}

/// Loads a CA bundle into a root store; fails if no certificate in it is usable.
pub fn load_roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let certs = pem::read_certs(path).map_err(|e| TlsError::Ca {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    let mut roots = RootCertStore::empty();
    let (added, ignored) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(TlsError::Ca {
            path: path.to_owned(),
            reason: format!("none of its {ignored} certificates is a usable trust anchor"),
        });
    }
    Ok(roots)
}

fn not_after(
    cert: &CertificateDer<'_>,
) -> Result<i64, x509_parser::nom::Err<x509_parser::error::X509Error>> {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let (_, x) = X509Certificate::from_der(cert.as_ref())?;
    Ok(x.validity().not_after.timestamp())
}

#[derive(Debug)]
struct ReloadingResolver(Arc<TlsMaterial>);

impl ResolvesServerCert for ReloadingResolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.0.snapshot().key))
    }
}

impl rustls::client::ResolvesClientCert for ReloadingResolver {
    fn resolve(&self, _hints: &[&[u8]], _schemes: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.0.snapshot().key))
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// The signature checks both reloading verifiers pass on unchanged to the current snapshot's
/// verifier (`self.$inner()`): the same three methods of rustls' `ClientCertVerifier` and
/// `ServerCertVerifier`, which share no trait, so a function cannot stand in for them.
macro_rules! delegate_signature_checks {
    ($inner:ident) => {
        delegate_signature_checks!($inner: verify_tls12_signature, verify_tls13_signature);

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.$inner().supported_verify_schemes()
        }
    };
    ($inner:ident: $($method:ident),+) => {
        $(
            fn $method(
                &self,
                message: &[u8],
                cert: &CertificateDer<'_>,
                dss: &DigitallySignedStruct,
            ) -> Result<HandshakeSignatureValid, rustls::Error> {
                self.$inner().$method(message, cert, dss)
            }
        )+
    };
}

#[derive(Debug)]
struct ReloadingClientVerifier {
    material: Arc<TlsMaterial>,
    required: bool,
}

impl ReloadingClientVerifier {
    fn inner(&self) -> Arc<dyn ClientCertVerifier> {
        let s = self.material.snapshot();
        if self.required {
            Arc::clone(&s.client_verifier)
        } else {
            Arc::clone(&s.optional_client_verifier)
        }
    }
}

impl ClientCertVerifier for ReloadingClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        self.required
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.inner()
            .verify_client_cert(end_entity, intermediates, now)
    }

    delegate_signature_checks!(inner);
}

#[derive(Debug)]
struct ReloadingServerVerifier(Arc<TlsMaterial>);

impl ReloadingServerVerifier {
    fn inner(&self) -> Arc<WebPkiServerVerifier> {
        Arc::clone(&self.0.snapshot().server_verifier)
    }
}

impl ServerCertVerifier for ReloadingServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.inner()
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
    }

    delegate_signature_checks!(inner);
}
