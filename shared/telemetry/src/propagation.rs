//! W3C trace-context propagation over string key/value carriers.
//!
//! Used for HTTP/2 request headers on the tunnel, gRPC metadata and NATS message headers: the
//! sender calls [`inject`] with the current span, the receiver calls [`set_parent`] on its own
//! span with the received pairs.

use std::collections::HashMap;

use opentelemetry::propagation::{Extractor, Injector};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Header carrying the W3C trace context.
pub const TRACEPARENT: &str = "traceparent";
/// Header carrying vendor-specific trace state beside [`TRACEPARENT`].
pub const TRACESTATE: &str = "tracestate";

/// The trace-context headers for `span` (empty when tracing export is off).
pub fn inject(span: &tracing::Span) -> HashMap<String, String> {
    let cx = span.context();
    let mut map = HashMap::new();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&cx, &mut MapInjector(&mut map))
    });
    map
}

/// Makes `span` a child of the context found in `headers` (if any).
pub fn set_parent<K: AsRef<str>, V: AsRef<str>>(
    span: &tracing::Span,
    headers: impl IntoIterator<Item = (K, V)>,
) {
    let map: HashMap<String, String> = headers
        .into_iter()
        .filter(|(k, _)| is_trace_header(k.as_ref()))
        .map(|(k, v)| (k.as_ref().to_ascii_lowercase(), v.as_ref().to_owned()))
        .collect();
    if map.is_empty() {
        return;
    }
    let extractor = MapExtractor(map);
    let cx = opentelemetry::global::get_text_map_propagator(|p| p.extract(&extractor));
    let _ = span.set_parent(cx);
}

struct MapInjector<'a>(&'a mut HashMap<String, String>);

impl Injector for MapInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key.to_owned(), value);
    }
}

struct MapExtractor(HashMap<String, String>);

impl Extractor for MapExtractor {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(String::as_str).collect()
    }
}

/// The trace-context headers of an HTTP header map (or gRPC metadata, `MetadataMap::as_ref`) as
/// the pairs [`set_parent`] reads. Only `traceparent` and `tracestate` are looked up (header maps
/// keep names lowercase), so the other headers of a request cost nothing; a value that is not
/// visible ASCII cannot be a trace header's and is skipped.
pub fn header_pairs(headers: &http::HeaderMap) -> impl Iterator<Item = (&str, &str)> {
    [TRACEPARENT, TRACESTATE].into_iter().filter_map(|name| {
        let value = headers.get(name)?.to_str().ok()?;
        Some((name, value))
    })
}

/// Whether a header name belongs to the W3C trace context.
pub fn is_trace_header(name: &str) -> bool {
    name.eq_ignore_ascii_case(TRACEPARENT) || name.eq_ignore_ascii_case(TRACESTATE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_pairs_keep_readable_trace_headers_only() {
        let mut h = http::HeaderMap::new();
        h.insert(TRACEPARENT, http::HeaderValue::from_static("00-abc-def-01"));
        h.insert("x-other", http::HeaderValue::from_static("kept out"));
        let pairs: Vec<_> = header_pairs(&h).collect();
        assert_eq!(pairs, vec![(TRACEPARENT, "00-abc-def-01")]);

        h.insert(
            TRACESTATE,
            http::HeaderValue::from_bytes(b"caf\xe9").expect("a valid opaque value"),
        );
        let pairs: Vec<_> = header_pairs(&h).collect();
        assert_eq!(
            pairs,
            vec![(TRACEPARENT, "00-abc-def-01")],
            "an unreadable tracestate is skipped"
        );

        h.insert(TRACESTATE, http::HeaderValue::from_static("v=1"));
        let pairs: Vec<_> = header_pairs(&h).collect();
        assert_eq!(
            pairs,
            vec![(TRACEPARENT, "00-abc-def-01"), (TRACESTATE, "v=1")]
        );
    }
}
