//! The rustls crypto provider of every Tether TLS config, and which library encrypts the
//! records.
//!
//! Key exchange, signatures, key loading and randomness always come from aws-lc-rs. The record
//! encryption (each cipher suite's AEAD, which every tunnelled byte pays once per TLS link)
//! comes from whichever of aws-lc-rs and ring is faster on the CPU at hand, because neither
//! wins everywhere: on an Intel Xeon with AVX-512 aws-lc-rs's AES-GCM took 0.14–0.15 CPU-s/GB
//! (seal and open of 256 KiB TLS 1.3 writes) against ring's 0.23–0.25, while on an AMD EPYC with
//! VAES but no AVX-512 ring's VAES/AVX2 code was twice as fast as aws-lc-rs's
//! (docs/benchmarks.md, tuning log items 10 and 11).
//!
//! [`aead_choice`] decides once per process: `TETHER_TLS_AEAD` = `aws-lc-rs` or `ring` forces
//! one; unset or `auto`, a calibration of a few milliseconds seals and opens the same 16 KiB
//! records with both (TLS 1.3 AES-256-GCM, the suite Tether's own links negotiate, alternating,
//! best of several trials) and keeps the faster. Both libraries implement the same suites,
//! so peers never see a difference.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use rustls::crypto::CryptoProvider;

use crate::error::TlsError;

/// The environment variable that forces the AEAD implementation.
pub const AEAD_ENV: &str = "TETHER_TLS_AEAD";

/// Which library encrypts and decrypts TLS records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AeadImpl {
    AwsLcRs,
    Ring,
}

impl AeadImpl {
    /// The name `TETHER_TLS_AEAD` takes and logs show.
    pub fn name(self) -> &'static str {
        match self {
            Self::AwsLcRs => "aws-lc-rs",
            Self::Ring => "ring",
        }
    }

    /// The library's default cipher suites (the same suites in the same order for both).
    fn cipher_suites(self) -> &'static [rustls::SupportedCipherSuite] {
        match self {
            Self::AwsLcRs => rustls::crypto::aws_lc_rs::DEFAULT_CIPHER_SUITES,
            Self::Ring => rustls::crypto::ring::DEFAULT_CIPHER_SUITES,
        }
    }
}

/// How the process's AEAD implementation was chosen.
#[derive(Debug, Clone, PartialEq)]
pub enum ChoiceReason {
    /// `TETHER_TLS_AEAD` named it.
    Forced,
    /// Calibrated at start: GB/s of seal + open of 16 KiB records with each library.
    Measured { aws_lc_rs_gbps: f64, ring_gbps: f64 },
}

/// The AEAD implementation of this process and why.
#[derive(Debug, Clone, PartialEq)]
pub struct AeadChoice {
    pub implementation: AeadImpl,
    pub reason: ChoiceReason,
}

impl std::fmt::Display for AeadChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.reason {
            ChoiceReason::Forced => {
                write!(f, "{} ({AEAD_ENV})", self.implementation.name())
            }
            ChoiceReason::Measured {
                aws_lc_rs_gbps,
                ring_gbps,
            } => write!(
                f,
                "{} (measured seal+open of 16 KiB records: aws-lc-rs {aws_lc_rs_gbps:.2} GB/s, \
                 ring {ring_gbps:.2} GB/s)",
                self.implementation.name()
            ),
        }
    }
}

/// Reads a `TETHER_TLS_AEAD` value: `None` (unset, empty or `auto`) means calibrate.
pub fn parse_aead(value: Option<&str>) -> Result<Option<AeadImpl>, TlsError> {
    match value.map(str::trim) {
        None | Some("") | Some("auto") => Ok(None),
        Some("aws-lc-rs") => Ok(Some(AeadImpl::AwsLcRs)),
        Some("ring") => Ok(Some(AeadImpl::Ring)),
        Some(other) => Err(TlsError::Config(format!(
            "{AEAD_ENV}={other:?}: expected `auto`, `aws-lc-rs` or `ring`"
        ))),
    }
}

fn env_value() -> Option<String> {
    std::env::var(AEAD_ENV).ok()
}

/// This process's choice, made on first use (see the module docs). An invalid
/// `TETHER_TLS_AEAD` calibrates here; [`crate::install_default_crypto`], which every `main`
/// calls first, reports it as an error.
pub fn aead_choice() -> &'static AeadChoice {
    static CHOICE: OnceLock<AeadChoice> = OnceLock::new();
    CHOICE.get_or_init(|| match parse_aead(env_value().as_deref()) {
        Ok(Some(implementation)) => AeadChoice {
            implementation,
            reason: ChoiceReason::Forced,
        },
        Ok(None) | Err(_) => calibrate(),
    })
}

/// Checks `TETHER_TLS_AEAD` without choosing.
pub(crate) fn check_env() -> Result<(), TlsError> {
    parse_aead(env_value().as_deref()).map(|_| ())
}

/// aws-lc-rs's provider with the record encryption of `aead`.
pub fn provider_with(aead: AeadImpl) -> CryptoProvider {
    CryptoProvider {
        cipher_suites: aead.cipher_suites().to_vec(),
        ..rustls::crypto::aws_lc_rs::default_provider()
    }
}

/// The provider every Tether TLS config uses: [`provider_with`] the [`aead_choice`].
pub fn crypto_provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    Arc::clone(PROVIDER.get_or_init(|| Arc::new(provider_with(aead_choice().implementation))))
}

/// Records per calibration trial (16 KiB each, the largest TLS record).
const CALIBRATION_RECORDS: u64 = 16;
/// Trials per library, alternating; the fastest of each counts.
const CALIBRATION_TRIALS: usize = 4;
const RECORD_BYTES: usize = 16 * 1024;

/// Seals and opens the same records with both libraries and picks the faster; aws-lc-rs when a
/// measurement fails (it cannot with these fixed inputs) or they tie.
pub fn calibrate() -> AeadChoice {
    let mut best = [Duration::MAX; 2];
    for _ in 0..CALIBRATION_TRIALS {
        for (i, aead) in [AeadImpl::AwsLcRs, AeadImpl::Ring].into_iter().enumerate() {
            if let Some(t) = seal_open(aead, CALIBRATION_RECORDS) {
                best[i] = best[i].min(t);
            }
        }
    }
    let gbps = |t: Duration| {
        if t == Duration::MAX || t.is_zero() {
            0.0
        } else {
            (CALIBRATION_RECORDS as usize * RECORD_BYTES) as f64 / t.as_secs_f64() / 1e9
        }
    };
    let (aws_lc_rs_gbps, ring_gbps) = (gbps(best[0]), gbps(best[1]));
    AeadChoice {
        implementation: if ring_gbps > aws_lc_rs_gbps {
            AeadImpl::Ring
        } else {
            AeadImpl::AwsLcRs
        },
        reason: ChoiceReason::Measured {
            aws_lc_rs_gbps,
            ring_gbps,
        },
    }
}

/// Time to seal and open `records` 16 KiB TLS 1.3 records with `aead`'s AES-256-GCM, through
/// rustls's own record encrypter and decrypter (the code path of a live connection).
fn seal_open(aead: AeadImpl, records: u64) -> Option<Duration> {
    use rustls::crypto::cipher::{
        AeadKey, InboundOpaqueMessage, Iv, OutboundChunks, OutboundPlainMessage,
    };
    use rustls::{CipherSuite, ContentType, ProtocolVersion, SupportedCipherSuite};
    let suite = aead.cipher_suites().iter().find_map(|s| match *s {
        SupportedCipherSuite::Tls13(s)
            if s.common.suite == CipherSuite::TLS13_AES_256_GCM_SHA384 =>
        {
            Some(s)
        }
        _ => None,
    })?;
    // A fixed key and IV: the input only has to be the same for both libraries.
    let mut enc = suite
        .aead_alg
        .encrypter(AeadKey::from([0x42; 32]), Iv::new([7; 12]));
    let mut dec = suite
        .aead_alg
        .decrypter(AeadKey::from([0x42; 32]), Iv::new([7; 12]));
    let plain = vec![0x5a_u8; RECORD_BYTES];
    let start = Instant::now();
    for seq in 0..records {
        let msg = OutboundPlainMessage {
            typ: ContentType::ApplicationData,
            version: ProtocolVersion::TLSv1_2,
            payload: OutboundChunks::Single(&plain),
        };
        // `encode` writes the 5-byte record header in front of the ciphertext.
        let mut wire = enc.encrypt(msg, seq).ok()?.encode();
        let opened = dec
            .decrypt(
                InboundOpaqueMessage::new(
                    ContentType::ApplicationData,
                    ProtocolVersion::TLSv1_2,
                    wire.get_mut(5..)?,
                ),
                seq,
            )
            .ok()?;
        // The decrypter strips TLS 1.3's inner content-type byte: the data comes back whole.
        if opened.payload.len() != RECORD_BYTES {
            return None;
        }
    }
    Some(start.elapsed())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_from(provider: &CryptoProvider, aead: AeadImpl) -> bool {
        let theirs = aead.cipher_suites();
        provider.cipher_suites.len() == theirs.len()
            && provider
                .cipher_suites
                .iter()
                .zip(theirs)
                .all(|(a, b)| match (a, b) {
                    (
                        rustls::SupportedCipherSuite::Tls13(a),
                        rustls::SupportedCipherSuite::Tls13(b),
                    ) => std::ptr::eq(*a, *b),
                    (
                        rustls::SupportedCipherSuite::Tls12(a),
                        rustls::SupportedCipherSuite::Tls12(b),
                    ) => std::ptr::eq(*a, *b),
                    _ => false,
                })
    }

    #[test]
    fn the_variable_forces_a_library_and_bad_values_are_named() {
        assert_eq!(parse_aead(None).unwrap(), None);
        assert_eq!(parse_aead(Some("auto")).unwrap(), None);
        assert_eq!(parse_aead(Some(" ring ")).unwrap(), Some(AeadImpl::Ring));
        assert_eq!(
            parse_aead(Some("aws-lc-rs")).unwrap(),
            Some(AeadImpl::AwsLcRs)
        );
        let err = parse_aead(Some("openssl")).unwrap_err().to_string();
        assert!(
            err.contains("TETHER_TLS_AEAD") && err.contains("\"openssl\""),
            "{err}"
        );
        assert!(err.contains("aws-lc-rs") && err.contains("ring"), "{err}");
    }

    #[test]
    fn providers_take_the_record_encryption_of_the_chosen_library_only() {
        for aead in [AeadImpl::AwsLcRs, AeadImpl::Ring] {
            let p = provider_with(aead);
            assert!(is_from(&p, aead), "{aead:?}");
            let other = match aead {
                AeadImpl::AwsLcRs => AeadImpl::Ring,
                AeadImpl::Ring => AeadImpl::AwsLcRs,
            };
            assert!(!is_from(&p, other), "{aead:?}");
            // Key exchange stays aws-lc-rs's (its post-quantum hybrid group first).
            let aws = rustls::crypto::aws_lc_rs::default_provider();
            let groups =
                |p: &CryptoProvider| -> Vec<_> { p.kx_groups.iter().map(|g| g.name()).collect() };
            assert_eq!(groups(&p), groups(&aws));
        }
    }

    #[test]
    fn calibration_measures_both_libraries_and_keeps_the_faster() {
        let choice = calibrate();
        let ChoiceReason::Measured {
            aws_lc_rs_gbps,
            ring_gbps,
        } = choice.reason
        else {
            panic!("calibrate() measures: {choice:?}");
        };
        // Both round trips succeeded (a failure reads 0) at a rate any CPU reaches.
        assert!(aws_lc_rs_gbps > 0.01 && ring_gbps > 0.01, "{choice}");
        let faster = if ring_gbps > aws_lc_rs_gbps {
            AeadImpl::Ring
        } else {
            AeadImpl::AwsLcRs
        };
        assert_eq!(choice.implementation, faster, "{choice}");
        assert!(choice.to_string().contains("GB/s"), "{choice}");
        // Shown with `--nocapture`: which library this machine's records would use.
        eprintln!("TLS record encryption: {choice}");
    }

    /// A client on one library's records and a server on the other's agree on every byte.
    #[test]
    fn mixed_libraries_interoperate() {
        use std::io::{Read as _, Write as _};
        let (ca, leaf, key) = ca_and_leaf();
        for (client_aead, server_aead) in [
            (AeadImpl::Ring, AeadImpl::AwsLcRs),
            (AeadImpl::AwsLcRs, AeadImpl::Ring),
        ] {
            let mut roots = rustls::RootCertStore::empty();
            roots.add(ca.clone()).unwrap();
            let client_cfg =
                rustls::ClientConfig::builder_with_provider(Arc::new(provider_with(client_aead)))
                    .with_safe_default_protocol_versions()
                    .unwrap()
                    .with_root_certificates(roots)
                    .with_no_client_auth();
            let server_cfg =
                rustls::ServerConfig::builder_with_provider(Arc::new(provider_with(server_aead)))
                    .with_safe_default_protocol_versions()
                    .unwrap()
                    .with_no_client_auth()
                    .with_single_cert(vec![leaf.clone()], key.clone_key())
                    .unwrap();
            let mut client = rustls::ClientConnection::new(
                Arc::new(client_cfg),
                "localhost".try_into().unwrap(),
            )
            .unwrap();
            // The payload is written before the handshake: buffer all of it.
            client.set_buffer_limit(None);
            let mut server = rustls::ServerConnection::new(Arc::new(server_cfg)).unwrap();
            let payload: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
            client.writer().write_all(&payload).unwrap();
            let mut got = Vec::new();
            for _ in 0..100 {
                let mut wire = Vec::new();
                while client.wants_write() {
                    client.write_tls(&mut wire).unwrap();
                }
                let mut rd = &wire[..];
                let mut buf = [0u8; 65536];
                while !rd.is_empty() {
                    server.read_tls(&mut rd).unwrap();
                    server.process_new_packets().unwrap();
                    loop {
                        match server.reader().read(&mut buf) {
                            Ok(0) => break,
                            Ok(n) => got.extend_from_slice(&buf[..n]),
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                            Err(e) => panic!("{e}"),
                        }
                    }
                }
                let mut back = Vec::new();
                while server.wants_write() {
                    server.write_tls(&mut back).unwrap();
                }
                let mut rd = &back[..];
                while !rd.is_empty() {
                    client.read_tls(&mut rd).unwrap();
                    client.process_new_packets().unwrap();
                }
                if got.len() == payload.len() {
                    break;
                }
            }
            assert_eq!(
                got, payload,
                "{client_aead:?} client, {server_aead:?} server"
            );
            assert_eq!(
                client.negotiated_cipher_suite().map(|s| s.suite()),
                Some(rustls::CipherSuite::TLS13_AES_256_GCM_SHA384)
            );
        }
    }

    /// A CA certificate and a `localhost` leaf it signed, with the leaf's key.
    fn ca_and_leaf() -> (
        rustls::pki_types::CertificateDer<'static>,
        rustls::pki_types::CertificateDer<'static>,
        rustls::pki_types::PrivateKeyDer<'static>,
    ) {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let issuer = rcgen::Issuer::new(ca_params, ca_key);
        let key = rcgen::KeyPair::generate().unwrap();
        let leaf = rcgen::CertificateParams::new(vec!["localhost".into()])
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        (
            ca.der().clone(),
            leaf.der().clone(),
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
    }
}
