//! The hub context the NATS adapters share: the [`Registration`] logic on the JetStream store,
//! plus what only the adapters need (the NATS client for notifications, the auth-callout
//! issuer). It dereferences to [`Registration`], so handlers call the registration logic
//! directly; what touches NATS (watch tasks, the `Denied` notification) lives here.

use std::sync::Arc;

use futures::StreamExt;
use tether_control::hub::RegistrationPolicy;
use tether_control::resources::{AdminClusterRequest, BootstrapTokenRecord, Lease, ManagedCluster};
use tether_control::store::{Bucket, HubStore};
use tether_control::subjects;
use tether_pki::HubCa;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
pub use crate::registration::{
    DENIED_ANNOTATION, HubError, LeaseState, REVOKED_BEFORE_ANNOTATION, Registration, has_condition,
};

/// Shared hub state; cheap to share behind an `Arc`.
pub struct HubCtx {
    pub registration: Registration<HubStore>,
    pub client: async_nats::Client,
    pub issuer: tether_control::auth::CalloutIssuer,
}

impl std::fmt::Debug for HubCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubCtx").finish_non_exhaustive()
    }
}

impl std::ops::Deref for HubCtx {
    type Target = Registration<HubStore>;
    fn deref(&self) -> &Self::Target {
        &self.registration
    }
}

impl HubCtx {
    pub fn new(
        store: HubStore,
        client: async_nats::Client,
        ca: HubCa,
        issuer: tether_control::auth::CalloutIssuer,
        policy: RegistrationPolicy,
        metrics: Metrics,
    ) -> Self {
        Self {
            registration: Registration::new(
                store,
                tether_control::clock::system(),
                ca,
                policy,
                metrics,
            ),
            client,
            issuer,
        }
    }

    /// Keeps the caches and the lease table in step with KV (other replicas, `tetherctl token
    /// create`): one task of `tasks` per watched bucket, each ending on `stop` or when the
    /// context is dropped.
    pub async fn start_watches(
        self: &Arc<Self>,
        tasks: &tether_runtime::Drain,
        stop: &CancellationToken,
    ) -> Result<(), HubError> {
        let clusters = self.store.watch::<ManagedCluster>(Bucket::Clusters).await?;
        let leases = self.store.watch::<Lease>(Bucket::Leases).await?;
        let tokens = self
            .store
            .watch::<BootstrapTokenRecord>(Bucket::Tokens)
            .await?;
        let me = || Arc::downgrade(self);
        tasks.spawn(
            "clusters watch",
            follow(
                me(),
                clusters,
                stop.clone(),
                Registration::apply_cluster_change,
            ),
        );
        tasks.spawn(
            "leases watch",
            follow(me(), leases, stop.clone(), Registration::apply_lease_change),
        );
        tasks.spawn(
            "tokens watch",
            follow(me(), tokens, stop.clone(), Registration::apply_token_change),
        );
        Ok(())
    }

    /// `tetherctl deny` ([`Registration::deny`]), then tells the cluster's agent at once.
    pub async fn deny(&self, req: AdminClusterRequest) -> Result<ManagedCluster, HubError> {
        let name = req.cluster_name.clone();
        let mc = self.registration.deny(req).await?;
        let _ = self
            .client
            .publish(
                subjects::cluster_notify(&name),
                r#"{"type":"Denied"}"#.into(),
            )
            .await;
        Ok(mc)
    }
}

/// Applies every change of `changes` to the context until `stop`, the end of the watch, or the
/// context being dropped.
async fn follow<T>(
    me: std::sync::Weak<HubCtx>,
    changes: impl futures::Stream<Item = (String, Option<T>)>,
    stop: CancellationToken,
    apply: fn(&Registration<HubStore>, String, Option<T>),
) {
    let mut changes = std::pin::pin!(changes);
    loop {
        let (k, v) = tokio::select! {
            _ = stop.cancelled() => return,
            c = changes.next() => match c {
                Some(c) => c,
                None => return,
            },
        };
        let Some(ctx) = me.upgrade() else { return };
        apply(&ctx, k, v);
    }
}
