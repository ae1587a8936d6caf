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
    #[command(flatten)]
    process: tether_runtime::ProcessArgs,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let aead = tether_tls::install_default_crypto()?;
    let hub = tether_control::hub::HubDir::load(&args.hub_dir)
        .with_context(|| format!("invalid hub directory {}", args.hub_dir.display()))?;
    tether_runtime::actix_system(args.process.worker_threads).block_on(async move {
        let _telemetry = tether_telemetry::init_tracing("addon-manager");
        tracing::info!(aead = %aead, "TLS record encryption");
        let shutdown = tether_runtime::shutdown_token();
        let listeners = addon_manager::bind(
            args.admin_listen
                .as_deref()
                .or(hub.config.admin.listen.as_deref()),
        )
        .await?;
        let opts = addon_manager::RunOptions {
            nats_url: args.nats_url,
            readiness: tether_telemetry::Readiness::new(),
        };
        if let Some(path) = args.process.ready_file {
            // Written once ready (connected, store open, subjects served), for scripts and tests.
            let admin = listeners.admin.as_ref().and_then(|l| l.local_addr().ok());
            let mut ready = opts.readiness.subscribe();
            tokio::spawn(async move {
                while ready.borrow_and_update().is_err() {
                    if ready.changed().await.is_err() {
                        return;
                    }
                }
                let body = serde_json::json!({ "admin": admin.map(|a| a.to_string()) });
                if let Err(e) = tether_runtime::write_ready_file(&path, &body) {
                    tracing::error!(path = %path.display(), error = %e, "cannot write the ready file");
                }
            });
        }
        addon_manager::run(hub, opts, listeners, shutdown).await?;
        anyhow::Ok(())
    })
}
