//! The error of loading TLS material, shared by `pem` and `reload`.

use std::path::PathBuf;

/// Errors loading TLS material; each names the file or the reason.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Pem { path: PathBuf, reason: String },
    #[error("{path}: bad certificate: {source}")]
    BadCertificate {
        path: PathBuf,
        #[source]
        source: x509_parser::nom::Err<x509_parser::error::X509Error>,
    },
    #[error("{path}: {source}")]
    Certs {
        path: PathBuf,
        #[source]
        source: CertsError,
    },
    #[error("certificate {cert} does not match key {key}: {reason}")]
    KeyMismatch {
        cert: PathBuf,
        key: PathBuf,
        reason: String,
    },
    #[error("CA bundle {path}: {reason}")]
    Ca { path: PathBuf, reason: String },
    #[error("TLS configuration error: {0}")]
    Config(String),
}

/// Why PEM text holds no usable certificate.
#[derive(Debug, thiserror::Error)]
pub enum CertsError {
    #[error("malformed PEM certificate: {0}")]
    Malformed(#[source] rustls::pki_types::pem::Error),
    #[error("no CERTIFICATE block found")]
    Empty,
}
