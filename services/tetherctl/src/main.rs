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
//! - `proxy health` (the `clusteradm proxy health` table, from the health-prober over NATS),
//!   `proxy connect` (local port forward through a broker), `proxy kubectl` (kubectl through
//!   the tunnel, TLS verified against the cluster CA).
//! - `events [--watch] [--durable NAME]`: events as they arrive (JetStream consumer).
//! - `completions <shell>`: shell completion script.
//! - `get brokers`: broker presence (live, draining, load, client addresses).
//! - `client create|delete`, `get clients`: hub client credentials; `apply -f` also takes
//!   ClientAccessPolicy documents (`delete clientaccesspolicy NAME`).
//! - `kubeconfig <cluster> --server https://broker:port`: a kubeconfig for the brokers' HTTP
//!   service proxy (plain kubectl, no proxy-url); `apply -f` also takes ServiceProxyAllowlist
//!   documents (`delete serviceproxyallowlist NAME`).
//!
//! Hub commands read `<hub dir>/hub.yaml` (`--hub-dir`, env `TETHER_HUB_DIR`) and connect as the
//! `tether-admin` NATS user.

mod addons;
mod allowlist;
mod cert;
mod clients;
mod events;
mod init;
mod kernel_relay;
mod kube_secret;
mod kubeconfig;
mod ops;
mod plain_connect;
mod proxy;

use std::path::PathBuf;

use clap::{CommandFactory as _, Parser, Subcommand, ValueEnum};

const EXAMPLES: &str = "\
Examples:
  tetherctl init --dir hub --hub-host hub.example.com
  tetherctl accept edge-1
  tetherctl get clusters -o wide
  tetherctl proxy health
  tetherctl proxy health --cluster edge-1 -o json
  tetherctl proxy connect edge-1 web.default.svc:8080 --local-port 8080 --broker https://broker:8443 --token-file ops.token
  tetherctl proxy kubectl --cluster edge-1 --kubeconfig edge-1.kubeconfig -- get pods -A
  tetherctl events --watch
  tetherctl completions bash > /etc/bash_completion.d/tetherctl

Hub commands read <hub dir>/hub.yaml (--hub-dir, TETHER_HUB_DIR) and connect to NATS as tether-admin.
Output: tables for people; -o json|yaml for scripts. Waits longer than a second say so on stderr.";

const PROXY_EXAMPLES: &str = "\
Examples:
  # The clusteradm-style table, answered from the health-prober's results (instant)
  tetherctl proxy health
  tetherctl proxy health -o wide       # adds tunnel vs target latency, reason, probed-at
  # Forward 127.0.0.1:8080 to a service in edge-1 through a broker
  export TETHER_BROKER=https://broker.hub:8443 TETHER_TOKEN_FILE=ops.token
  tetherctl proxy connect edge-1 web.default.svc:8080 --local-port 8080
  # kubectl against edge-1's API server through the tunnel
  tetherctl proxy kubectl --cluster edge-1 --kubeconfig edge-1.kubeconfig -- get nodes

Broker access: --broker (TETHER_BROKER), --broker-ca (TETHER_BROKER_CA, default <hub dir>/ca.crt),
--broker-server-name (TETHER_BROKER_SERVER_NAME), --client-cert/--client-key
(TETHER_CLIENT_CERT/TETHER_CLIENT_KEY) or --token-file (TETHER_TOKEN_FILE) / TETHER_TOKEN.";

#[derive(Parser, Debug)]
#[command(name = "tetherctl", version, about = "Tether CLI", after_help = EXAMPLES)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args, Debug, Clone)]
pub struct HubArgs {
    /// Hub directory written by `tetherctl init`.
    #[arg(long, env = "TETHER_HUB_DIR", default_value = "hub")]
    pub hub_dir: PathBuf,
    /// Override the NATS URL from hub.yaml (e.g. when NATS picked a random port); a
    /// comma-separated seed list for a NATS cluster.
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
    /// A directory of files to / from a Kubernetes Secret (the Helm bootstrap Job).
    KubeSecret {
        #[command(subcommand)]
        what: kube_secret::KubeSecretCmd,
    },
    /// Certificates for hub components, signed by the hub CA (files only).
    Cert {
        #[command(subcommand)]
        what: CertCmd,
    },
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
    /// Hub client credentials: `client create NAME --token | --cert-out DIR`, `client delete NAME`.
    Client {
        #[command(subcommand)]
        what: clients::ClientCmd,
    },
    /// Reach clusters: health table, port forward, kubectl through the tunnel.
    #[command(after_help = PROXY_EXAMPLES)]
    Proxy {
        #[command(subcommand)]
        what: ProxyCmd,
    },
    /// Events from the events stream; --watch prints them as they arrive.
    #[command(
        after_help = "Examples:\n  tetherctl events edge-1\n  tetherctl events --watch\n  tetherctl events --watch --subject 'tether.v1.events.health.>' -o json\n  tetherctl events --watch --durable ops-audit   # resumes where it stopped"
    )]
    Events(events::EventsArgs),
    /// Write a kubeconfig whose server is the brokers' service proxy path for CLUSTER.
    #[command(
        after_help = "Examples:\n  tetherctl kubeconfig edge-1 --server https://broker.hub:8443 --token-file ops.token -o edge-1.kubeconfig\n  tetherctl kubeconfig edge-1 --server https://broker.hub:8443 --cert ops.crt --key ops.key -o edge-1.kubeconfig\n  kubectl --kubeconfig edge-1.kubeconfig get --raw /version"
    )]
    Kubeconfig(kubeconfig::KubeconfigArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    #[command(
        after_help = "Examples:\n  tetherctl completions bash > /etc/bash_completion.d/tetherctl\n  tetherctl completions zsh > \"${fpath[1]}/_tetherctl\""
    )]
    Completions { shell: clap_complete::Shell },
}

#[derive(Subcommand, Debug)]
enum CertCmd {
    /// Issue a broker (server + client auth) or static hub client certificate.
    Issue(cert::IssueArgs),
}

#[derive(Subcommand, Debug)]
enum ProxyCmd {
    /// CLUSTER NAME, INSTALLED, AVAILABLE, PROBED HEALTH, LATENCY (like clusteradm proxy health).
    #[command(
        after_help = "Examples:\n  tetherctl proxy health\n  tetherctl proxy health --cluster edge-1 -o wide\n  tetherctl proxy health -o json | jq '.items[] | select(.probedHealth != \"True\")'"
    )]
    Health {
        /// Only this cluster.
        #[arg(long)]
        cluster: Option<String>,
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: Output,
        #[command(flatten)]
        hub: HubArgs,
    },
    /// Forward a local port to a target in a cluster (default: its API server).
    #[command(
        after_help = "Examples:\n  tetherctl proxy connect edge-1 --local-port 6443                 # the API server\n  tetherctl proxy connect edge-1 web.default.svc:8080 --local-port 8080\n  tetherctl proxy connect edge-1 db:5432 --local-port 0           # a free port, printed"
    )]
    Connect {
        cluster: String,
        /// host:port inside the cluster (default: its API server).
        target: Option<String>,
        /// Local port (0: any free port; the chosen one is printed).
        #[arg(long, default_value_t = 0)]
        local_port: u16,
        /// Local address to listen on.
        #[arg(long, default_value = "127.0.0.1")]
        address: String,
        /// Threads of the forward, and HTTP/2 connections to the broker (default: half the
        /// CPUs, at least 1, at most 4 — like the broker and the agent).
        #[arg(long, env = "TETHER_WORKER_THREADS", value_parser = clap::value_parser!(u16).range(1..=64))]
        worker_threads: Option<u16>,
        /// Idle polling of the forward, as the broker's and agent's.
        #[command(flatten)]
        idle_poll: tether_runtime::IdlePollArgs,
        #[command(flatten)]
        broker: proxy::BrokerArgs,
    },
    /// Run kubectl against a cluster's API server through the tunnel.
    #[command(
        after_help = "Examples:\n  tetherctl proxy kubectl --cluster edge-1 --kubeconfig edge-1.kubeconfig -- get pods -A\n  tetherctl proxy kubectl --cluster edge-1 --cluster-ca edge-1-ca.crt --kube-token-file t -- version"
    )]
    Kubectl {
        #[command(flatten)]
        args: proxy::KubectlArgs,
        #[command(flatten)]
        broker: proxy::BrokerArgs,
    },
}

#[derive(Subcommand, Debug)]
enum GetWhat {
    /// Brokers from their presence: live, draining, load, client addresses.
    #[command(alias = "broker")]
    Brokers {
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: Output,
        #[command(flatten)]
        hub: HubArgs,
    },
    /// HubClients and the ClientAccessPolicies naming them.
    #[command(alias = "client", alias = "hubclients")]
    Clients {
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: Output,
        #[command(flatten)]
        hub: HubArgs,
    },
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
    if let Err(e) = tether_tls::install_default_crypto() {
        eprintln!("tetherctl: {e}");
        std::process::exit(2);
    }
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
        Cmd::Cert {
            what: CertCmd::Issue(a),
        } => cert::issue(a),
        Cmd::KubeSecret { what } => kube_secret::run(what).await,
        Cmd::Accept { cluster, hub } => ops::admin(&hub, &cluster, true).await,
        Cmd::Deny { cluster, hub } => ops::admin(&hub, &cluster, false).await,
        Cmd::Get { what } => match what {
            GetWhat::Clients { output, hub } => clients::get_clients(&hub, output).await,
            GetWhat::Brokers { output, hub } => clients::get_brokers(&hub, output).await,
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
        Cmd::Apply { file, hub } => allowlist::apply(&hub, &file).await,
        Cmd::Delete { kind, name, hub } => allowlist::delete(&hub, &kind, &name).await,
        Cmd::Kubeconfig(a) => kubeconfig::run(&a),
        Cmd::Client { what } => clients::run(what).await,
        Cmd::Proxy { what } => match what {
            ProxyCmd::Health {
                cluster,
                output,
                hub,
            } => proxy::health(&hub, cluster.as_deref(), output).await,
            ProxyCmd::Connect {
                cluster,
                target,
                local_port,
                address,
                worker_threads,
                idle_poll,
                broker,
            } => {
                let workers = worker_threads.map(usize::from);
                proxy::connect(
                    &broker,
                    &cluster,
                    target.as_deref(),
                    &address,
                    local_port,
                    workers,
                    idle_poll.max(),
                )
                .await
            }
            ProxyCmd::Kubectl { args, broker } => match proxy::kubectl(&broker, &args).await {
                Ok(code) => std::process::exit(code),
                Err(e) => Err(e),
            },
        },
        Cmd::Events(a) => events::events(&a).await,
        Cmd::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "tetherctl",
                &mut std::io::stdout(),
            );
            Ok(())
        }
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
