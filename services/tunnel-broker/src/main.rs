//! tunnel-broker binary: parse flags, load config, bind, start telemetry, run.

#![forbid(unsafe_code)]

use anyhow::Context as _;
use tokio::net::TcpListener;

tether_runtime::data_plane_allocator!();

fn main() -> anyhow::Result<()> {
    let args = tether_runtime::ConfigFileArgs::parse_for(
        "tunnel-broker",
        "Tether tunnel-broker: accepts agent tunnels and routes hub clients to clusters.",
        "TETHER_BROKER_CONFIG",
    );
    let aead = tether_tls::install_default_crypto()?;
    let cfg: tunnel_broker::config::BrokerConfig =
        tether_config::load(&args.config).context("invalid tunnel-broker configuration")?;
    let bind = tether_runtime::bind;
    args.process.data_plane_system().block_on(async move {
        let _telemetry = tether_telemetry::init_tracing("tunnel-broker");
        tracing::info!(aead = %aead, "TLS record encryption");
        tracing::info!(idle_poll = tether_idlepoll::status(), "runtime");
        let shutdown = tether_runtime::shutdown_token();
        let listeners = tunnel_broker::Listeners {
            agent: bind(cfg.agent_listen, "agent_listen").await?,
            client: match cfg.client_listen {
                Some(a) => Some(bind(a, "client_listen").await?),
                None => None,
            },
            client_tls: match cfg.client_tls_listen {
                Some(a) => Some(bind(a, "client_tls_listen").await?),
                None => None,
            },
            admin: bind(cfg.admin_listen, "admin_listen").await?,
            service_proxy: match &cfg.service_proxy {
                Some(sp) => Some(bind(sp.listen, "service_proxy.listen").await?),
                None => None,
            },
        };
        if let Some(path) = &args.process.ready_file {
            let addr = |l: &Option<TcpListener>| {
                l.as_ref()
                    .and_then(|l| l.local_addr().ok())
                    .map(|a| a.to_string())
            };
            let info = serde_json::json!({
                "agent": listeners.agent.local_addr()?.to_string(),
                "client": addr(&listeners.client),
                "client_tls": addr(&listeners.client_tls),
                "admin": listeners.admin.local_addr()?.to_string(),
                "service_proxy": addr(&listeners.service_proxy),
            });
            tether_runtime::write_ready_file(path, &info)
                .with_context(|| format!("write ready file {}", path.display()))?;
        }
        tunnel_broker::run(cfg, listeners, shutdown).await?;
        anyhow::Ok(())
    })
}
