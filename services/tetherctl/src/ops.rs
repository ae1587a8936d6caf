//! Hub operations over NATS as the `tether-admin` user.

use std::time::{Duration, SystemTime};

use anyhow::Context;
use tether_control::connect::{self, ConnectConfig, Credentials};
use tether_control::hub::{ADMIN_USER, HubDir};
use tether_control::resources::{
    AdminClusterRequest, BootstrapTokenRecord, Lease, ManagedCluster, condition, parse_rfc3339,
    rfc3339,
};
use tether_control::store::Store as _;
use tether_control::store::{Bucket, HubStore};
use tether_control::subjects;

use crate::{HubArgs, Output};

pub(crate) async fn connect_admin(
    hub: &HubArgs,
) -> anyhow::Result<(HubDir, tether_control::NatsConnection)> {
    let dir = HubDir::load(&hub.hub_dir)
        .with_context(|| format!("loading hub directory {}", hub.hub_dir.display()))?;
    let endpoint = dir.endpoint(hub.nats_url.as_deref())?;
    let password = dir.read(&dir.config.nats.admin_password_file)?;
    let cfg = ConnectConfig::new(
        endpoint,
        Credentials::HubUser {
            user: ADMIN_USER.into(),
            password: password.trim().to_string(),
        },
        "tetherctl",
    );
    let conn = connect::connect(&cfg).await?;
    Ok((dir, conn))
}

pub async fn admin(hub: &HubArgs, cluster: &str, accept: bool) -> anyhow::Result<()> {
    let (_, conn) = connect_admin(hub).await?;
    let subject = if accept {
        subjects::ADMIN_ACCEPT
    } else {
        subjects::ADMIN_DENY
    };
    let mc: ManagedCluster = connect::request_json(
        &conn.client,
        subject.to_string(),
        &AdminClusterRequest {
            cluster_name: cluster.to_string(),
        },
    )
    .await?;
    println!(
        "managedcluster/{} {}",
        mc.metadata.name,
        if accept { "accepted" } else { "denied" }
    );
    Ok(())
}

pub(crate) fn age(created: &str, now: SystemTime) -> String {
    let Some(t) = parse_rfc3339(created) else {
        return "<unknown>".into();
    };
    let s = now.duration_since(t).unwrap_or_default().as_secs();
    match s {
        0..=119 => format!("{s}s"),
        120..=7199 => format!("{}m", s / 60),
        7200..=172_799 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86400),
    }
}

fn cond(mc: &ManagedCluster, t: &str) -> String {
    mc.condition(t).unwrap_or("").to_string()
}

pub async fn get_clusters(hub: &HubArgs, name: Option<&str>, output: Output) -> anyhow::Result<()> {
    let (dir, conn) = connect_admin(hub).await?;
    let store = HubStore::open(conn.client.clone()).await?;
    let listed = match name {
        Some(n) => store
            .get::<ManagedCluster>(Bucket::Clusters, n)
            .await?
            .map(|(mc, rev)| (n.to_string(), mc, rev))
            .into_iter()
            .collect(),
        None => store.list::<ManagedCluster>(Bucket::Clusters).await?,
    };
    let mut clusters: Vec<ManagedCluster> = listed
        .into_iter()
        .map(|(_, mut mc, rev)| {
            mc.metadata.resource_version = Some(rev.to_string());
            mc
        })
        .filter(|mc| name.is_none_or(|n| mc.metadata.name == n))
        .collect();
    clusters.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    if let Some(n) = name
        && clusters.is_empty()
    {
        anyhow::bail!("managedcluster {n:?} not found");
    }
    let now = SystemTime::now();
    let grace_mult = dir.config.registration.lease_grace_multiplier as u64;
    // One listing of the lease bucket (or one get for a single cluster), not a get per row.
    let mut leases: std::collections::HashMap<String, (Lease, u64)> = match name {
        Some(n) => store
            .get::<Lease>(Bucket::Leases, n)
            .await?
            .map(|l| (n.to_string(), l))
            .into_iter()
            .collect(),
        None => store
            .list::<Lease>(Bucket::Leases)
            .await?
            .into_iter()
            .map(|(k, l, rev)| (k, (l, rev)))
            .collect(),
    };
    let mut lease_ages = Vec::new();
    for mc in &mut clusters {
        let lease: Option<(Lease, u64)> = leases.remove(&mc.metadata.name);
        let renew = lease
            .as_ref()
            .and_then(|(l, _)| parse_rfc3339(&l.spec.renew_time));
        let grace = Duration::from_secs(mc.spec.lease_duration_seconds as u64 * grace_mult);
        mc.status.seconds_until_unknown = renew.map(|r| {
            let deadline = r + grace;
            match deadline.duration_since(now) {
                Ok(d) => d.as_secs() as i64,
                Err(e) => -(e.duration().as_secs() as i64),
            }
        });
        lease_ages.push(renew.map(|r| now.duration_since(r).unwrap_or_default().as_secs()));
    }
    match output {
        Output::Json => {
            let v = if name.is_some() {
                serde_json::to_value(&clusters[0])?
            } else {
                serde_json::json!({"apiVersion": "v1", "kind": "List", "items": clusters})
            };
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
        Output::Yaml => {
            let v = if name.is_some() {
                serde_json::to_value(&clusters[0])?
            } else {
                serde_json::json!({"apiVersion": "v1", "kind": "List", "items": clusters})
            };
            print!("{}", serde_saphyr::to_string(&v)?);
        }
        Output::Table | Output::Wide => {
            let wide = output == Output::Wide;
            let mut rows = vec![{
                let mut h = vec!["NAME", "HUB ACCEPTED", "JOINED", "AVAILABLE", "AGE"];
                if wide {
                    h.extend(["LEASE AGE", "UNKNOWN IN"]);
                }
                h.into_iter().map(String::from).collect::<Vec<_>>()
            }];
            for (mc, lease_age) in clusters.iter().zip(&lease_ages) {
                let mut r = vec![
                    mc.metadata.name.clone(),
                    mc.spec.hub_accepts_client.to_string(),
                    cond(mc, condition::JOINED),
                    cond(mc, condition::AVAILABLE),
                    age(&mc.metadata.creation_timestamp, now),
                ];
                if wide {
                    r.push(lease_age.map(|a| format!("{a}s")).unwrap_or_default());
                    r.push(match mc.status.seconds_until_unknown {
                        Some(s) if s > 0 => format!("{s}s"),
                        Some(_) => "now".into(),
                        None => String::new(),
                    });
                }
                rows.push(r);
            }
            print_table(&rows);
        }
    }
    Ok(())
}

/// `kind/name` of the object an event is about, as the tables show it.
pub(crate) fn object_ref(e: &tether_control::resources::Event) -> String {
    format!(
        "{}/{}",
        e.involved_object.kind.to_ascii_lowercase(),
        e.involved_object.name
    )
}

pub(crate) fn print_table(rows: &[Vec<String>]) {
    print!("{}", tether_control::health::format_table(rows));
}

pub async fn get_events(
    hub: &HubArgs,
    name: Option<&str>,
    limit: usize,
    output: Output,
) -> anyhow::Result<()> {
    let (_, conn) = connect_admin(hub).await?;
    let store = HubStore::open(conn.client.clone()).await?;
    let events = store.recent_events(limit, name).await?;
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&events)?),
        Output::Yaml => print!("{}", serde_saphyr::to_string(&events)?),
        _ => {
            let mut rows = vec![
                ["TIME", "TYPE", "REASON", "OBJECT", "MESSAGE"]
                    .map(String::from)
                    .to_vec(),
            ];
            for e in events {
                let object = object_ref(&e);
                rows.push(vec![e.event_time, e.type_, e.reason, object, e.message]);
            }
            print_table(&rows);
        }
    }
    Ok(())
}

pub async fn token_create(hub: &HubArgs, ttl: Duration, description: &str) -> anyhow::Result<()> {
    let (_, conn) = connect_admin(hub).await?;
    let store = HubStore::open(conn.client.clone()).await?;
    let token = tether_control::auth::BootstrapToken::generate();
    let record = BootstrapTokenRecord {
        id: token.id.clone(),
        secret_sha256: token.secret_sha256(),
        expires: rfc3339(SystemTime::now() + ttl),
        description: description.to_string(),
    };
    store.put(Bucket::Tokens, &token.id, &record).await?;
    println!("{}", token.to_token_string());
    Ok(())
}
