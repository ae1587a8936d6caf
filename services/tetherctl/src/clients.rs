//! Hub clients and their access policy:
//!
//! - `tetherctl client create <name> --token` prints a new bearer token (shown once; the hub
//!   keeps only its SHA-256); `--cert-out DIR` writes `tls.crt`, `tls.key` (0600) and `ca.crt`
//!   for a certificate with CN `tether:client:<name>` signed by the hub CA.
//! - `tetherctl client delete <name>` revokes it (brokers refuse it for new streams within
//!   seconds).
//! - `tetherctl get clients` lists HubClients and the ClientAccessPolicies naming them.
//! - `tetherctl apply -f` accepts ClientAccessPolicy documents next to the add-on kinds (all
//!   documents are validated before anything is stored; errors name the document and field);
//!   `tetherctl delete clientaccesspolicy <name>`.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use anyhow::{Context, bail};
use tether_control::clients::{
    ClientAccessPolicy, ClientCreateReply, ClientCreateRequest, ClientDeleteReply,
    ClientDeleteRequest, HubClient, parse_policy,
};
use tether_control::connect;
use tether_control::resources::Event;
use tether_control::store::Store as _;
use tether_control::store::{Bucket, HubStore};
use tether_control::subjects;

use crate::ops::{age, connect_admin, print_table};
use crate::{HubArgs, Output};

#[derive(clap::Subcommand, Debug)]
pub enum ClientCmd {
    /// Issue a credential for a hub client: a bearer token (--token) or a client certificate
    /// (--cert-out DIR).
    Create {
        name: String,
        /// Issue a bearer token and print it (shown once).
        #[arg(long, conflicts_with = "cert_out")]
        token: bool,
        /// Issue a client certificate; write tls.crt, tls.key and ca.crt into DIR.
        #[arg(long, value_name = "DIR")]
        cert_out: Option<PathBuf>,
        /// Certificate lifetime (e.g. 90d is 2160h).
        #[arg(long, default_value = "2160h", value_parser = crate::init::parse_duration)]
        cert_lifetime: std::time::Duration,
        #[command(flatten)]
        hub: HubArgs,
    },
    /// Delete a hub client: its token or certificate stops working.
    Delete {
        name: String,
        #[command(flatten)]
        hub: HubArgs,
    },
}

pub async fn run(cmd: ClientCmd) -> anyhow::Result<()> {
    match cmd {
        ClientCmd::Create {
            name,
            token,
            cert_out,
            cert_lifetime,
            hub,
        } => {
            let credential = match (token, &cert_out) {
                (_, Some(_)) => "certificate",
                (true, None) => "token",
                (false, None) => bail!("choose --token or --cert-out DIR"),
            };
            let (_, conn) = connect_admin(&hub).await?;
            let reply: ClientCreateReply = connect::request_json(
                &conn.client,
                subjects::ADMIN_CLIENT_CREATE.to_string(),
                &ClientCreateRequest {
                    name: name.clone(),
                    credential: credential.into(),
                    cert_lifetime_seconds: cert_out.as_ref().map(|_| cert_lifetime.as_secs()),
                },
            )
            .await?;
            match cert_out {
                Some(dir) => write_cert(&dir, &reply)?,
                None => {
                    let t = reply.token.context("the hub sent no token")?;
                    eprintln!("hubclient/{name} created; the token is shown once:");
                    println!("{t}");
                }
            }
            Ok(())
        }
        ClientCmd::Delete { name, hub } => {
            let (_, conn) = connect_admin(&hub).await?;
            let _: ClientDeleteReply = connect::request_json(
                &conn.client,
                subjects::ADMIN_CLIENT_DELETE.to_string(),
                &ClientDeleteRequest { name: name.clone() },
            )
            .await?;
            println!("hubclient/{name} deleted");
            Ok(())
        }
    }
}

fn write_cert(dir: &Path, reply: &ClientCreateReply) -> anyhow::Result<()> {
    use std::io::Write as _;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let cert = reply
        .certificate
        .as_deref()
        .context("the hub sent no certificate")?;
    let key = reply.key.as_deref().context("the hub sent no key")?;
    std::fs::write(dir.join("tls.crt"), cert)?;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
    opts.open(dir.join("tls.key"))
        .and_then(|mut f| f.write_all(key.as_bytes()))
        .with_context(|| format!("writing {}", dir.join("tls.key").display()))?;
    if let Some(ca) = &reply.ca_bundle {
        std::fs::write(dir.join("ca.crt"), ca)?;
    }
    println!(
        "hubclient/{} created: {} {} {}",
        reply.client.metadata.name,
        dir.join("tls.crt").display(),
        dir.join("tls.key").display(),
        dir.join("ca.crt").display()
    );
    Ok(())
}

pub async fn get_clients(hub: &HubArgs, output: Output) -> anyhow::Result<()> {
    let (_, conn) = connect_admin(hub).await?;
    let store = HubStore::open(conn.client.clone()).await?;
    let mut clients: Vec<HubClient> = store
        .list::<HubClient>(Bucket::HubClients)
        .await?
        .into_iter()
        .map(|(_, c, _)| c)
        .collect();
    clients.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let mut policies: Vec<ClientAccessPolicy> = store
        .list::<ClientAccessPolicy>(Bucket::ClientAccessPolicies)
        .await?
        .into_iter()
        .map(|(_, p, _)| p)
        .collect();
    policies.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    match output {
        Output::Json | Output::Yaml => {
            let v = serde_json::json!({
                "apiVersion": "v1", "kind": "List",
                "items": clients.iter().map(serde_json::to_value)
                    .chain(policies.iter().map(serde_json::to_value))
                    .collect::<Result<Vec<_>, _>>()?,
            });
            if output == Output::Json {
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                print!(
                    "{}",
                    serde_saphyr::to_string(&v).map_err(|e| anyhow::anyhow!("{e}"))?
                );
            }
        }
        Output::Table | Output::Wide => {
            let now = SystemTime::now();
            let mut rows = vec![vec![
                "NAME".to_string(),
                "CREDENTIAL".into(),
                "EXPIRES".into(),
                "POLICIES".into(),
                "AGE".into(),
            ]];
            for c in &clients {
                let name = &c.metadata.name;
                let (cred, expires) = match (&c.spec.token_sha256, &c.spec.certificate) {
                    (_, Some(cert)) => ("certificate", cert.not_after.clone()),
                    (Some(_), None) => ("token", "-".into()),
                    (None, None) => ("none", "-".into()),
                };
                let named: Vec<&str> = policies
                    .iter()
                    .filter(|p| p.spec.clients.iter().any(|n| n == name))
                    .map(|p| p.metadata.name.as_str())
                    .collect();
                rows.push(vec![
                    name.clone(),
                    cred.into(),
                    expires,
                    if named.is_empty() {
                        "<none: API servers only>".into()
                    } else {
                        named.join(",")
                    },
                    age(&c.metadata.creation_timestamp, now),
                ]);
            }
            print_table(&rows);
        }
    }
    Ok(())
}

fn is_client_kind(d: &serde_json::Value) -> bool {
    d["kind"] == ClientAccessPolicy::KIND
}

/// `tetherctl apply -f`: ClientAccessPolicy documents are handled here, everything else by
/// the add-on apply; every document is validated before anything is stored.
pub async fn apply(hub: &HubArgs, text: &str) -> anyhow::Result<()> {
    let docs = crate::addons::documents(text)?;
    if !docs.iter().any(is_client_kind) {
        return crate::addons::apply(hub, text).await;
    }
    let mut policies = Vec::new();
    let mut others = Vec::new();
    let mut errors = Vec::new();
    for (i, d) in docs.into_iter().enumerate() {
        if !is_client_kind(&d) {
            others.push(d);
            continue;
        }
        let what = format!(
            "document {} ({}/{})",
            i + 1,
            d["kind"].as_str().unwrap_or("?"),
            d["metadata"]["name"].as_str().unwrap_or("?")
        );
        match parse_policy(d) {
            Ok(p) => policies.push(p),
            Err(e) => errors.push(format!("{what}: {e}")),
        }
    }
    if !errors.is_empty() {
        bail!("nothing applied; invalid input:\n  {}", errors.join("\n  "));
    }
    if !others.is_empty() {
        // Validate the add-on documents too before storing anything, then let the add-on
        // apply store them.
        crate::addons::validate_all(others.clone())?;
        crate::addons::apply(hub, &serde_json::to_string(&others)?).await?;
    }
    let (_, conn) = connect_admin(hub).await?;
    let store = HubStore::open(conn.client.clone()).await?;
    for mut p in policies {
        let name = p.metadata.name.clone();
        let old: Option<(ClientAccessPolicy, u64)> =
            store.get(Bucket::ClientAccessPolicies, &name).await?;
        let verb = match &old {
            Some((o, _)) => {
                p.metadata.uid = o.metadata.uid.clone();
                p.metadata.creation_timestamp = o.metadata.creation_timestamp.clone();
                if o.spec == p.spec {
                    "unchanged"
                } else {
                    "configured"
                }
            }
            None => "created",
        };
        store.put(Bucket::ClientAccessPolicies, &name, &p).await?;
        if verb != "unchanged" {
            let reason = if verb == "created" {
                "Created"
            } else {
                "Updated"
            };
            let ev = Event::new(
                ClientAccessPolicy::KIND,
                &name,
                "Normal",
                reason,
                format!("clientaccesspolicy {name} {verb} by tetherctl apply"),
            );
            if let Err(e) = store.publish_event(&ev).await {
                eprintln!("warning: cannot publish event: {e}");
            }
        }
        println!("clientaccesspolicy/{name} {verb}");
    }
    Ok(())
}

/// `tetherctl delete`: client kinds here, the rest by the add-on delete.
pub async fn delete(hub: &HubArgs, kind: &str, name: &str) -> anyhow::Result<()> {
    match kind.to_ascii_lowercase().as_str() {
        "clientaccesspolicy" | "clientaccesspolicies" | "cap" => {
            let (_, conn) = connect_admin(hub).await?;
            let store = HubStore::open(conn.client.clone()).await?;
            if store
                .get::<serde_json::Value>(Bucket::ClientAccessPolicies, name)
                .await?
                .is_none()
            {
                bail!("clientaccesspolicy {name} not found");
            }
            store.delete(Bucket::ClientAccessPolicies, name).await?;
            let ev = Event::new(
                ClientAccessPolicy::KIND,
                name,
                "Normal",
                "Deleted",
                format!("clientaccesspolicy {name} deleted by tetherctl"),
            );
            let _ = store.publish_event(&ev).await;
            println!("clientaccesspolicy/{name} deleted");
            Ok(())
        }
        "hubclient" | "hubclients" | "client" | "clients" => {
            run(ClientCmd::Delete {
                name: name.to_string(),
                hub: hub.clone(),
            })
            .await
        }
        _ => crate::addons::delete(hub, kind, name).await,
    }
}

/// `tetherctl get brokers`: the brokers' presence entries — where hub clients connect
/// (`clientAddresses`), whether each is live or draining, and its load.
pub async fn get_brokers(hub: &HubArgs, output: Output) -> anyhow::Result<()> {
    use tether_control::brokers::BrokerPresence;
    let (_, conn) = connect_admin(hub).await?;
    let store = HubStore::open(conn.client.clone()).await?;
    let mut brokers: Vec<BrokerPresence> = store
        .list::<BrokerPresence>(Bucket::Brokers)
        .await?
        .into_iter()
        .map(|(_, b, _)| b)
        .collect();
    brokers.sort_by(|a, b| a.id.cmp(&b.id));
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&brokers)?),
        Output::Yaml => print!(
            "{}",
            serde_saphyr::to_string(&brokers).map_err(|e| anyhow::anyhow!("{e}"))?
        ),
        Output::Table | Output::Wide => {
            let now = SystemTime::now();
            let mut head = vec![
                "NAME".to_string(),
                "LIVE".into(),
                "DRAINING".into(),
                "TUNNELS".into(),
                "STREAMS".into(),
                "CLIENT ADDRESSES".into(),
                "RENEWED".into(),
                "AGE".into(),
            ];
            if output == Output::Wide {
                head.push("AGENT ADDRESSES".into());
                head.push("RELAY".into());
            }
            let mut rows = vec![head];
            for b in &brokers {
                let mut row = vec![
                    b.id.clone(),
                    b.is_live(now).to_string(),
                    b.draining.to_string(),
                    b.tunnels.to_string(),
                    b.streams.to_string(),
                    b.client_addresses.join(","),
                    format!("{} ago", age(&b.renew_time, now)),
                    age(&b.started_at, now),
                ];
                if output == Output::Wide {
                    row.push(b.agent_addresses.join(","));
                    row.push(b.relay_address.clone());
                }
                rows.push(row);
            }
            print_table(&rows);
        }
    }
    Ok(())
}
