//! Broker HA with a control plane (real nats-server, addon-manager, brokers and agents):
//! brokers announce themselves in `tether-brokers` and relay to each other without static
//! peers; killing a broker leaves the other serving at once; a drained broker shows
//! `draining` and removes its entry on exit; a deleted cluster loses its tunnels and clients
//! get "unknown cluster"; hub clients issued by `tetherctl client create` are enforced by the
//! brokers, limited by a ClientAccessPolicy, and revoked by `tetherctl client delete`.

use tether_e2e::registration;

use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use tether_control::brokers::BrokerPresence;
use tether_control::connect::{self, ConnectConfig, Credentials};
use tether_control::hub::{ADMIN_USER, HubDir};
use tether_control::resources::ManagedCluster;
use tether_control::store::Store as _;
use tether_control::store::{Bucket, HubStore};
use tether_e2e::{
    Broker, Hub as Procs, OPS_TOKEN, admin_get, connect, connect_ok, echo_server, metric,
    qualified, wait_agent_ready, wait_tunnel,
};
use tether_test_support::wait_until_async;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use registration::{Hub as ControlHub, HubOpts};

/// Deadline for anything the control plane propagates.
const CP_TIMEOUT: Duration = Duration::from_secs(20);

struct Ha {
    procs: Procs,
    hub: ControlHub,
    store: HubStore,
    _conn: tether_control::NatsConnection,
}

impl Ha {
    async fn start() -> anyhow::Result<Self> {
        let hub = ControlHub::start(HubOpts::default())?;
        let procs = Procs::new()?;
        let dir = HubDir::load(&hub.hub_dir)?;
        let endpoint = dir.endpoint(Some(&hub.nats_url()))?;
        let password = dir.read(&dir.config.nats.admin_password_file)?;
        let conn = connect::connect(&ConnectConfig::new(
            endpoint,
            Credentials::HubUser {
                user: ADMIN_USER.into(),
                password: password.trim().into(),
            },
            "tetherctl",
        ))
        .await?;
        let store = HubStore::open(conn.client.clone()).await?;
        Ok(Self {
            procs,
            hub,
            store,
            _conn: conn,
        })
    }

    /// YAML of a broker's `control_plane` section (plus `extra` top-level keys).
    fn cp_yaml(&self, extra: &str) -> String {
        format!(
            "control_plane:\n  nats_url: {}\n  server_name: {}\n  ca: {}\n  password_file: {}\n  advertise:\n    server_name: tether-broker\n{extra}",
            self.hub.nats_url(),
            self.hub.opts.hub_host,
            self.hub.hub_dir.join("ca.crt").display(),
            self.hub.hub_dir.join("hub-user.password").display(),
        )
    }

    fn broker(&self, id: &str) -> anyhow::Result<Broker> {
        self.procs.start_broker(id, &self.cp_yaml(""))
    }

    /// Writes an accepted (or not) ManagedCluster, as registration would.
    async fn register(&self, cluster: &str, accepted: bool) -> anyhow::Result<()> {
        let mut mc = ManagedCluster::new(cluster);
        mc.spec.hub_accepts_client = accepted;
        self.store.put(Bucket::Clusters, cluster, &mc).await?;
        Ok(())
    }

    async fn presence(&self, id: &str) -> Option<BrokerPresence> {
        self.store
            .get::<BrokerPresence>(Bucket::Brokers, id)
            .await
            .ok()
            .flatten()
            .map(|(p, _)| p)
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.procs.path().join(format!("{name}.log"))).unwrap_or_default()
    }
}

/// Waits until `broker` answers a CONNECT to `authority` with 200.
async fn wait_connect(broker: &Broker, authority: &str) -> anyhow::Result<tokio::net::TcpStream> {
    wait_until_async(
        CP_TIMEOUT,
        &format!("CONNECT {authority} via {}", broker.id),
        || async {
            connect(broker.client_addr, authority, Some(OPS_TOKEN))
                .await
                .ok()?
                .ok()
        },
    )
    .await
}

async fn echo_round_trip(mut s: tokio::net::TcpStream, n: usize) -> anyhow::Result<()> {
    let data: Vec<u8> = (0..n).map(|i| (i * 31 % 251) as u8).collect();
    s.write_all(&data).await?;
    s.shutdown().await?;
    let mut back = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut back)).await??;
    anyhow::ensure!(back == data, "echo differs ({} of {n} bytes)", back.len());
    Ok(())
}

/// One konnectivity DIAL_REQ through `broker`'s client TLS port; returns DIAL_RSP's error.
async fn konnectivity_dial(ha: &Ha, broker: &Broker, address: &str) -> anyhow::Result<String> {
    use futures::SinkExt as _;
    use tether_proto::konnectivity as k;
    let ca = std::fs::read_to_string(ha.procs.pki.ca_path())?;
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(ca))
        .domain_name("localhost");
    let channel =
        tonic::transport::Endpoint::from_shared(format!("https://{}", broker.client_tls_addr))?
            .tls_config(tls)?
            .connect_timeout(Duration::from_secs(10))
            .connect()
            .await?;
    let mut client = k::proxy_service_client::ProxyServiceClient::new(channel);
    let (mut tx, rx) = futures::channel::mpsc::channel(4);
    let mut req = tonic::Request::new(rx);
    req.metadata_mut()
        .insert("authorization", format!("Bearer {OPS_TOKEN}").parse()?);
    tx.send(k::Packet {
        r#type: k::PacketType::DialReq as i32,
        payload: Some(k::packet::Payload::DialRequest(k::DialRequest {
            protocol: "tcp".into(),
            address: address.into(),
            random: 1,
        })),
    })
    .await?;
    let mut inbound = client.proxy(req).await?.into_inner();
    let rsp = tokio::time::timeout(Duration::from_secs(10), inbound.message())
        .await??
        .ok_or_else(|| anyhow::anyhow!("no DIAL_RSP"))?;
    match rsp.payload {
        Some(k::packet::Payload::DialResponse(d)) => Ok(d.error),
        other => anyhow::bail!("expected DIAL_RSP, got {other:?}"),
    }
}

/// A target that writes forever, so a client is mid-read when something breaks.
async fn endless_source() -> anyhow::Result<std::net::SocketAddr> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let a = l.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let chunk = vec![7u8; 64 * 1024];
                while s.write_all(&chunk).await.is_ok() {}
            });
        }
    });
    Ok(a)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brokers_announce_and_relay_without_static_peers() -> anyhow::Result<()> {
    let ha = Ha::start().await?;
    ha.register("c1", true).await?;
    ha.register("c2", true).await?;
    let echo = echo_server().await?;
    let a = ha.broker("a")?;
    let b = ha.broker("b")?;

    // Both announce themselves, with their addresses and a live lease.
    for br in [&a, &b] {
        let p = wait_until_async(CP_TIMEOUT, &format!("presence of {}", br.id), || async {
            ha.presence(&br.id)
                .await
                .filter(|p| p.is_serving(SystemTime::now()))
        })
        .await?;
        assert_eq!(p.agent_addresses, vec![br.agent_addr.to_string()]);
        assert_eq!(p.relay_address, br.agent_addr.to_string());
        assert!(
            p.client_addresses
                .contains(&format!("http://{}", br.client_addr)),
            "{p:?}"
        );
    }

    // An agent connected only to B is reached through A (relay peer from presence).
    let agent = ha
        .procs
        .start_agent("c1", "c1", &[vec![b.agent_addr]], echo, "")?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&b, "c1").await?;
    let s = wait_connect(&a, &qualified("c1", echo))
        .await
        .inspect_err(|_| eprintln!("== a\n{}\n== b\n{}", ha.log("broker-a"), ha.log("broker-b")))?;
    echo_round_trip(s, 1_000_000).await?;
    assert_eq!(
        metric(a.admin_addr, "tether_broker_discovered_peers", &[]).await?,
        1.0
    );
    assert_eq!(
        metric(a.admin_addr, "tether_broker_control_plane_connected", &[]).await?,
        1.0
    );
    // Load is announced: B reports its tunnel.
    wait_until_async(CP_TIMEOUT, "B's presence counts its tunnel", || async {
        ha.presence("b").await.filter(|p| p.tunnels == 1)
    })
    .await?;

    // A cluster the hub does not know: a clear "unknown cluster", not "no tunnel".
    match connect(a.client_addr, "nowhere:443", Some(OPS_TOKEN)).await? {
        Err((404, body)) => assert!(
            body.contains("unknown cluster nowhere") && body.contains("unknown_cluster"),
            "{body}"
        ),
        other => panic!("expected 404, got {:?}", other.map(|_| ())),
    }
    // The same answer on the native gRPC API and the konnectivity API.
    let d = tether_client::Dialer::connect(tether_client::DialerConfig {
        endpoint: format!("https://{}", a.client_tls_addr),
        server_name: "localhost".into(),
        ca_pem: std::fs::read_to_string(ha.procs.pki.ca_path())?,
        client_cert: None,
        token: Some(tether_client::Token(OPS_TOKEN.into())),
        connect_timeout: Duration::from_secs(5),
    })
    .await?;
    match d.dial("nowhere", "", 0).await {
        Err(tether_client::ClientError::Dial { code, message }) => {
            assert_eq!(
                code,
                tether_proto::tunnel::v1::DialErrorCode::UnknownCluster,
                "{message}"
            );
            assert!(message.contains("unknown cluster nowhere"), "{message}");
        }
        other => panic!("expected UnknownCluster, got {:?}", other.map(|_| ())),
    }
    let rsp = konnectivity_dial(&ha, &a, "nowhere:443").await?;
    assert!(rsp.contains("unknown cluster nowhere"), "{rsp}");
    // A known cluster without an agent: still no_tunnel (502), after asking the peer.
    match connect(a.client_addr, "c2:443", Some(OPS_TOKEN)).await? {
        Err((502, body)) => assert!(body.contains("no_tunnel"), "{body}"),
        other => panic!("expected 502, got {:?}", other.map(|_| ())),
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_broker_leaves_the_other_serving() -> anyhow::Result<()> {
    let ha = Ha::start().await?;
    ha.register("c1", true).await?;
    let echo = echo_server().await?;
    let source = endless_source().await?;
    let mut a = ha.broker("a")?;
    let b = ha.broker("b")?;
    // The agent holds a tunnel to every broker; its API server is the endless source.
    let agent = ha.procs.start_agent(
        "c1",
        "c1",
        &[vec![a.agent_addr], vec![b.agent_addr]],
        source,
        "",
    )?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&a, "c1").await?;
    wait_tunnel(&b, "c1").await?;
    wait_until_async(CP_TIMEOUT, "b discovers a", || async {
        (metric(b.admin_addr, "tether_broker_relay_peers_connected", &[])
            .await
            .ok()?
            == 1.0)
            .then_some(())
    })
    .await?;

    // Two streams on A, mid-transfer: CONNECT over TLS and over plain TCP.
    let cfg = tether_e2e::client_tls_config(&ha.procs.pki.ca_path(), &[b"http/1.1"], None)?;
    let mut on_a_tls =
        match tether_e2e::connect_tls(a.client_tls_addr, cfg, "c1:443", Some(OPS_TOKEN)).await? {
            Ok(s) => s,
            Err((code, body)) => anyhow::bail!("CONNECT over TLS answered {code}: {body}"),
        };
    let mut buf = vec![0u8; 64 * 1024];
    let mut got = 0;
    while got < 1_000_000 {
        got += on_a_tls.read(&mut buf).await?;
    }
    let mut on_a_plain = connect_ok(a.client_addr, "c1:443").await?;
    let mut got = 0;
    while got < 1_000_000 {
        got += on_a_plain.read(&mut buf).await?;
    }

    let killed = Instant::now();
    a.child.kill();
    // New streams through B succeed within 5 s of the kill.
    let s = wait_until_async(Duration::from_secs(5), "a new stream via B", || async {
        connect_ok(b.client_addr, &qualified("c1", echo)).await.ok()
    })
    .await?;
    let first_ok = killed.elapsed();
    echo_round_trip(s, 100_000).await?;
    eprintln!("new stream through the surviving broker {first_ok:?} after SIGKILL");
    assert!(first_ok < Duration::from_secs(5), "{first_ok:?}");

    // The stream that was on the killed broker ends with an error, never a clean EOF.
    let end = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match on_a_tls.read(&mut buf).await {
                Ok(0) => return Ok(()),
                Ok(_) => continue,
                Err(e) => return Err(e),
            }
        }
    })
    .await?;
    let err = end.expect_err("a stream on the killed broker must end with an error, not EOF");
    eprintln!("TLS stream on the killed broker ended with: {err}");
    let end = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match on_a_plain.read(&mut buf).await {
                Ok(0) => return Ok(()),
                Ok(_) => continue,
                Err(e) => return Err(e),
            }
        }
    })
    .await?;
    let err = end.expect_err("a plain CONNECT stream on the killed broker must end with a reset");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");

    // A's presence goes stale (it could not delete it) and B drops it as a peer.
    wait_until_async(CP_TIMEOUT, "A's presence goes stale", || async {
        ha.presence("a")
            .await
            .filter(|p| !p.is_live(SystemTime::now()))
    })
    .await?;
    wait_until_async(CP_TIMEOUT, "B forgets A", || async {
        (metric(b.admin_addr, "tether_broker_discovered_peers", &[])
            .await
            .ok()?
            == 0.0)
            .then_some(())
    })
    .await?;
    // Many new streams through B keep working.
    for _ in 0..20 {
        echo_round_trip(
            connect_ok(b.client_addr, &qualified("c1", echo)).await?,
            10_000,
        )
        .await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drained_broker_shows_draining_then_removes_its_entry() -> anyhow::Result<()> {
    let ha = Ha::start().await?;
    ha.register("c1", true).await?;
    let echo = echo_server().await?;
    let mut a = ha.broker("a")?;
    let agent = ha
        .procs
        .start_agent("c1", "c1", &[vec![a.agent_addr]], echo, "")?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&a, "c1").await?;
    wait_until_async(CP_TIMEOUT, "presence of a", || async {
        ha.presence("a").await
    })
    .await?;
    // An open stream keeps the drain going (drain_grace 10 s) so `draining` can be seen.
    let mut open = connect_ok(a.client_addr, &qualified("c1", echo)).await?;
    a.child.terminate();
    wait_until_async(CP_TIMEOUT, "a shows draining", || async {
        ha.presence("a").await.filter(|p| p.draining)
    })
    .await?;
    let p = ha.presence("a").await.expect("entry while draining");
    assert!(!p.is_serving(SystemTime::now()) && p.is_live(SystemTime::now()));
    let table = ha.hub.tetherctl_ok(&["get", "brokers"])?;
    let row: Vec<&str> = table
        .lines()
        .find(|l| l.starts_with("a "))
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(row.get(1..3), Some(&["true", "true"][..]), "{table}");
    // The open stream still works during the drain; closing it lets the broker exit.
    open.write_all(b"ping").await?;
    let mut four = [0u8; 4];
    open.read_exact(&mut four).await?;
    assert_eq!(&four, b"ping");
    drop(open);
    a.child.wait_exit(CP_TIMEOUT)?;
    assert!(
        ha.presence("a").await.is_none(),
        "presence key must be deleted on a clean exit"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_cluster_loses_its_tunnels_and_clients_get_unknown_cluster() -> anyhow::Result<()> {
    let ha = Ha::start().await?;
    ha.register("c1", true).await?;
    ha.register("c3", false).await?;
    let source = endless_source().await?;
    let a = ha.broker("a")?;
    let agent = ha
        .procs
        .start_agent("c1", "c1", &[vec![a.agent_addr]], source, "")?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&a, "c1").await?;

    // Agents of an unregistered or not accepted cluster are refused, with the reason.
    wait_until_async(CP_TIMEOUT, "a has read the hub's clusters", || async {
        (metric(a.admin_addr, "tether_broker_known_clusters", &[])
            .await
            .ok()?
            == 2.0)
            .then_some(())
    })
    .await?;
    let c9 = ha
        .procs
        .start_agent("c9", "c9", &[vec![a.agent_addr]], source, "")?;
    let _c3 = ha
        .procs
        .start_agent("c3", "c3", &[vec![a.agent_addr]], source, "")?;
    let refused = || async {
        metric(
            a.admin_addr,
            "tether_broker_tunnel_connects_total",
            &[("result", "cluster_refused")],
        )
        .await
        .unwrap_or(0.0)
    };
    wait_until_async(
        CP_TIMEOUT,
        "c9 and c3 refused with their reasons",
        || async {
            let log = ha.log("broker-a");
            (log.contains("cluster c9 is not registered on the hub")
                && log.contains("cluster c3 is not accepted by the hub")
                && refused().await >= 2.0)
                .then_some(())
        },
    )
    .await?;
    // The agent hears the refusal as such (not as an unknown request or a lost connection).
    wait_until_async(CP_TIMEOUT, "c9's agent counts a refusal", || async {
        (metric(
            c9.admin_addr,
            "tether_agent_tunnel_connects_total",
            &[("result", "refused")],
        )
        .await
        .ok()?
            >= 1.0)
            .then_some(())
    })
    .await
    .inspect_err(|_| eprintln!("== broker-a\n{}", ha.log("broker-a")))?;
    let (_, tunnels) = admin_get(a.admin_addr, "/debug/tunnels").await?;
    assert!(
        !tunnels.contains("\"c9\"") && !tunnels.contains("\"c3\""),
        "{tunnels}"
    );

    // A stream open while the cluster is deleted ends with an error.
    let mut s = connect_ok(a.client_addr, "c1:443").await?;
    let mut buf = vec![0u8; 64 * 1024];
    let mut got = 0;
    while got < 500_000 {
        got += s.read(&mut buf).await?;
    }
    ha.hub.tetherctl_ok(&["delete", "managedcluster", "c1"])?;
    wait_until_async(CP_TIMEOUT, "c1's tunnel closed", || async {
        let (_, body) = admin_get(a.admin_addr, "/debug/tunnels").await.ok()?;
        (!body.contains("\"cluster\":\"c1\"")).then_some(())
    })
    .await?;
    let end = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) => return Ok(()),
                Ok(_) => continue,
                Err(e) => return Err(e),
            }
        }
    })
    .await?;
    end.expect_err("a stream of a deleted cluster must end with an error");
    match connect(a.client_addr, "c1:443", Some(OPS_TOKEN)).await? {
        Err((404, body)) => assert!(body.contains("unknown cluster c1"), "{body}"),
        other => panic!("expected 404 unknown cluster, got {:?}", other.map(|_| ())),
    }
    assert!(
        metric(
            a.admin_addr,
            "tether_broker_tunnels_closed_by_hub_total",
            &[]
        )
        .await?
            >= 1.0
    );
    // The agent keeps trying and is refused (with the reason); its tunnel never comes back.
    let refused = metric(
        a.admin_addr,
        "tether_broker_tunnel_connects_total",
        &[("result", "cluster_refused")],
    )
    .await?;
    wait_until_async(CP_TIMEOUT, "c1's agent refused again", || async {
        (metric(
            a.admin_addr,
            "tether_broker_tunnel_connects_total",
            &[("result", "cluster_refused")],
        )
        .await
        .ok()?
            > refused)
            .then_some(())
    })
    .await?;
    let (_, body) = admin_get(a.admin_addr, "/debug/tunnels").await?;
    assert!(!body.contains("\"cluster\":\"c1\""), "{body}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hub_clients_are_issued_limited_and_revoked() -> anyhow::Result<()> {
    let ha = Ha::start().await?;
    ha.register("c1", true).await?;
    // Brokers trust client certificates signed by the hub CA.
    let hub_ca = std::fs::read_to_string(ha.hub.hub_dir.join("ca.crt"))?;
    let mut bundle = std::fs::read_to_string(ha.procs.pki.ca_path())?;
    bundle.push_str(&hub_ca);
    std::fs::write(ha.procs.pki.ca_path(), bundle)?;
    let echo = echo_server().await?;
    let a = ha.broker("a")?;
    let agent = ha
        .procs
        .start_agent("c1", "c1", &[vec![a.agent_addr]], echo, "")?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&a, "c1").await?;
    let echo_target = qualified("c1", echo);

    // A token: shown once by tetherctl; the broker accepts it as soon as it sees the HubClient.
    let token = ha
        .hub
        .tetherctl_ok(&["client", "create", "robot", "--token"])?
        .trim()
        .to_string();
    assert!(token.starts_with("tether-client.robot."), "{token}");
    wait_until_async(CP_TIMEOUT, "robot's token accepted", || async {
        connect(a.client_addr, "c1:443", Some(&token))
            .await
            .ok()?
            .ok()
    })
    .await?;
    // No policy names it: the API server only.
    match connect(a.client_addr, &echo_target, Some(&token)).await? {
        Err((403, body)) => assert!(body.contains("robot"), "{body}"),
        other => panic!("expected 403, got {:?}", other.map(|_| ())),
    }

    // A policy: invalid documents are refused naming the field, nothing is stored.
    let bad = ha.procs.path().join("bad-policy.yaml");
    std::fs::write(
        &bad,
        "apiVersion: proxy.tether.io/v1alpha1\nkind: ClientAccessPolicy\nmetadata: {name: robot-echo}\nspec:\n  clients: [robot]\n  rules:\n    - clusters: [c1]\n      targets: ['127.0.0.1:http']\n",
    )?;
    let o = ha.hub.tetherctl(&["apply", "-f", bad.to_str().unwrap()])?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("spec.rules[0].targets[0]"),
        "{err}"
    );
    let good = ha.procs.path().join("policy.yaml");
    std::fs::write(
        &good,
        "apiVersion: proxy.tether.io/v1alpha1\nkind: ClientAccessPolicy\nmetadata: {name: robot-echo}\nspec:\n  clients: [robot]\n  rules:\n    - clusters: [c1]\n      targets: ['127.0.0.1:*']\n",
    )?;
    let out = ha
        .hub
        .tetherctl_ok(&["apply", "-f", good.to_str().unwrap()])?;
    assert!(
        out.contains("clientaccesspolicy/robot-echo created"),
        "{out}"
    );
    let s = wait_until_async(
        CP_TIMEOUT,
        "policy lets robot reach the service",
        || async {
            connect(a.client_addr, &echo_target, Some(&token))
                .await
                .ok()?
                .ok()
        },
    )
    .await?;
    echo_round_trip(s, 10_000).await?;
    // Its rules replace the default: no API server any more.
    match connect(a.client_addr, "c1:443", Some(&token)).await? {
        Err((403, _)) => {}
        other => panic!("expected 403, got {:?}", other.map(|_| ())),
    }
    let table = ha.hub.tetherctl_ok(&["get", "clients"])?;
    assert!(
        table.contains("robot") && table.contains("token") && table.contains("robot-echo"),
        "{table}"
    );

    // Revocation: new streams are refused within seconds.
    ha.hub.tetherctl_ok(&["client", "delete", "robot"])?;
    let revoked = Instant::now();
    wait_until_async(Duration::from_secs(5), "robot's token revoked", || async {
        match connect(a.client_addr, &echo_target, Some(&token))
            .await
            .ok()?
        {
            Err((407, _)) => Some(()),
            _ => None,
        }
    })
    .await?;
    eprintln!(
        "token refused {:?} after tetherctl client delete",
        revoked.elapsed()
    );

    // A certificate issued by the hub CA (CN tether:client:certbot) works the same way.
    let dir = ha.procs.path().join("certbot");
    ha.hub.tetherctl_ok(&[
        "client",
        "create",
        "certbot",
        "--cert-out",
        dir.to_str().unwrap(),
    ])?;
    let leaf = tether_test_support::LeafFiles {
        cert: dir.join("tls.crt"),
        key: dir.join("tls.key"),
        ca: dir.join("ca.crt"),
    };
    let cfg =
        || tether_e2e::client_tls_config(&ha.procs.pki.ca_path(), &[b"http/1.1"], Some(&leaf));
    wait_until_async(CP_TIMEOUT, "certbot's certificate accepted", || async {
        tether_e2e::connect_tls(a.client_tls_addr, cfg().ok()?, "c1:443", None)
            .await
            .ok()?
            .ok()
    })
    .await?;
    ha.hub.tetherctl_ok(&["client", "delete", "certbot"])?;
    wait_until_async(Duration::from_secs(5), "certbot revoked", || async {
        match tether_e2e::connect_tls(a.client_tls_addr, cfg().ok()?, "c1:443", None)
            .await
            .ok()?
        {
            Err((403, body)) if body.contains("revoked") => Some(()),
            _ => None,
        }
    })
    .await?;

    // Re-creating the name issues a new certificate; the old one stays revoked (the broker
    // checks the serial the hub recorded, not only the name).
    let dir2 = ha.procs.path().join("certbot-2");
    ha.hub.tetherctl_ok(&[
        "client",
        "create",
        "certbot",
        "--cert-out",
        dir2.to_str().unwrap(),
    ])?;
    let leaf2 = tether_test_support::LeafFiles {
        cert: dir2.join("tls.crt"),
        key: dir2.join("tls.key"),
        ca: dir2.join("ca.crt"),
    };
    let cfg2 =
        || tether_e2e::client_tls_config(&ha.procs.pki.ca_path(), &[b"http/1.1"], Some(&leaf2));
    wait_until_async(
        CP_TIMEOUT,
        "the new certbot certificate accepted",
        || async {
            tether_e2e::connect_tls(a.client_tls_addr, cfg2().ok()?, "c1:443", None)
                .await
                .ok()?
                .ok()
        },
    )
    .await?;
    match tether_e2e::connect_tls(a.client_tls_addr, cfg()?, "c1:443", None).await? {
        Err((403, body)) => assert!(body.contains("not the one the hub issued"), "{body}"),
        other => panic!(
            "the old certbot certificate must stay refused, got {:?}",
            other.map(|_| ())
        ),
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_plane_survives_a_nats_outage_and_presence_comes_back() -> anyhow::Result<()> {
    let mut ha = Ha::start().await?;
    ha.register("c1", true).await?;
    let echo = echo_server().await?;
    let a = ha.broker("a")?;
    let b = ha.broker("b")?;
    let agent = ha
        .procs
        .start_agent("c1", "c1", &[vec![b.agent_addr]], echo, "")?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&b, "c1").await?;
    let target = qualified("c1", echo);
    echo_round_trip(wait_connect(&a, &target).await?, 10_000).await?;

    ha.hub.stop_nats()?;
    let down = Instant::now();
    for br in [&a, &b] {
        wait_until_async(CP_TIMEOUT, &format!("{} sees NATS down", br.id), || async {
            (metric(br.admin_addr, "tether_broker_control_plane_connected", &[])
                .await
                .ok()?
                == 0.0)
                .then_some(())
        })
        .await?;
        assert_eq!(admin_get(br.admin_addr, "/readyz").await?.0, 200);
    }
    // Streams keep flowing (relayed A → B) well past the time presence would go stale: the
    // peer set is frozen while NATS is unreachable, and the cluster directory is kept.
    let mut streams = 0;
    while down.elapsed() < Duration::from_secs(8) {
        echo_round_trip(connect_ok(a.client_addr, &target).await?, 10_000).await?;
        streams += 1;
    }
    match connect(a.client_addr, "nowhere:443", Some(OPS_TOKEN)).await? {
        Err((404, body)) => assert!(body.contains("unknown cluster"), "{body}"),
        other => panic!("expected 404, got {:?}", other.map(|_| ())),
    }
    eprintln!("{streams} relayed streams during the NATS outage");

    // NATS back (memory bucket lost): both re-announce and follow the hub again.
    ha.hub.start_nats()?;
    for br in [&a, &b] {
        wait_until_async(CP_TIMEOUT, &format!("{} reconnects", br.id), || async {
            (metric(br.admin_addr, "tether_broker_control_plane_connected", &[])
                .await
                .ok()?
                == 1.0)
                .then_some(())
        })
        .await?;
        wait_until_async(CP_TIMEOUT, &format!("{} re-announced", br.id), || async {
            ha.presence(&br.id)
                .await
                .filter(|p| p.is_serving(SystemTime::now()))
        })
        .await?;
    }
    echo_round_trip(connect_ok(a.client_addr, &target).await?, 10_000).await?;
    Ok(())
}

// ---- the whole add-on: kill a broker, the add-on stays or returns Available ----

/// The add-on with two proxy servers.
fn addons_yaml() -> String {
    tether_e2e::addons::ClusterProxyAddOn {
        server_replicas: 2,
        ..Default::default()
    }
    .yaml()
}

/// The add-on of `cluster` as JSON.
fn addon(hub: &ControlHub, cluster: &str) -> Option<serde_json::Value> {
    let o = hub
        .tetherctl(&["get", "addons", cluster, "cluster-proxy", "-o", "json"])
        .ok()?;
    o.status
        .success()
        .then(|| serde_json::from_slice(&o.stdout).ok())
        .flatten()
}

/// (status, message) of condition `t`.
fn condition(m: &serde_json::Value, t: &str) -> (String, String) {
    m["status"]["conditions"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["type"] == t))
        .map(|c| {
            (
                c["status"].as_str().unwrap_or_default().to_string(),
                c["message"].as_str().unwrap_or_default().to_string(),
            )
        })
        .unwrap_or_default()
}

/// CONNECT `<cluster>:443` through `broker`, TLS to the API server stand-in, `GET /livez`.
async fn reach_apiserver(
    broker: &Broker,
    cluster: &str,
    ca: &std::path::Path,
) -> anyhow::Result<()> {
    let s = connect_ok(broker.client_addr, &format!("{cluster}:443")).await?;
    let cfg = tether_e2e::client_tls_config(ca, &[b"http/1.1"], None)?;
    let name = rustls::pki_types::ServerName::try_from("kubernetes.default.svc")?;
    let mut tls = tokio::time::timeout(
        Duration::from_secs(5),
        tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg)).connect(name, s),
    )
    .await??;
    tls.write_all(b"GET /livez HTTP/1.1\r\nhost: kubernetes.default.svc\r\n\r\n")
        .await?;
    let mut buf = vec![0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(5), tls.read(&mut buf)).await??;
    let head = String::from_utf8_lossy(&buf[..n]);
    anyhow::ensure!(head.starts_with("HTTP/1.1 200"), "{head}");
    Ok(())
}

/// Kills the tunnel-agent the registration-agent supervises if the test fails half-way.
struct Reaper(std::path::PathBuf);
impl Drop for Reaper {
    fn drop(&mut self) {
        if let Ok(pid) = std::fs::read_to_string(self.0.join("tunnel-agent.pid")) {
            let _ = std::process::Command::new("kill")
                .args(["-9", pid.trim()])
                .status();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_broker_keeps_the_addon_available() -> anyhow::Result<()> {
    use tether_test_support::wait_until;
    let hub = ControlHub::start(HubOpts::default())?;
    // Brokers and the API server stand-in chain to the hub CA, like the add-on credentials.
    let tmp = tempfile::tempdir()?;
    let pki_dir = tmp.path().join("pki");
    std::fs::create_dir_all(&pki_dir)?;
    let ca_pem = std::fs::read_to_string(hub.hub_dir.join("ca.crt"))?;
    let ca_key = std::fs::read_to_string(hub.hub_dir.join("ca.key"))?;
    std::fs::write(pki_dir.join("ca.crt"), &ca_pem)?;
    let procs = Procs {
        dir: tmp,
        pki: tether_test_support::Pki {
            dir: pki_dir.clone(),
            ca: tether_pki::HubCa::from_pem(&ca_pem, &ca_key)?,
        },
        env: vec![],
    };
    let dir = HubDir::load(&hub.hub_dir)?;
    let conn = connect::connect(&ConnectConfig::new(
        dir.endpoint(Some(&hub.nats_url()))?,
        Credentials::HubUser {
            user: ADMIN_USER.into(),
            password: dir
                .read(&dir.config.nats.admin_password_file)?
                .trim()
                .into(),
        },
        "tetherctl",
    ))
    .await?;
    let store = HubStore::open(conn.client.clone()).await?;
    let ha = Ha {
        procs,
        hub,
        store,
        _conn: conn,
    };
    let mut b1 = ha.broker("b1")?;
    let b2 = ha.broker("b2")?;
    let api = tether_e2e::apiserver::FakeApiServer::start(&ha.procs).await?;
    let f = ha.hub.dir.join("addons.yaml");
    std::fs::write(&f, addons_yaml())?;
    ha.hub
        .tetherctl_ok(&["apply", "-f", &f.to_string_lossy()])?;

    let boot = ha.hub.dir.join("bootstrap.kubeconfig");
    ha.hub
        .join(&boot, &ha.hub.server_url(), &ha.hub.token, None, None)?;
    let base = ha.hub.dir.join("edge");
    let _reaper = Reaper(base.join("cluster-proxy-agent"));
    let mut c = std::process::Command::new(tether_test_support::bin("registration-agent")?);
    c.args(["--cluster-name", "edge-1"])
        .arg("--bootstrap-kubeconfig")
        .arg(&boot)
        .arg("--hub-kubeconfig-dir")
        .arg(base.join("hub-kubeconfig"))
        .args(["--check-interval", "200ms"])
        .args(["--addon", "cluster-proxy"])
        .args(["--addon-apiserver", &api.addr.to_string()])
        .args(["--addon-lease-seconds", "2"])
        .args(["--addon-resync", "10s"])
        .env("RUST_LOG", "info,async_nats=warn");
    let _agent = tether_test_support::Child::spawn("agent", c, &ha.hub.logs)?;
    wait_until(CP_TIMEOUT, "edge-1 asks to join", || {
        ha.hub.cluster("edge-1")
    })?;
    ha.hub.tetherctl_ok(&["accept", "edge-1"])?;

    let wait_available = |what: &str| {
        wait_until(Duration::from_secs(30), what, || {
            addon(&ha.hub, "edge-1").filter(|m| condition(m, "Available").0 == "True")
        })
        .with_context(|| {
            format!(
                "add-on: {:#}\nagent log:\n{}",
                addon(&ha.hub, "edge-1").unwrap_or_default(),
                registration::tail(&registration::read_log(&ha.hub.logs, "agent"), 25)
            )
        })
    };
    let m = wait_available("add-on Available through both brokers")?;
    let (_, msg) = condition(&m, "Available");
    eprintln!("Available: {msg}");
    let ca = ha.procs.pki.ca_path();
    wait_tunnel(&b1, "edge-1").await?;
    wait_tunnel(&b2, "edge-1").await?;
    reach_apiserver(&b1, "edge-1", &ca).await?;
    reach_apiserver(&b2, "edge-1", &ca).await?;

    // SIGKILL b1: new streams through b2 within 5 s; the add-on stays or returns Available.
    let killed = Instant::now();
    b1.child.kill();
    wait_until_async(Duration::from_secs(5), "API server through b2", || async {
        reach_apiserver(&b2, "edge-1", &ca).await.ok()
    })
    .await?;
    let first_ok = killed.elapsed();
    let mut seen = Vec::new();
    let m = wait_until(
        Duration::from_secs(30),
        "add-on Available without b1",
        || {
            let m = addon(&ha.hub, "edge-1")?;
            let (status, msg) = condition(&m, "Available");
            if seen.last() != Some(&status) {
                seen.push(status.clone());
            }
            (status == "True" && !msg.contains("b1")).then_some(m)
        },
    )?;
    eprintln!(
        "after SIGKILL of b1: first stream through b2 after {first_ok:?}; Available statuses seen {seen:?}; back to Available (b2 only) after {:?}: {}",
        killed.elapsed(),
        condition(&m, "Available").1
    );
    assert!(first_ok < Duration::from_secs(5));
    Ok(())
}
