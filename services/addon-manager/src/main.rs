//! addon-manager binary: parse flags, load the hub directory, start telemetry, run the
//! registration controller until SIGTERM/SIGINT.
#![forbid(unsafe_code)]

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;

/// Tether addon-manager (hub): registration controller and NATS auth callout.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Hub directory written by `tetherctl init`.
    #[arg(long, env = "TETHER_HUB_DIR", default_value = "hub")]
    hub_dir: PathBuf,
    /// Override nats.url from hub.yaml (a comma-separated seed list for a NATS cluster).
    #[arg(long, env = "TETHER_NATS_URL")]
    nats_url: Option<String>,
    /// Override admin.listen (/healthz, /readyz, /metrics), e.g. 127.0.0.1:0.
    #[arg(long, env = "TETHER_ADMIN_LISTEN")]
    admin_listen: Option<String>,
    /// Write {"admin": "<addr>"} here once running (for scripts and tests).
    #[arg(long)]
    ready_file: Option<PathBuf>,
    /// Tokio worker threads (default: number of CPUs).
    #[arg(long, env = "TETHER_WORKER_THREADS")]
    worker_threads: Option<usize>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tether_tls::install_default_crypto();
    let hub = tether_control::hub::HubDir::load(&args.hub_dir)
        .with_context(|| format!("invalid hub directory {}", args.hub_dir.display()))?;
    tether_runtime::actix_system(args.worker_threads).block_on(async move {
        let _telemetry = tether_telemetry::init_tracing("addon-manager");
        let shutdown = tether_runtime::shutdown_token();
        let opts = addon_manager::RunOptions {
            nats_url: args.nats_url,
            admin_listen: args.admin_listen.or(hub.config.admin.listen.clone()),
            ready_file: args.ready_file,
        };
        addon_manager::run(hub, opts, shutdown).await?;
        anyhow::Ok(())
    })
}
