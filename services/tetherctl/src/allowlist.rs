//! `tetherctl apply -f` for ServiceProxyAllowlist documents (the brokers' service proxy
//! allowlist, `tether-serviceproxyallowlists`), and `tetherctl delete serviceproxyallowlist`.
//!
//! Every allowlist document is validated before anything is stored; the other documents of the
//! file go to the client/add-on apply ([`crate::clients::apply`]) unchanged.

use anyhow::{Context, bail};
use tether_control::resources::Event;
use tether_control::service_proxy::{self, ServiceProxyAllowlist};
use tether_control::store::Store as _;
use tether_control::store::{Bucket, HubStore};

use crate::HubArgs;
use crate::ops::connect_admin;

fn is_allowlist(d: &serde_json::Value) -> bool {
    d["kind"] == ServiceProxyAllowlist::KIND
}

async fn event(store: &HubStore, name: &str, reason: &str, text: String) {
    let ev = Event::new(ServiceProxyAllowlist::KIND, name, "Normal", reason, text);
    if let Err(e) = store.publish_event(&ev).await {
        eprintln!("warning: cannot publish event: {e}");
    }
}

/// `tetherctl apply -f FILE`.
pub async fn apply(hub: &HubArgs, file: &str) -> anyhow::Result<()> {
    let text = if file == "-" {
        std::io::read_to_string(std::io::stdin()).context("reading stdin")?
    } else {
        std::fs::read_to_string(file).with_context(|| format!("reading {file}"))?
    };
    // Read once (stdin cannot be read twice); the other kinds get the same text.
    let docs = crate::addons::documents(&text)?;
    if !docs.iter().any(is_allowlist) {
        return crate::clients::apply(hub, &text).await;
    }
    let (mine, others): (Vec<_>, Vec<_>) = docs
        .into_iter()
        .enumerate()
        .partition(|(_, d)| is_allowlist(d));
    let mut lists = Vec::new();
    let mut errors = Vec::new();
    for (i, d) in mine {
        let name = d["metadata"]["name"].as_str().unwrap_or("?").to_owned();
        match service_proxy::parse(d) {
            Ok(a) => lists.push(a),
            Err(e) => errors.push(format!(
                "document {} (ServiceProxyAllowlist/{name}): {}: {}",
                i + 1,
                e.field,
                e.message
            )),
        }
    }
    if !errors.is_empty() {
        bail!("nothing applied; invalid input:\n  {}", errors.join("\n  "));
    }
    if !others.is_empty() {
        let others: Vec<_> = others.into_iter().map(|(_, d)| d).collect();
        // JSON is YAML: the other documents go on as one JSON list.
        crate::clients::apply(hub, &serde_json::to_string(&others)?).await?;
    }
    let (_, conn) = connect_admin(hub).await?;
    let store = HubStore::open(conn.client.clone()).await?;
    for mut a in lists {
        let name = a.metadata.name.clone();
        let old: Option<(ServiceProxyAllowlist, u64)> =
            store.get(Bucket::ServiceProxyAllowlists, &name).await?;
        let verb = match &old {
            Some((o, _)) => {
                a.metadata.uid = o.metadata.uid.clone();
                a.metadata.creation_timestamp = o.metadata.creation_timestamp.clone();
                if o.spec == a.spec {
                    "unchanged"
                } else {
                    "configured"
                }
            }
            None => "created",
        };
        store.put(Bucket::ServiceProxyAllowlists, &name, &a).await?;
        if verb != "unchanged" {
            let reason = if verb == "created" {
                "Created"
            } else {
                "Updated"
            };
            event(
                &store,
                &name,
                reason,
                format!("serviceproxyallowlist {name} {verb} by tetherctl apply"),
            )
            .await;
        }
        println!("serviceproxyallowlist/{name} {verb}");
    }
    Ok(())
}

/// `tetherctl delete serviceproxyallowlist NAME`: with no allowlist left every service is denied.
pub async fn delete(hub: &HubArgs, kind: &str, name: &str) -> anyhow::Result<()> {
    if !matches!(
        kind.to_ascii_lowercase().as_str(),
        "serviceproxyallowlist" | "serviceproxyallowlists" | "spa"
    ) {
        return crate::clients::delete(hub, kind, name).await;
    }
    let (_, conn) = connect_admin(hub).await?;
    let store = HubStore::open(conn.client.clone()).await?;
    if store
        .get::<serde_json::Value>(Bucket::ServiceProxyAllowlists, name)
        .await?
        .is_none()
    {
        bail!("serviceproxyallowlist {name} not found");
    }
    store.delete(Bucket::ServiceProxyAllowlists, name).await?;
    event(
        &store,
        name,
        "Deleted",
        format!("serviceproxyallowlist {name} deleted by tetherctl"),
    )
    .await;
    println!("serviceproxyallowlist/{name} deleted");
    Ok(())
}
