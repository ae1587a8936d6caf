//! The `clients` section: one row per way a client reaches a service inside a cluster, all to
//! the same broker, agent and target, rotated every round:
//!
//! - CONNECT: plain HTTP CONNECT on the broker's client port (the reference);
//! - TLS CONNECT: the same over TLS (ALPN http/1.1) on the broker's client TLS port;
//! - gRPC Dial (SDK): [`tether_client::Dialer`] in this process (the native gRPC Dial API, what
//!   the `kube::Client` through the tunnel uses);
//! - `tetherctl proxy connect`: the real binary as a local port forward; the bench connects to
//!   its local port.
//!
//! Each is measured with 1 and 8 streams (bulk upload to the target's sink). CPU-s/GB counts
//! every process on the path, the same set for every row: this process (bench client, and the
//! SDK for the gRPC path), the target, broker, agent and tetherctl (idle outside its row). The
//! SDK and `proxy connect` rows also give their CPU-s/GB against TLS CONNECT, the path with the
//! same client-side TLS; the pass mark stays against plain CONNECT (issue 16).

use std::time::Duration;

use anyhow::Context as _;
use tether_e2e::benchkit::{cpu_secs, median, range_note};
use tether_e2e::{Broker, Hub, OPS_TOKEN};
use tokio::io::{AsyncRead, AsyncWrite};

use super::{CLUSTER, Row, Setup, gbit, upload_streams};

/// A stream of any client path.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}
type BoxIo = Box<dyn Io>;

/// Streams per measurement.
const STREAMS: [usize; 2] = [1, 8];
/// Within this much of CONNECT (throughput and CPU-s/GB).
const TOLERANCE: f64 = 0.10;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Path {
    Connect,
    TlsConnect,
    Grpc,
    ProxyConnect,
}

/// Index 0 must be CONNECT and 1 TLS CONNECT (the references of the ratios).
const PATHS: [Path; 4] = [
    Path::Connect,
    Path::TlsConnect,
    Path::Grpc,
    Path::ProxyConnect,
];

impl Path {
    fn name(self) -> &'static str {
        match self {
            Path::Connect => "CONNECT",
            Path::TlsConnect => "TLS CONNECT",
            Path::Grpc => "gRPC Dial (SDK)",
            Path::ProxyConnect => "tetherctl proxy connect",
        }
    }
}

struct Clients {
    plain: std::net::SocketAddr,
    tls_addr: std::net::SocketAddr,
    tls: rustls::ClientConfig,
    dialer: tether_client::Dialer,
    forward: std::net::SocketAddr,
}

impl Clients {
    async fn open(&self, path: Path) -> anyhow::Result<BoxIo> {
        let authority = format!("{CLUSTER}:443");
        Ok(match path {
            Path::Connect => {
                let tcp = tokio::net::TcpStream::connect(self.plain).await?;
                tcp.set_nodelay(true)?;
                let head = format!(
                    "CONNECT {authority} HTTP/1.1\r\nhost: {authority}\r\nproxy-authorization: Bearer {OPS_TOKEN}\r\n\r\n"
                );
                let s = tether_e2e::send_head(tcp, head.as_bytes())
                    .await?
                    .map_err(|(c, m)| anyhow::anyhow!("CONNECT refused: {c} {m}"))?;
                Box::new(s)
            }
            Path::TlsConnect => {
                let s = tether_e2e::connect_tls(
                    self.tls_addr,
                    self.tls.clone(),
                    &authority,
                    Some(OPS_TOKEN),
                )
                .await?
                .map_err(|(c, m)| anyhow::anyhow!("TLS CONNECT refused: {c} {m}"))?;
                Box::new(s)
            }
            Path::Grpc => Box::new(self.dialer.dial_api_server(CLUSTER).await?),
            Path::ProxyConnect => {
                let tcp = tokio::net::TcpStream::connect(self.forward).await?;
                tcp.set_nodelay(true)?;
                Box::new(tcp)
            }
        })
    }
}

/// Starts `tetherctl proxy connect` to the API server of [`CLUSTER`]; its local address.
fn proxy_connect(
    hub: &Hub,
    broker: &Broker,
) -> anyhow::Result<(tether_test_support::Child, std::net::SocketAddr)> {
    let mut cmd = std::process::Command::new(tether_test_support::bin("tetherctl")?);
    cmd.args(["proxy", "connect", CLUSTER, "--local-port", "0", "--broker"])
        .arg(format!("https://{}", broker.client_tls_addr))
        .arg("--broker-ca")
        .arg(hub.pki.ca_path())
        .args(["--broker-server-name", "localhost"])
        .env("TETHER_TOKEN", OPS_TOKEN);
    let name = "bench-proxy-connect";
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

/// Runs the section; one row per path.
pub async fn section(
    hub: &Hub,
    broker: &Broker,
    setup: &Setup,
    other_pids: &[u32],
) -> anyhow::Result<Vec<Row>> {
    let dialer = tether_client::Dialer::connect(tether_client::DialerConfig {
        endpoint: format!("https://{}", broker.client_tls_addr),
        server_name: "localhost".into(),
        ca_pem: std::fs::read_to_string(hub.pki.ca_path())?,
        client_cert: None,
        token: Some(tether_client::Token(OPS_TOKEN.into())),
        connect_timeout: Duration::from_secs(10),
    })
    .await
    .context("SDK Dialer")?;
    let (forward_proc, forward) = proxy_connect(hub, broker)?;
    let clients = Clients {
        plain: broker.client_addr,
        tls_addr: broker.client_tls_addr,
        tls: tether_e2e::client_tls_config(&hub.pki.ca_path(), &[b"http/1.1"], None)?,
        dialer,
        forward,
    };
    let mut pids = vec![std::process::id(), forward_proc.pid()];
    pids.extend_from_slice(other_pids);
    let cpu = || pids.iter().map(|p| cpu_secs(*p)).sum::<f64>();

    // Warm up every path.
    for path in PATHS {
        let socks = vec![clients.open(path).await?];
        upload_streams(socks, Duration::from_millis(200)).await?;
    }

    // [path][streams index]: rates per round, CPU seconds, GB.
    let mut rate = vec![[Vec::new(), Vec::new()]; PATHS.len()];
    let mut cpu_s = vec![[0.0f64; 2]; PATHS.len()];
    let mut gb = vec![[0.0f64; 2]; PATHS.len()];
    for round in 0..setup.rounds {
        let mut order: Vec<usize> = (0..PATHS.len()).collect();
        order.rotate_left(round % PATHS.len());
        for (si, &streams) in STREAMS.iter().enumerate() {
            for &p in &order {
                let mut socks = Vec::new();
                for _ in 0..streams {
                    socks.push(clients.open(PATHS[p]).await?);
                }
                let c0 = cpu();
                let (bytes, secs) = upload_streams(socks, setup.secs).await?;
                cpu_s[p][si] += cpu() - c0;
                gb[p][si] += bytes as f64 / 1e9;
                rate[p][si].push(bytes as f64 / secs);
            }
            println!(
                "  clients, {streams} stream(s), round {}: {}",
                round + 1,
                PATHS
                    .iter()
                    .enumerate()
                    .map(|(p, path)| format!(
                        "{} {}",
                        path.name(),
                        gbit(*rate[p][si].last().expect("measured"))
                    ))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    drop(forward_proc);

    let per_gb = |p: usize, si: usize| cpu_s[p][si] / gb[p][si];
    let mut rows = Vec::new();
    for (p, path) in PATHS.iter().enumerate() {
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
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
            let vs_tls = if matches!(path, Path::Grpc | Path::ProxyConnect) {
                format!(", {:.2}× TLS CONNECT", per_gb(p, si) / per_gb(1, si))
            } else {
                String::new()
            };
            if *path != Path::Connect {
                ok &= r >= 1.0 - TOLERANCE && c <= 1.0 + TOLERANCE;
                notes.push(format!(
                    "{streams}: {r:.2}×{} CONNECT, CPU-s/GB {:.2} ({c:.2}× CONNECT{vs_tls})",
                    range_note(&vs),
                    per_gb(p, si)
                ));
            } else {
                notes.push(format!("{streams}: CPU-s/GB {:.2}", per_gb(p, si)));
            }
        }
        let eight_vs_one = mean(&rate[p][1]) / mean(&rate[p][0]);
        notes.push(format!("8 vs 1 stream {eight_vs_one:.2}×"));
        if *path == Path::ProxyConnect {
            ok &= eight_vs_one >= 1.0;
        }
        rows.push(Row {
            what: format!("client path: {}, 1 / 8 streams", path.name()),
            tunnel: tput,
            result: notes.join("; "),
            target: if *path == Path::Connect {
                "the reference".into()
            } else if *path == Path::ProxyConnect {
                "within 10 % of CONNECT (tput, CPU-s/GB); 8 ≥ 1 stream".into()
            } else {
                "within 10 % of CONNECT (tput, CPU-s/GB)".into()
            },
            ok: (*path != Path::Connect).then_some(ok),
            ..Row::default()
        });
    }
    Ok(rows)
}
