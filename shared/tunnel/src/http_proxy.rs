//! Shared pieces of the HTTP service proxy (broker front end and agent end).
//!
//! Both ends are a hyper server whose requests are forwarded by a pooled hyper client:
//! [`strip_hop_by_hop`] cleans a request or response head for the next hop (keeping an
//! upgrade), and [`forward`] sends a request and, on `101 Switching Protocols`, joins the two
//! upgraded connections (watches stream as ordinary bodies; exec/attach/port-forward over
//! SPDY or WebSocket are upgrades).

use http::header::{self, HeaderMap, HeaderName};
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::Connect;
use hyper_util::rt::TokioIo;

/// Headers that only concern one hop (RFC 9110 §7.6.1), besides those `Connection` names.
const HOP_BY_HOP: [&str; 7] = [
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
];

/// Whether a request asks for a protocol upgrade (`Connection: upgrade` + `Upgrade`).
pub fn is_upgrade(h: &HeaderMap) -> bool {
    h.contains_key(header::UPGRADE)
        && h.get_all(header::CONNECTION).iter().any(|v| {
            v.to_str()
                .map(|s| {
                    s.split(',')
                        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
                })
                .unwrap_or(false)
        })
}

/// Removes hop-by-hop headers; an upgrade keeps `Connection: upgrade` and `Upgrade`.
pub fn strip_hop_by_hop(h: &mut HeaderMap) {
    let upgrade = is_upgrade(h);
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|s| s.split(',').map(|t| t.trim().to_ascii_lowercase()))
        .filter(|t| !(upgrade && t == "upgrade"))
        .filter_map(|t| HeaderName::from_bytes(t.as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in HOP_BY_HOP {
        h.remove(n);
    }
    if upgrade {
        h.insert(
            header::CONNECTION,
            header::HeaderValue::from_static("upgrade"),
        );
    } else {
        h.remove(header::CONNECTION);
        h.remove(header::UPGRADE);
    }
}

/// Sends `req` with `client` (an upgrade request with `upgrade_client`, which must speak
/// HTTP/1.1). On `101` the caller's connection (taken from `req` before sending) and the
/// upstream's are joined in a task until either side closes.
pub async fn forward<C>(
    client: &Client<C, Incoming>,
    upgrade_client: &Client<C, Incoming>,
    mut req: Request<Incoming>,
) -> Result<Response<Incoming>, hyper_util::client::legacy::Error>
where
    C: Connect + Clone + Send + Sync + 'static,
{
    if !is_upgrade(req.headers()) {
        return client.request(req).await;
    }
    let downstream = hyper::upgrade::on(&mut req);
    let mut resp = upgrade_client.request(req).await?;
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let upstream = hyper::upgrade::on(&mut resp);
        tokio::spawn(async move {
            match tokio::try_join!(downstream, upstream) {
                Ok((d, u)) => {
                    let _ =
                        tokio::io::copy_bidirectional(&mut TokioIo::new(d), &mut TokioIo::new(u))
                            .await;
                }
                Err(e) => tracing::debug!(error = %e, "upgrade did not complete"),
            }
        });
    }
    Ok(resp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_go_upgrades_stay() {
        let mut h = HeaderMap::new();
        h.insert("connection", "keep-alive, x-secret".parse().unwrap());
        h.insert("x-secret", "1".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert("accept", "application/json".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert!(h.get("x-secret").is_none() && h.get("keep-alive").is_none());
        assert!(h.get("connection").is_none());
        assert_eq!(h["accept"], "application/json");
        let mut h = HeaderMap::new();
        h.insert("connection", "Upgrade".parse().unwrap());
        h.insert("upgrade", "websocket".parse().unwrap());
        assert!(is_upgrade(&h));
        strip_hop_by_hop(&mut h);
        assert_eq!(h["connection"], "upgrade");
        assert_eq!(h["upgrade"], "websocket");
    }
}
