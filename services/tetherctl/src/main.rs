//! `tetherctl`: the Tether CLI.
//!
//! - `init`: create a hub directory (CA, NATS config with TLS + auth callout, hub/admin
//!   credentials, a bootstrap token) and print how to start it and how to join clusters.
//! - `join`: write a bootstrap kubeconfig like `clusteradm join --proxy-url --proxy-ca-file`.
//! - `accept` / `deny`: let a cluster in, or shrink its rights again.
//! - `get clusters` (`-o json|yaml|wide`), `get events`, `token create`.
//! - `apply -f FILE` (YAML or JSON, one or several documents: ClusterManagementAddOn,
//!   ManagedClusterAddOn, AddOnDeploymentConfig, ManagedProxyConfiguration; all validated before
//!   any is stored), `get addons|configs|clustermanagementaddons`, `delete <kind> <name>`.
//!
//! Hub commands read `<hub dir>/hub.yaml` (`--hub-dir`, env `TETHER_HUB_DIR`) and connect as the
//! `tether-admin` NATS user.

mod addons;
mod init;
mod ops;

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser, Debug)]
#[command(name = "tetherctl", version, about = "Tether CLI")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args, Debug, Clone)]
pub struct HubArgs {
    /// Hub directory written by `tetherctl init`.
    #[arg(long, env = "TETHER_HUB_DIR", default_value = "hub")]
    pub hub_dir: PathBuf,
    /// Override the NATS URL from hub.yaml (e.g. when NATS picked a random port).
    #[arg(long, env = "TETHER_NATS_URL")]
    pub nats_url: Option<String>,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Wide,
    Json,
    Yaml,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Create the hub CA, NATS config, credentials and a bootstrap token.
    Init(init::InitArgs),
    /// Write a bootstrap kubeconfig for a managed cluster.
    Join(init::JoinArgs),
    /// Accept a cluster: approve its CSRs and set spec.hubAcceptsClient=true.
    Accept {
        cluster: String,
        #[command(flatten)]
        hub: HubArgs,
    },
    /// Deny a cluster: hubAcceptsClient=false, pending CSRs denied, its certificates refused.
    Deny {
        cluster: String,
        #[command(flatten)]
        hub: HubArgs,
    },
    /// Show resources.
    Get {
        #[command(subcommand)]
        what: GetWhat,
    },
    /// Create or update add-on resources from a YAML or JSON file (`-` = stdin).
    Apply {
        #[arg(short = 'f', long = "filename")]
        file: String,
        #[command(flatten)]
        hub: HubArgs,
    },
    /// Delete a resource: clustermanagementaddon NAME, managedclusteraddon CLUSTER/ADDON,
    /// addondeploymentconfig [NAMESPACE/]NAME, managedproxyconfiguration NAME, managedcluster NAME.
    Delete {
        kind: String,
        name: String,
        #[command(flatten)]
        hub: HubArgs,
    },
    /// Bootstrap tokens.
    Token {
        #[command(subcommand)]
        what: TokenCmd,
    },
}

#[derive(Subcommand, Debug)]
enum GetWhat {
    /// ManagedClusters: NAME HUB ACCEPTED JOINED AVAILABLE AGE.
    #[command(alias = "managedclusters", alias = "cluster")]
    Clusters {
        /// Only this cluster.
        name: Option<String>,
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: Output,
        #[command(flatten)]
        hub: HubArgs,
    },
    /// ManagedClusterAddOns: CLUSTER NAME AVAILABLE DEGRADED PROGRESSING AGE.
    #[command(alias = "addon", alias = "managedclusteraddons")]
    Addons {
        /// Only this cluster's add-ons.
        cluster: Option<String>,
        /// Only this add-on (with a cluster: `-o json|yaml` prints the object itself).
        addon: Option<String>,
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: Output,
        #[command(flatten)]
        hub: HubArgs,
    },
    /// AddOnDeploymentConfigs and ManagedProxyConfigurations.
    #[command(alias = "config")]
    Configs {
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: Output,
        #[command(flatten)]
        hub: HubArgs,
    },
    /// ClusterManagementAddOns.
    #[command(alias = "cma")]
    Clustermanagementaddons {
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: Output,
        #[command(flatten)]
        hub: HubArgs,
    },
    /// Recent events from the events stream.
    Events {
        /// Only events about this object name.
        name: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: usize,
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: Output,
        #[command(flatten)]
        hub: HubArgs,
    },
}

#[derive(Subcommand, Debug)]
enum TokenCmd {
    /// Create a bootstrap token valid for --ttl and print it.
    Create {
        #[arg(long, default_value = "24h", value_parser = init::parse_duration)]
        ttl: std::time::Duration,
        #[arg(long, default_value = "")]
        description: String,
        #[command(flatten)]
        hub: HubArgs,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    tether_tls::install_default_crypto();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Init(a) => init::init(a),
        Cmd::Join(a) => init::join(a),
        Cmd::Accept { cluster, hub } => ops::admin(&hub, &cluster, true).await,
        Cmd::Deny { cluster, hub } => ops::admin(&hub, &cluster, false).await,
        Cmd::Get { what } => match what {
            GetWhat::Clusters { name, output, hub } => {
                ops::get_clusters(&hub, name.as_deref(), output).await
            }
            GetWhat::Events {
                name,
                limit,
                output,
                hub,
            } => ops::get_events(&hub, name.as_deref(), limit, output).await,
            GetWhat::Addons {
                cluster,
                addon,
                output,
                hub,
            } => addons::get_addons(&hub, cluster.as_deref(), addon.as_deref(), output).await,
            GetWhat::Configs { output, hub } => addons::get_configs(&hub, output).await,
            GetWhat::Clustermanagementaddons { output, hub } => {
                addons::get_cmas(&hub, output).await
            }
        },
        Cmd::Apply { file, hub } => addons::apply(&hub, &file).await,
        Cmd::Delete { kind, name, hub } => addons::delete(&hub, &kind, &name).await,
        Cmd::Token { what } => match what {
            TokenCmd::Create {
                ttl,
                description,
                hub,
            } => ops::token_create(&hub, ttl, &description).await,
        },
    };
    if let Err(e) = r {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
