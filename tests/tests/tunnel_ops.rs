//! Operations through real processes: certificate rotation on disk while a stream is moving
//! data, broker drain (SIGTERM) moving the agent to a second broker while an open stream
//! finishes, a draining broker sending its service-proxy clients away (HTTP/1.1 close, HTTP/2
//! GOAWAY), and the TLS client port (HTTP CONNECT over TLS with a token or a client
//! certificate).

use std::sync::Arc;
use std::time::Duration;

use tether_e2e::live::ContinuousEcho;
use tether_e2e::{
    ClientTls, Hub, OPS_TOKEN, Payload, Setup, client_tls_config, connect_ok, connect_tls,
    echo_server, echo_transfer, metric, wait_agent_ready, wait_tunnel,
};
use tether_test_support::wait_until_async;
use tether_tls::Identity;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The file stem of a certificate path (the name it was issued under).
fn stem(p: &std::path::Path) -> String {
    p.file_stem().unwrap().to_string_lossy().into_owned()
}

/// The certificate a TLS server presents.
fn server_cert(tls: &ClientTls) -> Vec<u8> {
    tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

/// Overwriting the agent's and the broker's certificate and key while a stream moves data:
/// both reload (metrics), the stream keeps moving and completes intact, new streams work and
/// new TLS connections get the new broker certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_reload_keeps_live_stream() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "", "").await?;
    let ca = setup.hub.pki.ca_path();
    let tls_cfg = || client_tls_config(&ca, &[b"http/1.1"], None);
    let old_cert =
        server_cert(&tether_e2e::tls_connect(setup.broker.client_tls_addr, tls_cfg()?).await?);

    let live = ContinuousEcho::start(setup.connect_echo().await?, 64 << 10, false);
    live.wait_progress(4 << 20, "data flowing before the rotation")
        .await?;

    setup.hub.pki.issue(
        &stem(&setup.agent.tls.cert),
        Identity::tunnel_agent("c1", "agent-0"),
        &[],
    )?;
    setup.hub.pki.issue(
        "broker-b1",
        Identity::Broker { id: "b1".into() },
        &["localhost", "127.0.0.1", "tether-broker"],
    )?;
    for (who, admin) in [
        ("agent", setup.agent.admin_addr),
        ("broker", setup.broker.admin_addr),
    ] {
        wait_until_async(
            Duration::from_secs(20),
            &format!("{who} TLS reload"),
            || async {
                let n = metric(admin, "tether_tls_reloads_total", &[]).await.ok()?;
                (n >= 1.0).then_some(())
            },
        )
        .await?;
    }
    live.wait_progress(8 << 20, "data flowing after the rotation")
        .await?;
    let moved = live.finish().await?;
    println!(
        "live stream moved {} MiB each way across the rotation",
        moved >> 20
    );

    // The tunnel was not replaced, new streams work, and new TLS handshakes use the new cert.
    let connects = metric(
        setup.broker.admin_addr,
        "tether_broker_tunnel_connects_total",
        &[("result", "ok")],
    )
    .await?;
    assert_eq!(connects, 1.0, "the rotation must not reconnect the tunnel");
    let t = echo_transfer(
        setup.connect_echo().await?,
        Arc::new(Payload::new()),
        1 << 20,
    )
    .await?;
    assert!(t.intact());
    let new_cert =
        server_cert(&tether_e2e::tls_connect(setup.broker.client_tls_addr, tls_cfg()?).await?);
    assert_ne!(
        old_cert, new_cert,
        "the broker still presents the old certificate"
    );
    Ok(())
}

/// SIGTERM on broker b1: it tells its agent to move; the agent (one endpoint group [b1, b2])
/// opens a tunnel to b2 where new CONNECTs work, while the stream already open through b1 keeps
/// moving data and completes intact; b1 exits once that stream is done, within its grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_drain_moves_agent_to_second_broker() -> anyhow::Result<()> {
    let hub = Hub::new()?;
    let echo = echo_server().await?;
    let mut b1 = hub.start_broker("b1", "")?;
    let b2 = hub.start_broker("b2", "")?;
    let agent = hub.start_agent("c1", "c1", &[vec![b1.agent_addr, b2.agent_addr]], echo, "")?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&b1, "c1").await?;
    let (_, on_b2) = tether_e2e::admin_get(b2.admin_addr, "/debug/tunnels").await?;
    assert_eq!(
        on_b2.trim(),
        "[]",
        "the agent should start on the first address only"
    );
    let authority = tether_e2e::qualified("c1", echo);

    let live = ContinuousEcho::start(
        connect_ok(b1.client_addr, &authority).await?,
        64 << 10,
        false,
    );
    live.wait_progress(4 << 20, "data flowing through b1")
        .await?;

    b1.child.terminate();
    wait_tunnel(&b2, "c1").await?;
    let t = echo_transfer(
        connect_ok(b2.client_addr, &authority).await?,
        Arc::new(Payload::new()),
        4 << 20,
    )
    .await?;
    assert!(t.intact(), "new stream through b2: {t:?}");
    // b1 accepts nothing new while draining.
    let refused = tokio::time::timeout(
        Duration::from_secs(5),
        tether_e2e::connect(b1.client_addr, &authority, Some(OPS_TOKEN)),
    )
    .await
    .map(|r| r.map(|r| r.is_err()).unwrap_or(true))
    .unwrap_or(true);
    assert!(refused, "a draining broker must not open new streams");
    assert!(
        b1.child.try_wait().is_none(),
        "b1 must wait for its open stream"
    );

    live.wait_progress(8 << 20, "data still flowing through draining b1")
        .await?;
    live.finish().await?;
    // Stream done: b1 exits well within its 10 s grace.
    let status = wait_until_async(
        Duration::from_secs(8),
        "b1 to exit after its stream",
        || {
            let s = b1.child.try_wait();
            async move { s }
        },
    )
    .await?;
    assert!(status.success(), "b1 exited with {status}");
    wait_agent_ready(&agent).await?;
    let t = echo_transfer(
        connect_ok(b2.client_addr, &authority).await?,
        Arc::new(Payload::new()),
        1 << 20,
    )
    .await?;
    assert!(t.intact());
    Ok(())
}

/// HTTP CONNECT over TLS (ALPN http/1.1, server name localhost, test CA): with a token, with a
/// client certificate (`tether:client:ops`) instead of a token; an unknown certificate client is
/// refused 403 and no credentials at all 407. A clean end is a TLS close_notify (EOF).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_connect_with_token_or_client_certificate() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "", "").await?;
    let ca = setup.hub.pki.ca_path();
    let addr = setup.broker.client_tls_addr;
    let authority = setup.echo_authority();

    let cfg = client_tls_config(&ca, &[b"http/1.1"], None)?;
    let s = match connect_tls(addr, cfg, &authority, Some(OPS_TOKEN)).await? {
        Ok(s) => s,
        Err((code, body)) => panic!("TLS CONNECT with token: {code} {body}"),
    };
    assert_eq!(s.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    let t = echo_transfer(s, Arc::new(Payload::new()), 16 << 20).await?;
    assert!(t.intact(), "{t:?}");

    let ops = setup
        .hub
        .pki
        .issue("client-ops", Identity::Client { name: "ops".into() }, &[])?;
    let cfg = client_tls_config(&ca, &[b"http/1.1"], Some(&ops))?;
    let mut s = match connect_tls(addr, cfg, &authority, None).await? {
        Ok(s) => s,
        Err((code, body)) => panic!("TLS CONNECT with a client certificate: {code} {body}"),
    };
    s.write_all(b"certificate client").await?;
    let mut got = [0u8; 18];
    s.read_exact(&mut got).await?;
    assert_eq!(&got, b"certificate client");

    let ghost = setup.hub.pki.issue(
        "client-ghost",
        Identity::Client {
            name: "ghost".into(),
        },
        &[],
    )?;
    let cfg = client_tls_config(&ca, &[b"http/1.1"], Some(&ghost))?;
    match connect_tls(addr, cfg, &authority, None).await? {
        Ok(_) => panic!("an unconfigured certificate client was let through"),
        Err((code, body)) => {
            assert_eq!(code, 403, "{body}");
            assert!(body.contains("not configured"), "{body}");
        }
    }
    let cfg = client_tls_config(&ca, &[b"http/1.1"], None)?;
    match connect_tls(addr, cfg, &authority, None).await? {
        Ok(_) => panic!("no credentials let through"),
        Err((code, body)) => assert_eq!(code, 407, "{body}"),
    }
    Ok(())
}

/// The agent dies under a TLS CONNECT stream: the broker resets the client's TCP connection,
/// so the TLS client's read fails with ECONNRESET; it never reads a clean EOF.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_connect_abort_is_an_error() -> anyhow::Result<()> {
    let mut setup = Setup::start("c1", "", "").await?;
    let cfg = client_tls_config(&setup.hub.pki.ca_path(), &[b"http/1.1"], None)?;
    let s = match connect_tls(
        setup.broker.client_tls_addr,
        cfg,
        &setup.echo_authority(),
        Some(OPS_TOKEN),
    )
    .await?
    {
        Ok(s) => s,
        Err((code, body)) => panic!("{code} {body}"),
    };
    let (mut rd, mut wr) = tokio::io::split(s);
    wr.write_all(b"0123456789").await?;
    let mut got = [0u8; 10];
    rd.read_exact(&mut got).await?;
    setup.agent.child.kill();
    let mut buf = [0u8; 1024];
    let end = tokio::time::timeout(Duration::from_secs(30), rd.read(&mut buf)).await?;
    match end {
        Ok(0) => panic!("clean EOF after the agent died: an abort must be an error"),
        Ok(n) => panic!("{n} unexpected bytes"),
        Err(e) => assert_eq!(
            e.kind(),
            std::io::ErrorKind::ConnectionReset,
            "the broker resets an aborted TLS stream: {e}"
        ),
    }
    drop(wr);
    Ok(())
}

/// A TLS CONNECT stream that sits idle — across several tunnel keepalive PINGs (200 ms here)
/// and past the agent's idle read-buffer release (250 ms) — still carries data afterwards, on
/// the same tunnel. The idle period is the input of this test, not a wait for something.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_tls_connect_keeps_working() -> anyhow::Result<()> {
    let keepalive = "tunnel:\n  keepalive_interval: 200ms\n  keepalive_timeout: 1s";
    let setup = Setup::start("c1", keepalive, keepalive).await?;
    let cfg = client_tls_config(&setup.hub.pki.ca_path(), &[b"http/1.1"], None)?;
    let mut s = match connect_tls(
        setup.broker.client_tls_addr,
        cfg,
        &setup.echo_authority(),
        Some(OPS_TOKEN),
    )
    .await?
    {
        Ok(s) => s,
        Err((code, body)) => panic!("{code} {body}"),
    };
    s.write_all(b"before idle").await?;
    let mut got = [0u8; 11];
    s.read_exact(&mut got).await?;
    assert_eq!(&got, b"before idle");

    tokio::time::sleep(Duration::from_millis(1500)).await;

    let t = echo_transfer(s, Arc::new(Payload::new()), 8 << 20).await?;
    assert!(t.intact(), "after idling: {t:?}");
    let connects = metric(
        setup.broker.admin_addr,
        "tether_broker_tunnel_connects_total",
        &[("result", "ok")],
    )
    .await?;
    assert_eq!(connects, 1.0, "the tunnel must have stayed up while idle");
    Ok(())
}

/// Sends `signal` (e.g. `STOP`, `CONT`) to a process we started, by PID.
fn signal(pid: u32, signal: &str) -> anyhow::Result<()> {
    let ok = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()?
        .success();
    anyhow::ensure!(ok, "kill -{signal} {pid} failed");
    Ok(())
}

/// Resumes a stopped process when dropped, so a failing test never leaves it frozen.
struct Resume(u32);

impl Drop for Resume {
    fn drop(&mut self) {
        let _ = signal(self.0, "CONT");
    }
}

/// A frozen agent (SIGSTOP: its TCP connection stays open, nothing answers) is detected by the
/// broker's HTTP/2 PING keepalive within about interval + timeout, not hours; CONNECTs then get
/// 502 at once. Resumed, the agent finds its tunnel gone and reconnects; traffic flows again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalive_detects_frozen_agent_which_then_reconnects() -> anyhow::Result<()> {
    let keepalive = "tunnel:\n  keepalive_interval: 300ms\n  keepalive_timeout: 700ms";
    let setup = Setup::start("c1", keepalive, keepalive).await?;
    let pid = setup.agent.child.pid();
    signal(pid, "STOP")?;
    let resume = Resume(pid);
    let frozen_at = std::time::Instant::now();
    wait_until_async(
        Duration::from_secs(10),
        "the broker to drop the tunnel",
        || async {
            let (_, body) = tether_e2e::admin_get(setup.broker.admin_addr, "/debug/tunnels")
                .await
                .ok()?;
            (!body.contains("\"cluster\":\"c1\"")).then_some(())
        },
    )
    .await?;
    let detected = frozen_at.elapsed();
    println!("frozen agent detected after {detected:.2?}");
    assert!(
        detected < Duration::from_secs(5),
        "keepalive took {detected:?} to notice a dead agent"
    );
    match tether_e2e::connect(setup.broker.client_addr, "c1:443", Some(OPS_TOKEN)).await? {
        Ok(_) => panic!("a CONNECT succeeded with the only agent frozen"),
        Err((code, body)) => {
            assert_eq!(code, 502, "{body}");
            assert!(body.contains("no tunnel"), "{body}");
        }
    }
    drop(resume);
    wait_tunnel(&setup.broker, "c1").await?;
    wait_agent_ready(&setup.agent).await?;
    let t = echo_transfer(
        setup.connect_echo().await?,
        Arc::new(Payload::new()),
        1 << 20,
    )
    .await?;
    assert!(t.intact());
    let connects = metric(
        setup.broker.admin_addr,
        "tether_broker_tunnel_connects_total",
        &[("result", "ok")],
    )
    .await?;
    assert_eq!(connects, 2.0, "the agent should have reconnected once");
    Ok(())
}

/// The whole data plane pauses — the broker and the agent both SIGSTOPped, as a paused VM stops
/// every process on it — for longer than the keepalive timeout and the stall timeout together,
/// while a stream moves data. When they run again, the timers that came due during the pause
/// fire before the sockets are read; the time the processes did not run is not counted against
/// their peers (`tether_tunnel::pause`), so the tunnel stays (no wedge, no redial) and the
/// stream carries on intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_data_plane_keeps_its_tunnel_and_stream() -> anyhow::Result<()> {
    let keepalive_timeout = Duration::from_millis(700);
    let stall_timeout = Duration::from_millis(1000);
    let tunnel = format!(
        "tunnel:\n  keepalive_interval: 300ms\n  keepalive_timeout: {}ms\n  stall_timeout: {}ms",
        keepalive_timeout.as_millis(),
        stall_timeout.as_millis()
    );
    let setup = Setup::start("c1", &tunnel, &tunnel).await?;
    let before = tether_e2e::tunnel_ids(&setup.broker).await?;
    assert_eq!(before.len(), 1, "{before:?}");
    let live = ContinuousEcho::start(setup.connect_echo().await?, 16 << 10, false);
    live.wait_progress(1 << 20, "data flowing before the pause")
        .await?;

    let pids = [setup.broker.child.pid(), setup.agent.child.pid()];
    let pause = 3 * (keepalive_timeout + stall_timeout);
    for pid in pids {
        signal(pid, "STOP")?;
    }
    let resume: Vec<Resume> = pids.into_iter().map(Resume).collect();
    // A fixed pause is the stimulus, not a wait: it must outlast every failure detector.
    tokio::time::sleep(pause).await;
    drop(resume);

    live.wait_progress(4 << 20, "data flowing after the pause")
        .await?;
    let moved = live.finish().await?;
    println!(
        "a pause of {pause:?}: the stream moved {} KiB each way, intact",
        moved >> 10
    );
    assert_eq!(
        tether_e2e::tunnel_ids(&setup.broker).await?,
        before,
        "the tunnel was replaced"
    );
    for (admin, name) in [
        (setup.broker.admin_addr, "tether_broker_tunnel_wedged_total"),
        (setup.agent.admin_addr, "tether_agent_tunnel_wedged_total"),
        (
            setup.broker.admin_addr,
            "tether_broker_tunnel_connects_total",
        ),
    ] {
        let want = if name.ends_with("connects_total") {
            1.0
        } else {
            0.0
        };
        assert_eq!(metric(admin, name, &[]).await?, want, "{name}");
    }
    Ok(())
}

/// SIGTERM on a broker with the HTTP service proxy: a kept-alive HTTP/1.1 client connection is
/// closed and an HTTP/2 one gets a GOAWAY at once (hyper's graceful shutdown), so clients move
/// to another broker for their next requests instead of sending them to one that is going away
/// until its grace (10 s here) runs out. A CONNECT stream held open keeps the broker draining.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_broker_sends_its_service_proxy_clients_away() -> anyhow::Result<()> {
    use http_body_util::{BodyExt as _, Empty};
    use hyper_util::rt::TokioIo;

    let hub = Hub::new()?;
    let echo = echo_server().await?;
    let mut broker = hub.start_broker("b1", "service_proxy:\n  listen: 127.0.0.1:0\n")?;
    let sp = hub.service_proxy_addr("b1")?;
    let agent = hub.start_agent("c1", "c1", &[vec![broker.agent_addr]], echo, "")?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&broker, "c1").await?;
    let ca = hub.pki.ca_path();
    let request = || {
        http::Request::get("/c1/version")
            .header("host", "localhost")
            .header("authorization", format!("Bearer {OPS_TOKEN}"))
            .body(Empty::<bytes::Bytes>::new())
    };

    // HTTP/1.1: one request answered on a kept-alive connection.
    let tls = tether_e2e::tls_connect(sp, client_tls_config(&ca, &[b"http/1.1"], None)?).await?;
    let (mut h1, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
    let h1_conn = tokio::spawn(conn);
    let resp = h1.send_request(request()?).await?;
    let keep_alive = resp
        .headers()
        .get(http::header::CONNECTION)
        .is_none_or(|v| !v.as_bytes().eq_ignore_ascii_case(b"close"));
    resp.into_body().collect().await?;
    assert!(keep_alive, "the first answer keeps the connection");

    // HTTP/2: one request answered.
    let tls = tether_e2e::tls_connect(sp, client_tls_config(&ca, &[b"h2"], None)?).await?;
    let (h2, conn) = h2::client::handshake(tls).await?;
    let h2_conn = tokio::spawn(conn);
    let mut h2 = h2.ready().await?;
    let (resp, _) = h2.send_request(request()?.map(|_| ()), true)?;
    let mut body = resp.await?.into_body();
    while let Some(chunk) = body.data().await {
        chunk?;
    }

    // A stream open through the drain keeps the broker draining (an idle one exits at once).
    let held = connect_ok(broker.client_addr, &tether_e2e::qualified("c1", echo)).await?;
    broker.child.terminate();
    // Both connections end well within the grace: HTTP/1.1 closed, HTTP/2 after its GOAWAY.
    tokio::time::timeout(Duration::from_secs(5), h1_conn)
        .await
        .map_err(|_| anyhow::anyhow!("the HTTP/1.1 connection stayed open while draining"))??
        .ok();
    let ended = tokio::time::timeout(Duration::from_secs(5), h2_conn)
        .await
        .map_err(|_| anyhow::anyhow!("the HTTP/2 connection stayed open while draining"))??;
    if let Err(e) = ended {
        assert!(e.is_go_away(), "the HTTP/2 connection ended by GOAWAY: {e}");
    }
    match h2.ready().await {
        Err(e) => assert!(
            e.is_go_away() || e.is_io(),
            "no new stream after the GOAWAY: {e}"
        ),
        Ok(_) => anyhow::bail!("the HTTP/2 connection still takes streams while draining"),
    }
    assert!(
        broker.child.try_wait().is_none(),
        "the broker still drains (its stream is open)"
    );
    drop(held);
    Ok(())
}

/// SIGKILL of broker b1 (no drain): the stream through it breaks with an error, the agent
/// (one endpoint group [b1, b2]) fails over to b2, and new streams work there.
///
/// The live stream uses CONNECT over TLS: when a process dies the kernel closes its plain TCP
/// sockets with a FIN, so over plain TCP nothing can tell a crashed proxy from an EOF; over TLS
/// the missing close_notify makes it an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_crash_fails_agent_over_to_second_broker() -> anyhow::Result<()> {
    let hub = Hub::new()?;
    let echo = echo_server().await?;
    let mut b1 = hub.start_broker("b1", "")?;
    let b2 = hub.start_broker("b2", "")?;
    let agent = hub.start_agent("c1", "c1", &[vec![b1.agent_addr, b2.agent_addr]], echo, "")?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&b1, "c1").await?;
    let authority = tether_e2e::qualified("c1", echo);
    let cfg = client_tls_config(&hub.pki.ca_path(), &[b"http/1.1"], None)?;
    let mut s = match connect_tls(b1.client_tls_addr, cfg, &authority, Some(OPS_TOKEN)).await? {
        Ok(s) => s,
        Err((code, body)) => panic!("{code} {body}"),
    };
    s.write_all(b"before").await?;
    let mut got = [0u8; 6];
    s.read_exact(&mut got).await?;

    b1.child.kill();
    let mut buf = [0u8; 64];
    let end = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await?;
    assert!(
        end.is_err(),
        "a crashed broker must not look like a clean EOF over TLS: {end:?}"
    );
    wait_tunnel(&b2, "c1").await?;
    wait_agent_ready(&agent).await?;
    let t = echo_transfer(
        connect_ok(b2.client_addr, &authority).await?,
        Arc::new(Payload::new()),
        4 << 20,
    )
    .await?;
    assert!(t.intact(), "{t:?}");
    Ok(())
}

/// SIGTERM on the agent: it stops taking new streams (HTTP/2 GOAWAY; new CONNECTs get 502)
/// while the stream already open keeps moving data and completes intact; the agent then exits
/// cleanly, well within its shutdown grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_sigterm_lets_open_stream_finish() -> anyhow::Result<()> {
    let mut setup = Setup::start("c1", "", "shutdown_grace: 20s").await?;
    let live = ContinuousEcho::start(setup.connect_echo().await?, 64 << 10, false);
    live.wait_progress(4 << 20, "data flowing before SIGTERM")
        .await?;
    setup.agent.child.terminate();
    let b = setup.broker.client_addr;
    let authority = setup.echo_authority();
    let refused = wait_until_async(Duration::from_secs(10), "new CONNECTs refused", || async {
        match tether_e2e::connect(b, &authority, Some(OPS_TOKEN))
            .await
            .ok()?
        {
            Err((code, body)) => Some((code, body)),
            Ok(_) => None,
        }
    })
    .await?;
    assert_eq!(refused.0, 502, "{}", refused.1);
    live.wait_progress(8 << 20, "data still flowing after SIGTERM")
        .await?;
    assert!(
        setup.agent.child.try_wait().is_none(),
        "the agent must wait for its open stream"
    );
    live.finish().await?;
    let status = wait_until_async(Duration::from_secs(10), "the agent to exit", || {
        let s = setup.agent.child.try_wait();
        async move { s }
    })
    .await?;
    assert!(status.success(), "agent exited with {status}");
    Ok(())
}

/// Two agents of one cluster (replicas) on one broker; one is stopped (SIGTERM: GOAWAY, its
/// open stream keeps its grace). Every new CONNECT still succeeds: the broker learns of the
/// GOAWAY, picks the closing tunnel no more, and sends each stream the closing agent did not
/// take (opened after the GOAWAY arrived, or above its last-stream id: h2 writes the PING ack
/// of the graceful shutdown ahead of queued HEADERS) to the other tunnel — no client sees the
/// replica go (before, a CONNECT routed to it got 502 until the tunnel closed). The closing
/// agent's open stream keeps moving data meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closing_replica_takes_no_new_streams_and_loses_none() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "", "shutdown_grace: 30s").await?;
    let second =
        setup
            .hub
            .start_agent("c1", "c1", &[vec![setup.broker.agent_addr]], setup.echo, "")?;
    wait_agent_ready(&second).await?;
    let tunnels = || async {
        let (_, body) = tether_e2e::admin_get(setup.broker.admin_addr, "/debug/tunnels").await?;
        let v: serde_json::Value = serde_json::from_str(&body)?;
        anyhow::Ok(v.as_array().map_or(0, Vec::len))
    };
    wait_until_async(Duration::from_secs(10), "two tunnels of c1", || async {
        (tunnels().await.ok()? == 2).then_some(())
    })
    .await?;
    // Streams go to the least-loaded tunnel: with one held on each, the first agent keeps one.
    let live = ContinuousEcho::start(setup.connect_echo().await?, 16 << 10, false);
    let other = ContinuousEcho::start(setup.connect_echo().await?, 16 << 10, false);
    live.wait_progress(1 << 20, "data flowing on the first stream")
        .await?;
    other
        .wait_progress(1 << 20, "data flowing on the second stream")
        .await?;
    setup.agent.child.terminate();
    let b = setup.broker.client_addr;
    let authority = setup.echo_authority();
    for i in 0..40 {
        let mut s = tether_e2e::connect(b, &authority, Some(OPS_TOKEN))
            .await?
            .map_err(|(code, body)| {
                anyhow::anyhow!("CONNECT {i} after the SIGTERM refused: {code} {body}")
            })?;
        s.write_all(b"ping").await?;
        let mut back = [0u8; 4];
        tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut back)).await??;
        assert_eq!(&back, b"ping", "CONNECT {i}");
    }
    let failed = metric(
        setup.broker.admin_addr,
        "tether_broker_dial_failures_total",
        &[("frontend", "connect")],
    )
    .await?;
    assert_eq!(failed, 0.0, "CONNECT dials failed after the SIGTERM");
    // Both held streams still move data: the closing agent's within its grace.
    live.wait_progress(2 << 20, "the closing agent's stream still flowing")
        .await?;
    other
        .wait_progress(2 << 20, "the other stream still flowing")
        .await?;
    live.finish().await?;
    other.finish().await?;
    Ok(())
}
