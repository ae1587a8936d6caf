//! tunnel-agent binary: parse flags, load config, start telemetry, run.

#![forbid(unsafe_code)]

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;

/// mimalloc instead of glibc malloc: h2 allocates a buffer per received DATA frame, and glibc
/// trims and re-faults that memory constantly (~110k page faults per 3 s of one-stream traffic,
/// 15–25 % of the tunnel's CPU per GB; see docs/benchmarks.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Tether tunnel-agent: keeps reverse tunnels from a managed cluster to the hub's brokers.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Path of the YAML config file.
    #[arg(long, short, env = "TETHER_AGENT_CONFIG")]
    config: PathBuf,
    #[command(flatten)]
    process: tether_runtime::ProcessArgs,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tether_tls::install_default_crypto();
    let cfg: tunnel_agent::config::AgentConfig =
        tether_config::load(&args.config).context("invalid tunnel-agent configuration")?;
    let workers = args
        .process
        .worker_threads
        .unwrap_or_else(tether_runtime::data_plane_workers);
    tether_runtime::actix_system(Some(workers)).block_on(async move {
        let _telemetry = tether_telemetry::init_tracing("tunnel-agent");
        let shutdown = tether_runtime::shutdown_token();
        let admin =
            tether_runtime::bind_admin(cfg.admin_listen, args.process.ready_file.as_deref())
                .await?;
        tunnel_agent::run_with_reload(cfg, Some(args.config.clone()), admin, shutdown).await?;
        anyhow::Ok(())
    })
}
