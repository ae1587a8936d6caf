//! TLS for every Tether connection: mTLS configs, identities carried in certificates, hot
//! reload from disk. Certificates are issued by `tether_pki::HubCa` (the hub, `tetherctl`, and
//! tests alike).
//!
//! Layout:
//! - [`identity`]: who a peer is, read from its certificate's subject CN (OCM conventions for
//!   managed-cluster agents, `tether:client:<name>` / `tether:broker:<id>` for hub components).
//! - [`error`]: [`TlsError`], naming the file or the reason.
//! - [`pem`]: reading certificate chains, keys and CA bundles, with errors naming the file.
//! - [`reload`]: [`reload::TlsMaterial`] — the current cert/key/CA, re-read from disk when the
//!   files change; the rustls configs built from it resolve the certificate and verify peers
//!   through it on every handshake, so a rotation never touches live connections.

pub mod error;
pub mod identity;
pub mod pem;
pub mod reload;

pub use identity::{Identity, IdentityError};
pub use reload::{TlsError, TlsFiles, TlsMaterial};

/// ALPN protocol of the broker↔agent tunnel (HTTP/2 with Tether's stream semantics).
pub const ALPN_TUNNEL: &[u8] = b"tether-tunnel/1";
/// ALPN protocol of broker→broker relay connections (the dialling broker is the HTTP/2 client).
pub const ALPN_RELAY: &[u8] = b"tether-relay/1";

/// Installs ring as the process-wide rustls crypto provider. Idempotent; call at the start of
/// every `main` and test harness (two enabled providers make rustls refuse to pick one).
pub fn install_default_crypto() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Lower-case hex SHA-256 of `bytes`: config and file fingerprints, token hashes.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}
