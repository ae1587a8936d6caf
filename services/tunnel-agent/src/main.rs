//! tunnel-agent binary: parse flags, load config, start telemetry, run.

#![forbid(unsafe_code)]

use anyhow::Context as _;

tether_runtime::data_plane_allocator!();

fn main() -> anyhow::Result<()> {
    let args = tether_runtime::ConfigFileArgs::parse_for(
        "tunnel-agent",
        "Tether tunnel-agent: keeps reverse tunnels from a managed cluster to the hub's brokers.",
        "TETHER_AGENT_CONFIG",
    );
    let aead = tether_tls::install_default_crypto()?;
    let (cfg, config_file) = tunnel_agent::ConfigFile::load(&args.config)
        .context("invalid tunnel-agent configuration")?;
    args.process.data_plane_system().block_on(async move {
        let _telemetry = tether_telemetry::init_tracing("tunnel-agent");
        tracing::info!(aead = %aead, "TLS record encryption");
        tracing::info!(idle_poll = tether_idlepoll::status(), "runtime");
        let shutdown = tether_runtime::shutdown_token();
        let admin =
            tether_runtime::bind_admin(cfg.admin_listen, args.process.ready_file.as_deref())
                .await?;
        tunnel_agent::run_with_reload(cfg, Some(config_file), admin, shutdown).await?;
        anyhow::Ok(())
    })
}
