//! Notifications to managed clusters on `tether.v1.cluster.<c>.notify` (best effort: agents
//! also re-read their config periodically).

use tether_control::addons::AddOnNotify;
use tether_control::subjects;

/// Publishes `AddOnConfigChanged` for one add-on of one cluster (best effort).
pub async fn config_changed(client: &async_nats::Client, cluster: &str, addon: &str) {
    let body = serde_json::to_vec(&AddOnNotify::config_changed(addon)).unwrap_or_default();
    if let Err(e) = client
        .publish(subjects::cluster_notify(cluster), body.into())
        .await
    {
        tracing::debug!(%cluster, %addon, error = %e, "cannot publish add-on notification");
    }
}
