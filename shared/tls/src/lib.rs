//! TLS for every Tether connection: mTLS configs, identities carried in certificates, hot
//! reload from disk. Certificates are issued by `tether_pki::HubCa` (the hub, `tetherctl`, and
//! tests alike).
//!
//! Layout:
//! - [`identity`]: who a peer is, read from its certificate's subject CN (OCM conventions for
//!   managed-cluster agents, `tether:client:<name>` / `tether:broker:<id>` for hub components).
//! - [`error`]: [`TlsError`], naming the file or the reason.
//! - [`pem`]: reading certificate chains, keys and CA bundles, with errors naming the file.
//! - [`provider`]: the crypto provider of every config: aws-lc-rs, with the record encryption of
//!   aws-lc-rs or ring, whichever is faster on this CPU (or `TETHER_TLS_AEAD`).
//! - [`reload`]: [`reload::TlsMaterial`] — the current cert/key/CA, re-read from disk when the
//!   files change; the rustls configs built from it resolve the certificate and verify peers
//!   through it on every handshake, so a rotation never touches live connections.

pub mod error;
pub mod identity;
pub mod pem;
pub mod provider;
pub mod reload;

use rustls::crypto::CryptoProvider;

pub use identity::{Identity, IdentityError};
pub use provider::{AeadChoice, AeadImpl, aead_choice, crypto_provider};
pub use reload::{TlsError, TlsFiles, TlsMaterial};

/// ALPN protocol of the broker↔agent tunnel (HTTP/2 with Tether's stream semantics).
pub const ALPN_TUNNEL: &[u8] = b"tether-tunnel/1";
/// ALPN protocol of the broker↔agent tunnel's own multiplexer (`tether_tunnel::mux`), offered
/// before `tether-tunnel/1`.
pub const ALPN_TUNNEL_V2: &[u8] = b"tether-tunnel/2";
/// ALPN protocol of a client's dials on the broker's client TLS listener with the frames of
/// `tether-tunnel/2` (the SDK, `tetherctl proxy connect`), offered before `h2`.
pub const ALPN_DIAL: &[u8] = b"tether-dial/1";
/// ALPN protocol of broker→broker relay connections (the dialling broker is the HTTP/2 client).
pub const ALPN_RELAY: &[u8] = b"tether-relay/1";
/// ALPN protocol of broker→broker relay connections on the frames of `tether-tunnel/2` (the
/// dialling broker opens the streams), offered before `tether-relay/1`.
pub const ALPN_RELAY_V2: &[u8] = b"tether-relay/2";

/// A rustls client-config builder on [`crypto_provider`] with rustls' safe default protocol
/// versions (TLS 1.3 and 1.2): the start of every client config Tether builds outside
/// [`reload`] (which pins TLS 1.3 for its own links).
pub fn client_config_builder() -> rustls::ConfigBuilder<rustls::ClientConfig, rustls::WantsVerifier>
{
    rustls::ClientConfig::builder_with_provider(crypto_provider())
        .with_safe_default_protocol_versions()
        // Fails only for a provider without cipher suites for those versions; both libraries'
        // suites have both (the unit test below builds it).
        .expect("aws-lc-rs's and ring's cipher suites cover TLS 1.3 and TLS 1.2")
}

/// Installs [`crypto_provider`] as the process-wide rustls default and returns how its record
/// encryption was chosen (log it once tracing is up). Idempotent; call at the start of every
/// `main` and test harness: with two providers compiled in, rustls refuses to pick one for
/// configs built by dependencies (kube, async-nats, tonic's server) that ask for the process
/// default. Fails only for an invalid `TETHER_TLS_AEAD`, naming the value.
pub fn install_default_crypto() -> Result<&'static AeadChoice, TlsError> {
    provider::check_env()?;
    let _ = CryptoProvider::install_default((*crypto_provider()).clone());
    Ok(provider::aead_choice())
}

/// Lower-case hex SHA-256 of `bytes`: config and file fingerprints, token hashes.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

#[cfg(test)]
mod provider_tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn client_configs_use_tethers_provider_and_offer_tls13_and_tls12() {
        let cfg = client_config_builder()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        assert!(Arc::ptr_eq(cfg.crypto_provider(), &crypto_provider()));
        let aws = rustls::crypto::aws_lc_rs::default_provider();
        let names =
            |p: &CryptoProvider| -> Vec<_> { p.cipher_suites.iter().map(|s| s.suite()).collect() };
        assert_eq!(names(cfg.crypto_provider()), names(&aws));
        let versions: Vec<_> = cfg
            .crypto_provider()
            .cipher_suites
            .iter()
            .map(|s| s.version().version)
            .collect();
        assert!(versions.contains(&rustls::ProtocolVersion::TLSv1_3));
        assert!(versions.contains(&rustls::ProtocolVersion::TLSv1_2));
    }
}
