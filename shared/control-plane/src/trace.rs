//! W3C trace context (`traceparent`) carried in NATS message headers.
//!
//! Every request the agents and `tetherctl` send carries a `traceparent` header; the hub reads it
//! back ([`extract`]) and records the trace id on its spans and on the events it publishes, so a
//! registration can be followed from agent to hub. When OpenTelemetry is wired (tether-telemetry)
//! the same header names are what its propagator reads and writes.

use async_nats::HeaderMap;

pub use tether_telemetry::propagation::{TRACEPARENT, TRACESTATE};

/// A parsed `traceparent`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: String,
    pub span_id: String,
    pub sampled: bool,
}

impl TraceParent {
    pub fn new_root() -> Self {
        Self {
            trace_id: hex::encode(rand::random::<[u8; 16]>()),
            span_id: hex::encode(rand::random::<[u8; 8]>()),
            sampled: true,
        }
    }

    /// A child span in the same trace.
    pub fn child(&self) -> Self {
        Self {
            trace_id: self.trace_id.clone(),
            span_id: hex::encode(rand::random::<[u8; 8]>()),
            sampled: self.sampled,
        }
    }

    pub fn header_value(&self) -> String {
        format!(
            "00-{}-{}-{}",
            self.trace_id,
            self.span_id,
            if self.sampled { "01" } else { "00" }
        )
    }

    pub fn parse(s: &str) -> Option<Self> {
        let mut it = s.trim().split('-');
        let (Some("00"), Some(t), Some(sp), Some(f), None) =
            (it.next(), it.next(), it.next(), it.next(), it.next())
        else {
            return None;
        };
        let hexok = |x: &str, n: usize| x.len() == n && x.bytes().all(|b| b.is_ascii_hexdigit());
        (hexok(t, 32) && hexok(sp, 16) && hexok(f, 2)).then(|| Self {
            trace_id: t.to_string(),
            span_id: sp.to_string(),
            sampled: f == "01",
        })
    }
}

tokio::task_local! {
    /// The trace the current task works for; requests made inside carry it.
    pub static CURRENT: TraceParent;
}

/// Adds a `traceparent` header: a child of the task's current trace, or a new root.
pub fn inject(headers: &mut HeaderMap) {
    let tp = CURRENT
        .try_with(|c| c.child())
        .unwrap_or_else(|_| TraceParent::new_root());
    headers.insert(TRACEPARENT, tp.header_value().as_str());
}

/// Adds the W3C context of the current `tracing` span (OpenTelemetry, when export is on);
/// falls back to [`inject`] so every request carries a `traceparent`.
pub fn inject_current(headers: &mut HeaderMap) {
    let map = tether_telemetry::propagation::inject(&tracing::Span::current());
    if map.contains_key(TRACEPARENT) {
        for (k, v) in map {
            headers.insert(k.as_str(), v.as_str());
        }
    } else {
        inject(headers);
    }
}

/// Makes `span` a child of the trace context carried in `headers` (when export is on).
pub fn set_parent(span: &tracing::Span, headers: Option<&HeaderMap>) {
    let Some(h) = headers else { return };
    let pairs: Vec<(String, String)> = [TRACEPARENT, TRACESTATE]
        .iter()
        .filter_map(|k| h.get(*k).map(|v| (k.to_string(), v.as_str().to_string())))
        .collect();
    tether_telemetry::propagation::set_parent(span, pairs);
}

/// Reads the `traceparent` header, if present and well formed.
pub fn extract(headers: Option<&HeaderMap>) -> Option<TraceParent> {
    headers?
        .get(TRACEPARENT)
        .and_then(|v| TraceParent::parse(v.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn round_trip() {
        let t = TraceParent::new_root();
        assert_eq!(TraceParent::parse(&t.header_value()), Some(t.clone()));
        let mut h = HeaderMap::new();
        inject(&mut h);
        assert!(extract(Some(&h)).is_some());
        assert!(TraceParent::parse("01-xx").is_none());
    }
}
