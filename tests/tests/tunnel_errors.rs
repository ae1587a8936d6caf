//! Failures through real broker and agent processes: aborts reach the other side as errors
//! (never as a clean EOF), refused identities and clients, malformed requests, and dial errors
//! answered with the right status and reason.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tether_e2e::{Hub, OPS_TOKEN, Payload, Setup, connect, echo_server, metric, qualified};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Asserts a CONNECT answered `code` and its body or headers mention `reason`.
async fn expect_status(
    broker: std::net::SocketAddr,
    authority: &str,
    token: Option<&str>,
    code: u16,
    reason: &str,
) -> anyhow::Result<String> {
    match connect(broker, authority, token).await? {
        Ok(_) => anyhow::bail!("CONNECT {authority} succeeded, expected {code}"),
        Err((got, body)) => {
            assert_eq!(got, code, "CONNECT {authority}: {body}");
            assert!(
                body.to_lowercase().contains(&reason.to_lowercase()),
                "CONNECT {authority}: the answer should mention {reason:?}: {body}"
            );
            Ok(body)
        }
    }
}

/// Reads until EOF or error; returns the bytes read and how it ended.
async fn read_until_end<R: tokio::io::AsyncRead + Unpin>(rd: &mut R) -> (u64, std::io::Result<()>) {
    let mut buf = vec![0u8; 256 << 10];
    let mut n = 0u64;
    loop {
        match rd.read(&mut buf).await {
            Ok(0) => return (n, Ok(())),
            Ok(k) => n += k as u64,
            Err(e) => return (n, Err(e)),
        }
    }
}

/// A target that sends [`Payload`] chunks to every connection, endlessly.
async fn source_server() -> anyhow::Result<std::net::SocketAddr> {
    let l = TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    let payload = Arc::new(Payload::new());
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let payload = Arc::clone(&payload);
            tokio::spawn(async move {
                let mut i = 0;
                while s.write_all(payload.chunk(i, 256 << 10)).await.is_ok() {
                    i += 1;
                }
            });
        }
    });
    Ok(addr)
}

/// SIGKILL of the agent in the middle of a transfer: the client's read fails (connection
/// reset), it never sees a clean EOF with data missing.
///
/// The client only reads (the target streams endlessly): Linux reports a reset to the first
/// syscall on the socket only, so a client writing at the same time could take the error on
/// its write and then read a 0 that is not an EOF.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_killed_mid_transfer_is_an_error_not_eof() -> anyhow::Result<()> {
    let mut setup = Setup::start("c1", "", "").await?;
    let source = source_server().await?;
    let mut rd = tether_e2e::connect_ok(setup.broker.client_addr, &qualified("c1", source)).await?;
    // Let data flow, then kill the agent.
    let mut buf = vec![0u8; 256 << 10];
    let mut received = 0u64;
    while received < 8 << 20 {
        let n = rd.read(&mut buf).await?;
        anyhow::ensure!(n > 0, "EOF after {received} bytes, before the kill");
        received += n as u64;
    }
    setup.agent.child.kill();
    let (more, end) = tokio::time::timeout(Duration::from_secs(30), read_until_end(&mut rd))
        .await
        .context("the client's read neither failed nor ended after the agent died")?;
    let err = match end {
        Ok(()) => panic!(
            "clean EOF after {} bytes of an endless stream: an abort must not look like an EOF",
            received + more
        ),
        Err(e) => e,
    };
    assert_eq!(
        err.kind(),
        std::io::ErrorKind::ConnectionReset,
        "expected ECONNRESET, got {err}"
    );
    // The tunnel is gone from the broker; new CONNECTs say so.
    tether_test_support::wait_until_async(Duration::from_secs(20), "tunnel to vanish", || async {
        let (_, body) = tether_e2e::admin_get(setup.broker.admin_addr, "/debug/tunnels")
            .await
            .ok()?;
        (!body.contains("\"cluster\":\"c1\"")).then_some(())
    })
    .await?;
    expect_status(
        setup.broker.client_addr,
        &setup.echo_authority(),
        Some(OPS_TOKEN),
        502,
        "no tunnel",
    )
    .await?;
    Ok(())
}

/// The target resets its connection: the client sees ECONNRESET, not EOF.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_reset_reaches_client_as_error() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "", "").await?;
    let l = TcpListener::bind("127.0.0.1:0").await?;
    let target = l.local_addr()?;
    tokio::spawn(async move {
        if let Ok((mut s, _)) = l.accept().await {
            let _ = s.write_all(b"partial answer").await;
            let mut b = [0u8; 5];
            let _ = s.read_exact(&mut b).await;
            // Close with RST (zero linger): an abort, not a FIN.
            #[allow(deprecated)]
            let _ = s.set_linger(Some(Duration::ZERO));
            drop(s);
        }
    });
    let mut s = tether_e2e::connect_ok(setup.broker.client_addr, &qualified("c1", target)).await?;
    let mut got = [0u8; 14];
    s.read_exact(&mut got).await?;
    assert_eq!(&got, b"partial answer");
    s.write_all(b"reset").await?;
    let (_, end) = tokio::time::timeout(Duration::from_secs(10), read_until_end(&mut s)).await?;
    let err = end.expect_err("a reset target must not look like a clean EOF");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
    Ok(())
}

/// The client resets its connection: the target sees ECONNRESET, not EOF.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_reset_reaches_target_as_error() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "", "").await?;
    let l = TcpListener::bind("127.0.0.1:0").await?;
    let target = l.local_addr()?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        if let Ok((mut s, _)) = l.accept().await {
            // Read the client's bytes first, so its reset cannot discard them in transit.
            let mut first = [0u8; 10];
            let r = s.read_exact(&mut first).await.map(|_| ());
            let _ = s.write_all(b"hello").await;
            let (n, end) = read_until_end(&mut s).await;
            let _ = tx.send((r.map(|_| first.len() as u64 + n), end));
        }
    });
    let mut s = tether_e2e::connect_ok(setup.broker.client_addr, &qualified("c1", target)).await?;
    s.write_all(b"some bytes").await?;
    let mut got = [0u8; 5];
    s.read_exact(&mut got).await?;
    #[allow(deprecated)]
    s.set_linger(Some(Duration::ZERO))?;
    drop(s);
    let (n, end) = tokio::time::timeout(Duration::from_secs(10), rx).await??;
    assert_eq!(n?, 10);
    let err = end.expect_err("a reset client must not look like a clean EOF to the target");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
    Ok(())
}

/// An agent whose certificate names cluster `a` but which is configured as cluster `b` is
/// refused: no tunnel for either name, and the broker counts an identity mismatch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_certificate_for_other_cluster_is_refused() -> anyhow::Result<()> {
    let hub = Hub::new()?;
    let echo = echo_server().await?;
    let broker = hub.start_broker("b1", "")?;
    let series = ("result", "identity_mismatch");
    let before = metric(
        broker.admin_addr,
        "tether_broker_tunnel_connects_total",
        &[series],
    )
    .await?;
    let _agent = hub.start_agent("b", "a", &[vec![broker.agent_addr]], echo, "")?;
    tether_test_support::wait_until_async(
        Duration::from_secs(20),
        "an identity_mismatch refusal",
        || async {
            let now = metric(
                broker.admin_addr,
                "tether_broker_tunnel_connects_total",
                &[series],
            )
            .await
            .ok()?;
            (now > before).then_some(())
        },
    )
    .await?;
    let ok = metric(
        broker.admin_addr,
        "tether_broker_tunnel_connects_total",
        &[("result", "ok")],
    )
    .await?;
    assert_eq!(ok, 0.0, "the mismatched agent must never be accepted");
    for authority in ["b:443", "a:443"] {
        expect_status(
            broker.client_addr,
            authority,
            Some(OPS_TOKEN),
            502,
            "no tunnel",
        )
        .await?;
    }
    let (_, tunnels) = tether_e2e::admin_get(broker.admin_addr, "/debug/tunnels").await?;
    assert_eq!(tunnels.trim(), "[]");
    Ok(())
}

/// No credentials or a wrong token → 407 with a challenge; a client without a rule for the
/// target → 403; the same client may still reach the API server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_and_unauthorised_clients_are_refused() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "", "").await?;
    let b = setup.broker.client_addr;
    let echo = setup.echo_authority();
    let body = expect_status(b, &echo, None, 407, "no credentials").await?;
    assert!(
        body.to_lowercase().contains("proxy-authenticate: bearer"),
        "407 needs a Proxy-Authenticate challenge: {body}"
    );
    expect_status(
        b,
        &echo,
        Some("wrong-token"),
        407,
        "unknown or revoked token",
    )
    .await?;
    expect_status(b, "c1:443", Some("wrong-token"), 407, "token").await?;
    // Wrong Basic credentials too.
    let head = format!(
        "CONNECT {echo} HTTP/1.1\r\nproxy-authorization: Basic {}\r\n\r\n",
        base64_encode(b"user:wrong")
    );
    let r =
        tether_e2e::send_head(tokio::net::TcpStream::connect(b).await?, head.as_bytes()).await?;
    assert_eq!(r.err().map(|e| e.0), Some(407));
    // apionly has no rules: API server yes, anything else 403.
    expect_status(b, &echo, Some("apionly-token"), 403, "may not reach").await?;
    let mut s = tether_e2e::connect(b, "c1:443", Some("apionly-token"))
        .await?
        .map_err(|(c, body)| anyhow::anyhow!("apionly to c1:443: {c} {body}"))?;
    s.write_all(b"ping").await?;
    let mut got = [0u8; 4];
    s.read_exact(&mut got).await?;
    assert_eq!(&got, b"ping");
    // Right Basic credentials work (kubectl's proxy-url user:token form).
    let head = format!(
        "CONNECT {echo} HTTP/1.1\r\nproxy-authorization: Basic {}\r\n\r\n",
        base64_encode(format!("ops:{OPS_TOKEN}").as_bytes())
    );
    let r =
        tether_e2e::send_head(tokio::net::TcpStream::connect(b).await?, head.as_bytes()).await?;
    assert!(r.is_ok(), "Basic ops credentials: {:?}", r.err());
    let failures = metric(
        setup.broker.admin_addr,
        "tether_broker_dial_failures_total",
        &[("reason", "unauthenticated")],
    )
    .await?;
    assert!(
        failures >= 4.0,
        "unauthenticated refusals counted: {failures}"
    );
    Ok(())
}

fn base64_encode(data: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in data.chunks(3) {
        let b = [c[0], *c.get(1).unwrap_or(&0), *c.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for k in 0..4 {
            if k <= c.len() {
                out.push(A[((n >> (18 - 6 * k)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Malformed requests → 400 with the reason in the body (and the `tether-error` header).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_connect_is_400_with_reason() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "", "").await?;
    let auth = format!("proxy-authorization: Bearer {OPS_TOKEN}\r\n");
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            b"\x16\x03\x01\x02\x00garbage\r\n\r\n".to_vec(),
            "malformed request",
        ),
        (b"hello there\r\n\r\n".to_vec(), "malformed request"),
        (
            format!("GET / HTTP/1.1\r\nhost: c1\r\n{auth}\r\n").into_bytes(),
            "method GET not supported",
        ),
        (
            format!("CONNECT c1:99999 HTTP/1.1\r\n{auth}\r\n").into_bytes(),
            "invalid port",
        ),
        (
            format!("CONNECT c1:http HTTP/1.1\r\n{auth}\r\n").into_bytes(),
            "invalid port",
        ),
        (
            format!("CONNECT c1 HTTP/1.1\r\n{auth}\r\n").into_bytes(),
            "no port",
        ),
        (
            format!("CONNECT Bad_Cluster:443 HTTP/1.1\r\n{auth}\r\n").into_bytes(),
            "cluster name \"bad_cluster\" is invalid",
        ),
        (
            format!("CONNECT web.-bad-.tether:80 HTTP/1.1\r\n{auth}\r\n").into_bytes(),
            "cluster name \"-bad-\" is invalid",
        ),
        (
            format!("CONNECT c1:8080 HTTP/1.1\r\n{auth}\r\n").into_bytes(),
            "ambiguous",
        ),
        (
            format!("CONNECT example.com:443 HTTP/1.1\r\n{auth}\r\n").into_bytes(),
            "not a cluster name",
        ),
    ];
    for (head, reason) in &cases {
        let s = tokio::net::TcpStream::connect(setup.broker.client_addr).await?;
        let r = tether_e2e::send_head(s, head).await?;
        let shown = String::from_utf8_lossy(head);
        let (code, body) = match r {
            Ok(_) => panic!("{shown:?} was accepted"),
            Err(e) => e,
        };
        assert_eq!(code, 400, "{shown:?}: {body}");
        assert!(
            body.to_lowercase().contains(&reason.to_lowercase()),
            "{shown:?}: body should explain {reason:?}: {body}"
        );
        assert!(
            body.to_lowercase().contains("tether-error: bad_request"),
            "{body}"
        );
    }
    let counted = metric(
        setup.broker.admin_addr,
        "tether_broker_dial_failures_total",
        &[("frontend", "connect"), ("reason", "bad_request")],
    )
    .await?;
    assert_eq!(counted, cases.len() as f64);
    Ok(())
}

/// A client that sends its first bytes right behind the CONNECT head (without waiting for the
/// answer) still reads the whole error answer, ended by a clean EOF. The broker closes with a
/// lingering close, so the unread early bytes cannot turn its close into a reset that destroys
/// an answer still in its send queue. On loopback the answer leaves at once and Linux hands
/// queued bytes over before a reset, so this guards the behaviour (the head parser with early
/// data, the clean end) rather than reproducing the loss, which needs a slow link.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_answer_survives_early_client_data() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "", "").await?;
    for round in 0..20 {
        let s = tokio::net::TcpStream::connect(setup.broker.client_addr).await?;
        let (mut rd, mut wr) = s.into_split();
        let head =
            format!("CONNECT c1:99999 HTTP/1.1\r\nproxy-authorization: Bearer {OPS_TOKEN}\r\n\r\n");
        let writer = tokio::spawn(async move {
            // Early data: more than the broker reads with the head; errors once it has closed.
            let _ = wr.write_all(head.as_bytes()).await;
            let _ = wr.write_all(&vec![0x16u8; 4 << 20]).await;
        });
        let mut answer = Vec::new();
        let end = tokio::time::timeout(Duration::from_secs(10), rd.read_to_end(&mut answer))
            .await
            .context("the broker never closed")?;
        let text = String::from_utf8_lossy(&answer);
        assert!(
            end.is_ok(),
            "round {round}: the answer was cut by {end:?} after {} bytes: {text:?}",
            answer.len()
        );
        assert!(text.starts_with("HTTP/1.1 400"), "round {round}: {text:?}");
        assert!(text.contains("invalid port"), "round {round}: {text:?}");
        writer.abort();
    }
    Ok(())
}

/// A dial that cannot complete → 504 within the agent's `max_dial_timeout`.
///
/// How the dial is made to hang: every address outside loopback answers at once in the
/// sandbox (refused, or accepted by its network), so the target is a local listener with a
/// listen backlog of 0 whose single accept-queue slot is taken by a connection nobody accepts.
/// Linux then drops further SYNs (a full accept queue), so a connect to it hangs until the
/// dialler gives up. The test checks that precondition itself before relying on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dial_timeout_is_504() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "", "max_dial_timeout: 300ms").await?;
    let (l, _filler) = hanging_target().await?;
    let target = l.local_addr()?;
    let probe = tokio::time::timeout(
        Duration::from_millis(200),
        tokio::net::TcpStream::connect(target),
    )
    .await;
    anyhow::ensure!(
        probe.is_err(),
        "precondition: a connect to a listener with a full accept queue should hang, got {probe:?}"
    );
    let started = std::time::Instant::now();
    let body = expect_status(
        setup.broker.client_addr,
        &qualified("c1", target),
        Some(OPS_TOKEN),
        504,
        "timed out after 300 ms",
    )
    .await?;
    let took = started.elapsed();
    assert!(body.contains("tether-error: timeout"), "{body}");
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(5),
        "504 after {took:?}, expected just over the 300 ms dial timeout"
    );
    let agent_timeouts = metric(
        setup.agent.admin_addr,
        "tether_agent_dial_failures_total",
        &[("reason", "timeout")],
    )
    .await?;
    assert_eq!(agent_timeouts, 1.0);
    drop(l);
    Ok(())
}

/// Refused → 502 naming the refusal; unknown host → 502 name_not_found; a target the agent's
/// policy forbids → 403 agent_policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dial_refused_and_unknown_host_are_502() -> anyhow::Result<()> {
    let setup = Setup::start(
        "c1",
        "",
        "policy:\n  allow: ['*:*']\n  deny: ['forbidden.example:*']",
    )
    .await?;
    let refusing = tether_e2e::RefusingPort::new()?;
    let closed = refusing.addr;
    let b = setup.broker.client_addr;
    let body = expect_status(b, &qualified("c1", closed), Some(OPS_TOKEN), 502, "refused").await?;
    assert!(body.contains("tether-error: refused"), "{body}");
    let body = expect_status(
        b,
        "no-such-host.invalid.c1.tether:80",
        Some(OPS_TOKEN),
        502,
        "cannot resolve no-such-host.invalid",
    )
    .await?;
    assert!(body.contains("tether-error: name_not_found"), "{body}");
    let body = expect_status(
        b,
        "forbidden.example.c1.tether:80",
        Some(OPS_TOKEN),
        403,
        "agent policy",
    )
    .await?;
    assert!(body.contains("tether-error: agent_policy"), "{body}");
    expect_status(b, "nope:443", Some(OPS_TOKEN), 502, "no tunnel").await?;
    for (reason, n) in [
        ("refused", 1.0),
        ("name_not_found", 1.0),
        ("no_tunnel", 1.0),
    ] {
        let v = metric(
            setup.broker.admin_addr,
            "tether_broker_dial_failures_total",
            &[("reason", reason)],
        )
        .await?;
        assert_eq!(v, n, "broker dial failures with reason {reason}");
    }
    Ok(())
}

/// A local target address whose connects hang: a listener with backlog 0 whose one
/// accept-queue slot is taken (see [`dial_timeout_is_504`]). Keep both values alive.
async fn hanging_target() -> anyhow::Result<(tokio::net::TcpListener, tokio::net::TcpStream)> {
    let sock = tokio::net::TcpSocket::new_v4()?;
    sock.bind("127.0.0.1:0".parse()?)?;
    let l = sock.listen(0)?;
    let filler = tokio::net::TcpStream::connect(l.local_addr()?).await?;
    Ok((l, filler))
}

/// With `max_pending_dials_per_tunnel: 1`, a second dial while one is pending is refused at
/// once with 503 and the reason; once the pending one ends (504), dials work again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_dials_are_bounded_503() -> anyhow::Result<()> {
    let setup = Setup::start(
        "c1",
        "max_pending_dials_per_tunnel: 1",
        "max_dial_timeout: 8s",
    )
    .await?;
    let (hang, _filler) = hanging_target().await?;
    let b = setup.broker.client_addr;
    let hang_authority = qualified("c1", hang.local_addr()?);
    let start_hanging = || {
        let authority = hang_authority.clone();
        tokio::spawn(async move { connect(b, &authority, Some(OPS_TOKEN)).await })
    };
    let mut pending = start_hanging();
    // Probe until the hanging dial is pending (it stays so for 8 s): then the next dial must
    // be refused at once, not queued. If a probe took the only slot first, the hanging dial
    // itself got the 503: start it again.
    let echo = setup.echo_authority();
    let deadline = std::time::Instant::now() + Duration::from_secs(6);
    let mut seen = Vec::new();
    let body = loop {
        if pending.is_finished() {
            let lost = pending.await??;
            seen.push(format!("hanging dial: {:?}", lost.err()));
            pending = start_hanging();
        }
        let probe =
            tokio::time::timeout(Duration::from_secs(2), connect(b, &echo, Some(OPS_TOKEN))).await;
        match probe {
            Ok(Ok(Err((503, body)))) if !pending.is_finished() => break body,
            other => seen.push(format!("{:?}", other.map(|r| r.map(|r| r.err())))),
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "no 503 while a dial was pending; probes answered {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(body.contains("too many pending dials"), "{body}");
    assert!(body.contains("tether-error: overloaded"), "{body}");
    let first = tokio::time::timeout(Duration::from_secs(10), pending).await???;
    assert_eq!(first.err().map(|e| e.0), Some(504));
    let mut s = setup.connect_echo().await?;
    s.write_all(b"again").await?;
    let mut got = [0u8; 5];
    s.read_exact(&mut got).await?;
    assert_eq!(&got, b"again");
    Ok(())
}

/// A target that never reads pins nothing: once the agent's write to it makes no progress for
/// `write_stall_timeout`, the stream is aborted in both directions — the client's write fails
/// with a reset, both processes count the stream closed (`write_stalled`) and hold no streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_that_never_reads_is_aborted_after_write_stall() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "", "tunnel:\n  write_stall_timeout: 500ms").await?;
    let l = TcpListener::bind("127.0.0.1:0").await?;
    let target = l.local_addr()?;
    let (held_tx, held_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        // Accept and hold the connection without ever reading.
        if let Ok((s, _)) = l.accept().await {
            let _ = held_tx.send(s);
        }
    });
    let mut s = tether_e2e::connect_ok(setup.broker.client_addr, &qualified("c1", target)).await?;
    let _held = held_rx.await?;
    let payload = Payload::new();
    let mut written = 0u64;
    let err = tokio::time::timeout(Duration::from_secs(30), async {
        let mut i = 0;
        loop {
            match s.write_all(payload.chunk(i, 256 << 10)).await {
                Ok(()) => written += 256 << 10,
                Err(e) => return e,
            }
            i += 1;
        }
    })
    .await
    .context("the client's writes never failed: a non-reading target pins the stream")?;
    assert!(
        matches!(
            err.kind(),
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
        ),
        "{err}"
    );
    println!(
        "client wrote {} MiB before the stream was aborted",
        written >> 20
    );
    let stalled = metric(
        setup.agent.admin_addr,
        "tether_agent_stream_duration_seconds_count",
        &[("result", "write_stalled")],
    )
    .await?;
    assert_eq!(
        stalled, 1.0,
        "the agent should close the stream as write_stalled"
    );
    for (admin, name) in [
        (setup.agent.admin_addr, "tether_agent_open_streams"),
        (setup.broker.admin_addr, "tether_broker_open_streams"),
    ] {
        tether_test_support::wait_until_async(Duration::from_secs(10), name, || async {
            (metric(admin, name, &[]).await.ok()? == 0.0).then_some(())
        })
        .await?;
    }
    Ok(())
}

/// The agent accepts at most `tunnel.max_concurrent_streams` streams on a tunnel; a CONNECT
/// beyond that is refused at once with 503 and the reason (not queued until the dial budget
/// runs out), and once a stream closes, new ones work again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_per_tunnel_are_bounded_503() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "", "tunnel:\n  max_concurrent_streams: 2").await?;
    let b = setup.broker.client_addr;
    let echo = setup.echo_authority();
    let mut first = setup.connect_echo().await?;
    let _second = setup.connect_echo().await?;
    let started = std::time::Instant::now();
    let third = connect(b, &echo, Some(OPS_TOKEN)).await?;
    let took = started.elapsed();
    let (code, body) = third.expect_err("a third stream must be refused");
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("limit of 2 concurrent streams"), "{body}");
    assert!(
        took < Duration::from_secs(2),
        "refused after {took:?}: should be at once"
    );
    // Close one stream cleanly; then a new one gets through.
    first.shutdown().await?;
    let mut rest = Vec::new();
    first.read_to_end(&mut rest).await?;
    let mut s = tether_test_support::wait_until_async(
        Duration::from_secs(10),
        "a stream slot to free up",
        || async { connect(b, &echo, Some(OPS_TOKEN)).await.ok()?.ok() },
    )
    .await?;
    s.write_all(b"third").await?;
    let mut got = [0u8; 5];
    s.read_exact(&mut got).await?;
    assert_eq!(&got, b"third");
    Ok(())
}

/// A target given by name is resolved once per `dns_cache.ttl` (the next dial within it uses
/// the cached addresses), and a name none of whose addresses took the connection is resolved
/// again on the next dial, not served stale for the TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_names_are_cached_and_forgotten_when_their_addresses_fail() -> anyhow::Result<()> {
    let setup = Setup::start("c1", "", "dns_cache:\n  ttl: 60s\n  max_entries: 16").await?;
    let b = setup.broker.client_addr;
    let resolutions = |result: &'static str| {
        let admin = setup.agent.admin_addr;
        async move {
            metric(
                admin,
                "tether_agent_dial_resolutions_total",
                &[("result", result)],
            )
            .await
        }
    };
    // `localhost` comes from /etc/hosts: the system resolver, no DNS traffic.
    let by_name = format!("localhost.c1.tether:{}", setup.echo.port());
    for _ in 0..2 {
        let mut s = tether_e2e::connect_ok(b, &by_name).await?;
        s.write_all(b"hi").await?;
        let mut got = [0u8; 2];
        s.read_exact(&mut got).await?;
        assert_eq!(&got, b"hi");
    }
    assert_eq!(resolutions("resolved").await?, 1.0, "first dial resolves");
    assert_eq!(
        resolutions("cached").await?,
        1.0,
        "second dial uses the cache"
    );
    // A name whose addresses refuse: forgotten after the failed dial, resolved again next time.
    let closed = {
        let l = TcpListener::bind("127.0.0.1:0").await?;
        l.local_addr()?.port()
    };
    let refusing = format!("localhost.c1.tether:{closed}");
    for _ in 0..2 {
        expect_status(b, &refusing, Some(OPS_TOKEN), 502, "refused").await?;
    }
    assert_eq!(
        resolutions("resolved").await?,
        3.0,
        "a name whose addresses failed is resolved again"
    );
    assert_eq!(resolutions("cached").await?, 1.0);
    Ok(())
}
