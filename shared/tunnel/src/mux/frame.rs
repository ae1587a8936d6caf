//! Frames of `tether-tunnel/2`: a 9-byte header and a payload, inside TLS.
//!
//! Header: `kind` (u8), `flags` (u8), `stream` (u32 big-endian; 0 = the connection), `length`
//! (u24 big-endian) of the payload. Strings in payloads are a u16 length and UTF-8 bytes.
//! Every decoder error names the frame and the field that is wrong.

use bytes::{Buf, BufMut};

/// What a `tether-dial/1` client sends first on the broker's plain client port (no TLS, no ALPN:
/// this names the protocol there; on the client TLS port ALPN does).
pub const DIAL_PREFACE: &[u8] = b"TETHER-DIAL/1\r\n\r\n";

/// Bytes of a frame header.
pub const HEADER_LEN: usize = 9;
/// Largest payload the u24 length can carry.
pub const MAX_PAYLOAD: usize = (1 << 24) - 1;
/// Flag of `DATA`: the sender's half of the stream ends after this frame (half-close).
pub const FLAG_FIN: u8 = 0x1;
/// Most trace-context fields an `OPEN` carries.
pub const MAX_TRACE_FIELDS: usize = 8;

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Broker → agent, stream 0: who the broker's certificate check says the agent is.
    Hello = 1,
    /// Agent → broker, stream 0: the hello matched the agent's configuration.
    HelloOk = 2,
    /// Either way, stream 0: the connection is refused (hub refuses the cluster, or the hello
    /// names another cluster); the text says why.
    Refused = 3,
    /// Broker → agent: dial a target on a new stream.
    Open = 4,
    /// Agent → broker: the dial succeeded; bytes flow.
    OpenOk = 5,
    /// Agent → broker: the dial failed (error kind and message); the stream is over.
    OpenErr = 6,
    /// Bytes of a stream (`FLAG_FIN`: half-close).
    Data = 7,
    /// The stream is aborted (code and text).
    Reset = 8,
    /// Bytes returned to the sender's window of a stream.
    Credit = 9,
    /// Stream 0: the sender's receive window of every stream (first frame of each side, and
    /// each time its adaptive window changes).
    Window = 10,
    /// Stream 0: 8 opaque bytes to echo.
    Ping = 11,
    /// Stream 0: the echo of a `PING`.
    Pong = 12,
    /// Agent → broker, stream 0: no stream above `last` is taken any more; the tunnel closes
    /// when its streams end.
    GoAway = 13,
    /// Broker → agent, stream 0: this broker is draining.
    Drain = 14,
    /// Client → broker, stream 0 (`tether-dial/1` only): the client's credential, an
    /// `authorization` value (`Bearer <token>`); it applies to the `OPEN`s after it.
    Auth = 15,
}

impl Kind {
    pub fn from_u8(v: u8) -> Option<Self> {
        use Kind::*;
        Some(match v {
            1 => Hello,
            2 => HelloOk,
            3 => Refused,
            4 => Open,
            5 => OpenOk,
            6 => OpenErr,
            7 => Data,
            8 => Reset,
            9 => Credit,
            10 => Window,
            11 => Ping,
            12 => Pong,
            13 => GoAway,
            14 => Drain,
            15 => Auth,
            _ => return None,
        })
    }
}

/// Why a stream was reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ResetCode {
    /// The sender gave up on the stream (its socket failed, its client left).
    Cancel = 0,
    /// The stream was not processed (no dial happened): it may be opened elsewhere.
    Refused = 1,
    /// The peer sent beyond the stream's window.
    FlowControl = 2,
    /// The peer broke the protocol on this stream.
    Protocol = 3,
}

impl ResetCode {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::Refused,
            2 => Self::FlowControl,
            3 => Self::Protocol,
            _ => Self::Cancel,
        }
    }
}

/// A frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub flags: u8,
    pub stream: u32,
    pub len: usize,
}

/// A malformed frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("{kind:?} frame of {len} bytes exceeds the limit of {max}")]
    TooLarge { kind: Kind, len: usize, max: usize },
    #[error("{kind:?} frame: {what}")]
    Malformed { kind: Kind, what: String },
}

/// Reads a header; `max_payload` bounds what a peer may announce.
pub fn parse_header(b: &[u8; HEADER_LEN], max_payload: usize) -> Result<Header, FrameError> {
    let kind = Kind::from_u8(b[0]).ok_or(FrameError::UnknownKind(b[0]))?;
    let stream = u32::from_be_bytes([b[2], b[3], b[4], b[5]]);
    let len = u32::from_be_bytes([0, b[6], b[7], b[8]]) as usize;
    if len > max_payload {
        return Err(FrameError::TooLarge {
            kind,
            len,
            max: max_payload,
        });
    }
    Ok(Header {
        kind,
        flags: b[1],
        stream,
        len,
    })
}

/// A header as bytes (the send path keeps it inline, no allocation per frame).
pub fn header(kind: Kind, flags: u8, stream: u32, len: usize) -> [u8; HEADER_LEN] {
    debug_assert!(len <= MAX_PAYLOAD);
    let mut h = [0u8; HEADER_LEN];
    h[0] = kind as u8;
    h[1] = flags;
    h[2..6].copy_from_slice(&stream.to_be_bytes());
    h[6..].copy_from_slice(&(len as u32).to_be_bytes()[1..]);
    h
}

/// Appends a header to `out`.
pub fn put_header(out: &mut Vec<u8>, kind: Kind, flags: u8, stream: u32, len: usize) {
    out.extend_from_slice(&header(kind, flags, stream, len));
}

/// Appends a whole frame (header and payload) to `out`.
pub fn put_frame(out: &mut Vec<u8>, kind: Kind, flags: u8, stream: u32, payload: &[u8]) {
    put_header(out, kind, flags, stream, payload.len());
    out.extend_from_slice(payload);
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    // Strings are identifiers, targets and messages: cut at u16::MAX on a char boundary.
    let mut end = s.len().min(u16::MAX as usize);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out.put_u16(end as u16);
    out.extend_from_slice(&s.as_bytes()[..end]);
}

/// A cursor over a payload whose errors name the frame and field.
struct Fields<'a> {
    kind: Kind,
    buf: &'a [u8],
}

impl<'a> Fields<'a> {
    fn err(&self, what: impl Into<String>) -> FrameError {
        FrameError::Malformed {
            kind: self.kind,
            what: what.into(),
        }
    }
    fn u8(&mut self, field: &str) -> Result<u8, FrameError> {
        if self.buf.remaining() < 1 {
            return Err(self.err(format!("{field} missing")));
        }
        Ok(self.buf.get_u8())
    }
    fn u32(&mut self, field: &str) -> Result<u32, FrameError> {
        if self.buf.remaining() < 4 {
            return Err(self.err(format!("{field} missing")));
        }
        Ok(self.buf.get_u32())
    }
    fn u64(&mut self, field: &str) -> Result<u64, FrameError> {
        if self.buf.remaining() < 8 {
            return Err(self.err(format!("{field} missing")));
        }
        Ok(self.buf.get_u64())
    }
    fn str(&mut self, field: &str) -> Result<String, FrameError> {
        if self.buf.remaining() < 2 {
            return Err(self.err(format!("{field} missing")));
        }
        let n = self.buf.get_u16() as usize;
        if self.buf.remaining() < n {
            return Err(self.err(format!(
                "{field} announces {n} bytes, {} left",
                self.buf.remaining()
            )));
        }
        let s = std::str::from_utf8(&self.buf[..n])
            .map_err(|_| self.err(format!("{field} is not UTF-8")))?
            .to_owned();
        self.buf.advance(n);
        Ok(s)
    }
    fn end(&self) -> Result<(), FrameError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(self.err(format!("{} trailing bytes", self.buf.len())))
        }
    }
}

/// `HELLO`: the identity the broker read from the agent's certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub cluster: String,
    pub agent: String,
    pub broker: String,
}

impl Hello {
    pub fn encode(&self) -> Vec<u8> {
        let mut p = Vec::new();
        put_str(&mut p, &self.cluster);
        put_str(&mut p, &self.agent);
        put_str(&mut p, &self.broker);
        p
    }
    pub fn decode(buf: &[u8]) -> Result<Self, FrameError> {
        let mut f = Fields {
            kind: Kind::Hello,
            buf,
        };
        let h = Self {
            cluster: f.str("cluster")?,
            agent: f.str("agent")?,
            broker: f.str("broker")?,
        };
        f.end()?;
        Ok(h)
    }
}

/// `OPEN`: what to dial and how.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Open {
    /// `apiserver`, `host:port`, or the service-proxy destination (wire.rs).
    pub target: String,
    pub cluster: String,
    /// The broker's stream id (logs, traces).
    pub tag: u64,
    pub dial_timeout_ms: u32,
    /// W3C trace context (`traceparent`, `tracestate`).
    pub trace: Vec<(String, String)>,
}

impl Open {
    /// The trace context as the name–value pairs `tether_telemetry::propagation::set_parent`
    /// reads.
    pub fn trace_context(&self) -> impl Iterator<Item = (&str, &str)> {
        self.trace.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut p = Vec::with_capacity(64 + self.target.len());
        p.put_u32(self.dial_timeout_ms);
        p.put_u64(self.tag);
        put_str(&mut p, &self.cluster);
        put_str(&mut p, &self.target);
        let n = self.trace.len().min(MAX_TRACE_FIELDS);
        p.put_u8(n as u8);
        for (k, v) in &self.trace[..n] {
            put_str(&mut p, k);
            put_str(&mut p, v);
        }
        p
    }
    pub fn decode(buf: &[u8]) -> Result<Self, FrameError> {
        let mut f = Fields {
            kind: Kind::Open,
            buf,
        };
        let dial_timeout_ms = f.u32("dial timeout")?;
        let tag = f.u64("stream tag")?;
        let cluster = f.str("cluster")?;
        let target = f.str("target")?;
        let n = f.u8("trace field count")? as usize;
        if n > MAX_TRACE_FIELDS {
            return Err(f.err(format!(
                "{n} trace fields, at most {MAX_TRACE_FIELDS} allowed"
            )));
        }
        let mut trace = Vec::with_capacity(n);
        for _ in 0..n {
            trace.push((f.str("trace field name")?, f.str("trace field value")?));
        }
        f.end()?;
        Ok(Self {
            target,
            cluster,
            tag,
            dial_timeout_ms,
            trace,
        })
    }
}

/// `OPEN_OK`'s payload: empty from an agent; from a broker to a `tether-dial/1` client, the
/// broker's stream id and the tunnel's last round trip in µs (0: unknown).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpenOk {
    pub stream_id: u64,
    pub tunnel_rtt_micros: u32,
}

impl OpenOk {
    pub fn encode(&self) -> [u8; 12] {
        let mut p = [0u8; 12];
        p[..8].copy_from_slice(&self.stream_id.to_be_bytes());
        p[8..].copy_from_slice(&self.tunnel_rtt_micros.to_be_bytes());
        p
    }
    /// An empty payload (an agent's) is the default.
    pub fn decode(buf: &[u8]) -> Result<Self, FrameError> {
        if buf.is_empty() {
            return Ok(Self::default());
        }
        let mut f = Fields {
            kind: Kind::OpenOk,
            buf,
        };
        let r = Self {
            stream_id: f.u64("stream id")?,
            tunnel_rtt_micros: f.u32("tunnel round trip")?,
        };
        f.end()?;
        Ok(r)
    }
}

/// `OPEN_ERR`: why the dial failed (`DialErrorKind` label and message).
pub fn encode_open_err(kind_label: &str, message: &str) -> Vec<u8> {
    let mut p = Vec::new();
    put_str(&mut p, kind_label);
    put_str(&mut p, message);
    p
}

pub fn decode_open_err(buf: &[u8]) -> Result<(String, String), FrameError> {
    let mut f = Fields {
        kind: Kind::OpenErr,
        buf,
    };
    let r = (f.str("error kind")?, f.str("message")?);
    f.end()?;
    Ok(r)
}

/// `RESET`: code and text.
pub fn encode_reset(code: ResetCode, message: &str) -> Vec<u8> {
    let mut p = vec![code as u8];
    put_str(&mut p, message);
    p
}

pub fn decode_reset(buf: &[u8]) -> Result<(ResetCode, String), FrameError> {
    let mut f = Fields {
        kind: Kind::Reset,
        buf,
    };
    let r = (ResetCode::from_u8(f.u8("code")?), f.str("message")?);
    f.end()?;
    Ok(r)
}

/// A payload of one string (`REFUSED`'s reason, `GOAWAY`'s after its last stream).
pub fn encode_text(s: &str) -> Vec<u8> {
    let mut p = Vec::new();
    put_str(&mut p, s);
    p
}

pub fn decode_text(kind: Kind, buf: &[u8]) -> Result<String, FrameError> {
    let mut f = Fields { kind, buf };
    let s = f.str("text")?;
    f.end()?;
    Ok(s)
}

/// `HELLO_OK`: the agent's own cluster and agent names.
pub fn encode_pair(a: &str, b: &str) -> Vec<u8> {
    let mut p = Vec::new();
    put_str(&mut p, a);
    put_str(&mut p, b);
    p
}

pub fn decode_pair(kind: Kind, buf: &[u8]) -> Result<(String, String), FrameError> {
    let mut f = Fields { kind, buf };
    let r = (f.str("first")?, f.str("second")?);
    f.end()?;
    Ok(r)
}

/// `GOAWAY`: the last stream taken and why.
pub fn encode_goaway(last: u32, reason: &str) -> Vec<u8> {
    let mut p = last.to_be_bytes().to_vec();
    put_str(&mut p, reason);
    p
}

pub fn decode_goaway(buf: &[u8]) -> Result<(u32, String), FrameError> {
    let mut f = Fields {
        kind: Kind::GoAway,
        buf,
    };
    let r = (f.u32("last stream")?, f.str("reason")?);
    f.end()?;
    Ok(r)
}

/// `WINDOW`: the stream window, the connection window, the most concurrent streams accepted.
pub fn decode_window(buf: &[u8]) -> Result<(u32, u32, u32), FrameError> {
    let mut f = Fields {
        kind: Kind::Window,
        buf,
    };
    let r = (
        f.u32("stream window")?,
        f.u32("connection window")?,
        f.u32("max streams")?,
    );
    f.end()?;
    Ok(r)
}

/// A payload of one u32 (`CREDIT`).
pub fn decode_u32(kind: Kind, buf: &[u8]) -> Result<u32, FrameError> {
    let mut f = Fields { kind, buf };
    let v = f.u32("value")?;
    f.end()?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_bounds_the_length() {
        let mut out = Vec::new();
        put_header(&mut out, Kind::Data, FLAG_FIN, 7, 70_000);
        let h = parse_header(out[..].try_into().unwrap(), 1 << 20).unwrap();
        assert_eq!(
            h,
            Header {
                kind: Kind::Data,
                flags: FLAG_FIN,
                stream: 7,
                len: 70_000
            }
        );
        let e = parse_header(out[..].try_into().unwrap(), 65_536).unwrap_err();
        assert!(e.to_string().contains("70000 bytes exceeds"), "{e}");
        out[0] = 99;
        let e = parse_header(out[..].try_into().unwrap(), 1 << 20).unwrap_err();
        assert_eq!(e, FrameError::UnknownKind(99));
    }

    #[test]
    fn open_round_trips_and_names_what_is_wrong() {
        let o = Open {
            target: "db.ns.svc:5432".into(),
            cluster: "c1".into(),
            tag: 42,
            dial_timeout_ms: 3000,
            trace: vec![("traceparent".into(), "00-abc-def-01".into())],
        };
        assert_eq!(Open::decode(&o.encode()).unwrap(), o);
        assert_eq!(
            o.trace_context().collect::<Vec<_>>(),
            [("traceparent", "00-abc-def-01")]
        );
        let bytes = o.encode();
        let e = Open::decode(&bytes[..bytes.len() - 3]).unwrap_err();
        assert!(e.to_string().contains("trace field value"), "{e}");
        let mut long = bytes.clone();
        long.push(0);
        assert!(
            Open::decode(&long)
                .unwrap_err()
                .to_string()
                .contains("trailing")
        );
    }

    #[test]
    fn open_ok_is_empty_from_an_agent_and_carries_the_stream_from_a_broker() {
        assert_eq!(OpenOk::decode(&[]).unwrap(), OpenOk::default());
        let ok = OpenOk {
            stream_id: 77,
            tunnel_rtt_micros: 140,
        };
        assert_eq!(OpenOk::decode(&ok.encode()).unwrap(), ok);
        let e = OpenOk::decode(&ok.encode()[..10]).unwrap_err();
        assert!(e.to_string().contains("tunnel round trip"), "{e}");
    }

    #[test]
    fn strings_are_cut_on_a_char_boundary() {
        let s = "é".repeat(40_000);
        let p = encode_text(&s);
        let back = decode_text(Kind::Refused, &p).unwrap();
        assert!(back.len() <= u16::MAX as usize && s.starts_with(&back));
    }
}
