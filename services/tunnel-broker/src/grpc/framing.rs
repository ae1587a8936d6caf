//! gRPC's length-prefixed messages read straight off an HTTP/2 request body and written straight
//! into a response body, without tonic's decode and encode buffers: what the konnectivity front
//! end (`konnectivity`) carries its DATA packets on.
//!
//! Why: tonic copies every received byte into its decode buffer and every sent byte into its
//! encode buffer. On a konnectivity connection those are the connection's bytes, one copy per
//! byte and direction that CONNECT and the unframed Dial do not make (a fifth of the broker's CPU
//! in a bulk upload, docs/benchmarks.md).
//!
//! - [`MessageReader`] yields each message as the HTTP/2 DATA chunks it arrived in (slices, no
//!   copy); [`Pieces`] decodes a konnectivity `Packet` from them, keeping a DATA packet's payload
//!   as those slices ([`Inbound::Data`]) and decoding every other packet with prost.
//! - [`PacketBody`] is the response body: a DATA packet is a few header bytes plus its payload
//!   as its own chunk; other packets are encoded with prost; the RPC's status goes out as
//!   trailers.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{BufMut as _, Bytes, BytesMut};
use http_body_util::BodyExt as _;
use hyper::body::{Frame, Incoming};
use prost::Message as _;
use tether_proto::konnectivity as k;
use tokio::sync::mpsc;
use tonic::Status;

/// gRPC's message prefix: compressed flag (1 byte) and length (4 bytes, big-endian).
const PREFIX: usize = 5;
/// Payload slices shorter than this are merged (copied) into one piece, so a client that sends
/// small HTTP/2 frames (grpc-go writes 16 KiB) does not turn each into a tunnel frame of its own.
pub const MERGE_BELOW: usize = 32 << 10;

/// A gRPC message as the chunks it arrived in.
#[derive(Debug, Default)]
pub struct Pieces(VecDeque<Bytes>);

impl Pieces {
    fn len(&self) -> usize {
        self.0.iter().map(Bytes::len).sum()
    }

    /// Takes the next `n` bytes as slices of the chunks (no copy).
    fn take(&mut self, mut n: usize) -> Option<Vec<Bytes>> {
        if self.len() < n {
            return None;
        }
        let mut out = Vec::new();
        while n > 0 {
            let front = self.0.front_mut().expect("length checked");
            if front.len() <= n {
                n -= front.len();
                out.push(self.0.pop_front().expect("non-empty"));
            } else {
                out.push(front.split_to(n));
                n = 0;
            }
        }
        Some(out)
    }

    /// The whole message in one buffer (copied only when it spans chunks).
    fn contiguous(mut self) -> Bytes {
        match self.0.len() {
            0 => Bytes::new(),
            1 => self.0.pop_front().expect("one chunk"),
            _ => {
                let mut b = BytesMut::with_capacity(self.len());
                for c in self.0 {
                    b.put(c);
                }
                b.freeze()
            }
        }
    }

    /// Decodes a konnectivity packet; a DATA packet keeps its payload as slices.
    pub fn decode_packet(self) -> Result<Inbound, Status> {
        // A DATA decoded by prost is still `Inbound::Data`, so callers have one DATA case.
        let whole = |p: Pieces| match k::Packet::decode(p.contiguous()) {
            Ok(k::Packet {
                payload: Some(k::packet::Payload::Data(d)),
                ..
            }) => Ok(Inbound::Data {
                connect_id: d.connect_id,
                error: d.error,
                payload: vec![d.data],
            }),
            Ok(p) => Ok(Inbound::Packet(p)),
            Err(e) => Err(Status::internal(format!(
                "malformed konnectivity packet: {e}"
            ))),
        };
        // Fast path: DATA as Go's and tonic's encoders write it (fields in order: type, then
        // data { connectID, [error], data }). Anything else is decoded by prost, which also
        // judges malformed input.
        let mut probe = PiecesBuf::new(&self);
        match probe.data_layout() {
            Some(layout) => {
                let mut p = self;
                p.take(layout.payload_at).expect("length checked");
                let payload = p.take(layout.payload_len).expect("length checked");
                if p.len() != 0 {
                    return Err(Status::internal(
                        "malformed konnectivity packet: bytes after the DATA payload",
                    ));
                }
                Ok(Inbound::Data {
                    connect_id: layout.connect_id,
                    error: layout.error,
                    payload: merge_small(payload),
                })
            }
            None => whole(self),
        }
    }
}

/// Merges runs of slices shorter than [`MERGE_BELOW`] into one (a copy of those bytes only).
fn merge_small(pieces: Vec<Bytes>) -> Vec<Bytes> {
    if pieces.iter().all(|p| p.len() >= MERGE_BELOW) || pieces.len() == 1 {
        return pieces;
    }
    let mut out = Vec::with_capacity(pieces.len());
    let mut run = BytesMut::new();
    for p in pieces {
        if p.len() >= MERGE_BELOW {
            if !run.is_empty() {
                out.push(std::mem::take(&mut run).freeze());
            }
            out.push(p);
        } else {
            run.put(p);
        }
    }
    if !run.is_empty() {
        out.push(run.freeze());
    }
    out
}

/// Where a DATA packet's fields lie in a message.
struct DataLayout {
    connect_id: i64,
    error: String,
    /// Offset of the payload from the start of the message, and its length.
    payload_at: usize,
    payload_len: usize,
}

/// A read cursor over a message's chunks (for the DATA fast path's header fields).
struct PiecesBuf<'a> {
    chunks: &'a VecDeque<Bytes>,
    /// Index of the current chunk and offset in it.
    chunk: usize,
    off: usize,
    /// Bytes consumed so far.
    pos: usize,
    len: usize,
}

impl<'a> PiecesBuf<'a> {
    fn new(p: &'a Pieces) -> Self {
        Self {
            chunks: &p.0,
            chunk: 0,
            off: 0,
            pos: 0,
            len: p.len(),
        }
    }

    fn byte(&mut self) -> Option<u8> {
        loop {
            let c = self.chunks.get(self.chunk)?;
            if self.off < c.len() {
                let b = c[self.off];
                self.off += 1;
                self.pos += 1;
                return Some(b);
            }
            self.chunk += 1;
            self.off = 0;
        }
    }

    fn varint(&mut self) -> Option<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Some(v);
            }
        }
        None
    }

    fn string(&mut self, n: usize) -> Option<String> {
        let mut s = Vec::with_capacity(n.min(4096));
        for _ in 0..n {
            s.push(self.byte()?);
        }
        String::from_utf8(s).ok()
    }

    /// `Packet { type = 1 (DATA = 3? any); data = 4 { connectID = 1; error = 2; data = 3 } }`
    /// with the payload as the message's last field; `None` for any other shape.
    fn data_layout(&mut self) -> Option<DataLayout> {
        const DATA_FIELD: u64 = 4;
        let mut key = self.varint()?;
        if key == 1 << 3 {
            self.varint()?; // type
            key = self.varint()?;
        }
        if key != (DATA_FIELD << 3 | 2) {
            return None;
        }
        let data_len = usize::try_from(self.varint()?).ok()?;
        if self.pos + data_len != self.len {
            return None;
        }
        let (mut connect_id, mut error) = (0i64, String::new());
        loop {
            let key = self.varint()?;
            match key {
                k if k == 1 << 3 => connect_id = self.varint()? as i64,
                k if k == (2 << 3 | 2) => {
                    let n = usize::try_from(self.varint()?).ok()?;
                    error = self.string(n)?;
                }
                k if k == (3 << 3 | 2) => {
                    let n = usize::try_from(self.varint()?).ok()?;
                    if self.pos + n != self.len {
                        return None;
                    }
                    return Some(DataLayout {
                        connect_id,
                        error,
                        payload_at: self.pos,
                        payload_len: n,
                    });
                }
                _ => return None,
            }
        }
    }
}

/// A received konnectivity packet.
#[derive(Debug)]
pub enum Inbound {
    /// DATA, its payload as received (slices of the HTTP/2 frames, small ones merged).
    Data {
        connect_id: i64,
        error: String,
        payload: Vec<Bytes>,
    },
    /// Any other packet.
    Packet(k::Packet),
}

impl Inbound {
    /// As a prost packet (the payload copied into one buffer when it came in pieces).
    pub fn into_packet(self) -> k::Packet {
        match self {
            Inbound::Packet(p) => p,
            Inbound::Data {
                connect_id,
                error,
                payload,
            } => {
                let data = if payload.len() == 1 {
                    payload.into_iter().next().expect("one piece")
                } else {
                    let mut b = BytesMut::new();
                    for p in payload {
                        b.put(p);
                    }
                    b.freeze()
                };
                k::Packet {
                    r#type: k::PacketType::Data as i32,
                    payload: Some(k::packet::Payload::Data(k::Data {
                        connect_id,
                        error,
                        data,
                    })),
                }
            }
        }
    }
}

/// Reads gRPC messages from a request body.
pub struct MessageReader {
    body: Incoming,
    chunks: Pieces,
    buffered: usize,
    max_message: usize,
    ended: bool,
}

impl MessageReader {
    pub fn new(body: Incoming, max_message: usize) -> Self {
        Self {
            body,
            chunks: Pieces::default(),
            buffered: 0,
            max_message,
            ended: false,
        }
    }

    /// The next message; `None` at the clean end of the request stream.
    pub async fn message(&mut self) -> Result<Option<Inbound>, Status> {
        // The prefix.
        if !self.fill(PREFIX).await? {
            return if self.buffered == 0 {
                Ok(None)
            } else {
                Err(Status::internal(
                    "the request stream ended inside a message prefix",
                ))
            };
        }
        let prefix = self.chunks.take(PREFIX).expect("filled");
        self.buffered -= PREFIX;
        let mut head = [0u8; PREFIX];
        let mut at = 0;
        for p in &prefix {
            head[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        match head[0] {
            0 => {}
            1 => {
                return Err(Status::internal(
                    "protocol error: received message with compressed-flag but no grpc-encoding was specified",
                ));
            }
            f => {
                return Err(Status::internal(format!(
                    "protocol error: received message with invalid compression flag: {f} (valid flags are 0 and 1)"
                )));
            }
        }
        let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
        if len > self.max_message {
            return Err(Status::out_of_range(format!(
                "Error, decoded message length too large: found {len} bytes, the limit is: {} bytes",
                self.max_message
            )));
        }
        if !self.fill(len).await? {
            return Err(Status::internal(
                "the request stream ended inside a message",
            ));
        }
        let body = Pieces(self.chunks.take(len).expect("filled").into());
        self.buffered -= len;
        body.decode_packet().map(Some)
    }

    /// Reads frames until `n` bytes are buffered; false if the body ended first.
    async fn fill(&mut self, n: usize) -> Result<bool, Status> {
        while self.buffered < n {
            if self.ended {
                return Ok(false);
            }
            match self.body.frame().await {
                None => self.ended = true,
                Some(Ok(f)) => {
                    if let Ok(data) = f.into_data()
                        && !data.is_empty()
                    {
                        self.buffered += data.len();
                        self.chunks.0.push_back(data);
                    }
                }
                Some(Err(e)) => return Err(Status::from_error(Box::new(e))),
            }
        }
        Ok(true)
    }
}

/// The response body of a konnectivity RPC: packets from a channel, then the status as trailers
/// (OK when the channel closes; the status an `Err` carries, which ends the body).
pub struct PacketBody {
    rx: mpsc::Receiver<Result<k::Packet, Status>>,
    /// A DATA payload to send after its header.
    payload: Option<Bytes>,
    done: bool,
    /// Where DATA payloads are offered to the connection's batch for sending by reference.
    payloads: crate::batch::Payloads,
}

impl PacketBody {
    pub fn new(
        rx: mpsc::Receiver<Result<k::Packet, Status>>,
        payloads: crate::batch::Payloads,
    ) -> Self {
        Self {
            rx,
            payload: None,
            done: false,
            payloads,
        }
    }
}

/// The gRPC message for `p`: a DATA packet as its header bytes and its payload (not copied),
/// any other packet encoded whole.
fn encode(p: k::Packet) -> (Bytes, Option<Bytes>) {
    let p = match p {
        k::Packet {
            r#type,
            payload: Some(k::packet::Payload::Data(d)),
        } if !d.data.is_empty() => {
            // Data's fields before the payload, then the payload's key and length.
            let mut inner = BytesMut::with_capacity(32 + d.error.len());
            if d.connect_id != 0 {
                prost::encoding::int64::encode(1, &d.connect_id, &mut inner);
            }
            if !d.error.is_empty() {
                prost::encoding::string::encode(2, &d.error, &mut inner);
            }
            prost::encoding::encode_key(3, prost::encoding::WireType::LengthDelimited, &mut inner);
            prost::encoding::encode_varint(d.data.len() as u64, &mut inner);
            let data_len = inner.len() + d.data.len();
            let mut outer = BytesMut::with_capacity(PREFIX + 16 + inner.len());
            let mut env = BytesMut::with_capacity(16);
            if r#type != 0 {
                prost::encoding::int32::encode(1, &r#type, &mut env);
            }
            prost::encoding::encode_key(4, prost::encoding::WireType::LengthDelimited, &mut env);
            prost::encoding::encode_varint(data_len as u64, &mut env);
            let total = env.len() + data_len;
            outer.put_u8(0);
            outer.put_u32(total as u32);
            outer.put(env);
            outer.put(inner);
            return (outer.freeze(), Some(d.data));
        }
        p => p,
    };
    let len = p.encoded_len();
    let mut b = BytesMut::with_capacity(PREFIX + len);
    b.put_u8(0);
    b.put_u32(len as u32);
    p.encode(&mut b).expect("capacity reserved");
    (b.freeze(), None)
}

fn trailers(status: &Status) -> http::HeaderMap {
    let mut h = http::HeaderMap::new();
    if status.add_header(&mut h).is_err() {
        // A message that cannot be a header value: the code alone.
        let _ = Status::new(status.code(), "").add_header(&mut h);
    }
    h
}

impl hyper::body::Body for PacketBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if let Some(p) = self.payload.take() {
            self.payloads.offer(&p);
            return Poll::Ready(Some(Ok(Frame::data(p))));
        }
        if self.done {
            return Poll::Ready(None);
        }
        match ready!(self.rx.poll_recv(cx)) {
            Some(Ok(p)) => {
                let (head, payload) = encode(p);
                self.payload = payload;
                Poll::Ready(Some(Ok(Frame::data(head))))
            }
            Some(Err(status)) => {
                self.done = true;
                Poll::Ready(Some(Ok(Frame::trailers(trailers(&status)))))
            }
            None => {
                self.done = true;
                Poll::Ready(Some(Ok(Frame::trailers(trailers(&Status::ok(""))))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.payload.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data_packet(connect_id: i64, error: &str, data: &[u8]) -> k::Packet {
        k::Packet {
            r#type: k::PacketType::Data as i32,
            payload: Some(k::packet::Payload::Data(k::Data {
                connect_id,
                error: error.into(),
                data: Bytes::copy_from_slice(data),
            })),
        }
    }

    /// A message cut into chunks of `sizes` (repeating), as HTTP/2 frames would deliver it.
    fn chunked(msg: &[u8], sizes: &[usize]) -> Pieces {
        let mut p = Pieces::default();
        let (mut at, mut i) = (0, 0);
        while at < msg.len() {
            let n = sizes[i % sizes.len()].min(msg.len() - at);
            p.0.push_back(Bytes::copy_from_slice(&msg[at..at + n]));
            at += n;
            i += 1;
        }
        p
    }

    fn payload_of(i: Inbound) -> (i64, String, Vec<u8>, usize) {
        match i {
            Inbound::Data {
                connect_id,
                error,
                payload,
            } => {
                let n = payload.len();
                (connect_id, error, payload.concat(), n)
            }
            Inbound::Packet(p) => panic!("not the DATA fast path: {p:?}"),
        }
    }

    /// What `encode` writes (header + payload) decodes with prost to the same packet, and the
    /// fast path reads back the same fields however the message is chunked.
    #[test]
    fn data_packets_round_trip_through_encode_and_the_fast_path() {
        let payload: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        for (id, err) in [(1i64, ""), (0, ""), (i64::MAX, "boom"), (-5, "")] {
            let p = data_packet(id, err, &payload);
            let (head, body) = encode(p.clone());
            let mut msg = head.to_vec();
            msg.extend_from_slice(&body.expect("a DATA payload"));
            assert_eq!(msg[0], 0);
            let len = u32::from_be_bytes(msg[1..5].try_into().unwrap()) as usize;
            assert_eq!(len, msg.len() - PREFIX);
            assert_eq!(k::Packet::decode(&msg[PREFIX..]).unwrap(), p);
            for sizes in [&[usize::MAX][..], &[16384], &[7, 262_144], &[1]] {
                let got = chunked(&msg[PREFIX..], sizes).decode_packet().unwrap();
                let (cid, e, data, _) = payload_of(got);
                assert_eq!((cid, e.as_str()), (id, err), "{sizes:?}");
                assert_eq!(data, payload, "{sizes:?}");
            }
        }
    }

    /// prost's own encoding of DATA (the bench's and tonic clients') takes the fast path, with
    /// the payload sliced, not copied, when it arrives in large frames.
    #[test]
    fn prost_encoded_data_is_sliced_not_copied() {
        let payload = vec![7u8; 262_144];
        let msg = data_packet(42, "", &payload).encode_to_vec();
        let (cid, _, data, pieces) = payload_of(
            chunked(&msg, &[262_144 - 20, 262_144])
                .decode_packet()
                .unwrap(),
        );
        assert_eq!((cid, data.len()), (42, payload.len()));
        assert_eq!(pieces, 2, "large slices are kept as they came");
        // grpc-go's 16 KiB frames: merged into pieces of at least MERGE_BELOW (except the last).
        let (_, _, data, pieces) = payload_of(chunked(&msg, &[16_384]).decode_packet().unwrap());
        assert_eq!(data, payload);
        assert_eq!(pieces, 1);
    }

    /// Every other packet, and DATA in an unusual field order, goes through prost.
    #[test]
    fn other_packets_and_shapes_decode_with_prost() {
        let close = k::Packet {
            r#type: k::PacketType::CloseReq as i32,
            payload: Some(k::packet::Payload::CloseRequest(k::CloseRequest {
                connect_id: 9,
            })),
        };
        let got = chunked(&close.encode_to_vec(), &[1])
            .decode_packet()
            .unwrap();
        assert!(matches!(got, Inbound::Packet(p) if p == close));
        // DATA with the payload before connectID: valid protobuf, not the fast path's shape.
        let mut inner = Vec::new();
        prost::encoding::bytes::encode(3, &Bytes::from_static(b"hi"), &mut inner);
        prost::encoding::int64::encode(1, &3, &mut inner);
        let mut msg = Vec::new();
        prost::encoding::int32::encode(1, &(k::PacketType::Data as i32), &mut msg);
        prost::encoding::encode_key(4, prost::encoding::WireType::LengthDelimited, &mut msg);
        prost::encoding::encode_varint(inner.len() as u64, &mut msg);
        msg.extend_from_slice(&inner);
        let got = chunked(&msg, &[3]).decode_packet().unwrap();
        assert!(
            matches!(&got, Inbound::Data { payload, .. } if payload.len() == 1),
            "{got:?}"
        );
        assert_eq!(got.into_packet(), data_packet(3, "", b"hi"));
        // Garbage is an error that names the packet, not a panic.
        let e = chunked(&[0x22, 0xff, 0xff], &[2])
            .decode_packet()
            .unwrap_err();
        assert!(e.message().contains("malformed konnectivity packet"), "{e}");
    }

    /// Non-DATA packets are encoded whole and decode with prost.
    #[test]
    fn control_packets_encode_whole() {
        let p = k::Packet {
            r#type: k::PacketType::CloseRsp as i32,
            payload: Some(k::packet::Payload::CloseResponse(k::CloseResponse {
                error: "x".into(),
                connect_id: 4,
            })),
        };
        let (head, body) = encode(p.clone());
        assert!(body.is_none());
        assert_eq!(k::Packet::decode(&head[PREFIX..]).unwrap(), p);
        // An empty DATA (no payload) too.
        let empty = data_packet(4, "", b"");
        let (head, body) = encode(empty.clone());
        assert!(body.is_none());
        assert_eq!(k::Packet::decode(&head[PREFIX..]).unwrap(), empty);
    }
}
