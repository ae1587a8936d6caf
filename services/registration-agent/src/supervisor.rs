//! The actor that owns one cluster's registration loop.
//!
//! It starts [`Agent::run`] as a task bound to a child cancellation token, keeps the latest
//! [`Phase`] from the agent's `watch`, and answers [`GetPhase`]. Stopping the actor (or
//! cancelling the parent token) stops the loop.

use actix::prelude::*;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::agent::{Agent, Phase};
use crate::secret::HubSecretStore;

/// Query the agent's current phase.
#[derive(Message)]
#[rtype(result = "Phase")]
pub struct GetPhase;

pub struct AgentSupervisor {
    cluster: String,
    phase: watch::Receiver<Phase>,
    stop: CancellationToken,
}

impl AgentSupervisor {
    /// Starts the agent loop; `stop` is the parent token (process shutdown).
    pub fn start_agent<S: HubSecretStore>(
        agent: Agent<S>,
        phase: watch::Receiver<Phase>,
        cluster: String,
        stop: &CancellationToken,
    ) -> Addr<Self> {
        let token = stop.child_token();
        let run_token = token.clone();
        tokio::spawn(async move { agent.run(run_token).await });
        Self::create(move |_| Self {
            cluster,
            phase,
            stop: token,
        })
    }
}

impl Actor for AgentSupervisor {
    type Context = Context<Self>;

    fn stopped(&mut self, _ctx: &mut Self::Context) {
        tracing::debug!(cluster = %self.cluster, "agent supervisor stopped");
        self.stop.cancel();
    }
}

impl Handler<GetPhase> for AgentSupervisor {
    type Result = MessageResult<GetPhase>;

    fn handle(&mut self, _: GetPhase, _: &mut Self::Context) -> Self::Result {
        MessageResult(self.phase.borrow().clone())
    }
}
