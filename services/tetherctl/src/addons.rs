//! `tetherctl apply -f`, `get addons|configs|clustermanagementaddons`, `delete <kind> <name>`.
//!
//! Documents are validated entirely before anything is stored: one bad document (the error
//! names it and the field) and nothing of the file is written. Writes go straight to the
//! JetStream KV buckets as the `tether-admin` user (like `token create`), and every write is an
//! event on the events stream; the addon-manager's controller reacts to the KV changes.

use std::time::SystemTime;

use anyhow::bail;
use tether_control::addons::{
    self, AddOnDeploymentConfig, AddOnResource, ClusterManagementAddOn, ManagedClusterAddOn,
    ManagedProxyConfiguration, addon_key, namespaced_key, parse_resource, spec_hash,
};
use tether_control::resources::{Event, Lease, ManagedCluster, ObjectMeta};
use tether_control::store::Store as _;
use tether_control::store::{Bucket, HubStore};

use crate::ops::{age, connect_admin, print_table};
use crate::{HubArgs, Output};

/// Splits a file into documents ([`tether_control::resources::parse_documents`]).
pub fn documents(text: &str) -> anyhow::Result<Vec<serde_json::Value>> {
    Ok(tether_control::resources::parse_documents(text)?)
}

/// Parses and validates every document; the error lists each bad one with its field.
pub fn validate_all(docs: Vec<serde_json::Value>) -> anyhow::Result<Vec<AddOnResource>> {
    let mut ok = Vec::new();
    let mut errors = Vec::new();
    for (i, d) in docs.into_iter().enumerate() {
        let what = format!(
            "document {} ({}/{})",
            i + 1,
            d["kind"].as_str().unwrap_or("?"),
            d["metadata"]["name"].as_str().unwrap_or("?")
        );
        match parse_resource(d) {
            Ok(r) => ok.push(r),
            Err(e) => errors.push(format!("{what}: {e}")),
        }
    }
    if ok.is_empty() && errors.is_empty() {
        bail!("no documents");
    }
    if !errors.is_empty() {
        bail!("nothing applied; invalid input:\n  {}", errors.join("\n  "));
    }
    Ok(ok)
}

fn target(r: &AddOnResource) -> (Bucket, String) {
    match r {
        AddOnResource::ClusterManagementAddOn(x) => {
            (Bucket::ClusterManagementAddOns, x.metadata.name.clone())
        }
        AddOnResource::ManagedClusterAddOn(x) => (
            Bucket::ManagedClusterAddOns,
            addon_key(x.cluster(), &x.metadata.name),
        ),
        AddOnResource::AddOnDeploymentConfig(x) => (
            Bucket::AddOnDeploymentConfigs,
            namespaced_key(
                x.metadata.namespace.as_deref().unwrap_or_default(),
                &x.metadata.name,
            ),
        ),
        AddOnResource::ManagedProxyConfiguration(x) => {
            (Bucket::ProxyConfigurations, x.metadata.name.clone())
        }
    }
}

fn keep_identity(meta: &mut ObjectMeta, old: &serde_json::Value) {
    if let Some(uid) = old["metadata"]["uid"].as_str() {
        meta.uid = uid.to_string();
    }
    if let Some(t) = old["metadata"]["creationTimestamp"].as_str() {
        meta.creation_timestamp = t.to_string();
    }
}

/// Stores the add-on resources of `text` (the content of `tetherctl apply -f`, already read:
/// stdin can be read only once).
pub async fn apply(hub: &HubArgs, text: &str) -> anyhow::Result<()> {
    let resources = validate_all(documents(text)?)?;
    let (_, conn) = connect_admin(hub).await?;
    let store = HubStore::open(conn.client.clone()).await?;
    for mut r in resources {
        let (bucket, key) = target(&r);
        let old: Option<(serde_json::Value, u64)> = store.get(bucket, &key).await?;
        let what = r.display();
        // Keep identity and (for status-bearing kinds) the controller's status.
        if let Some((o, _)) = &old {
            match &mut r {
                AddOnResource::ClusterManagementAddOn(x) => keep_identity(&mut x.metadata, o),
                AddOnResource::AddOnDeploymentConfig(x) => keep_identity(&mut x.metadata, o),
                AddOnResource::ManagedClusterAddOn(x) => {
                    keep_identity(&mut x.metadata, o);
                    if let Ok(s) = serde_json::from_value(o["status"].clone()) {
                        x.status = s;
                    }
                    if let Some(a) = o["metadata"]["annotations"].as_object() {
                        for (k, v) in a {
                            if let Some(v) = v.as_str() {
                                x.metadata
                                    .annotations
                                    .entry(k.clone())
                                    .or_insert_with(|| v.to_string());
                            }
                        }
                    }
                }
                AddOnResource::ManagedProxyConfiguration(x) => {
                    keep_identity(&mut x.metadata, o);
                    if let Ok(s) = serde_json::from_value(o["status"].clone()) {
                        x.status = s;
                    }
                }
            }
        }
        let new = match &r {
            AddOnResource::ClusterManagementAddOn(x) => serde_json::to_value(x)?,
            AddOnResource::ManagedClusterAddOn(x) => serde_json::to_value(x)?,
            AddOnResource::AddOnDeploymentConfig(x) => serde_json::to_value(x)?,
            AddOnResource::ManagedProxyConfiguration(x) => serde_json::to_value(x)?,
        };
        let verb = match &old {
            Some((o, _))
                if o["spec"] == new["spec"]
                    && o["metadata"]["labels"] == new["metadata"]["labels"] =>
            {
                println!("{what} unchanged");
                continue;
            }
            Some((_, rev)) => {
                if store.update(bucket, &key, &new, *rev).await?.is_none() {
                    bail!("{what} changed while applying; nothing more applied, retry");
                }
                "configured"
            }
            None => {
                if store.create(bucket, &key, &new).await?.is_none() {
                    bail!("{what} was created concurrently; nothing more applied, retry");
                }
                "created"
            }
        };
        let ev = Event::new(
            r.kind(),
            &key,
            "Normal",
            if verb == "created" {
                "Created"
            } else {
                "Updated"
            },
            format!("{what} {verb} by tetherctl apply"),
        );
        if let Err(e) = store.publish_event(&ev).await {
            eprintln!("warning: {what} {verb}, but its event was not published: {e}");
        }
        println!("{what} {verb}");
    }
    Ok(())
}

fn print_value(output: Output, v: &serde_json::Value) -> anyhow::Result<()> {
    match output {
        Output::Yaml => print!("{}", serde_saphyr::to_string(v)?),
        _ => println!("{}", serde_json::to_string_pretty(v)?),
    }
    Ok(())
}

fn list_value<T: serde::Serialize>(items: &[T]) -> anyhow::Result<serde_json::Value> {
    Ok(
        serde_json::json!({"apiVersion": "v1", "kind": "List", "items": serde_json::to_value(items)?}),
    )
}

/// ManagedClusterAddOns, optionally of one cluster (and one add-on).
pub async fn get_addons(
    hub: &HubArgs,
    cluster: Option<&str>,
    addon: Option<&str>,
    output: Output,
) -> anyhow::Result<()> {
    let (_, conn) = connect_admin(hub).await?;
    let store = HubStore::open(conn.client.clone()).await?;
    let mut items: Vec<ManagedClusterAddOn> = store
        .list::<ManagedClusterAddOn>(Bucket::ManagedClusterAddOns)
        .await?
        .into_iter()
        .map(|(_, mut m, rev)| {
            m.metadata.resource_version = Some(rev.to_string());
            m
        })
        .filter(|m| cluster.is_none_or(|c| m.cluster() == c))
        .filter(|m| addon.is_none_or(|a| m.metadata.name == a))
        .collect();
    items.sort_by(|a, b| (a.cluster(), &a.metadata.name).cmp(&(b.cluster(), &b.metadata.name)));
    if let (Some(c), Some(a)) = (cluster, addon) {
        let Some(m) = items.first() else {
            bail!("managedclusteraddon {c}/{a} not found");
        };
        if matches!(output, Output::Json | Output::Yaml) {
            return print_value(output, &serde_json::to_value(m)?);
        }
    }
    match output {
        Output::Json | Output::Yaml => print_value(output, &list_value(&items)?),
        Output::Table | Output::Wide => {
            let now = SystemTime::now();
            let mut head = vec![
                "CLUSTER",
                "NAME",
                "AVAILABLE",
                "DEGRADED",
                "PROGRESSING",
                "AGE",
            ];
            if output == Output::Wide {
                head.push("CONFIGS");
            }
            let mut rows = vec![head.into_iter().map(String::from).collect::<Vec<_>>()];
            for m in &items {
                let c = |t| m.condition(t).unwrap_or("").to_string();
                let mut r = vec![
                    m.cluster().to_string(),
                    m.metadata.name.clone(),
                    c(addons::condition::AVAILABLE),
                    c(addons::condition::DEGRADED),
                    c(addons::condition::PROGRESSING),
                    age(&m.metadata.creation_timestamp, now),
                ];
                if output == Output::Wide {
                    r.push(
                        m.status
                            .config_references
                            .iter()
                            .map(|r| {
                                let h = &r.desired_config.spec_hash;
                                format!("{}/{}@{}", r.resource, r.name, &h[..h.len().min(12)])
                            })
                            .collect::<Vec<_>>()
                            .join(","),
                    );
                }
                rows.push(r);
            }
            print_table(&rows);
            Ok(())
        }
    }
}

/// AddOnDeploymentConfigs and ManagedProxyConfigurations.
pub async fn get_configs(hub: &HubArgs, output: Output) -> anyhow::Result<()> {
    let (_, conn) = connect_admin(hub).await?;
    let store = HubStore::open(conn.client.clone()).await?;
    let mut adcs: Vec<AddOnDeploymentConfig> = store
        .list::<AddOnDeploymentConfig>(Bucket::AddOnDeploymentConfigs)
        .await?
        .into_iter()
        .map(|(_, v, _)| v)
        .collect();
    adcs.sort_by(|a, b| {
        (&a.metadata.namespace, &a.metadata.name).cmp(&(&b.metadata.namespace, &b.metadata.name))
    });
    let mut mpcs: Vec<ManagedProxyConfiguration> = store
        .list::<ManagedProxyConfiguration>(Bucket::ProxyConfigurations)
        .await?
        .into_iter()
        .map(|(_, v, _)| v)
        .collect();
    mpcs.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    match output {
        Output::Json | Output::Yaml => {
            let mut items = serde_json::to_value(&adcs)?
                .as_array()
                .cloned()
                .unwrap_or_default();
            items.extend(
                serde_json::to_value(&mpcs)?
                    .as_array()
                    .cloned()
                    .unwrap_or_default(),
            );
            print_value(output, &list_value(&items)?)
        }
        _ => {
            let now = SystemTime::now();
            let mut rows = vec![
                ["KIND", "NAMESPACE", "NAME", "SPEC HASH", "SUMMARY", "AGE"]
                    .map(String::from)
                    .to_vec(),
            ];
            for a in &adcs {
                let p = &a.spec.proxy_config;
                let mut s = Vec::new();
                for (k, v) in [
                    ("httpProxy", &p.http_proxy),
                    ("httpsProxy", &p.https_proxy),
                    ("noProxy", &p.no_proxy),
                ] {
                    if !v.is_empty() {
                        s.push(format!("{k}={v}"));
                    }
                }
                if !p.ca_bundle.is_empty() {
                    s.push("caBundle".into());
                }
                rows.push(vec![
                    AddOnDeploymentConfig::KIND.into(),
                    a.metadata.namespace.clone().unwrap_or_default(),
                    a.metadata.name.clone(),
                    spec_hash(&a.spec)[..12].to_string(),
                    s.join(" "),
                    age(&a.metadata.creation_timestamp, now),
                ]);
            }
            for m in &mpcs {
                let eps: Vec<String> = m
                    .spec
                    .proxy_server
                    .entrypoints
                    .iter()
                    .map(|e| format!("{}:{}", e.host, e.port))
                    .collect();
                rows.push(vec![
                    ManagedProxyConfiguration::KIND.into(),
                    String::new(),
                    m.metadata.name.clone(),
                    spec_hash(&m.spec)[..12].to_string(),
                    format!(
                        "entrypoints={} serverReplicas={} agentReplicas={}",
                        eps.join(","),
                        m.spec.proxy_server.replicas,
                        m.spec.proxy_agent.replicas
                    ),
                    age(&m.metadata.creation_timestamp, now),
                ]);
            }
            print_table(&rows);
            Ok(())
        }
    }
}

pub async fn get_cmas(hub: &HubArgs, output: Output) -> anyhow::Result<()> {
    let (_, conn) = connect_admin(hub).await?;
    let store = HubStore::open(conn.client.clone()).await?;
    let mut items: Vec<ClusterManagementAddOn> = store
        .list::<ClusterManagementAddOn>(Bucket::ClusterManagementAddOns)
        .await?
        .into_iter()
        .map(|(_, v, _)| v)
        .collect();
    items.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    match output {
        Output::Json | Output::Yaml => print_value(output, &list_value(&items)?),
        _ => {
            let now = SystemTime::now();
            let mut rows = vec![
                ["NAME", "INSTALL STRATEGY", "DEFAULT CONFIGS", "AGE"]
                    .map(String::from)
                    .to_vec(),
            ];
            for c in &items {
                let s = &c.spec.install_strategy;
                let strategy = match &s.selector {
                    Some(sel) if s.type_ == "LabelSelector" => format!(
                        "LabelSelector({})",
                        sel.match_labels
                            .iter()
                            .map(|(k, v)| format!("{k}={v}"))
                            .collect::<Vec<_>>()
                            .join(",")
                    ),
                    _ => s.type_.clone(),
                };
                rows.push(vec![
                    c.metadata.name.clone(),
                    strategy,
                    c.spec
                        .default_configs
                        .iter()
                        .map(|r| r.display())
                        .collect::<Vec<_>>()
                        .join(","),
                    age(&c.metadata.creation_timestamp, now),
                ]);
            }
            print_table(&rows);
            Ok(())
        }
    }
}

/// `tetherctl delete <kind> <name>`; namespaced names are `<namespace>/<name>` (for add-ons
/// `<cluster>/<addon>`; AddOnDeploymentConfigs default to namespace `default`).
pub async fn delete(hub: &HubArgs, kind: &str, name: &str) -> anyhow::Result<()> {
    let (bucket, key, kind_name) = match kind.to_ascii_lowercase().as_str() {
        "clustermanagementaddon" | "clustermanagementaddons" | "cma" => (
            Bucket::ClusterManagementAddOns,
            name.to_string(),
            ClusterManagementAddOn::KIND,
        ),
        "managedclusteraddon" | "managedclusteraddons" | "addon" | "addons" | "mca" => {
            let Some((c, a)) = name.split_once('/') else {
                bail!("a managedclusteraddon is named <cluster>/<addon>, not {name:?}");
            };
            (
                Bucket::ManagedClusterAddOns,
                addon_key(c, a),
                ManagedClusterAddOn::KIND,
            )
        }
        "addondeploymentconfig" | "addondeploymentconfigs" | "adc" => {
            let (ns, n) = name.split_once('/').unwrap_or(("", name));
            (
                Bucket::AddOnDeploymentConfigs,
                namespaced_key(ns, n),
                AddOnDeploymentConfig::KIND,
            )
        }
        "managedproxyconfiguration" | "managedproxyconfigurations" | "mpc" => (
            Bucket::ProxyConfigurations,
            name.to_string(),
            ManagedProxyConfiguration::KIND,
        ),
        "managedcluster" | "managedclusters" | "cluster" | "clusters" => {
            (Bucket::Clusters, name.to_string(), ManagedCluster::KIND)
        }
        other => bail!(
            "unknown kind {other:?} (clustermanagementaddon, managedclusteraddon, addondeploymentconfig, managedproxyconfiguration, managedcluster)"
        ),
    };
    let (_, conn) = connect_admin(hub).await?;
    let store = HubStore::open(conn.client.clone()).await?;
    if store
        .get::<serde_json::Value>(bucket, &key)
        .await?
        .is_none()
    {
        bail!("{} {name:?} not found", kind_name.to_ascii_lowercase());
    }
    store.delete(bucket, &key).await?;
    if bucket == Bucket::Clusters {
        // The cluster's lease goes with it (the hub stops expecting renewals).
        if store.get::<Lease>(Bucket::Leases, &key).await?.is_some() {
            store.delete(Bucket::Leases, &key).await?;
        }
    }
    let ev = Event::new(
        kind_name,
        &key,
        "Normal",
        "Deleted",
        format!(
            "{} {name} deleted by tetherctl",
            kind_name.to_ascii_lowercase()
        ),
    );
    if let Err(e) = store.publish_event(&ev).await {
        eprintln!("warning: deleted, but the event was not published: {e}");
    }
    println!("{}/{name} deleted", kind_name.to_ascii_lowercase());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_multi_document_and_all_or_nothing() {
        let text = "apiVersion: addon.open-cluster-management.io/v1alpha1\nkind: AddOnDeploymentConfig\nmetadata:\n  name: a\nspec:\n  proxyConfig:\n    noProxy: .svc\n---\napiVersion: addon.open-cluster-management.io/v1alpha1\nkind: AddOnDeploymentConfig\nmetadata:\n  name: b\nspec:\n  proxyConfig:\n    httpsProxy: \"ftp://x\"\n";
        let docs = documents(text).unwrap();
        assert_eq!(docs.len(), 2);
        let e = validate_all(docs).unwrap_err().to_string();
        assert!(e.contains("document 2 (AddOnDeploymentConfig/b)"), "{e}");
        assert!(e.contains("spec.proxyConfig.httpsProxy"), "{e}");
    }
}
