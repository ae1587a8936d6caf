//! Traces: with the standard OTEL_EXPORTER_OTLP_ENDPOINT set, broker and agent export spans over
//! OTLP/gRPC (to a real OTLP receiver in this test), the stream's spans carry the cluster and
//! stream id, and the agent's span joins the broker's trace (context carried in the tunnel's
//! HTTP/2 headers). A CONNECT request with a W3C `traceparent` header puts both in the client's
//! trace, and so does a dial of the Rust SDK made inside a traced span (on each of its protocols).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use tether_e2e::{Hub, OPS_TOKEN, connect, echo_server, send_head, wait_agent_ready, wait_tunnel};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Debug, Clone)]
struct SpanRecord {
    service: String,
    name: String,
    trace_id: Vec<u8>,
    attrs: Vec<(String, String)>,
}

#[derive(Clone, Default)]
struct Receiver(Arc<Mutex<Vec<SpanRecord>>>);

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut out = self.0.lock().expect("lock");
        for rs in req.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| r.attributes.iter())
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| kv.value.as_ref()?.value.as_ref())
                .map(|v| match v {
                    Value::StringValue(s) => s.clone(),
                    other => format!("{other:?}"),
                })
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    let attrs = s
                        .attributes
                        .iter()
                        .map(|kv| {
                            let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                                Some(Value::StringValue(s)) => s.clone(),
                                Some(Value::IntValue(i)) => i.to_string(),
                                Some(other) => format!("{other:?}"),
                                None => String::new(),
                            };
                            (kv.key.clone(), v)
                        })
                        .collect();
                    out.push(SpanRecord {
                        service: service.clone(),
                        name: s.name,
                        trace_id: s.trace_id,
                        attrs,
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn attr<'a>(s: &'a SpanRecord, k: &str) -> Option<&'a str> {
    s.attrs
        .iter()
        .find(|(key, _)| key == k)
        .map(|(_, v)| v.as_str())
}

/// A traced hub ([`traced_hub`]) with broker `b1` and cluster `c1` (an echo server as its API
/// server), once the tunnel is up.
struct TracedCluster {
    receiver: Receiver,
    hub: Hub,
    broker: tether_e2e::Broker,
    _agent: tether_e2e::Agent,
    echo: std::net::SocketAddr,
}

async fn traced_cluster() -> anyhow::Result<TracedCluster> {
    let (receiver, hub) = traced_hub().await?;
    let echo = echo_server().await?;
    let broker = hub.start_broker("b1", "")?;
    let agent = hub.start_agent("c1", "c1", &[vec![broker.agent_addr]], echo, "")?;
    wait_agent_ready(&agent).await?;
    wait_tunnel(&broker, "c1").await?;
    Ok(TracedCluster {
        receiver,
        hub,
        broker,
        _agent: agent,
        echo,
    })
}

/// A real OTLP receiver on 127.0.0.1:0, and a hub whose processes export to it.
async fn traced_hub() -> anyhow::Result<(Receiver, Hub)> {
    let receiver = Receiver::default();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let otlp = l.local_addr()?;
    let svc = TraceServiceServer::new(receiver.clone());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l)),
    );
    let mut hub = Hub::new()?;
    hub.env = vec![
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT".into(),
            format!("http://{otlp}"),
        ),
        ("OTEL_BSP_SCHEDULE_DELAY".into(), "100".into()),
    ];
    Ok((receiver, hub))
}

/// The broker's span named `name` and the agent's stream span in trace `trace`, once exported.
async fn spans_in_trace(
    receiver: &Receiver,
    name: &str,
    trace: &[u8],
) -> anyhow::Result<(SpanRecord, SpanRecord)> {
    tether_test_support::wait_until_async(
        Duration::from_secs(20),
        "broker and agent spans in the client's trace",
        || async {
            let spans = receiver.0.lock().expect("lock").clone();
            let in_trace = |service: &str, name: &str| {
                spans
                    .iter()
                    .find(|s| s.service == service && s.name == name && s.trace_id == trace)
                    .cloned()
            };
            Some((
                in_trace("tunnel-broker", name)?,
                in_trace("tunnel-agent", "agent_stream")?,
            ))
        },
    )
    .await
}

/// An application traced with OpenTelemetry dials through the SDK inside a span of its trace:
/// the broker's and the agent's spans of each stream join that trace, on `tether-dial/1`, on the
/// framed gRPC Dial and on the unframed Dial over HTTP/2 (a broker that speaks only HTTP/2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sdk_dial_joins_the_callers_trace() -> anyhow::Result<()> {
    use opentelemetry::trace::TracerProvider as _;
    use tracing::Instrument as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    // The application's tracing: an OpenTelemetry layer (no exporter needed here) and the W3C
    // propagator, as an application that exports its own traces sets them up.
    opentelemetry::global::set_text_map_propagator(
        opentelemetry_sdk::propagation::TraceContextPropagator::new(),
    );
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
    tracing::subscriber::set_global_default(
        tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("sdk-test"))),
    )?;

    let c = traced_cluster().await?;
    let (receiver, hub, broker, echo) = (&c.receiver, &c.hub, &c.broker, c.echo);
    // A broker that speaks only HTTP/2 (as an older one): the SDK's unframed Dial, whose
    // context travels in the request's headers.
    let h2 = "tunnel:\n  protocol: h2\n";
    let h2_broker = hub.start_broker("b2", h2)?;
    let _h2_agent = hub.start_agent("c1", "c1", &[vec![h2_broker.agent_addr]], echo, h2)?;
    wait_tunnel(&h2_broker, "c1").await?;
    let dialer = |addr: std::net::SocketAddr| async move {
        tether_client::Dialer::connect(tether_client::DialerConfig {
            endpoint: format!("https://{addr}"),
            server_name: "localhost".into(),
            ca_pem: std::fs::read_to_string(hub.pki.ca_path())?,
            client_cert: None,
            token: Some(tether_client::Token(OPS_TOKEN.into())),
            connect_timeout: Duration::from_secs(5),
        })
        .await
        .map_err(anyhow::Error::from)
    };
    let (current, older) = (
        dialer(broker.client_tls_addr).await?,
        dialer(h2_broker.client_tls_addr).await?,
    );

    for (i, (d, framed, protocol)) in [
        (&current, false, "tether-dial/1"),
        (&current, true, "Dial"),
        (&older, false, "DialRaw"),
    ]
    .into_iter()
    .enumerate()
    {
        let trace = format!("4bf92f3577b34da6a3ce929d0e0e47{i:02x}");
        let span = tracing::info_span!("application_request");
        tether_telemetry::propagation::set_parent(
            &span,
            [(
                "traceparent",
                format!("00-{trace}-00f067aa0ba902b7-01").as_str(),
            )],
        );
        let dial = async {
            if framed {
                d.dial_framed("c1", "127.0.0.1", echo.port()).await
            } else {
                d.dial("c1", "127.0.0.1", echo.port()).await
            }
        };
        let mut s = dial.instrument(span).await?;
        assert_eq!(s.protocol(), protocol);
        s.write_all(b"traced").await?;
        let mut six = [0u8; 6];
        s.read_exact(&mut six).await?;
        drop(s);
        let (b, a) = spans_in_trace(receiver, "grpc_stream", &hex::decode(&trace)?).await?;
        assert_eq!(attr(&b, "client"), Some("ops"), "{protocol}: {b:?}");
        assert_eq!(attr(&a, "stream"), attr(&b, "stream"), "{a:?} / {b:?}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_are_exported_and_joined_across_the_tunnel() -> anyhow::Result<()> {
    let c = traced_cluster().await?;
    let (receiver, broker) = (&c.receiver, &c.broker);

    let mut s = match connect(broker.client_addr, "c1:443", Some(OPS_TOKEN)).await? {
        Ok(s) => s,
        Err((code, body)) => anyhow::bail!("CONNECT failed: {code} {body}"),
    };
    s.write_all(b"traced").await?;
    let mut six = [0u8; 6];
    s.read_exact(&mut six).await?;
    drop(s);

    let (b, a) = tether_test_support::wait_until_async(
        Duration::from_secs(20),
        "broker and agent stream spans",
        || async {
            let spans = receiver.0.lock().expect("lock").clone();
            let b = spans
                .iter()
                .find(|s| s.service == "tunnel-broker" && s.name == "connect_stream")?
                .clone();
            let a = spans
                .iter()
                .find(|s| s.service == "tunnel-agent" && s.name == "agent_stream")?
                .clone();
            Some((b, a))
        },
    )
    .await?;
    assert_eq!(attr(&b, "cluster"), Some("c1"), "{b:?}");
    assert!(attr(&b, "stream").is_some(), "{b:?}");
    // The broker's span is created once the head is read and checked, with all its fields;
    // `target` is the dialled address alone (the tracing target is not exported under the same
    // key).
    assert_eq!(attr(&b, "client"), Some("ops"), "{b:?}");
    assert_eq!(attr(&b, "target"), Some("c1:443"), "{b:?}");
    assert_eq!(
        b.attrs.iter().filter(|(k, _)| k == "target").count(),
        1,
        "{b:?}"
    );
    assert_eq!(attr(&a, "cluster"), Some("c1"), "{a:?}");
    assert_eq!(
        attr(&a, "stream"),
        attr(&b, "stream"),
        "agent span has the broker's stream id"
    );
    assert!(!b.trace_id.is_empty());
    assert_eq!(
        a.trace_id, b.trace_id,
        "agent span is not in the broker's trace"
    );

    // A client in a trace of its own: the broker's and the agent's spans join it.
    const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    let head = format!(
        "CONNECT c1:443 HTTP/1.1\r\nproxy-authorization: Bearer {OPS_TOKEN}\r\n\
         traceparent: 00-{CLIENT_TRACE}-00f067aa0ba902b7-01\r\n\r\n"
    );
    let stream = tokio::net::TcpStream::connect(broker.client_addr).await?;
    let mut s = match send_head(stream, head.as_bytes()).await? {
        Ok(s) => s,
        Err((code, body)) => anyhow::bail!("traced CONNECT failed: {code} {body}"),
    };
    s.write_all(b"traced").await?;
    s.read_exact(&mut six).await?;
    drop(s);
    let (b, a) = spans_in_trace(receiver, "connect_stream", &hex::decode(CLIENT_TRACE)?).await?;
    assert_eq!(attr(&b, "client"), Some("ops"), "{b:?}");
    assert_eq!(attr(&a, "stream"), attr(&b, "stream"), "{a:?} / {b:?}");
    Ok(())
}
