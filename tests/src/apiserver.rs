//! A stand-in for kube-apiserver (which cannot run here): a real TLS server on 127.0.0.1:0
//! with a certificate for `kubernetes.default.svc` from the test PKI, answering `/version`,
//! `/livez` and `/healthz`, and counting the TLS connections it accepted (so tests can check
//! connection reuse).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tether_tls::Identity;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::Hub;

/// Bearer token the fake API server accepts for `/version`.
pub const KUBE_TOKEN: &str = "kube-token";

/// A running fake API server.
pub struct FakeApiServer {
    pub addr: SocketAddr,
    accepted: Arc<AtomicU64>,
    requests: Arc<AtomicU64>,
}

impl FakeApiServer {
    /// TLS connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    /// HTTP requests answered so far.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    pub async fn start(hub: &Hub) -> anyhow::Result<Self> {
        let leaf = hub.pki.issue(
            &format!("apiserver-{:08x}", rand::random::<u32>()),
            Identity::Hub {
                component: "kube-apiserver".into(),
            },
            &["kubernetes.default.svc", "localhost"],
        )?;
        let tls = tether_tls::TlsMaterial::load(tether_tls::TlsFiles {
            cert: leaf.cert,
            key: leaf.key,
            ca: leaf.ca,
        })?;
        let acceptor =
            tokio_rustls::TlsAcceptor::from(Arc::new(tls.server_config(false, &[b"http/1.1"])?));
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = l.local_addr()?;
        let accepted = Arc::new(AtomicU64::new(0));
        let requests = Arc::new(AtomicU64::new(0));
        let (acc, reqs) = (Arc::clone(&accepted), Arc::clone(&requests));
        tokio::spawn(async move {
            while let Ok((tcp, _)) = l.accept().await {
                let acceptor = acceptor.clone();
                let (acc, reqs) = (Arc::clone(&acc), Arc::clone(&reqs));
                tokio::spawn(async move {
                    let Ok(mut s) = acceptor.accept(tcp).await else {
                        return;
                    };
                    acc.fetch_add(1, Ordering::Relaxed);
                    let mut buf = vec![0u8; 8192];
                    let mut got = Vec::new();
                    loop {
                        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                            match s.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => got.extend_from_slice(&buf[..n]),
                            }
                        }
                        let end = got
                            .windows(4)
                            .position(|w| w == b"\r\n\r\n")
                            .expect("found")
                            + 4;
                        let head = String::from_utf8_lossy(&got[..end]).into_owned();
                        got.drain(..end);
                        reqs.fetch_add(1, Ordering::Relaxed);
                        let (code, body) = answer(&head);
                        let resp = format!(
                            "HTTP/1.1 {code}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                            body.len()
                        );
                        if s.write_all(resp.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Ok(Self {
            addr,
            accepted,
            requests,
        })
    }
}

fn answer(head: &str) -> (&'static str, String) {
    let path = head.split_whitespace().nth(1).unwrap_or("");
    match path {
        "/livez" | "/healthz" | "/readyz" => ("200 OK", "ok".into()),
        "/version" if head.to_ascii_lowercase().contains(&format!("authorization: bearer {KUBE_TOKEN}")) => (
            "200 OK",
            r#"{"major":"1","minor":"32","gitVersion":"v1.32.0-tether-test","gitCommit":"","gitTreeState":"","buildDate":"","goVersion":"","compiler":"","platform":"linux/amd64"}"#.into(),
        ),
        "/version" => ("401 Unauthorized", r#"{"kind":"Status","code":401}"#.into()),
        _ => ("404 Not Found", r#"{"kind":"Status","code":404}"#.into()),
    }
}
