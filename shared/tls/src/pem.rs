//! Reading PEM files, with errors that name the file and what was wrong with it.

use std::path::Path;

use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};

use crate::error::{CertsError, TlsError};

/// Reads every certificate in a PEM file; fails if there is none.
pub fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let data = read(path)?;
    certs_from_pem(&data).map_err(|source| TlsError::Certs {
        path: path.to_owned(),
        source,
    })
}

/// Parses every certificate in PEM text; fails if there is none.
pub fn certs_from_pem(data: &[u8]) -> Result<Vec<CertificateDer<'static>>, CertsError> {
    let certs = CertificateDer::pem_slice_iter(data)
        .collect::<Result<Vec<_>, _>>()
        .map_err(CertsError::Malformed)?;
    if certs.is_empty() {
        return Err(CertsError::Empty);
    }
    Ok(certs)
}

/// Reads the first private key (PKCS#8, SEC1 or PKCS#1) in a PEM file.
pub fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let data = read(path)?;
    key_from_pem(&data).map_err(|reason| TlsError::Pem {
        path: path.to_owned(),
        reason,
    })
}

/// The first private key (PKCS#8, SEC1 or PKCS#1) in PEM text.
pub fn key_from_pem(data: &[u8]) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_slice(data).map_err(|e| format!("no usable private key: {e}"))
}

pub(crate) fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}
