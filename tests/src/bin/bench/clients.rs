//! The `clients` section: one row per way a client reaches a service inside a cluster, all to
//! the same broker, agent and target, rotated every round:
//!
//! - CONNECT: plain HTTP CONNECT on the broker's client port (the reference);
//! - TLS CONNECT: the same over TLS (ALPN http/1.1) on the broker's client TLS port;
//! - TLS CONNECT via a local relay: the same through a plain TCP forward in a process of its
//!   own (this binary with `--relay-server`), the floor of any local port forward in front of
//!   the client TLS port — the topology of `tetherctl proxy connect`, with nothing but a copy in
//!   the forward;
//! - gRPC Dial (SDK): [`tether_client::Dialer`] in this process (the native gRPC Dial API, what
//!   the `kube::Client` through the tunnel uses);
//! - `tetherctl proxy connect`: the real binary as a local port forward; the bench connects to
//!   its local port;
//! - the same two over the broker's **plain** client port, the like-for-like comparison with
//!   plain CONNECT: the SDK with `http://` (HTTP/2 without TLS, bearer token), and `proxy
//!   connect` with `http://`, which sends a CONNECT per forwarded connection and moves the bytes
//!   with `splice(2)`; and CONNECT via a local relay (a user-space copy in a process of its
//!   own), the topology of `proxy connect` to the plain port with an ordinary relay;
//! - konnectivity: the broker's konnectivity-compatible `ProxyService/Proxy` (one RPC per
//!   connection, each write one DATA packet: [`tether_e2e::konnectivity`], a client like
//!   upstream's single-use tunnel), on the client TLS port and on the plain port (h2c).
//!
//! Each is measured with 1 and 8 streams (back to back, the order alternating by round), bulk
//! upload to the target's sink (the rows per path) and bulk download from the target (one row for
//! all paths: kube watches, large GETs and logs are downloads, the receive side of the SDK and of
//! `proxy connect`). CPU-s/GB counts every process on the path, the same set for every row: this
//! process (bench client, and the SDK for the gRPC path), the target, broker, agent and tetherctl
//! (idle outside its row). The SDK and `proxy connect` rows also give their CPU-s/GB against TLS
//! CONNECT, the path with the same client-side TLS; the pass mark stays against plain CONNECT
//! (issue 16).
//!
//! Floors. Two measurements say how close a path can come to plain CONNECT at all:
//!
//! - the client-side TLS floor ([`tls_floor`]): CPU-s/GB of moving bytes from a rustls client to
//!   a rustls server in memory (the providers, cipher suite and record sizes of the client TLS
//!   port, no sockets): the encryption and decryption every path over the client TLS port pays
//!   and plain CONNECT does not;
//! - TLS CONNECT via a local relay (above): what one more local process costs.
//!
//! The "floors" row then judges each path against the cheapest path of its own topology: TLS
//! CONNECT against CONNECT plus the TLS floor, the SDK against TLS CONNECT (plain port: against
//! CONNECT), `proxy connect` against TLS CONNECT via a local relay (plain port: CONNECT via a
//! local relay).

use std::time::Duration;

use anyhow::Context as _;
use tether_e2e::benchkit::{cpu_secs, mean, median, range_note};
use tether_e2e::{Broker, Hub, OPS_TOKEN};
use tokio::io::{AsyncRead, AsyncWrite};

use super::{CLUSTER, Confirm, Row, Setup, download_streams, gbit, upload_streams_confirmed};

/// A stream of any client path.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}
type BoxIo = Box<dyn Io>;

/// Streams per measurement.
pub(super) const STREAMS: [usize; 2] = [1, 8];
/// Within this much of CONNECT (throughput and CPU-s/GB).
pub(super) const TOLERANCE: f64 = 0.10;

/// A client path (the `--client-paths` values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Path {
    /// Plain HTTP CONNECT on the client port (the reference).
    Connect,
    /// HTTP CONNECT on the client TLS port.
    TlsConnect,
    /// TLS CONNECT through a plain local relay process (a floor).
    TlsConnectRelayed,
    /// CONNECT through a plain local relay process (a floor).
    ConnectRelayed,
    /// The SDK's gRPC Dial on the client TLS port.
    #[value(name = "sdk")]
    Grpc,
    /// `tetherctl proxy connect` to the client TLS port.
    ProxyConnect,
    /// The SDK's gRPC Dial on the plain port (h2c).
    #[value(name = "sdk-plain")]
    GrpcPlain,
    /// `tetherctl proxy connect` to the plain port.
    ProxyConnectPlain,
    /// konnectivity's `ProxyService/Proxy` on the client TLS port.
    Konnectivity,
    /// konnectivity's `ProxyService/Proxy` on the plain port (h2c).
    KonnectivityPlain,
}

/// Index 0 must be CONNECT, 1 TLS CONNECT and 2 TLS CONNECT via a relay (the references of the
/// ratios).
const PATHS: [Path; 10] = [
    Path::Connect,
    Path::TlsConnect,
    Path::TlsConnectRelayed,
    Path::ConnectRelayed,
    Path::Grpc,
    Path::ProxyConnect,
    Path::GrpcPlain,
    Path::ProxyConnectPlain,
    Path::Konnectivity,
    Path::KonnectivityPlain,
];
const CONNECT: usize = 0;
const TLS_CONNECT: usize = 1;
const TLS_CONNECT_RELAYED: usize = 2;
const CONNECT_RELAYED: usize = 3;

impl Path {
    fn name(self) -> &'static str {
        match self {
            Path::Connect => "CONNECT",
            Path::TlsConnect => "TLS CONNECT",
            Path::TlsConnectRelayed => "TLS CONNECT via a local relay",
            Path::ConnectRelayed => "CONNECT via a local relay",
            Path::Grpc => "gRPC Dial (SDK)",
            Path::ProxyConnect => "tetherctl proxy connect",
            Path::GrpcPlain => "gRPC Dial (SDK), plain port",
            Path::ProxyConnectPlain => "tetherctl proxy connect, plain port",
            Path::Konnectivity => "konnectivity",
            Path::KonnectivityPlain => "konnectivity, plain port",
        }
    }

    /// How an upload on this path is confirmed: konnectivity's close is a full close (the
    /// broker drops what the target sends after CLOSE_REQ), its clean CLOSE_RSP the confirmation.
    fn confirm(self) -> Confirm {
        match self {
            Path::Konnectivity | Path::KonnectivityPlain => Confirm::CleanClose,
            _ => Confirm::TargetCount,
        }
    }

    /// A measured floor, not a client path of its own.
    fn is_floor(self) -> bool {
        matches!(self, Path::TlsConnectRelayed | Path::ConnectRelayed)
    }
}

struct Clients {
    plain: std::net::SocketAddr,
    tls_addr: std::net::SocketAddr,
    /// A plain TCP forward to `tls_addr`.
    tls_relay: std::net::SocketAddr,
    /// A plain TCP forward to `plain`.
    plain_relay: std::net::SocketAddr,
    tls: rustls::ClientConfig,
    dialer: tether_client::Dialer,
    /// The SDK to the plain client port (HTTP/2 without TLS).
    dialer_plain: tether_client::Dialer,
    forward: std::net::SocketAddr,
    /// `proxy connect` to the plain client port.
    forward_plain: std::net::SocketAddr,
    /// gRPC channels for konnectivity: the client TLS port, the plain port.
    konnectivity: tonic::transport::Channel,
    konnectivity_plain: tonic::transport::Channel,
}

impl Clients {
    /// The local address a socket-based path connects to (`None` for the SDK's and konnectivity's
    /// paths).
    fn addr(&self, path: Path) -> Option<std::net::SocketAddr> {
        Some(match path {
            Path::Connect => self.plain,
            Path::ConnectRelayed => self.plain_relay,
            Path::TlsConnect => self.tls_addr,
            Path::TlsConnectRelayed => self.tls_relay,
            Path::ProxyConnect => self.forward,
            Path::ProxyConnectPlain => self.forward_plain,
            Path::Grpc | Path::GrpcPlain | Path::Konnectivity | Path::KonnectivityPlain => {
                return None;
            }
        })
    }

    async fn open(&self, path: Path) -> anyhow::Result<BoxIo> {
        let authority = format!("{CLUSTER}:443");
        let addr = self.addr(path);
        let tcp = || async move {
            let tcp = tokio::net::TcpStream::connect(addr.expect("a socket path")).await?;
            tcp.set_nodelay(true)?;
            anyhow::Ok(tcp)
        };
        Ok(match path {
            Path::Connect | Path::ConnectRelayed => {
                let head = format!(
                    "CONNECT {authority} HTTP/1.1\r\nhost: {authority}\r\nproxy-authorization: Bearer {OPS_TOKEN}\r\n\r\n"
                );
                let s = tether_e2e::send_head(tcp().await?, head.as_bytes())
                    .await?
                    .map_err(|(c, m)| anyhow::anyhow!("CONNECT refused: {c} {m}"))?;
                Box::new(s)
            }
            Path::TlsConnect | Path::TlsConnectRelayed => {
                let addr = addr.expect("a socket path");
                let s =
                    tether_e2e::connect_tls(addr, self.tls.clone(), &authority, Some(OPS_TOKEN))
                        .await?
                        .map_err(|(c, m)| anyhow::anyhow!("TLS CONNECT refused: {c} {m}"))?;
                Box::new(s)
            }
            Path::Grpc => Box::new(self.dialer.dial_api_server(CLUSTER).await?),
            Path::GrpcPlain => Box::new(self.dialer_plain.dial_api_server(CLUSTER).await?),
            Path::ProxyConnect | Path::ProxyConnectPlain => Box::new(tcp().await?),
            Path::Konnectivity | Path::KonnectivityPlain => {
                let channel = if path == Path::Konnectivity {
                    &self.konnectivity
                } else {
                    &self.konnectivity_plain
                };
                Box::new(
                    tether_e2e::konnectivity::dial(channel.clone(), OPS_TOKEN, &authority).await?,
                )
            }
        })
    }
}

/// Starts `tetherctl proxy connect` to the API server of [`CLUSTER`] through the broker's client
/// TLS port, or with `plain` its plain client port; its local address.
fn proxy_connect(
    hub: &Hub,
    broker: &Broker,
    plain: bool,
) -> anyhow::Result<(tether_test_support::Child, std::net::SocketAddr)> {
    let mut cmd = std::process::Command::new(tether_test_support::bin("tetherctl")?);
    cmd.args(["proxy", "connect", CLUSTER, "--local-port", "0", "--broker"]);
    if plain {
        cmd.arg(format!("http://{}", broker.client_addr));
    } else {
        cmd.arg(format!("https://{}", broker.client_tls_addr))
            .arg("--broker-ca")
            .arg(hub.pki.ca_path())
            .args(["--broker-server-name", "localhost"]);
    }
    cmd.env("TETHER_TOKEN", OPS_TOKEN);
    let name = if plain {
        "bench-proxy-connect-plain"
    } else {
        "bench-proxy-connect"
    };
    let child = tether_test_support::Child::spawn(name, cmd, hub.path())?;
    let log = hub.path().join(format!("{name}.log"));
    let addr = tether_test_support::wait_until(
        Duration::from_secs(20),
        "tetherctl proxy connect: Forwarding from …",
        || {
            let text = std::fs::read_to_string(&log).ok()?;
            text.lines()
                .find_map(|l| l.strip_prefix("Forwarding from "))?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        },
    )?;
    Ok((child, addr))
}

/// Runs the section; one row per path. `floor`: [`measure_tls_floor`]'s figure for this run.
/// `other_pids`: the target's and the hop processes' (`hop_pids`: broker and agent, whose share
/// of each path's CPU is given apart).
pub async fn section(
    hub: &Hub,
    broker: &Broker,
    setup: &Setup,
    other_pids: &[u32],
    hop_pids: &[u32],
    floor: f64,
) -> anyhow::Result<Vec<Row>> {
    let ca_pem = std::fs::read_to_string(hub.pki.ca_path()).context("hub CA")?;
    let sdk = |endpoint: String| tether_client::DialerConfig {
        endpoint,
        server_name: "localhost".into(),
        ca_pem: ca_pem.clone(),
        client_cert: None,
        token: Some(tether_client::Token(OPS_TOKEN.into())),
        connect_timeout: Duration::from_secs(10),
    };
    let connect = |cfg| async move {
        match setup.sdk_connections {
            Some(n) => tether_client::Dialer::connect_pool(cfg, n).await,
            None => tether_client::Dialer::connect(cfg).await,
        }
    };
    let dialer = connect(sdk(format!("https://{}", broker.client_tls_addr)))
        .await
        .context("SDK Dialer")?;
    let dialer_plain = connect(sdk(format!("http://{}", broker.client_addr)))
        .await
        .context("SDK Dialer to the plain port")?;
    let konnectivity = tether_e2e::konnectivity::channel(
        &format!("https://{}", broker.client_tls_addr),
        &ca_pem,
        "localhost",
    )
    .await
    .context("konnectivity channel")?;
    let konnectivity_plain = tether_e2e::konnectivity::channel(
        &format!("http://{}", broker.client_addr),
        &ca_pem,
        "localhost",
    )
    .await
    .context("konnectivity channel to the plain port")?;
    let (forward_proc, forward) = proxy_connect(hub, broker, false)?;
    let (forward_plain_proc, forward_plain) = proxy_connect(hub, broker, true)?;
    let relay = |name: &str, upstream: std::net::SocketAddr| {
        super::spawn_server(
            hub,
            name,
            &["--relay-server", "--upstream", &upstream.to_string()],
        )
    };
    let (relay_proc, tls_relay) = relay("bench-tls-relay", broker.client_tls_addr)?;
    let (plain_relay_proc, plain_relay) = relay("bench-plain-relay", broker.client_addr)?;
    let clients = Clients {
        plain: broker.client_addr,
        tls_addr: broker.client_tls_addr,
        tls_relay,
        plain_relay,
        tls: tether_e2e::client_tls_config(&hub.pki.ca_path(), &[b"http/1.1"], None)?,
        dialer,
        dialer_plain,
        forward,
        forward_plain,
        konnectivity,
        konnectivity_plain,
    };
    let mut pids = vec![
        std::process::id(),
        forward_proc.pid(),
        forward_plain_proc.pid(),
        relay_proc.pid(),
        plain_relay_proc.pid(),
    ];
    pids.extend_from_slice(other_pids);
    let cpu = || {
        let all = pids.iter().map(|p| cpu_secs(*p)).sum::<f64>();
        let hop = hop_pids.iter().map(|p| cpu_secs(*p)).sum::<f64>();
        // The agent's share of `hop` (broker and agent apart in a focused run).
        let agent = hop_pids.get(1).map_or(0.0, |p| cpu_secs(*p));
        Cpu { all, hop, agent }
    };

    // `--client-paths`: CONNECT and the chosen paths only (indices into PATHS).
    let focus = (!setup.client_paths.is_empty()).then(|| {
        let mut only = vec![CONNECT];
        for p in &setup.client_paths {
            let i = PATHS
                .iter()
                .position(|q| q == p)
                .expect("every path is in PATHS");
            if !only.contains(&i) {
                only.push(i);
            }
        }
        only
    });

    // Warm up every path that is measured.
    let warm: Vec<usize> = focus.clone().unwrap_or_else(|| (0..PATHS.len()).collect());
    for p in warm {
        let path = PATHS[p];
        let socks = vec![clients.open(path).await?];
        upload_streams_confirmed(socks, Duration::from_millis(200), path.confirm(), 0).await?;
    }

    let mut rr_rows = Vec::new();
    if setup.wants("client-rr") {
        rr_rows.push(request_response_row(&clients, setup, &cpu, focus.as_deref()).await?);
    }
    if !setup.wants("clients") {
        return Ok(rr_rows);
    }

    if let Some(only) = focus {
        let mut rows = rr_rows;
        for direction in [Direction::Upload, Direction::Download] {
            if setup.client_direction.is_some_and(|d| d != direction) {
                continue;
            }
            let m = measure(&clients, setup, direction, &cpu, Some(&only)).await?;
            let copies = setup.connect_client_copies(direction);
            rows.extend(focused_rows(&m, &only, direction, copies));
        }
        return Ok(rows);
    }
    let Measured {
        rate,
        cpu_s,
        gb,
        hop_s,
        ..
    } = measure(&clients, setup, Direction::Upload, &cpu, None).await?;
    let down = measure(&clients, setup, Direction::Download, &cpu, None).await?;
    drop((forward_proc, forward_plain_proc));
    drop((relay_proc, plain_relay_proc));

    let per_gb = |p: usize, si: usize| cpu_s[p][si] / gb[p][si];
    let hop_per_gb = |p: usize, si: usize| hop_s[p][si] / gb[p][si];
    let mut rows = rr_rows;
    for (p, path) in PATHS.iter().enumerate() {
        let tput = format!("{} / {}", gbit(mean(&rate[p][0])), gbit(mean(&rate[p][1])));
        let mut notes = Vec::new();
        let mut ok = true;
        for (si, &streams) in STREAMS.iter().enumerate() {
            let vs: Vec<f64> = rate[p][si]
                .iter()
                .zip(&rate[0][si])
                .map(|(x, c)| x / c)
                .collect();
            let r = median(&vs);
            let c = per_gb(p, si) / per_gb(0, si);
            // The paths over the client TLS port also against TLS CONNECT: the same client-side
            // encryption and broker-side decryption, which plain CONNECT does not pay.
            let vs_tls = match path {
                Path::Grpc | Path::Konnectivity => format!(
                    ", {:.2}× TLS CONNECT",
                    per_gb(p, si) / per_gb(TLS_CONNECT, si)
                ),
                Path::ProxyConnect => format!(
                    ", {:.2}× TLS CONNECT, {:.2}× TLS CONNECT via a local relay",
                    per_gb(p, si) / per_gb(TLS_CONNECT, si),
                    per_gb(p, si) / per_gb(TLS_CONNECT_RELAYED, si)
                ),
                Path::TlsConnect => format!(
                    ", {:.2}× CONNECT + the TLS floor",
                    per_gb(p, si) / (per_gb(CONNECT, si) + floor)
                ),
                Path::ProxyConnectPlain => format!(
                    ", {:.2}× CONNECT via a local relay",
                    per_gb(p, si) / per_gb(CONNECT_RELAYED, si)
                ),
                Path::Connect
                | Path::TlsConnectRelayed
                | Path::ConnectRelayed
                | Path::GrpcPlain
                | Path::KonnectivityPlain => String::new(),
            };
            if *path == Path::TlsConnectRelayed {
                notes.push(format!(
                    "{streams}: {r:.2}×{} CONNECT, CPU-s/GB {:.2} ({c:.2}× CONNECT, {:.2}× TLS CONNECT)",
                    range_note(&vs),
                    per_gb(p, si),
                    per_gb(p, si) / per_gb(TLS_CONNECT, si)
                ));
            } else if *path == Path::ConnectRelayed {
                notes.push(format!(
                    "{streams}: {r:.2}×{} CONNECT, CPU-s/GB {:.2} ({c:.2}× CONNECT)",
                    range_note(&vs),
                    per_gb(p, si),
                ));
            } else if *path != Path::Connect {
                ok &= r >= 1.0 - TOLERANCE && c <= 1.0 + TOLERANCE;
                notes.push(format!(
                    "{streams}: {r:.2}×{} CONNECT, CPU-s/GB {:.2} ({c:.2}× CONNECT{vs_tls}; broker+agent {:.2}, {:.2}× CONNECT's)",
                    range_note(&vs),
                    per_gb(p, si),
                    hop_per_gb(p, si),
                    hop_per_gb(p, si) / hop_per_gb(CONNECT, si)
                ));
            } else {
                notes.push(format!(
                    "{streams}: CPU-s/GB {:.2} (broker+agent {:.2})",
                    per_gb(p, si),
                    hop_per_gb(p, si)
                ));
            }
        }
        let eight_vs_one = mean(&rate[p][1]) / mean(&rate[p][0]);
        notes.push(format!("8 vs 1 stream {eight_vs_one:.2}×"));
        if matches!(path, Path::ProxyConnect | Path::ProxyConnectPlain) {
            ok &= eight_vs_one >= 1.0;
        }
        rows.push(Row {
            what: format!("client path: {}, 1 / 8 streams", path.name()),
            tunnel: tput,
            result: notes.join("; "),
            target: match path {
                Path::Connect => "the reference".into(),
                Path::TlsConnectRelayed | Path::ConnectRelayed => {
                    "a floor (one more local process)".into()
                }
                Path::ProxyConnect | Path::ProxyConnectPlain => {
                    "within 10 % of CONNECT (tput, CPU-s/GB); 8 ≥ 1 stream".into()
                }
                _ => "within 10 % of CONNECT (tput, CPU-s/GB)".into(),
            },
            ok: (*path != Path::Connect && !path.is_floor()).then_some(ok),
            ..Row::default()
        });
    }
    rows.push(floors_row(floor, &per_gb, &rate));
    rows.push(download_row(&down));
    Ok(rows)
}

/// Which way the bulk data goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Direction {
    /// Client → target (the target's sink counts).
    Upload,
    /// Target → client (kube watches, large GETs, logs): the SDK's and `proxy connect`'s
    /// receive side.
    Download,
}

/// The path each path's request/response is judged against: the cheapest path of its own
/// topology (as in the floors row), `None` for CONNECT and the floors themselves.
fn rr_reference(p: Path) -> Option<usize> {
    match p {
        Path::Connect | Path::TlsConnectRelayed | Path::ConnectRelayed => None,
        Path::TlsConnect | Path::GrpcPlain | Path::KonnectivityPlain => Some(CONNECT),
        Path::Grpc | Path::Konnectivity => Some(TLS_CONNECT),
        Path::ProxyConnect => Some(TLS_CONNECT_RELAYED),
        Path::ProxyConnectPlain => Some(CONNECT_RELAYED),
    }
}

/// 64 B request/response on one open stream per client path (the target echoes), in blocks
/// rotated so that each path runs first, second, … equally often; p50 and p99 per path, and
/// the CPU per round trip of every process on the path and of broker and agent. Each path is
/// set against the cheapest path of its own topology: a user of `proxy connect` (kubectl) or
/// of the SDK pays this per request, whatever the bulk figures say. Information: issue 16
/// states no per-message target for the client paths.
async fn request_response_row(
    clients: &Clients,
    setup: &Setup,
    cpu: &dyn Fn() -> Cpu,
    only: Option<&[usize]>,
) -> anyhow::Result<Row> {
    use tether_e2e::benchkit::{percentile, request_response};
    use tokio::io::AsyncWriteExt as _;
    let (per_block, blocks) = if setup.quick { (300, 4) } else { (1000, 12) };
    let paths: Vec<usize> = only.map_or_else(|| (0..PATHS.len()).collect(), <[usize]>::to_vec);
    let mut socks = Vec::with_capacity(paths.len());
    for &p in &paths {
        let mut s = clients.open(PATHS[p]).await?;
        s.write_all(b"E").await?;
        request_response(&mut s, 200, &mut Vec::new())
            .await
            .with_context(|| format!("{}: request/response warm-up", PATHS[p].name()))?;
        socks.push(s);
    }
    let mut samples = vec![Vec::with_capacity(per_block * blocks); PATHS.len()];
    let (mut all_s, mut hop_s) = (vec![0.0f64; PATHS.len()], vec![0.0f64; PATHS.len()]);
    for block in 0..blocks {
        let mut order: Vec<usize> = (0..paths.len()).collect();
        order.rotate_left(block % paths.len());
        for i in order {
            let p = paths[i];
            let c0 = cpu();
            request_response(&mut socks[i], per_block, &mut samples[p])
                .await
                .with_context(|| format!("{}: request/response", PATHS[p].name()))?;
            let c1 = cpu();
            all_s[p] += (c1.all - c0.all).max(0.0);
            hop_s[p] += (c1.hop - c0.hop).max(0.0);
        }
    }
    drop(socks);
    let n = (per_block * blocks) as f64;
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    for s in &mut samples {
        s.sort();
    }
    let p50 = |p: usize| percentile(&samples[p], 0.5);
    let cells: Vec<String> = paths
        .iter()
        .map(|&p| {
            let vs = rr_reference(PATHS[p])
                .filter(|r| paths.contains(r))
                .map(|r| {
                    format!(
                        ", {:+.0} µs vs {}",
                        us(p50(p)) - us(p50(r)),
                        PATHS[r].name()
                    )
                })
                .unwrap_or_default();
            format!(
                "{} {:.0} / {:.0} µs{vs}, CPU per round trip {:.1} µs (broker+agent {:.1})",
                PATHS[p].name(),
                us(p50(p)),
                us(percentile(&samples[p], 0.99)),
                all_s[p] / n * 1e6,
                hop_s[p] / n * 1e6,
            )
        })
        .collect();
    println!(
        "  client paths, 64 B request/response p50 / p99: {}",
        cells.join("; ")
    );
    Ok(Row {
        what: "client paths, 64 B request/response p50 / p99 (each path against the cheapest path of its topology)".into(),
        tunnel: format!(
            "CONNECT {:.0} / {:.0} µs",
            us(p50(CONNECT)),
            us(percentile(&samples[CONNECT], 0.99))
        ),
        result: cells.join("; "),
        target: "information (per-request cost of each client path)".into(),
        ok: None,
        ..Row::default()
    })
}

/// CPU seconds so far: every process on the path, broker and agent, the agent alone.
#[derive(Clone, Copy)]
struct Cpu {
    all: f64,
    hop: f64,
    agent: f64,
}

/// Each field `[path][streams index]`: throughput per round (bytes/s), CPU seconds of every
/// process on the path, GB, CPU seconds of broker and agent, of the agent alone.
struct Measured {
    rate: Vec<[Vec<f64>; 2]>,
    cpu_s: Vec<[f64; 2]>,
    gb: Vec<[f64; 2]>,
    hop_s: Vec<[f64; 2]>,
    agent_s: Vec<[f64; 2]>,
}

/// Every path (or the paths of `only`, indices into [`PATHS`]) with 1 and 8 streams in
/// `direction`, `setup.rounds` rounds in rotating order.
async fn measure(
    clients: &Clients,
    setup: &Setup,
    direction: Direction,
    cpu: &dyn Fn() -> Cpu,
    only: Option<&[usize]>,
) -> anyhow::Result<Measured> {
    let mut rate = vec![[Vec::new(), Vec::new()]; PATHS.len()];
    let mut cpu_s = vec![[0.0f64; 2]; PATHS.len()];
    let mut gb = vec![[0.0f64; 2]; PATHS.len()];
    let mut hop_s = vec![[0.0f64; 2]; PATHS.len()];
    let mut agent_s = vec![[0.0f64; 2]; PATHS.len()];
    let paths: Vec<usize> = only.map_or_else(|| (0..PATHS.len()).collect(), <[usize]>::to_vec);
    for round in 0..setup.rounds {
        let mut order = paths.clone();
        order.rotate_left(round % paths.len());
        // Each path's 1- and 8-stream measurements run back to back (their order alternating by
        // round), so its 8 vs 1 ratio compares two figures seconds apart rather than two halves
        // of the round, and the machine's drift over a round does not enter it.
        let mut stream_order: Vec<usize> = (0..STREAMS.len())
            .filter(|&si| {
                setup.client_streams.is_empty() || setup.client_streams.contains(&STREAMS[si])
            })
            .collect();
        if round % 2 == 1 {
            stream_order.reverse();
        }
        for &p in &order {
            for &si in &stream_order {
                let streams = STREAMS[si];
                let mut socks = Vec::new();
                for _ in 0..streams {
                    socks.push(clients.open(PATHS[p]).await?);
                }
                // Only CONNECT's client is ever loaded (the reference the other paths meet).
                let copies = if PATHS[p] == Path::Connect {
                    setup.connect_client_copies(direction)
                } else {
                    0
                };
                let c0 = cpu();
                let (bytes, secs) = match direction {
                    Direction::Upload => {
                        upload_streams_confirmed(socks, setup.secs, PATHS[p].confirm(), copies)
                            .await?
                    }
                    Direction::Download => download_streams(socks, setup.secs, copies).await?,
                };
                let c1 = cpu();
                cpu_s[p][si] += c1.all - c0.all;
                hop_s[p][si] += c1.hop - c0.hop;
                agent_s[p][si] += c1.agent - c0.agent;
                gb[p][si] += bytes as f64 / 1e9;
                rate[p][si].push(bytes as f64 / secs);
            }
        }
        for (si, &streams) in STREAMS.iter().enumerate() {
            if !stream_order.contains(&si) {
                continue;
            }
            println!(
                "  clients{}, {streams} stream(s), round {}: {}",
                if direction == Direction::Download {
                    " (download)"
                } else {
                    ""
                },
                round + 1,
                paths
                    .iter()
                    .map(|&p| format!(
                        "{} {}",
                        PATHS[p].name(),
                        gbit(*rate[p][si].last().expect("measured"))
                    ))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    Ok(Measured {
        rate,
        cpu_s,
        gb,
        hop_s,
        agent_s,
    })
}

/// A focused run's rows (`--client-paths`): each measured path against CONNECT in the same
/// rounds, with broker and agent CPU apart; information, not judged.
fn focused_rows(
    m: &Measured,
    only: &[usize],
    direction: Direction,
    connect_client_copies: usize,
) -> Vec<Row> {
    let per_gb = |s: &[[f64; 2]], p: usize, si: usize| s[p][si] / m.gb[p][si];
    only.iter()
        .map(|&p| {
            let notes: Vec<String> = STREAMS
                .iter()
                .enumerate()
                .filter(|&(si, _)| !m.rate[p][si].is_empty())
                .map(|(si, streams)| {
                    let vs: Vec<f64> = m.rate[p][si]
                        .iter()
                        .zip(&m.rate[CONNECT][si])
                        .map(|(x, c)| x / c)
                        .collect();
                    let hop = per_gb(&m.hop_s, p, si);
                    let agent = per_gb(&m.agent_s, p, si);
                    format!(
                        "{streams}: {:.2}×{} CONNECT, CPU-s/GB {:.2} ({:.2}× CONNECT's); broker {:.3}, agent {:.3} CPU-s/GB, broker+agent {:.2}× CONNECT's",
                        median(&vs),
                        range_note(&vs),
                        per_gb(&m.cpu_s, p, si),
                        per_gb(&m.cpu_s, p, si) / per_gb(&m.cpu_s, CONNECT, si),
                        hop - agent,
                        agent,
                        hop / per_gb(&m.hop_s, CONNECT, si),
                    )
                })
                .collect();
            Row {
                what: format!(
                    "client path {}: {}{}, 1 / 8 streams",
                    match direction {
                        Direction::Upload => "upload",
                        Direction::Download => "download",
                    },
                    PATHS[p].name(),
                    if p == CONNECT && connect_client_copies > 0 {
                        match direction {
                            Direction::Upload => format!(
                                " (writer copies each buffer {connect_client_copies} more times)"
                            ),
                            Direction::Download => format!(
                                " (reader copies each read {connect_client_copies} more times)"
                            ),
                        }
                    } else {
                        String::new()
                    }
                ),
                tunnel: m.rate[p]
                    .iter()
                    .map(|r| {
                        if r.is_empty() {
                            "—".to_owned()
                        } else {
                            gbit(mean(r))
                        }
                    })
                    .collect::<Vec<_>>()
                    .join(" / "),
                result: notes.join("; "),
                target: "information (--client-paths)".into(),
                ok: None,
                ..Row::default()
            }
        })
        .collect()
}

/// Downloads (target → client): every client path against CONNECT, throughput and CPU-s/GB
/// with 1 and 8 streams, judged like uploads (within 10 %), the floors as information.
fn download_row(
    Measured {
        rate,
        cpu_s,
        gb,
        hop_s,
        ..
    }: &Measured,
) -> Row {
    let per_gb = |p: usize, si: usize| cpu_s[p][si] / gb[p][si];
    let hop_per_gb = |p: usize, si: usize| hop_s[p][si] / gb[p][si];
    let mut ok = true;
    let mut notes = vec![format!(
        "CONNECT {} / {}, CPU-s/GB {:.2} / {:.2}",
        gbit(mean(&rate[CONNECT][0])),
        gbit(mean(&rate[CONNECT][1])),
        per_gb(CONNECT, 0),
        per_gb(CONNECT, 1)
    )];
    for (p, path) in PATHS.iter().enumerate().skip(1) {
        let ratios = [0, 1].map(|si| {
            let vs: Vec<f64> = rate[p][si]
                .iter()
                .zip(&rate[CONNECT][si])
                .map(|(x, c)| x / c)
                .collect();
            (
                median(&vs),
                per_gb(p, si) / per_gb(CONNECT, si),
                hop_per_gb(p, si) / hop_per_gb(CONNECT, si),
            )
        });
        if !path.is_floor() {
            ok &= ratios
                .iter()
                .all(|&(r, c, _)| r >= 1.0 - TOLERANCE && c <= 1.0 + TOLERANCE);
        }
        notes.push(format!(
            "{}: throughput {:.2} / {:.2}×, CPU-s/GB {:.2} / {:.2}× (broker+agent {:.2} / {:.2}×){}",
            path.name(),
            ratios[0].0,
            ratios[1].0,
            ratios[0].1,
            ratios[1].1,
            ratios[0].2,
            ratios[1].2,
            if path.is_floor() { " (a floor)" } else { "" }
        ));
    }
    Row {
        what: "client paths, download (target → client), vs CONNECT, 1 / 8 streams".into(),
        tunnel: format!(
            "{} / {}",
            gbit(mean(&rate[CONNECT][0])),
            gbit(mean(&rate[CONNECT][1]))
        ),
        result: notes.join("; "),
        target: "within 10 % of CONNECT (tput, CPU-s/GB)".into(),
        ok: Some(ok),
        ..Row::default()
    }
}

/// Each path against the cheapest path of its own topology (CPU-s/GB, 1 and 8 streams): TLS
/// CONNECT against CONNECT plus the client-side TLS floor, the SDK against TLS CONNECT (same
/// TLS, same processes), `proxy connect` against TLS CONNECT via a local relay (same TLS, one
/// more local process). Throughput too, where the floor is a measured path.
fn floors_row(floor: f64, per_gb: &dyn Fn(usize, usize) -> f64, rate: &[[Vec<f64>; 2]]) -> Row {
    let idx = |path: Path| {
        PATHS
            .iter()
            .position(|p| *p == path)
            .expect("a measured path")
    };
    let mut notes = vec![format!(
        "client-side TLS floor {floor:.2} CPU-s/GB = {:.2} / {:.2}× CONNECT's (1 / 8 streams): \
         no path over the client TLS port can come within 10 % of plain CONNECT while this is \
         above 0.10×",
        floor / per_gb(CONNECT, 0),
        floor / per_gb(CONNECT, 1)
    )];
    let mut ok = true;
    let mut judge = |name: &str, cpu: [f64; 2], tput: Option<[f64; 2]>| {
        let worst_cpu = cpu[0].max(cpu[1]);
        ok &= worst_cpu <= 1.0 + TOLERANCE;
        let tput_note = match tput {
            Some(t) => {
                ok &= t[0].min(t[1]) >= 1.0 - TOLERANCE;
                format!(", throughput {:.2} / {:.2}×", t[0], t[1])
            }
            None => String::new(),
        };
        notes.push(format!(
            "{name}: CPU-s/GB {:.2} / {:.2}×{tput_note}",
            cpu[0], cpu[1]
        ));
    };
    let tls = idx(Path::TlsConnect);
    judge(
        "TLS CONNECT vs CONNECT + TLS floor",
        [0, 1].map(|si| per_gb(tls, si) / (per_gb(CONNECT, si) + floor)),
        None,
    );
    for (path, floor_path) in [
        (Path::Grpc, Path::TlsConnect),
        (Path::ProxyConnect, Path::TlsConnectRelayed),
        (Path::GrpcPlain, Path::Connect),
        (Path::ProxyConnectPlain, Path::ConnectRelayed),
        (Path::Konnectivity, Path::TlsConnect),
        (Path::KonnectivityPlain, Path::Connect),
    ] {
        let (p, f) = (idx(path), idx(floor_path));
        judge(
            &format!("{} vs {}", path.name(), floor_path.name()),
            [0, 1].map(|si| per_gb(p, si) / per_gb(f, si)),
            Some([0, 1].map(|si| mean(&rate[p][si]) / mean(&rate[f][si]))),
        );
    }
    // 8 streams against 1: on a machine where even plain CONNECT loses throughput with 8
    // streams (every process on the path shares the CPUs), a forward scales if it loses no
    // more than its floor.
    let eight_vs_one = |p: usize| mean(&rate[p][1]) / mean(&rate[p][0]);
    let mut scaling = Vec::new();
    for (fwd, relayed) in [
        (Path::ProxyConnect, Path::TlsConnectRelayed),
        (Path::ProxyConnectPlain, Path::ConnectRelayed),
    ] {
        let (f, r) = (idx(fwd), idx(relayed));
        ok &= eight_vs_one(f) >= eight_vs_one(r) * (1.0 - TOLERANCE);
        scaling.push(format!(
            "{} {:.2}×, {} {:.2}×",
            fwd.name(),
            eight_vs_one(f),
            relayed.name(),
            eight_vs_one(r)
        ));
    }
    notes.push(format!(
        "8 vs 1 stream: {}, CONNECT {:.2}×",
        scaling.join(", "),
        eight_vs_one(CONNECT)
    ));
    Row {
        what: "client paths vs the floor of their topology, 1 / 8 streams".into(),
        result: notes.join("; "),
        target: "within 10 % of the floor (CPU-s/GB, tput, 8 vs 1 stream)".into(),
        ok: Some(ok),
        ..Row::default()
    }
}

/// [`tls_floor`] with a leaf from `hub`'s CA, on a blocking thread: one AES-GCM encryption and
/// one decryption per byte, as rustls does them, in CPU-s/GB. The client paths judge TLS against
/// it; the throughput rows judge the tunnel's hops against the relay floor plus it.
pub(super) async fn measure_tls_floor(hub: &Hub) -> anyhow::Result<f64> {
    let (ca, leaf) = (
        hub.pki.ca_path(),
        hub.pki.issue(
            "bench-tls-floor",
            tether_tls::Identity::Hub {
                component: "bench-tls-floor".into(),
            },
            &["localhost"],
        )?,
    );
    tokio::task::spawn_blocking(move || tls_floor(&ca, &leaf, FLOOR_SECS)).await?
}

/// Seconds of data through the in-memory TLS pair.
const FLOOR_SECS: f64 = 1.0;
/// Plaintext per write into the client connection (the bench's upload buffer size).
const FLOOR_CHUNK: usize = super::BUF;

/// CPU-s/GB (this thread's CPU time) of moving bytes from a rustls client to a rustls server
/// in memory for `secs`: the same crypto provider and defaults as the client TLS port (the
/// client from [`tether_e2e::client_tls_config`], the server the broker's defaults with the
/// leaf `leaf`), no sockets. The cost every path over TLS pays and plain CONNECT does not.
fn tls_floor(
    ca: &std::path::Path,
    leaf: &tether_test_support::LeafFiles,
    secs: f64,
) -> anyhow::Result<f64> {
    use std::io::{Read as _, Write as _};
    use std::sync::Arc;
    let client_cfg = tether_e2e::client_tls_config(ca, &[b"http/1.1"], None)?;
    let server_cfg = rustls::ServerConfig::builder_with_provider(tether_tls::crypto_provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(
            tether_tls::pem::read_certs(&leaf.cert)?,
            tether_tls::pem::read_key(&leaf.key)?,
        )?;
    let mut client = rustls::ClientConnection::new(Arc::new(client_cfg), "localhost".try_into()?)?;
    client.set_buffer_limit(None);
    let mut server = rustls::ServerConnection::new(Arc::new(server_cfg))?;
    let mut wire = Vec::with_capacity(2 * FLOOR_CHUNK);
    let mut plain = vec![0u8; FLOOR_CHUNK];
    // Moves everything the client has to the server and reads the server's plaintext out;
    // the bytes read.
    let mut pump = |client: &mut rustls::ClientConnection,
                    server: &mut rustls::ServerConnection|
     -> anyhow::Result<usize> {
        let mut got = 0;
        loop {
            while server.wants_write() {
                wire.clear();
                server.write_tls(&mut wire)?;
                let mut rd = &wire[..];
                while !rd.is_empty() {
                    client.read_tls(&mut rd)?;
                    client.process_new_packets()?;
                }
            }
            if !client.wants_write() {
                return Ok(got);
            }
            wire.clear();
            while client.wants_write() {
                client.write_tls(&mut wire)?;
            }
            let mut rd = &wire[..];
            while !rd.is_empty() {
                server.read_tls(&mut rd)?;
                server.process_new_packets()?;
                loop {
                    match server.reader().read(&mut plain) {
                        Ok(0) => break,
                        Ok(n) => got += n,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(e) => return Err(e.into()),
                    }
                }
            }
        }
    };
    while client.is_handshaking() || server.is_handshaking() {
        pump(&mut client, &mut server)?;
    }
    let data = vec![0x5au8; FLOOR_CHUNK];
    let thread_cpu = || -> anyhow::Result<f64> {
        use nix::sys::resource::{UsageWho, getrusage};
        let u = getrusage(UsageWho::RUSAGE_THREAD)?;
        let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 / 1e6;
        Ok(t(u.user_time()) + t(u.system_time()))
    };
    let (c0, start) = (thread_cpu()?, std::time::Instant::now());
    let mut bytes = 0usize;
    while start.elapsed().as_secs_f64() < secs {
        client.writer().write_all(&data)?;
        bytes += pump(&mut client, &mut server)?;
    }
    anyhow::ensure!(
        bytes > 0,
        "no plaintext came through the in-memory TLS pair"
    );
    Ok((thread_cpu()? - c0) / (bytes as f64 / 1e9))
}
