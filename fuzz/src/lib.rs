//! Fuzz harness: one function per parser that takes bytes from the network or a user, called by
//! the cargo-fuzz targets in `fuzz/fuzz_targets/` and, for regression replay without
//! cargo-fuzz, by `tests/tests/fuzz_corpus.rs` (which includes this file as a module and feeds
//! every file of `fuzz/corpus/<target>/` and `fuzz/regressions/<target>/` through [`TARGETS`]).
//!
//! Each function must not panic on any input; where a parser's output can be checked cheaply
//! (a parsed target re-parses to itself) it asserts that too. docs/fuzzing.md lists the targets.

use prost::Message as _;

/// A harness function: takes any bytes, panics only on a defect.
pub type Harness = fn(&[u8]);

/// Every target: its name (the fuzz target and corpus directory) and its function.
pub const TARGETS: &[(&str, Harness)] = &[
    ("connect_head", connect_head),
    ("proxy_credentials", proxy_credentials),
    ("konnectivity_packet", konnectivity_packet),
    ("dial_frame", dial_frame),
    ("mux_frames", mux_frames),
    ("tunnel_address", tunnel_address),
    ("kubeconfig", kubeconfig),
    ("apply_documents", apply_documents),
    ("service_config", service_config),
    ("nats_payload", nats_payload),
];

/// The broker's client table as the credential checks see it: one client `ops` with token
/// `fuzz-token`.
fn auth() -> &'static tunnel_broker::auth::Auth {
    static AUTH: std::sync::OnceLock<tunnel_broker::auth::Auth> = std::sync::OnceLock::new();
    AUTH.get_or_init(|| {
        tunnel_broker::auth::Auth::new(&[tunnel_broker::config::ClientConfig {
            name: "ops".into(),
            token_sha256: Some(tunnel_broker::auth::token_sha256("fuzz-token")),
            allow: Vec::new(),
        }])
    })
}

/// A CONNECT request head (the broker's plain and TLS client ports), then its credentials and
/// the client policy check, as the broker runs them.
pub fn connect_head(data: &[u8]) {
    let Ok(Some((head, len))) = tunnel_broker::connect::parse_head(data) else {
        return;
    };
    assert!(len <= data.len(), "head length {len} beyond the input");
    let client = head.credentials.as_deref().map(|c| auth().from_header(c));
    if let (Some(Ok(client)), Ok(target)) = (client, &head.target) {
        let _ = auth().authorize(&client, target);
    }
}

/// A `Proxy-Authorization` / gRPC `authorization` value (Bearer, Basic base64(user:token)).
pub fn proxy_credentials(data: &[u8]) {
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = auth().from_header(s);
    }
}

/// A konnectivity `Packet` (gRPC message body), then what the broker checks of a DIAL_REQ.
pub fn konnectivity_packet(data: &[u8]) {
    use tether_proto::konnectivity as k;
    let Ok(p) = k::Packet::decode(data) else {
        return;
    };
    if let Some(k::packet::Payload::DialRequest(d)) = &p.payload
        && d.protocol == "tcp"
    {
        check_target(&d.address);
    }
    // What decodes re-encodes to something that decodes to the same packet.
    let again = k::Packet::decode(p.encode_to_vec().as_slice()).expect("re-encoded packet");
    assert_eq!(again, p);
}

/// A native `tether.tunnel.v1` `DialFrame`, then the broker's target check of a `dial`.
pub fn dial_frame(data: &[u8]) {
    use tether_proto::tunnel::v1 as pb;
    let Ok(f) = pb::DialFrame::decode(data) else {
        return;
    };
    if let Some(pb::dial_frame::Kind::Dial(d)) = &f.kind
        && let Ok(t) = tether_tunnel::Target::from_parts(&d.cluster, &d.host, d.port)
    {
        round_trip(&t);
    }
}

/// A byte stream from a `tether-tunnel/2` peer: every frame through its decoder (a decoded
/// `OPEN` or `HELLO` re-encodes to itself), then the whole input into a real connection of
/// each role (over an in-memory pipe), whose reader must end with a reason, never a panic.
pub fn mux_frames(data: &[u8]) {
    use tether_tunnel::mux::{self, frame};
    let mut buf = data;
    while buf.len() >= frame::HEADER_LEN {
        let head: &[u8; frame::HEADER_LEN] = buf[..frame::HEADER_LEN].try_into().expect("header");
        let Ok(h) = frame::parse_header(head, 1 << 20) else {
            break;
        };
        buf = &buf[frame::HEADER_LEN..];
        if buf.len() < h.len {
            break;
        }
        let (p, rest) = buf.split_at(h.len);
        buf = rest;
        match h.kind {
            frame::Kind::Open => {
                if let Ok(o) = frame::Open::decode(p) {
                    assert_eq!(frame::Open::decode(&o.encode()).as_ref(), Ok(&o));
                }
            }
            frame::Kind::Hello => {
                if let Ok(o) = frame::Hello::decode(p) {
                    assert_eq!(frame::Hello::decode(&o.encode()).as_ref(), Ok(&o));
                }
            }
            frame::Kind::OpenErr => drop(frame::decode_open_err(p)),
            frame::Kind::Reset => drop(frame::decode_reset(p)),
            frame::Kind::GoAway => drop(frame::decode_goaway(p)),
            frame::Kind::Window => drop(frame::decode_window(p)),
            frame::Kind::HelloOk => drop(frame::decode_pair(h.kind, p)),
            frame::Kind::OpenOk => {
                if let Ok(o) = frame::OpenOk::decode(p) {
                    assert_eq!(frame::OpenOk::decode(&o.encode()), Ok(o));
                }
            }
            frame::Kind::Auth => drop(frame::decode_text(h.kind, p)),
            _ => {}
        }
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    for role in [mux::Role::Acceptor, mux::Role::Opener] {
        rt.block_on(async {
            let (ours, mut theirs) = tokio::io::duplex(1 << 20);
            let cfg = mux::Config {
                max_frame_bytes: 64 << 10,
                stream_window_bytes: 65_535,
                connection_window_bytes: 1 << 20,
                max_streams: 16,
            };
            let on_open: mux::OnOpen = std::sync::Arc::new(drop);
            let (_conn, driver, _events) = mux::connect(ours, role, cfg, Some(on_open));
            let run = tokio::spawn(driver.run());
            use tokio::io::AsyncWriteExt as _;
            let _ = theirs.write_all(data).await;
            let _ = theirs.shutdown().await;
            // Drain what the connection writes so it never blocks on a full pipe.
            let drain = tokio::spawn(async move {
                let mut sink = tokio::io::sink();
                let _ = tokio::io::copy(&mut theirs, &mut sink).await;
            });
            let reason = tokio::time::timeout(std::time::Duration::from_secs(5), run)
                .await
                .expect("the reader ends at the end of its input")
                .expect("the reader does not panic");
            assert!(!reason.is_empty());
            drain.abort();
        });
    }
}

/// A target the wire form of which must parse back to itself (the broker sends `wire_dest`
/// to the agent, which rebuilds the target with `from_wire`).
pub fn round_trip(t: &tether_tunnel::Target) {
    let back = tether_tunnel::Target::from_wire(&t.cluster, &t.wire_dest());
    assert_eq!(back.as_ref(), Ok(t), "wire form {:?}", t.wire_dest());
}

fn check_target(authority: &str) {
    if let Ok(t) = tether_tunnel::Target::parse(authority) {
        round_trip(&t);
    }
}

/// The tunnel's addressing and control-message fields: a CONNECT/DIAL_REQ authority, the
/// `tether-cluster` + `tether-target` headers an agent gets, target patterns of client
/// policies, `tether-error` labels. Input: fields separated by `\n`.
pub fn tunnel_address(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut f = text.split('\n');
    let (a, b, c) = (
        f.next().unwrap_or(""),
        f.next().unwrap_or(""),
        f.next().unwrap_or(""),
    );
    check_target(a);
    if let Ok(t) = tether_tunnel::Target::from_wire(a, b) {
        round_trip(&t);
    }
    if tether_tunnel::pattern::validate(c).is_ok()
        && let Ok(tether_tunnel::Target {
            dest: tether_tunnel::Dest::HostPort { host, port },
            ..
        }) = tether_tunnel::Target::parse(a)
    {
        let _ = tether_tunnel::pattern::matches(c, &host, port);
    }
    let _ = tether_tunnel::pattern::cluster_matches(b, a);
    let _ = tether_tunnel::DialErrorKind::from_label(a);
    let safe = tether_tunnel::wire::header_safe(&text);
    assert!(
        http::HeaderValue::from_str(&safe).is_ok(),
        "header_safe output is not a header value: {safe:?}"
    );
}

/// A kubeconfig (bootstrap and hub kubeconfigs, `tetherctl` proxy configs).
pub fn kubeconfig(data: &[u8]) {
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = tether_control::kubeconfig::parse_hub_endpoint(s, "fuzz");
        let _ = tether_control::kubeconfig::parse_server(s);
    }
}

/// `tetherctl apply -f` input: split into documents, each validated as an add-on resource or a
/// ClientAccessPolicy.
pub fn apply_documents(data: &[u8]) {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(docs) = tether_control::resources::parse_documents(s) else {
        return;
    };
    for d in docs {
        let _ = tether_control::addons::parse_resource(d.clone());
        let _ = tether_control::clients::parse_policy(d);
    }
}

/// A service config file (`tether_config::from_str`): the first byte picks the service
/// (broker, agent, health prober), the rest is the YAML.
pub fn service_config(data: &[u8]) {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let origin = std::path::Path::new("fuzz.yaml");
    match which % 3 {
        0 => drop(tether_config::from_str::<tunnel_broker::config::BrokerConfig>(text, origin)),
        1 => drop(tether_config::from_str::<tunnel_agent::config::AgentConfig>(text, origin)),
        _ => drop(tether_config::from_str::<health_prober::config::ProberConfig>(text, origin)),
    }
}

/// A NATS message body the hub accepts from agents, probers and tetherctl (the serde types
/// of docs/schemas): the first byte picks the type, the rest is the JSON.
pub fn nats_payload(data: &[u8]) {
    use tether_control::{addons, clients, health, resources};
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    fn de<T: serde::de::DeserializeOwned + serde::Serialize>(body: &[u8]) {
        if let Ok(v) = serde_json::from_slice::<T>(body) {
            // What the hub accepted serialises again (it is stored and re-read).
            let text = serde_json::to_vec(&v).expect("serialise");
            serde_json::from_slice::<T>(&text).expect("re-read what was serialised");
        }
    }
    match which % 11 {
        0 => de::<resources::CsrSubmit>(body),
        1 => de::<resources::CsrGet>(body),
        2 => de::<resources::LeaseRenew>(body),
        3 => de::<addons::AddOnLeaseRenew>(body),
        4 => de::<addons::AddOnStatusReport>(body),
        5 => de::<addons::AddOnAgentConfigRequest>(body),
        6 => de::<health::HealthRecord>(body),
        7 => de::<health::HealthGetRequest>(body),
        8 => de::<clients::ClientCreateRequest>(body),
        9 => de::<clients::ClientDeleteRequest>(body),
        _ => de::<resources::AdminClusterRequest>(body),
    }
}
