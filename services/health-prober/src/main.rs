//! health-prober binary: parse flags, load config, start telemetry, run.

#![forbid(unsafe_code)]

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;

/// Tether health-prober: probes every managed cluster through the tunnels.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Path of the YAML config file.
    #[arg(long, short, env = "TETHER_PROBER_CONFIG")]
    config: PathBuf,
    /// Write the bound admin address here as JSON once listening (for scripts and tests).
    #[arg(long)]
    ready_file: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let aead = tether_tls::install_default_crypto()?;
    let cfg: health_prober::config::ProberConfig =
        tether_config::load(&args.config).context("invalid health-prober configuration")?;
    tether_runtime::actix_system(None).block_on(async move {
        let _telemetry = tether_telemetry::init_tracing("health-prober");
        tracing::info!(aead = %aead, "TLS record encryption");
        let shutdown = tether_runtime::shutdown_token();
        let admin =
            tether_runtime::bind_admin(cfg.admin_listen, args.ready_file.as_deref()).await?;
        health_prober::run(cfg, admin, shutdown).await?;
        anyhow::Ok(())
    })
}
