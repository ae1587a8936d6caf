//! Typed configuration loading for Tether services.
//!
//! A config file is YAML (JSON is valid YAML). Loading happens in two steps so that every error
//! names the field that is wrong:
//! 1. YAML → a generic JSON value (syntax errors carry the parser's line/column);
//! 2. value → the typed struct through `serde_path_to_error`, so a type error or an unknown field
//!    (structs use `#[serde(deny_unknown_fields)]`) is reported as e.g.
//!    `tunnel.keepalive_interval: invalid type…`;
//! 3. [`Validate::validate`] checks what types cannot (ranges, cross-field rules) and returns a
//!    [`ConfigError::Invalid`] naming the field.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;

/// Why a configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path} is not valid YAML: {message}")]
    Syntax { path: PathBuf, message: String },
    #[error("config file {path}: field `{field}`: {message}")]
    Field {
        path: PathBuf,
        field: String,
        message: String,
    },
    #[error("invalid config: field `{field}`: {message}")]
    Invalid { field: String, message: String },
}

impl ConfigError {
    /// A validation error for `field`.
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Invalid {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Checks that a deserialised config makes sense as a whole.
pub trait Validate {
    fn validate(&self) -> Result<(), ConfigError>;
}

/// Reads, parses and validates a YAML config file.
pub fn load<T: DeserializeOwned + Validate>(path: &Path) -> Result<T, ConfigError> {
    load_with_bytes(path).map(|(cfg, _)| cfg)
}

/// [`load`], also returning the bytes the config was parsed from: a caller that watches the
/// file compares later reads with these, never with a second read that may already hold a
/// newer file.
pub fn load_with_bytes<T: DeserializeOwned + Validate>(
    path: &Path,
) -> Result<(T, Vec<u8>), ConfigError> {
    let read_error = |source| ConfigError::Read {
        path: path.to_owned(),
        source,
    };
    let bytes = std::fs::read(path).map_err(read_error)?;
    let text = std::str::from_utf8(&bytes)
        .map_err(|e| read_error(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))?;
    let cfg = from_str(text, path)?;
    Ok((cfg, bytes))
}

/// Parses and validates YAML text; `origin` is only used in error messages.
pub fn from_str<T: DeserializeOwned + Validate>(
    text: &str,
    origin: &Path,
) -> Result<T, ConfigError> {
    let value: serde_json::Value = if text.trim().is_empty() {
        serde_json::Value::Object(Default::default())
    } else {
        serde_saphyr::from_str(text).map_err(|e| ConfigError::Syntax {
            path: origin.to_owned(),
            message: e.to_string(),
        })?
    };
    let cfg: T = serde_path_to_error::deserialize(value).map_err(|e| {
        let field = e.path().to_string();
        ConfigError::Field {
            path: origin.to_owned(),
            field: if field == "." { "(root)".into() } else { field },
            message: e.into_inner().to_string(),
        }
    })?;
    cfg.validate()?;
    Ok(cfg)
}

/// Serde helpers for durations written as human-readable strings ("5s", "250ms", "1h").
pub mod duration {
    pub use humantime_serde::{deserialize, serialize};

    /// Parses a human-readable duration ("200ms", "2s", "24h", "90d"), e.g. a command-line
    /// flag; the error names the text and what is wrong with it.
    pub fn parse(
        s: &str,
    ) -> Result<std::time::Duration, humantime_serde::re::humantime::DurationError> {
        humantime_serde::re::humantime::parse_duration(s.trim())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    use std::time::Duration;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Inner {
        #[serde(with = "duration")]
        timeout: Duration,
        port: u16,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Cfg {
        name: String,
        inner: Inner,
    }

    impl Validate for Cfg {
        fn validate(&self) -> Result<(), ConfigError> {
            if self.inner.port == 0 {
                return Err(ConfigError::invalid("inner.port", "must not be 0"));
            }
            Ok(())
        }
    }

    fn parse(s: &str) -> Result<Cfg, ConfigError> {
        from_str(s, Path::new("test.yaml"))
    }

    #[test]
    fn load_with_bytes_returns_what_it_parsed_and_names_a_file_it_cannot_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.yaml");
        let text = "name: a\ninner:\n  timeout: 1s\n  port: 8\n";
        std::fs::write(&path, text).unwrap();
        let (c, bytes): (Cfg, _) = load_with_bytes(&path).unwrap();
        assert_eq!(c.name, "a");
        assert_eq!(bytes, text.as_bytes());

        std::fs::write(&path, b"name: \xff\n").unwrap();
        let e = load::<Cfg>(&path).unwrap_err().to_string();
        assert!(e.contains("agent.yaml") && e.contains("utf-8"), "{e}");
    }

    #[test]
    fn parses_valid() {
        let c = parse("name: a\ninner:\n  timeout: 250ms\n  port: 8\n").unwrap();
        assert_eq!(c.inner.timeout, Duration::from_millis(250));
        assert_eq!(c.name, "a");
    }

    #[test]
    fn unknown_field_is_named() {
        let e = parse("name: a\ninner:\n  timeout: 1s\n  port: 8\n  prot: 9\n").unwrap_err();
        let m = e.to_string();
        assert!(m.contains("inner") && m.contains("prot"), "{m}");
    }

    #[test]
    fn wrong_type_is_named() {
        let e = parse("name: a\ninner:\n  timeout: soon\n  port: 8\n").unwrap_err();
        assert!(e.to_string().contains("inner.timeout"), "{e}");
    }

    #[test]
    fn validation_names_field() {
        let e = parse("name: a\ninner:\n  timeout: 1s\n  port: 0\n").unwrap_err();
        assert!(e.to_string().contains("inner.port"), "{e}");
    }

    #[test]
    fn syntax_error_is_reported() {
        let e = parse("name: [a\n").unwrap_err();
        assert!(matches!(e, ConfigError::Syntax { .. }), "{e}");
    }
}
