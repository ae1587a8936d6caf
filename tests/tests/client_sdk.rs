//! The Rust client SDK (`tether-client`) against real broker and agent processes: a `Dialer`
//! stream with half-close, a dial error with its reason, and a `kube::Client` whose HTTPS
//! requests reach a cluster's API server (a real TLS server on loopback standing in for
//! kube-apiserver, which cannot run here) through the tunnel.

use std::time::Duration;

use tether_client::{ClientError, Dialer, DialerConfig, Token};
use tether_e2e::apiserver::{FakeApiServer, KUBE_TOKEN};
use tether_e2e::{Hub, OPS_TOKEN, echo_server, wait_agent_ready, wait_tunnel};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn dialer(hub: &Hub, broker: &tether_e2e::Broker) -> anyhow::Result<Dialer> {
    dialer_at(hub, broker.client_tls_addr).await
}

/// A `Dialer` (the ops token) to a broker's client TLS port at `addr`.
async fn dialer_at(hub: &Hub, addr: std::net::SocketAddr) -> anyhow::Result<Dialer> {
    Ok(Dialer::connect(DialerConfig {
        endpoint: format!("https://{addr}"),
        server_name: "localhost".into(),
        ca_pem: std::fs::read_to_string(hub.pki.ca_path())?,
        client_cert: None,
        token: Some(Token(OPS_TOKEN.into())),
        connect_timeout: Duration::from_secs(5),
    })
    .await?)
}

/// A `Dialer` (the ops token) to a broker's plain client port at `addr` (no TLS).
async fn plain_dialer_at(addr: std::net::SocketAddr) -> anyhow::Result<Dialer> {
    Ok(Dialer::connect(DialerConfig {
        endpoint: format!("http://{addr}"),
        server_name: String::new(),
        ca_pem: String::new(),
        client_cert: None,
        token: Some(Token(OPS_TOKEN.into())),
        connect_timeout: Duration::from_secs(5),
    })
    .await?)
}

/// Writes `payload` and half-closes while reading the echo to its end (both at once, within
/// 30 s); the echo must be the payload.
async fn echo_round_trip<S>(s: S, payload: &[u8], what: &str) -> anyhow::Result<()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite,
{
    let (mut r, mut w) = tokio::io::split(s);
    let (wrote, back) = tokio::time::timeout(Duration::from_secs(30), async {
        tokio::join!(
            async {
                w.write_all(payload).await?;
                w.shutdown().await
            },
            async {
                let mut back = Vec::new();
                r.read_to_end(&mut back).await.map(|_| back)
            }
        )
    })
    .await?;
    wrote?;
    let back = back?;
    assert_eq!(back.len(), payload.len(), "{what}");
    assert!(back == payload, "{what}: echoed bytes differ");
    Ok(())
}

/// A hub with broker `b1` and cluster `c1`, whose agent's API server is `apiserver`, once the
/// tunnel is up. The agent must stay alive for as long as the test uses the tunnel.
async fn one_cluster(
    apiserver: std::net::SocketAddr,
) -> anyhow::Result<(Hub, tether_e2e::Broker, tether_e2e::Agent)> {
    let hub = Hub::new()?;
    let broker = hub.start_broker("b1", "")?;
    let agent = hub.start_agent("c1", "c1", &[vec![broker.agent_addr]], apiserver, "")?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&broker, "c1").await?;
    Ok((hub, broker, agent))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dialer_stream_round_trip_half_close_and_errors() -> anyhow::Result<()> {
    let echo = echo_server().await?;
    let (hub, broker, _agent) = one_cluster(echo).await?;
    let d = dialer(&hub, &broker).await?;

    let mut s = d.dial("c1", "127.0.0.1", echo.port()).await?;
    assert!(s.stream_id() > 0);
    let payload: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    s.write_all(&payload).await?;
    s.shutdown().await?; // half-close: the echo server sees EOF and closes after echoing
    let mut back = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut back)).await??;
    assert_eq!(back.len(), payload.len());
    assert!(back == payload, "echoed bytes differ");

    // The API server shorthand goes to the agent's `apiserver` (the echo server here).
    let mut api = d.dial_api_server("c1").await?;
    api.write_all(b"ping").await?;
    let mut four = [0u8; 4];
    api.read_exact(&mut four).await?;
    assert_eq!(&four, b"ping");

    match d.dial("nope", "", 0).await {
        Err(ClientError::Dial { code, message }) => {
            assert_eq!(code, tether_proto::tunnel::v1::DialErrorCode::NoTunnel);
            assert!(message.contains("nope"), "{message}");
        }
        other => panic!(
            "expected a NoTunnel dial error, got {:?}",
            other.map(|_| ())
        ),
    }
    match d.dial("c1", "127.0.0.1", 1).await {
        Err(ClientError::Dial { code, .. }) => {
            assert_eq!(code, tether_proto::tunnel::v1::DialErrorCode::Refused)
        }
        other => panic!("expected Refused, got {:?}", other.map(|_| ())),
    }
    Ok(())
}

/// `Dialer::dial` uses the unframed Dial (`DialRaw`); the framed gRPC `Dial` keeps working for
/// existing clients; both carry the same bytes, and refusals read the same on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unframed_and_framed_dial_carry_the_same_bytes() -> anyhow::Result<()> {
    let echo = echo_server().await?;
    let (hub, broker, _agent) = one_cluster(echo).await?;
    let d = dialer(&hub, &broker).await?;
    let payload: Vec<u8> = (0..1_000_000u32).map(|i| (i % 241) as u8).collect();
    for framed in [false, true] {
        let s = if framed {
            d.dial_framed("c1", "127.0.0.1", echo.port()).await?
        } else {
            d.dial("c1", "127.0.0.1", echo.port()).await?
        };
        assert_eq!(s.is_unframed(), !framed);
        assert!(s.stream_id() > 0);
        let (mut r, mut w) = tokio::io::split(s);
        let writer = {
            let payload = payload.clone();
            tokio::spawn(async move {
                w.write_all(&payload).await?;
                w.shutdown().await?;
                anyhow::Ok(w)
            })
        };
        let mut back = Vec::new();
        tokio::time::timeout(Duration::from_secs(30), r.read_to_end(&mut back)).await??;
        let w = writer.await??;
        assert_eq!(back.len(), payload.len(), "framed={framed}");
        assert!(back == payload, "echoed bytes differ (framed={framed})");
        drop((r, w));
    }
    // Refusals: the same code and reason either way.
    for framed in [false, true] {
        let r = if framed {
            d.dial_framed("nope", "", 0).await
        } else {
            d.dial("nope", "", 0).await
        };
        match r {
            Err(ClientError::Dial { code, message }) => {
                assert_eq!(code, tether_proto::tunnel::v1::DialErrorCode::NoTunnel);
                assert!(message.contains("nope"), "{message}");
            }
            other => panic!(
                "framed={framed}: expected NoTunnel, got {:?}",
                other.map(|_| ())
            ),
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_client_reaches_api_server_through_tunnel() -> anyhow::Result<()> {
    let hub = Hub::new()?;
    let api = FakeApiServer::start(&hub).await?;
    let broker = hub.start_broker("b1", "")?;
    let agent = hub.start_agent("c1", "c1", &[vec![broker.agent_addr]], api.addr, "")?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&broker, "c1").await?;
    let d = dialer(&hub, &broker).await?;

    let ca_der = tether_tls::pem::read_certs(&hub.pki.ca_path())?;
    let mut cfg = kube::Config::new("https://c1:443".parse()?);
    cfg.root_cert = Some(ca_der.iter().map(|c| c.to_vec()).collect());
    cfg.tls_server_name = Some("kubernetes.default.svc".into());
    cfg.auth_info.token = Some(KUBE_TOKEN.to_owned().into());
    let client = d.kube_client("c1", cfg)?;
    let v = tokio::time::timeout(Duration::from_secs(20), client.apiserver_version()).await??;
    assert_eq!(v.git_version, "v1.32.0-tether-test");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_dial_stream_resets_the_target_and_shutdown_half_closes() -> anyhow::Result<()> {
    let hub = Hub::new()?;
    // A target that says "bye" and half-closes at once, then reports how the client's side of
    // each connection ended: clean EOF (with the bytes read) or an error.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let target = l.local_addr()?;
    let (ended_tx, mut ended) = tokio::sync::mpsc::channel::<Result<usize, std::io::ErrorKind>>(4);
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let ended_tx = ended_tx.clone();
            tokio::spawn(async move {
                let _ = s.write_all(b"bye").await;
                let _ = s.shutdown().await;
                let mut buf = vec![0u8; 4096];
                let mut total = 0;
                let r = loop {
                    match s.read(&mut buf).await {
                        Ok(0) => break Ok(total),
                        Ok(n) => total += n,
                        Err(e) => break Err(e.kind()),
                    }
                };
                let _ = ended_tx.send(r).await;
            });
        }
    });
    let broker = hub.start_broker("b1", "")?;
    let agent = hub.start_agent("c1", "c1", &[vec![broker.agent_addr]], target, "")?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&broker, "c1").await?;
    let d = dialer(&hub, &broker).await?;

    let mut s = d.dial_api_server("c1").await?;
    s.write_all(b"partial request").await?;
    s.shutdown().await?;
    let r = tokio::time::timeout(Duration::from_secs(10), ended.recv()).await?;
    assert_eq!(
        r,
        Some(Ok(15)),
        "shutdown must reach the target as a clean EOF"
    );

    for framed in [false, true] {
        let mut s = if framed {
            d.dial_framed("c1", "", 0).await?
        } else {
            d.dial_api_server("c1").await?
        };
        s.write_all(b"partial request").await?;
        tokio::time::sleep(Duration::ZERO).await;
        drop(s);
        let r = tokio::time::timeout(Duration::from_secs(10), ended.recv()).await?;
        assert_eq!(
            r,
            Some(Err(std::io::ErrorKind::ConnectionReset)),
            "framed: {framed}: dropping a stream must reset the target's connection, not close it cleanly"
        );
    }

    // Dropped without shutdown after reading the target's whole answer (its EOF): still an
    // abort. The target finishing its side does not make the client's unsent bytes arrive, so
    // a clean EOF here would be a silent truncation (found by the truncation torture). The
    // unframed Dial only: the framed one ends its response (and so shows the target's EOF)
    // only once both directions are done, as a gRPC call does.
    let mut s = d.dial_api_server("c1").await?;
    s.write_all(b"partial request").await?;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut answer)).await??;
    assert_eq!(answer, b"bye");
    drop(s);
    let r = tokio::time::timeout(Duration::from_secs(10), ended.recv()).await?;
    assert_eq!(
        r,
        Some(Err(std::io::ErrorKind::ConnectionReset)),
        "a stream dropped after the target's EOF must still reset the target"
    );
    Ok(())
}

/// `Dialer::connect_pool` puts each new stream on the connection with the fewest open streams,
/// and the owned-bytes API (`send` / `poll_recv`, what `tetherctl proxy connect` uses) carries
/// the same bytes as `AsyncWrite`/`AsyncRead`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_dialer_spreads_streams_and_owned_bytes_round_trip() -> anyhow::Result<()> {
    let echo = echo_server().await?;
    let (hub, broker, _agent) = one_cluster(echo).await?;
    let d = Dialer::connect_pool(
        DialerConfig {
            endpoint: format!("https://{}", broker.client_tls_addr),
            server_name: "localhost".into(),
            ca_pem: std::fs::read_to_string(hub.pki.ca_path())?,
            client_cert: None,
            token: Some(Token(OPS_TOKEN.into())),
            connect_timeout: Duration::from_secs(5),
        },
        2,
    )
    .await?;
    assert_eq!(d.connections(), 2);

    let a = d.dial("c1", "127.0.0.1", echo.port()).await?;
    let mut b = d.dial("c1", "127.0.0.1", echo.port()).await?;
    assert_ne!(
        a.connection(),
        b.connection(),
        "two streams, two connections"
    );
    let freed = a.connection();
    drop(a);
    let c = d.dial("c1", "127.0.0.1", echo.port()).await?;
    assert_eq!(
        c.connection(),
        freed,
        "the new stream goes on the idle connection"
    );
    assert!(c.is_unframed() && b.is_unframed());

    // Owned chunks out, owned chunks back.
    let payload: Vec<u8> = (0..600_000u32).map(|i| (i % 253) as u8).collect();
    let too_big = bytes::Bytes::from(vec![0u8; tether_client::MAX_FRAME_BYTES + 1]);
    assert!(
        b.send(too_big).is_err(),
        "a chunk above MAX_FRAME_BYTES is refused"
    );
    for chunk in payload.chunks(tether_client::MAX_FRAME_BYTES) {
        std::future::poll_fn(|cx| b.poll_send_ready(cx)).await?;
        b.send(bytes::Bytes::copy_from_slice(chunk))?;
    }
    b.shutdown().await?;
    let mut back = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(chunk) = std::future::poll_fn(|cx| b.poll_recv(cx)).await {
            back.extend_from_slice(&chunk?);
        }
        anyhow::Ok(())
    })
    .await??;
    assert_eq!(back.len(), payload.len());
    assert!(back == payload, "echoed bytes differ");
    // The pool's two connections, counted as tether-dial/1 (`mux`) on the TLS port.
    let tls_mux = tether_e2e::metric(
        broker.admin_addr,
        "tether_broker_client_connections_total",
        &[("listener", "tls"), ("protocol", "mux")],
    )
    .await?;
    assert_eq!(tls_mux, 2.0, "tether-dial/1 connections on the TLS port");
    Ok(())
}

/// `Dialer::connect` opens one connection, and another only when a new stream finds every open
/// one carrying a stream, up to the CPUs (at most `MAX_ON_DEMAND_CONNECTIONS`): streams one
/// after another keep to one connection, concurrent streams spread, and past the cap they share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dialer_opens_connections_on_demand() -> anyhow::Result<()> {
    let echo = echo_server().await?;
    let (hub, broker, _agent) = one_cluster(echo).await?;
    let d = dialer(&hub, &broker).await?;
    assert_eq!(d.connections(), 1);
    let payload: Vec<u8> = (0..300_000u32).map(|i| (i % 241) as u8).collect();
    for i in 0..3 {
        let s = d.dial("c1", "127.0.0.1", echo.port()).await?;
        echo_round_trip(s, &payload, &format!("stream {i} of 3 in turn")).await?;
    }
    assert_eq!(d.connections(), 1, "streams in turn share one connection");

    let cap = std::thread::available_parallelism()?
        .get()
        .min(tether_client::MAX_ON_DEMAND_CONNECTIONS);
    let mut held = Vec::new();
    for _ in 0..cap + 2 {
        held.push(d.dial("c1", "127.0.0.1", echo.port()).await?);
    }
    assert_eq!(
        d.connections(),
        cap,
        "one connection per busy stream, up to the cap"
    );
    let used: std::collections::HashSet<usize> = held.iter().map(|s| s.connection()).collect();
    assert_eq!(
        used.len(),
        cap,
        "the streams are spread over every connection"
    );
    for (i, s) in held.into_iter().enumerate() {
        echo_round_trip(s, &payload, &format!("concurrent stream {i}")).await?;
    }
    let tls_mux = tether_e2e::metric(
        broker.admin_addr,
        "tether_broker_client_connections_total",
        &[("listener", "tls"), ("protocol", "mux")],
    )
    .await?;
    assert_eq!(
        tls_mux, cap as f64,
        "the broker saw exactly the dialer's connections"
    );
    Ok(())
}

/// Dials started at once spread over the connections they open: a burst of `cap + 2` dials on
/// a fresh `Dialer::connect` opens `cap` connections and puts no more than one stream more on
/// any of them than on another (before, every dial that found the open connection busy waited
/// for the same new one, so a burst went 1 : cap + 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_dials_spreads_over_the_connections_it_opens() -> anyhow::Result<()> {
    let echo = echo_server().await?;
    let (hub, broker, _agent) = one_cluster(echo).await?;
    let d = dialer(&hub, &broker).await?;
    let cap = std::thread::available_parallelism()?
        .get()
        .min(tether_client::MAX_ON_DEMAND_CONNECTIONS);
    let burst =
        futures::future::try_join_all((0..cap + 2).map(|_| d.dial("c1", "127.0.0.1", echo.port())))
            .await?;
    assert_eq!(
        d.connections(),
        cap,
        "one connection per busy stream, up to the cap"
    );
    let mut per_conn = std::collections::HashMap::<usize, usize>::new();
    for s in &burst {
        *per_conn.entry(s.connection()).or_default() += 1;
    }
    let (lo, hi) = (
        per_conn.values().min().copied().unwrap_or(0),
        per_conn.values().max().copied().unwrap_or(0),
    );
    assert_eq!(
        per_conn.len(),
        cap,
        "every connection carries streams: {per_conn:?}"
    );
    assert!(hi - lo <= 1, "streams spread evenly: {per_conn:?}");
    let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 233) as u8).collect();
    for (i, s) in burst.into_iter().enumerate() {
        echo_round_trip(s, &payload, &format!("burst stream {i}")).await?;
    }
    Ok(())
}

/// A TCP forward to `upstream` that passes on the connections it is told to and closes the
/// others at once; counts the connections it accepted.
struct Gate {
    addr: std::net::SocketAddr,
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    open: std::sync::Arc<std::sync::atomic::AtomicBool>,
    _task: tokio_util::task::AbortOnDropHandle<()>,
}

impl Gate {
    async fn start(upstream: std::net::SocketAddr) -> anyhow::Result<Self> {
        use std::sync::atomic::Ordering;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = l.local_addr()?;
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let open = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let (a, o) = (accepted.clone(), open.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut down, _)) = l.accept().await {
                a.fetch_add(1, Ordering::SeqCst);
                if !o.load(Ordering::SeqCst) {
                    continue; // dropped: closed at once
                }
                tokio::spawn(async move {
                    if let Ok(mut up) = tokio::net::TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
                    }
                });
            }
        });
        Ok(Self {
            addr,
            accepted,
            open,
            _task: tokio_util::task::AbortOnDropHandle::new(task),
        })
    }

    fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn set_open(&self, open: bool) {
        self.open.store(open, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A connection on demand that fails to open is not tried again by every dial: after the
/// failure, dials share the open connection without a connect attempt for the backoff's pause
/// (at least half of `ON_DEMAND_RETRY_INITIAL`), and once the broker is reachable again a later
/// dial opens the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_connection_on_demand_backs_off() -> anyhow::Result<()> {
    let echo = echo_server().await?;
    let (hub, broker, _agent) = one_cluster(echo).await?;
    let gate = Gate::start(broker.client_tls_addr).await?;
    let d = dialer_at(&hub, gate.addr).await?;
    if std::thread::available_parallelism()?.get() < 2 {
        eprintln!("one CPU: no connections on demand to test");
        return Ok(());
    }
    assert_eq!(gate.accepted(), 1);
    let first = d.dial("c1", "127.0.0.1", echo.port()).await?;

    // The broker cannot be reached any more: the next dial's connection on demand fails, and
    // the dial shares the open connection.
    gate.set_open(false);
    let mut held = vec![d.dial("c1", "127.0.0.1", echo.port()).await?];
    let failed_at = std::time::Instant::now();
    // One attempt per protocol: tether-dial/1, then HTTP/2 (the TLS handshake failed, which
    // an older broker without the ALPN would also do).
    let tried = gate.accepted();
    assert!(tried > 1, "the second dial tried a connection on demand");
    assert_eq!(d.connections(), 1);
    for _ in 0..5 {
        held.push(d.dial("c1", "127.0.0.1", echo.port()).await?);
    }
    let dials_took = failed_at.elapsed();
    if dials_took < tether_client::ON_DEMAND_RETRY_INITIAL / 2 {
        assert_eq!(
            gate.accepted(),
            tried,
            "dials within the pause after a failure try no connection ({dials_took:?})"
        );
    } else {
        eprintln!("five dials took {dials_took:?}, longer than the shortest pause: not checked");
    }
    assert!(held.iter().all(|s| s.connection() == first.connection()));

    // Reachable again: after the pause a dial opens the second connection.
    gate.set_open(true);
    let last = tether_test_support::wait_until_async(
        Duration::from_secs(20),
        "a dial on a connection on demand once the broker is reachable again",
        || async {
            let s = d.dial("c1", "127.0.0.1", echo.port()).await.ok()?;
            (s.connection() != first.connection()).then_some(s)
        },
    )
    .await?;
    assert_eq!(d.connections(), 2);
    let payload: Vec<u8> = (0..100_000u32).map(|i| (i % 229) as u8).collect();
    echo_round_trip(last, &payload, "stream on the new connection").await?;
    echo_round_trip(first, &payload, "first stream").await?;
    Ok(())
}

/// When its broker starts to drain, a `Dialer`'s connection gets a GOAWAY — the mux's on
/// `tether-dial/1`, HTTP/2's (hyper's graceful shutdown) on the unframed Dial of a broker that
/// speaks only HTTP/2: the stream open on it keeps working through the drain grace, and new
/// dials no longer go to that broker. Here no other broker answers at the address, so they fail
/// to reach one (behind a load balancer they would reach another broker); before, they opened
/// streams on the draining broker that the end of its grace would cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_broker_sends_its_dial_clients_away() -> anyhow::Result<()> {
    let echo = echo_server().await?;
    for (config, protocol) in [
        ("", "tether-dial/1"),
        ("tunnel:\n  protocol: h2\n", "DialRaw"),
    ] {
        let hub = Hub::new()?;
        let broker = hub.start_broker("b1", config)?;
        let agent = hub.start_agent("c1", "c1", &[vec![broker.agent_addr]], echo, config)?;
        wait_agent_ready(&agent).await?;
        wait_tunnel(&broker, "c1").await?;
        let d = dialer(&hub, &broker).await?;
        let held = d.dial("c1", "127.0.0.1", echo.port()).await?;
        assert_eq!(held.protocol(), protocol);
        broker.child.terminate();
        // Well within the broker's drain grace (10 s in the test config).
        let refused = tether_test_support::wait_until_async(
            Duration::from_secs(5),
            "a dial that no longer opens a stream on the draining broker",
            || async { d.dial("c1", "127.0.0.1", echo.port()).await.err() },
        )
        .await?;
        assert!(
            matches!(refused, ClientError::Unreachable(_)),
            "{protocol}: a new dial goes to a new connection, which the draining broker no \
             longer accepts: {refused}"
        );
        let payload: Vec<u8> = (0..100_000u32).map(|i| (i % 227) as u8).collect();
        echo_round_trip(
            held,
            &payload,
            &format!("{protocol}: the stream open when the drain began"),
        )
        .await?;
    }
    Ok(())
}

/// A broker that takes no stream — every `OPEN` refused unprocessed, as a draining broker
/// answers one that crossed its GOAWAY or found no tunnel once its drain began — makes the SDK
/// try once more on a new connection and then report `Unreachable` (nothing was dialled: the
/// dial may go to another broker, or again later), not a connect or dial error. The broker here
/// is the real `tether-dial/1` protocol (the crate the broker serves it with) on a real socket,
/// refusing every stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_takes_no_stream_is_unreachable_after_one_more_connection()
-> anyhow::Result<()> {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use tether_tunnel::mux;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (accepted, refused) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let server = {
        let (accepted, refused) = (Arc::clone(&accepted), Arc::clone(&refused));
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((mut tcp, _)) = listener.accept().await {
                accepted.fetch_add(1, SeqCst);
                let mut preface = vec![0; mux::frame::DIAL_PREFACE.len()];
                if tcp.read_exact(&mut preface).await.is_err()
                    || preface != mux::frame::DIAL_PREFACE
                {
                    continue;
                }
                let refused = Arc::clone(&refused);
                let on_open: mux::OnOpen = Arc::new(move |incoming: mux::Incoming| {
                    refused.fetch_add(1, SeqCst);
                    incoming.responder.refuse("the broker is draining");
                });
                let cfg = mux::Config::from_settings(&tether_tunnel::TunnelSettings::default());
                let (conn, driver, events) =
                    mux::connect(tcp, mux::Role::Acceptor, cfg, Some(on_open));
                held.push((conn, events, tokio::spawn(driver.run())));
            }
        })
    };
    let d = plain_dialer_at(addr).await?;
    let err = match d.dial("c1", "127.0.0.1", 9).await {
        Ok(_) => anyhow::bail!("a broker that refuses every stream opened one"),
        Err(e) => e,
    };
    server.abort();
    assert!(
        matches!(err, ClientError::Unreachable(_)),
        "expected Unreachable, got {err:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains("did not take the stream") && text.contains("draining"),
        "the error names the refusal and the broker's reason: {text}"
    );
    assert_eq!(
        (accepted.load(SeqCst), refused.load(SeqCst)),
        (2, 2),
        "one OPEN on the first connection, one more on a new connection"
    );
    Ok(())
}

/// The broker's plain client port serves the native Dial without TLS (h2c, bearer token) beside
/// plain CONNECT: the SDK over `http://` carries the same bytes unframed and framed, a dial
/// without a token is refused by name, a client certificate over `http://` is a config error
/// that names the fix, and plain CONNECT on the same port still works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_over_the_plain_port_and_connect_share_it() -> anyhow::Result<()> {
    let echo = echo_server().await?;
    let (_hub, broker, _agent) = one_cluster(echo).await?;
    let plain = |token: Option<&str>| DialerConfig {
        endpoint: format!("http://{}", broker.client_addr),
        server_name: String::new(),
        ca_pem: String::new(),
        client_cert: None,
        token: token.map(|t| Token(t.into())),
        connect_timeout: Duration::from_secs(5),
    };
    let d = Dialer::connect(plain(Some(OPS_TOKEN))).await?;
    let payload: Vec<u8> = (0..700_000u32).map(|i| (i % 239) as u8).collect();
    for framed in [false, true] {
        let mut s = if framed {
            d.dial_framed("c1", "127.0.0.1", echo.port()).await?
        } else {
            d.dial("c1", "127.0.0.1", echo.port()).await?
        };
        assert_eq!(s.is_unframed(), !framed);
        echo_round_trip(&mut s, &payload, &format!("framed={framed}")).await?;
    }

    // No token: the broker names the missing credential.
    let anonymous = Dialer::connect(plain(None)).await?;
    match anonymous.dial("c1", "127.0.0.1", echo.port()).await {
        Err(ClientError::Status(s)) => {
            assert_eq!(s.code(), tonic::Code::Unauthenticated);
            assert!(s.message().contains("no credentials"), "{}", s.message());
        }
        other => panic!("expected Unauthenticated, got {:?}", other.map(|_| ())),
    }
    // A client certificate cannot be presented without TLS.
    let mut with_cert = plain(None);
    with_cert.client_cert = Some(tether_client::ClientCert {
        cert_pem: String::new(),
        key_pem: String::new(),
    });
    match Dialer::connect(with_cert).await {
        Err(ClientError::Endpoint { reason, .. }) => {
            assert!(reason.contains("needs TLS"), "{reason}")
        }
        other => panic!("expected an endpoint error, got {:?}", other.map(|_| ())),
    }

    // Plain CONNECT on the same port, while the h2c connection above stays open.
    let tcp = tokio::net::TcpStream::connect(broker.client_addr).await?;
    let head = format!(
        "CONNECT 127.0.0.1.c1.tether:{} HTTP/1.1\r\nproxy-authorization: Bearer {OPS_TOKEN}\r\n\r\n",
        echo.port()
    );
    let mut s = tether_e2e::send_head(tcp, head.as_bytes())
        .await?
        .map_err(|(c, m)| anyhow::anyhow!("CONNECT refused: {c} {m}"))?;
    s.write_all(b"plain").await?;
    let mut five = [0u8; 5];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut five)).await??;
    assert_eq!(&five, b"plain");

    // The broker counts what each client port spoke: the SDK's connections as tether-dial/1
    // (`mux`) on the plain port, its framed dial's tonic channel as h2, the one CONNECT as
    // http1, nothing on the TLS port.
    let count = |listener: &'static str, protocol: &'static str| {
        let admin = broker.admin_addr;
        async move {
            tether_e2e::metric(
                admin,
                "tether_broker_client_connections_total",
                &[("listener", listener), ("protocol", protocol)],
            )
            .await
        }
    };
    assert_eq!(
        count("plain", "mux").await?,
        2.0,
        "the two dialers' tether-dial/1 connections"
    );
    assert!(
        count("plain", "h2").await? >= 1.0,
        "the framed dial's h2c connection"
    );
    assert_eq!(count("plain", "http1").await?, 1.0, "the CONNECT");
    assert_eq!(
        count("tls", "h2").await? + count("tls", "http1").await? + count("tls", "mux").await?,
        0.0
    );
    drop(d);
    Ok(())
}

/// A stream shut down and then dropped while the target keeps sending (a log follower, a
/// watch) lingers only for the bytes it sent: after `LINGER_MAX_BYTES` from the target it is
/// aborted and the target's connection is reset, well before `LINGER_AFTER_SHUTDOWN` (30 s).
/// Both framings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_dropped_after_shutdown_does_not_drain_an_endless_target() -> anyhow::Result<()> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let target = l.local_addr()?;
    // Streams until a write fails; reports what it read first and how its writes ended.
    let (ended_tx, mut ended) = tokio::sync::mpsc::channel::<(Vec<u8>, std::io::ErrorKind)>(4);
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let ended_tx = ended_tx.clone();
            tokio::spawn(async move {
                let mut first = vec![0u8; 5];
                if s.read_exact(&mut first).await.is_err() {
                    return;
                }
                let chunk = vec![0x5au8; 64 * 1024];
                let e = loop {
                    if let Err(e) = s.write_all(&chunk).await {
                        break e.kind();
                    }
                };
                let _ = ended_tx.send((first, e)).await;
            });
        }
    });
    let (hub, broker, _agent) = one_cluster(target).await?;
    let d = dialer(&hub, &broker).await?;
    for framed in [false, true] {
        let mut s = if framed {
            d.dial_framed("c1", "", 0).await?
        } else {
            d.dial_api_server("c1").await?
        };
        s.write_all(b"hello").await?;
        let mut buf = vec![0u8; 256 * 1024];
        let mut got = 0;
        while got < (1 << 20) {
            let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await??;
            anyhow::ensure!(
                n > 0,
                "framed: {framed}: the stream ended after {got} bytes"
            );
            got += n;
        }
        s.shutdown().await?;
        drop(s);
        let (first, e) = tokio::time::timeout(Duration::from_secs(10), ended.recv())
            .await
            .map_err(|_| {
                anyhow::anyhow!(
                    "framed: {framed}: the target was still streaming 10 s after the stream was dropped"
                )
            })?
            .expect("the target runs");
        assert_eq!(first, b"hello", "framed: {framed}");
        assert!(
            matches!(
                e,
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
            ),
            "framed: {framed}: the target's writes ended with {e:?}"
        );
    }
    Ok(())
}

/// A TCP relay to `to` whose relayed connections can all be cut at once (a load balancer
/// restarting, a network dropping its flows) while it keeps accepting new ones.
struct CuttableRelay {
    addr: std::net::SocketAddr,
    conns: std::sync::Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>>,
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    accept: tokio::task::JoinHandle<()>,
}

impl CuttableRelay {
    async fn start(to: std::net::SocketAddr) -> anyhow::Result<Self> {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = l.local_addr()?;
        let conns = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (c, a) = (conns.clone(), accepted.clone());
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = l.accept().await {
                a.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let task = tokio::spawn(async move {
                    if let Ok(mut out) = tokio::net::TcpStream::connect(to).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                    }
                });
                c.lock().unwrap().push(task.abort_handle());
            }
        });
        Ok(Self {
            addr,
            conns,
            accepted,
            accept,
        })
    }

    fn cut(&self) {
        for c in self.conns.lock().unwrap().drain(..) {
            c.abort();
        }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for CuttableRelay {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

/// A `Dialer` whose HTTP/2 connection broke under it (here a relay in front of the broker cuts
/// it) dials on a new connection: the open stream fails with an error, never a clean EOF, and
/// the next dial on the same `Dialer` succeeds without the caller reconnecting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dialer_whose_connection_broke_dials_on_a_new_one() -> anyhow::Result<()> {
    let echo = echo_server().await?;
    let (_hub, broker, _agent) = one_cluster(echo).await?;
    let relay = CuttableRelay::start(broker.client_addr).await?;
    let d = plain_dialer_at(relay.addr).await?;
    let round_trip = |mut s: tether_client::DialStream, msg: &'static [u8]| async move {
        s.write_all(msg).await?;
        let mut back = vec![0u8; msg.len()];
        tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut back)).await??;
        assert_eq!(back, msg);
        anyhow::Ok(s)
    };
    let mut s = round_trip(d.dial("c1", "127.0.0.1", echo.port()).await?, b"before").await?;
    assert_eq!(relay.accepted(), 1);

    relay.cut();
    let mut one = [0u8; 1];
    match tokio::time::timeout(Duration::from_secs(10), s.read(&mut one)).await? {
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
        Ok(n) => panic!("a stream on a broken connection read {n} bytes (0: a clean EOF)"),
    }

    let s2 = tokio::time::timeout(
        Duration::from_secs(10),
        d.dial("c1", "127.0.0.1", echo.port()),
    )
    .await??;
    round_trip(s2, b"after").await?;
    assert_eq!(
        relay.accepted(),
        2,
        "the second dial opened one new connection"
    );
    Ok(())
}

/// `Dialer::connect` fails with what is wrong: a broker certificate from another CA, a name the
/// certificate does not carry (both `Certificate` errors, after one handshake: HTTP/2 is not
/// tried after them), a CA bundle that is not PEM, nothing listening, a listener that hangs
/// up before the TLS handshake (both `Unreachable`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dialer_connect_errors_name_what_is_wrong() -> anyhow::Result<()> {
    let hub = Hub::new()?;
    let broker = hub.start_broker("b1", "")?;
    let other_ca = std::fs::read_to_string(Hub::new()?.pki.ca_path())?;
    let cfg = |ca_pem: String, server_name: &str| DialerConfig {
        endpoint: format!("https://{}", broker.client_tls_addr),
        server_name: server_name.into(),
        ca_pem,
        client_cert: None,
        token: Some(Token(OPS_TOKEN.into())),
        connect_timeout: Duration::from_secs(5),
    };
    let ca = std::fs::read_to_string(hub.pki.ca_path())?;
    let err = |r: Result<Dialer, ClientError>| match r {
        Ok(_) => panic!("connected"),
        Err(e) => e.to_string(),
    };

    // A certificate not accepted is a `Certificate` error, and the SDK does not try HTTP/2
    // after `tether-dial/1` failed that way: one connection (counted by a TCP forward).
    let gate = Gate::start(broker.client_tls_addr).await?;
    let through_gate = |ca_pem: String, server_name: &str| DialerConfig {
        endpoint: format!("https://{}", gate.addr),
        ..cfg(ca_pem, server_name)
    };
    let cert_err = |r: Result<Dialer, ClientError>| match r {
        Ok(_) => panic!("connected"),
        Err(e @ ClientError::Certificate(_)) => e.to_string(),
        Err(e) => panic!("expected a certificate error, got {e:?}"),
    };
    let e = cert_err(Dialer::connect(through_gate(other_ca, "localhost")).await);
    // (the other CA has the same name as the broker's: the signature is what fails)
    assert!(
        e.contains("TLS handshake") && e.contains("invalid peer certificate"),
        "{e}"
    );
    assert_eq!(
        gate.accepted(),
        1,
        "one handshake for a certificate not accepted"
    );
    let e = cert_err(Dialer::connect(through_gate(ca.clone(), "not-the-broker.example")).await);
    assert!(
        e.contains("TLS handshake") && e.contains("not valid for name"),
        "{e}"
    );
    assert_eq!(gate.accepted(), 2, "one handshake for a name not matched");
    let e = err(Dialer::connect(cfg("not a certificate".into(), "localhost")).await);
    assert!(
        e.contains("CA bundle") && e.contains("no CERTIFICATE"),
        "{e}"
    );

    let closed = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await?
        .local_addr()?;
    let mut nowhere = cfg(ca.clone(), "localhost");
    nowhere.endpoint = format!("https://{closed}");
    let e = err(Dialer::connect(nowhere).await);
    assert!(
        e.contains("TCP connect") && e.contains(&closed.to_string()),
        "{e}"
    );

    // A listener that closes each connection before the TLS handshake is answered (a broker
    // closing its listener as its drain begins resets what is in its backlog): not reached,
    // as when nothing listens, and not a certificate problem; HTTP/2 is not tried after it.
    let closing = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let closing_addr = closing.local_addr()?;
    let closer = tokio::spawn(async move {
        while let Ok((s, _)) = closing.accept().await {
            drop(s);
        }
    });
    let mut hanging_up = cfg(ca.clone(), "localhost");
    hanging_up.endpoint = format!("https://{closing_addr}");
    match Dialer::connect(hanging_up).await {
        Err(e @ ClientError::Unreachable(_)) => {
            let e = e.to_string();
            assert!(
                e.contains("TLS handshake") && e.contains(&closing_addr.to_string()),
                "{e}"
            );
        }
        Err(e) => panic!("a connection closed before the TLS handshake: {e:?}"),
        Ok(_) => panic!("connected to a listener that hangs up"),
    }
    closer.abort();

    // The right CA and name still connect.
    Dialer::connect(cfg(ca, "localhost")).await?;
    Ok(())
}

/// Writes to a target that never reads stop once the windows and buffers on the way are full:
/// the SDK queues at most its per-stream send buffer ahead of HTTP/2 flow control, both
/// framings. (h2 itself would queue every byte handed to it: an SDK that did not wait for
/// capacity would take all it is offered at once.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_to_a_target_that_never_reads_stop_at_the_windows() -> anyhow::Result<()> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let target = l.local_addr()?;
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            held.push(s); // accepted, never read
        }
    });
    let (hub, broker, _agent) = one_cluster(target).await?;
    let d = dialer(&hub, &broker).await?;
    // What a full path can hold: the broker's window towards the client (4 MiB) and its send
    // buffer, the agent's window (4, adaptive up to 16 MiB), two socket buffers (a few MiB
    // each) and the SDK's own send buffer; far below what is offered.
    const OFFERED: usize = 256 << 20;
    const BOUND: usize = 64 << 20;
    let chunk = vec![7u8; 256 << 10];
    for framed in [false, true] {
        let mut s = if framed {
            d.dial_framed("c1", "", 0).await?
        } else {
            d.dial("c1", "", 0).await?
        };
        let mut written = 0;
        // Until a write makes no progress for 2 s (the path is full), or all was taken.
        while written < OFFERED {
            match tokio::time::timeout(Duration::from_secs(2), s.write(&chunk)).await {
                Ok(n) => written += n?,
                Err(_) => break,
            }
        }
        assert!(
            written < BOUND,
            "framed={framed}: {written} bytes taken for a target that reads nothing"
        );
        assert!(written >= 1 << 20, "framed={framed}: only {written} bytes");
    }
    holder.abort();
    Ok(())
}

/// The SDK speaks `tether-dial/1` to a current broker, on both client ports, and keeps to the
/// unframed Dial on HTTP/2 with a broker that does not serve it (`tunnel.protocol: h2` stands in
/// for an older broker): the same bytes, half-close and refusals either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sdk_speaks_tether_dial_and_falls_back_to_http2() -> anyhow::Result<()> {
    let echo = echo_server().await?;
    let hub = Hub::new()?;
    let current = hub.start_broker("b1", "")?;
    let h2_only = hub.start_broker("b2", "tunnel:\n  protocol: h2\n")?;
    let agent = hub.start_agent(
        "c1",
        "c1",
        &[vec![current.agent_addr], vec![h2_only.agent_addr]],
        echo,
        "",
    )?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&current, "c1").await?;
    wait_tunnel(&h2_only, "c1").await?;
    let ca_pem = std::fs::read_to_string(hub.pki.ca_path())?;
    let payload: Vec<u8> = (0..2_000_000u32).map(|i| (i % 233) as u8).collect();
    for (broker, expected) in [(&current, "tether-dial/1"), (&h2_only, "DialRaw")] {
        for endpoint in [
            format!("https://{}", broker.client_tls_addr),
            format!("http://{}", broker.client_addr),
        ] {
            let d = Dialer::connect(DialerConfig {
                endpoint: endpoint.clone(),
                server_name: "localhost".into(),
                ca_pem: if endpoint.starts_with("https") {
                    ca_pem.clone()
                } else {
                    String::new()
                },
                client_cert: None,
                token: Some(Token(OPS_TOKEN.into())),
                connect_timeout: Duration::from_secs(5),
            })
            .await?;
            let s = d.dial("c1", "127.0.0.1", echo.port()).await?;
            assert_eq!(s.protocol(), expected, "{endpoint}");
            assert!(s.stream_id() > 0, "{endpoint}: the broker's stream id");
            echo_round_trip(s, &payload, &endpoint).await?;
            match d.dial("c1", "127.0.0.1", 1).await {
                Err(ClientError::Dial { code, message }) => {
                    assert_eq!(
                        code,
                        tether_proto::tunnel::v1::DialErrorCode::Refused,
                        "{endpoint}"
                    );
                    assert!(!message.is_empty(), "{endpoint}: a reason");
                }
                other => panic!("{endpoint}: expected Refused, got {:?}", other.map(|_| ())),
            }
        }
    }
    let mux_connections = |b: &tether_e2e::Broker| {
        let admin = b.admin_addr;
        async move {
            let mut n = 0.0;
            for listener in ["plain", "tls"] {
                n += tether_e2e::metric(
                    admin,
                    "tether_broker_client_connections_total",
                    &[("listener", listener), ("protocol", "mux")],
                )
                .await?;
            }
            anyhow::Ok(n)
        }
    };
    assert_eq!(mux_connections(&current).await?, 2.0, "one per port");
    assert_eq!(mux_connections(&h2_only).await?, 0.0);
    Ok(())
}
