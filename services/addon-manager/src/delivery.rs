//! Delivering add-ons to managed clusters (the agent side of OCM's addon-manager):
//!
//! - `tether.v1.cluster.<c>.addon.<a>.config` → [`AddOnAgentConfigReply`]: what the cluster
//!   should run, built from the ManagedClusterAddOn's configReferences (AddOnDeploymentConfig
//!   `proxyConfig` — a lone `noProxy` included — and `customizedVariables`; ManagedProxyConfiguration
//!   replicas, keepalive and entrypoints), the live non-draining brokers of `tether-brokers`
//!   (fallback: the entrypoints), the hub CA and the desired config hashes. `installed: false`
//!   when the add-on is not installed on that cluster (or the cluster is gone / not accepted).
//! - `tether.v1.cluster.<c>.addon.<a>.csr` / `.csr.get` → [`CsrReply`]: the add-on agent's client
//!   certificate, OCM's add-on subject (`CN=system:open-cluster-management:cluster:<c>:addon:<a>:agent:<agent>`,
//!   `O=system:open-cluster-management:cluster:<c>:addon:<a>`, `O=system:open-cluster-management:addon:<a>`).
//!   Signed at once when the cluster is accepted and the add-on installed, refused otherwise — an
//!   add-on CSR is never left pending, so the pending cap is zero by construction.
//! - a broker watcher: when the set of live, non-draining brokers changes it tells every
//!   installed add-on's agent (`{"type":"AddOnConfigChanged","addon":"<a>"}` on
//!   `tether.v1.cluster.<c>.notify`) and re-runs the add-on controller (Available depends on it);
//!   when only the tunnels a serving broker reports change, it re-runs the controller for those
//!   clusters' add-ons.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use actix::Addr;
use tether_control::ControlError;
use tether_control::addons::{
    self, AddOnAgentConfig, AddOnAgentConfigReply, AddOnAgentConfigRequest, AppliedConfig,
    ConfigKind, ManagedClusterAddOn, addon_key, spec_hash,
};
use tether_control::resources::{
    CertificateSigningRequest, CsrGet, CsrPhase, CsrReply, CsrSpec, CsrStatus, CsrSubmit, Event,
    ObjectMeta, set_condition,
};
use tether_control::store::{Bucket, Store};
use tether_control::subjects;
use tokio_util::sync::CancellationToken;

use crate::brokers;

use crate::addons::{AddOnController, Changed, ClustersChanged, QUEUE_GROUP};
use crate::hub::HubCtx;
use crate::registration::Registration;

/// Requests in flight per delivery subscription.
pub const MAX_INFLIGHT_DELIVERY: usize = 32;
/// How often the broker presence bucket is read for changes of the serving set (a broker that
/// dies silently only ages out; no KV event announces it).
pub const BROKER_CHECK_INTERVAL: Duration = Duration::from_secs(1);
/// Label of add-on CSRs: which add-on they are for.
pub const ADDON_LABEL: &str = "open-cluster-management.io/addon-name";
/// ManagedProxyConfiguration condition: how many brokers are live.
pub use crate::brokers::BROKERS_AVAILABLE;

fn not_installed(message: String) -> AddOnAgentConfigReply {
    AddOnAgentConfigReply {
        installed: false,
        message,
        config: None,
    }
}

/// Builds the add-on agent config of `<cluster>/<addon>`.
pub async fn agent_config(
    ctx: &Registration<impl Store>,
    cluster: &str,
    addon: &str,
) -> Result<AddOnAgentConfigReply, ControlError> {
    let store = &ctx.store;
    match ctx.cluster(cluster).await {
        Ok(Some(mc)) if mc.spec.hub_accepts_client => {}
        Ok(_) => {
            return Ok(not_installed(format!(
                "managed cluster {cluster} is gone or not accepted"
            )));
        }
        Err(e) => return Err(ControlError::Codec(e.to_string())),
    }
    // Read through the add-on caches (what the KV watches delivered; a miss reads the stream
    // leader): a config request costs no JetStream read in the steady state.
    let cache = &ctx.addon_cache;
    let Some(mca) = cache.addon(store, &addon_key(cluster, addon)).await? else {
        return Ok(not_installed(format!(
            "add-on {addon} is not installed on cluster {cluster}"
        )));
    };
    let mut cfg = AddOnAgentConfig {
        cluster: cluster.into(),
        addon: addon.into(),
        install_namespace: mca.spec.install_namespace.clone(),
        hub_ca_bundle: ctx.ca.cert_pem().to_string(),
        replicas: 1,
        ..Default::default()
    };
    let mut entrypoints = Vec::new();
    for r in &mca.status.config_references {
        let cref = addons::ConfigRef {
            group: r.group.clone(),
            resource: r.resource.clone(),
            namespace: r.namespace.clone(),
            name: r.name.clone(),
        };
        let hash = match cref.key() {
            Some((ConfigKind::AddOnDeploymentConfig, k)) => {
                let Some(adc) = cache.deployment_config(store, &k).await? else {
                    continue;
                };
                let p = &adc.spec.proxy_config;
                if !(p.http_proxy.is_empty()
                    && p.https_proxy.is_empty()
                    && p.no_proxy.is_empty()
                    && p.ca_bundle.is_empty())
                {
                    cfg.proxy = Some(p.clone());
                }
                cfg.customized_variables = adc.spec.customized_variables.clone();
                spec_hash(&adc.spec)
            }
            Some((ConfigKind::ManagedProxyConfiguration, k)) => {
                let Some(mpc) = cache.proxy_config(store, &k).await? else {
                    continue;
                };
                cfg.replicas = mpc.spec.proxy_agent.replicas.max(1);
                cfg.keepalive = mpc.spec.proxy_agent.keepalive.clone();
                entrypoints = mpc.spec.proxy_server.entrypoints.clone();
                spec_hash(&mpc.spec)
            }
            None => continue,
        };
        cfg.config_hashes.push(AppliedConfig {
            group: r.group.clone(),
            resource: r.resource.clone(),
            namespace: r.namespace.clone(),
            name: r.name.clone(),
            spec_hash: hash,
        });
    }
    // The broker watcher's listing of at most BROKER_CHECK_INTERVAL ago (it notifies every
    // agent after it saw the set change); before its first listing, one of our own.
    let now = ctx.clock.now();
    let serving = match cache.brokers() {
        Some(all) => brokers::listed_among(all, now),
        None => brokers::listed_brokers(store, now).await?,
    };
    cfg.brokers = brokers::agent_endpoints(serving, &entrypoints);
    Ok(AddOnAgentConfigReply {
        installed: true,
        message: String::new(),
        config: Some(cfg),
    })
}

fn csr_reply(csr: &CertificateSigningRequest) -> CsrReply {
    CsrReply {
        csr_name: csr.metadata.name.clone(),
        phase: csr.phase(),
        certificate: csr.status.certificate.clone(),
        message: match csr.phase() {
            CsrPhase::Issued => "issued".into(),
            CsrPhase::Denied => "denied".into(),
            _ => "pending".into(),
        },
    }
}

/// Why an add-on CSR is refused (the message goes back in `Tether-Error`).
#[derive(Debug, thiserror::Error)]
pub enum DeliveryError {
    #[error("{0}")]
    Rejected(String),
    #[error(transparent)]
    Control(#[from] ControlError),
    #[error("subject {0} names no cluster/add-on")]
    Subject(String),
    #[error("malformed add-on {what}: {source}")]
    Malformed {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("signing the add-on certificate: {0}")]
    Sign(#[source] tether_pki::PkiError),
    #[error("encoding the reply: {0}")]
    Encode(#[source] serde_json::Error),
}

fn reject<T>(
    ctx: &Registration<impl Store>,
    reason: &'static str,
    msg: String,
) -> Result<T, DeliveryError> {
    ctx.metrics
        .csrs_denied_total
        .with_label_values(&[reason])
        .inc();
    Err(DeliveryError::Rejected(msg))
}

/// Checks an add-on CSR (subject, signature, cluster accepted, add-on installed) and signs it.
pub async fn submit_addon_csr(
    ctx: &Registration<impl Store>,
    cluster: &str,
    addon: &str,
    req: CsrSubmit,
) -> Result<CsrReply, DeliveryError> {
    if req.cluster_name != cluster {
        return reject(
            ctx,
            "subject",
            format!(
                "clusterName {:?} does not match the subject's cluster {cluster:?}",
                req.cluster_name
            ),
        );
    }
    if !tether_pki::subject::is_agent_name(&req.agent_name) {
        return reject(
            ctx,
            "subject",
            format!("agentName {:?} must be 1-64 of [a-z0-9-]", req.agent_name),
        );
    }
    let parsed = match tether_pki::parse_csr(&req.csr) {
        Ok(p) => p,
        Err(e) => return reject(ctx, "invalid", e.to_string()),
    };
    let want_cn = addons::addon_agent_common_name(cluster, addon, &req.agent_name);
    let mut want_o = addons::addon_agent_organizations(cluster, addon);
    let mut have_o = parsed.organizations.clone();
    want_o.sort();
    have_o.sort();
    if parsed.common_name != want_cn || want_o != have_o {
        let msg = format!(
            "add-on CSR subject must be CN={want_cn:?} O={want_o:?}, not CN={:?} O={:?}",
            parsed.common_name, parsed.organizations
        );
        event(
            ctx,
            Event::new(
                ManagedClusterAddOn::KIND,
                &addon_key(cluster, addon),
                "Warning",
                "CSRRejected",
                msg.clone(),
            ),
        )
        .await;
        return reject(ctx, "subject", msg);
    }
    match ctx.cluster(cluster).await {
        Ok(Some(mc)) if mc.spec.hub_accepts_client => {}
        Ok(_) => {
            return reject(
                ctx,
                "not_accepted",
                format!("cluster {cluster} is not accepted by the hub"),
            );
        }
        Err(e) => return Err(DeliveryError::Rejected(e.to_string())),
    }
    if ctx
        .store
        .get::<serde_json::Value>(Bucket::ManagedClusterAddOns, &addon_key(cluster, addon))
        .await?
        .is_none()
    {
        return reject(
            ctx,
            "not_installed",
            format!("add-on {addon} is not installed on cluster {cluster}"),
        );
    }
    let name = format!("{cluster}-{addon}-{}", &parsed.key_fingerprint[..16]);
    let key = format!("{cluster}.{name}");
    let previous = ctx
        .store
        .get::<CertificateSigningRequest>(Bucket::Csrs, &key)
        .await?;
    if let Some((csr, _)) = &previous
        && csr.phase() == CsrPhase::Issued
    {
        return Ok(csr_reply(csr));
    }
    let lifetime = ctx.policy.client_cert_lifetime;
    let (csr_pem, c, a, agent) = (
        req.csr.clone(),
        cluster.to_owned(),
        addon.to_owned(),
        req.agent_name.clone(),
    );
    let cert = crate::signing::with_ca(&ctx.ca, move |ca| {
        sign_addon_csr(ca, &csr_pem, &c, &a, &agent, lifetime)
    })
    .await?;
    let mut meta = ObjectMeta::new(&name);
    meta.labels.insert(
        CertificateSigningRequest::CLUSTER_LABEL.into(),
        cluster.into(),
    );
    meta.labels.insert(ADDON_LABEL.into(), addon.into());
    let mut csr = CertificateSigningRequest {
        api_version: CertificateSigningRequest::API_VERSION.into(),
        kind: CertificateSigningRequest::KIND.into(),
        metadata: meta,
        spec: CsrSpec {
            request: req.csr.clone(),
            signer_name: tether_pki::subject::SIGNER_NAME.into(),
            usages: vec!["digital signature".into(), "client auth".into()],
            username: tether_pki::subject::common_name(cluster, &req.agent_name),
            expiration_seconds: Some(lifetime.as_secs()),
        },
        status: CsrStatus::default(),
    };
    set_condition(
        &mut csr.status.conditions,
        "Approved",
        "True",
        "AddOnCSRAutoApproved",
        "add-on installed on an accepted cluster",
    );
    csr.status.certificate = cert;
    // Compare-and-swap: when two hub replicas sign the same request at once, one certificate
    // is stored and both answer with it (the other signature is thrown away, never handed out).
    let stored = match previous {
        Some((_, revision)) => ctx.store.update(Bucket::Csrs, &key, &csr, revision).await?,
        None => ctx.store.create(Bucket::Csrs, &key, &csr).await?,
    };
    if stored.is_none() {
        ctx.metrics.csr_sign_conflicts_total.inc();
        return match ctx
            .store
            .get::<CertificateSigningRequest>(Bucket::Csrs, &key)
            .await?
        {
            Some((winner, _)) if winner.phase() == CsrPhase::Issued => Ok(csr_reply(&winner)),
            _ => Err(DeliveryError::Rejected(format!(
                "CSR {name} of cluster {cluster} changed while it was being signed; retry"
            ))),
        };
    }
    ctx.metrics
        .csrs_signed_total
        .with_label_values(&["addon"])
        .inc();
    tracing::info!(%cluster, %addon, agent = %req.agent_name, csr = %name, "add-on certificate signed");
    event(
        ctx,
        Event::new(
            CertificateSigningRequest::KIND,
            &name,
            "Normal",
            "CSRApproved",
            format!("signed the {addon} add-on client certificate of cluster {cluster}"),
        ),
    )
    .await;
    Ok(csr_reply(&csr))
}

/// Status of an add-on CSR.
pub async fn get_addon_csr(
    ctx: &Registration<impl Store>,
    cluster: &str,
    addon: &str,
    req: CsrGet,
) -> Result<CsrReply, DeliveryError> {
    if !req.csr_name.starts_with(&format!("{cluster}-{addon}-")) {
        return Err(DeliveryError::Rejected(format!(
            "CSR {} is not an add-on {addon} CSR of cluster {cluster}",
            req.csr_name
        )));
    }
    match ctx
        .store
        .get::<CertificateSigningRequest>(Bucket::Csrs, &format!("{cluster}.{}", req.csr_name))
        .await?
    {
        Some((csr, _)) => Ok(csr_reply(&csr)),
        None => Err(DeliveryError::Rejected(format!(
            "CSR {} of cluster {cluster} not found",
            req.csr_name
        ))),
    }
}

/// Signs an add-on CSR: the hub sets subject (OCM's add-on CN and organisations), client-auth
/// usage and lifetime; only the public key comes from the request.
pub fn sign_addon_csr(
    ca: &tether_pki::HubCa,
    csr_pem: &str,
    cluster: &str,
    addon: &str,
    agent: &str,
    lifetime: Duration,
) -> Result<String, DeliveryError> {
    ca.sign_csr_as(
        csr_pem,
        &addons::addon_agent_common_name(cluster, addon, agent),
        &addons::addon_agent_organizations(cluster, addon),
        lifetime,
    )
    .map_err(DeliveryError::Sign)
}

async fn event(ctx: &Registration<impl Store>, ev: Event) {
    if let Err(e) = ctx.store.publish_event(&ev).await {
        tracing::warn!(error = %e, reason = %ev.reason, "cannot publish event");
    }
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Config,
    Csr,
    CsrGet,
}

async fn serve(
    ctx: &HubCtx,
    kind: Kind,
    msg: &async_nats::Message,
) -> Result<serde_json::Value, DeliveryError> {
    let (Some(cluster), Some(addon)) = (
        subjects::cluster_of(&msg.subject),
        subjects::addon_of(&msg.subject),
    ) else {
        return Err(DeliveryError::Subject(msg.subject.to_string()));
    };
    let span = tracing::info_span!("addon.delivery", %cluster, %addon, kind = ?kind);
    tracing::Instrument::instrument(serve_in(ctx, kind, msg, cluster, addon), span).await
}

async fn serve_in(
    ctx: &HubCtx,
    kind: Kind,
    msg: &async_nats::Message,
    cluster: &str,
    addon: &str,
) -> Result<serde_json::Value, DeliveryError> {
    let malformed = |what| move |source| DeliveryError::Malformed { what, source };
    let to_json = |v: Result<CsrReply, DeliveryError>| {
        v.and_then(|r| serde_json::to_value(r).map_err(DeliveryError::Encode))
    };
    match kind {
        Kind::Config => {
            let req: AddOnAgentConfigRequest = if msg.payload.is_empty() {
                Default::default()
            } else {
                serde_json::from_slice(&msg.payload).map_err(malformed("config request"))?
            };
            tracing::debug!(agent = %req.agent_name, "add-on config requested");
            let r = agent_config(&ctx.registration, cluster, addon).await?;
            serde_json::to_value(r).map_err(DeliveryError::Encode)
        }
        Kind::Csr => {
            let body: CsrSubmit =
                serde_json::from_slice(&msg.payload).map_err(malformed("CSR body"))?;
            to_json(submit_addon_csr(&ctx.registration, cluster, addon, body).await)
        }
        Kind::CsrGet => {
            let body: CsrGet =
                serde_json::from_slice(&msg.payload).map_err(malformed("CSR get body"))?;
            to_json(get_addon_csr(&ctx.registration, cluster, addon, body).await)
        }
    }
}

/// Serves the delivery subjects and watches the broker set. Returns the tasks.
pub async fn start(
    client: async_nats::Client,
    ctx: Arc<HubCtx>,
    controller: Addr<AddOnController>,
    shutdown: CancellationToken,
) -> Result<Vec<tokio::task::JoinHandle<()>>, crate::ManagerError> {
    let served_ctx = ctx.clone();
    let mut handles = crate::serve::serve_subjects(
        &client,
        QUEUE_GROUP,
        [
            (subjects::CLUSTER_ADDON_CONFIG_ALL, Kind::Config),
            (subjects::CLUSTER_ADDON_CSR_ALL, Kind::Csr),
            (subjects::CLUSTER_ADDON_CSR_GET_ALL, Kind::CsrGet),
        ],
        MAX_INFLIGHT_DELIVERY,
        "add-on delivery",
        &shutdown,
        move |kind, msg| {
            let ctx = served_ctx.clone();
            async move {
                let r = serve(&ctx, kind, &msg).await;
                let label = match kind {
                    Kind::Config => "addon.config",
                    Kind::Csr => "addon.csr",
                    Kind::CsrGet => "addon.csr.get",
                };
                ctx.metrics
                    .requests_total
                    .with_label_values(&[label, if r.is_ok() { "ok" } else { "error" }])
                    .inc();
                r.map(|v| Some(bytes::Bytes::from(v.to_string())))
                    .map_err(|e| e.to_string())
            }
        },
    )
    .await?;
    // The broker set: notify every installed add-on and re-evaluate Available when it changes.
    let stop = shutdown.clone();
    handles.push(tokio::spawn(async move {
        let mut set = brokers::BrokerSet::default();
        let mut holders = brokers::TunnelHolders::default();
        let mut tick = tokio::time::interval(BROKER_CHECK_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            let announced = match brokers::announced(&ctx.store).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(error = %e, "cannot read broker presence");
                    continue;
                }
            };
            // Config requests read this listing (before any agent is notified of a change).
            ctx.addon_cache.set_brokers(announced.clone());
            let now = SystemTime::now();
            // Available: the serving brokers and the tunnels they report.
            let serving = brokers::select(announced.iter().cloned(), |b| b.is_serving(now));
            match holders.observe(&serving) {
                None => {}
                Some(brokers::HoldersChange::All) => {
                    let _ = controller.send(Changed).await;
                }
                Some(brokers::HoldersChange::Clusters(c)) => {
                    tracing::debug!(clusters = ?c, "tunnel holders changed");
                    let _ = controller.send(ClustersChanged(c)).await;
                }
            }
            // The agents' config: the listed brokers.
            let listed = brokers::listed_among(announced, now);
            let Some(change) = set.observe(listed) else {
                continue;
            };
            let first = change.first;
            ctx.metrics.serving_brokers.set(change.ids.len() as i64);
            tracing::info!(brokers = ?change.ids, "serving broker set changed");
            let _ = controller.send(Changed).await;
            if first {
                continue; // agents re-read their config periodically anyway
            }
            match ctx.store.keys(Bucket::ManagedClusterAddOns).await {
                Ok(keys) => {
                    for k in keys {
                        if let Some((cluster, addon)) = k.split_once('.') {
                            crate::notify::config_changed(&client, cluster, addon).await;
                            ctx.metrics.addon_notifications_total.inc();
                        }
                    }
                }
                Err(e) => tracing::warn!(error = %e, "cannot list add-ons to notify"),
            }
        }
    }));
    Ok(handles)
}

#[cfg(test)]
mod config_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signs_with_the_addon_subject_only() {
        let ca = tether_pki::HubCa::generate("hub", Duration::from_secs(600)).unwrap();
        let kp = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut params = rcgen::CertificateParams::default();
        let mut dn = rcgen::DistinguishedName::new();
        dn.push(rcgen::DnType::CommonName, "something-else");
        params.distinguished_name = dn;
        let csr = params.serialize_request(&kp).unwrap().pem().unwrap();
        let pem = sign_addon_csr(
            &ca,
            &csr,
            "c1",
            "cluster-proxy",
            "a1",
            Duration::from_secs(300),
        )
        .unwrap();
        let info = tether_pki::CertInfo::from_pem(&pem).unwrap();
        assert_eq!(
            info.common_name,
            "system:open-cluster-management:cluster:c1:addon:cluster-proxy:agent:a1"
        );
        assert_eq!(info.organizations.len(), 2);
        assert_eq!(info.public_key_raw, kp.public_key_raw());
        let der = tether_pki::pem_certificates(&pem).remove(0);
        tether_pki::verify_issued_by(der.as_ref(), ca.cert_pem(), SystemTime::now()).unwrap();
        assert_eq!(
            tether_tls::Identity::from_certificate(&der).unwrap(),
            tether_tls::Identity::tunnel_agent("c1", "a1")
        );
    }
}
