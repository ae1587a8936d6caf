//! `tetherctl events [--watch]`: the latest events, then (with `--watch`) every new one as it
//! arrives, from a JetStream consumer on `TETHER_EVENTS`.
//!
//! Without `--durable` the consumer is ephemeral and starts with new events (after printing
//! the last `--limit`). With `--durable NAME` it is a durable pull consumer: a later
//! `--watch --durable NAME` resumes after the last event it acknowledged, so nothing is missed
//! between runs. Output: a table row per event, or one JSON object per line (`-o json`), or
//! YAML documents (`-o yaml`).

use std::time::Duration;

use anyhow::Context;
use async_nats::jetstream::consumer::{self, DeliverPolicy};
use futures::StreamExt as _;
use tether_control::resources::Event;
use tether_control::store::HubStore;
use tether_control::subjects;

use crate::ops::connect_admin;
use crate::proxy::progress;
use crate::{HubArgs, Output};

/// Events fetched per pull and held unacknowledged at most.
pub const PULL_BATCH: usize = 256;
/// A delivered event not acknowledged within this is delivered again.
pub const ACK_WAIT: Duration = Duration::from_secs(30);

#[derive(clap::Args, Debug, Clone)]
pub struct EventsArgs {
    /// Only events about this object name (e.g. a cluster).
    pub name: Option<String>,
    /// Keep printing events as they arrive.
    #[arg(short = 'w', long)]
    pub watch: bool,
    /// With --watch: a durable consumer of this name (resumes where it stopped).
    #[arg(long, requires = "watch")]
    pub durable: Option<String>,
    /// Only subjects matching this filter (default tether.v1.events.>; e.g.
    /// tether.v1.events.health.>).
    #[arg(long, default_value = subjects::EVENTS_ALL)]
    pub subject: String,
    /// Events printed before watching (or in all, without --watch).
    #[arg(long, default_value_t = 20)]
    pub limit: usize,
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    pub output: Output,
    #[command(flatten)]
    pub hub: HubArgs,
}

struct Printer {
    output: Output,
    header: bool,
}

impl Printer {
    fn print(&mut self, e: &Event) -> anyhow::Result<()> {
        match self.output {
            Output::Json => println!("{}", serde_json::to_string(e)?),
            Output::Yaml => print!("---\n{}", serde_saphyr::to_string(e)?),
            Output::Table | Output::Wide => {
                if !self.header {
                    println!(
                        "{:<21} {:<8} {:<32} {:<40} MESSAGE",
                        "TIME", "TYPE", "REASON", "OBJECT"
                    );
                    self.header = true;
                }
                println!(
                    "{:<21} {:<8} {:<32} {:<40} {}",
                    e.event_time,
                    e.type_,
                    e.reason,
                    crate::ops::object_ref(e),
                    e.message
                );
            }
        }
        use std::io::Write as _;
        std::io::stdout().flush()?;
        Ok(())
    }
}

pub async fn events(a: &EventsArgs) -> anyhow::Result<()> {
    let (_, conn) = progress("connecting to hub NATS", connect_admin(&a.hub)).await?;
    let store = HubStore::open(conn.client.clone()).await?;
    let mut printer = Printer {
        output: a.output,
        header: false,
    };
    let wanted = |e: &Event| {
        a.name
            .as_deref()
            .is_none_or(|n| e.involved_object.name == n)
    };
    if a.durable.is_none() {
        for e in recent(&store, a).await? {
            printer.print(&e)?;
        }
    }
    if !a.watch {
        return Ok(());
    }
    let stream = store
        .jetstream()
        .get_stream(subjects::STREAM_EVENTS)
        .await
        .context("events stream")?;
    let cfg = consumer::pull::Config {
        durable_name: a.durable.clone(),
        deliver_policy: if a.durable.is_some() {
            DeliverPolicy::All
        } else {
            DeliverPolicy::New
        },
        filter_subject: a.subject.clone(),
        ack_wait: ACK_WAIT,
        max_ack_pending: PULL_BATCH as i64,
        inactive_threshold: if a.durable.is_some() {
            Duration::ZERO
        } else {
            Duration::from_secs(60)
        },
        ..Default::default()
    };
    let consumer = match &a.durable {
        Some(name) => stream.get_or_create_consumer(name, cfg).await,
        None => stream.create_consumer(cfg).await,
    }
    .context("creating the events consumer")?;
    let mut messages = consumer
        .stream()
        .max_messages_per_batch(PULL_BATCH)
        .messages()
        .await
        .context("consuming events")?;
    eprintln!(
        "watching {} ({}; Ctrl-C to stop)",
        a.subject,
        match &a.durable {
            Some(d) => format!("durable consumer {d}"),
            None => "new events".to_string(),
        }
    );
    loop {
        let next = tokio::select! {
            m = messages.next() => m,
            _ = tokio::signal::ctrl_c() => return Ok(()),
        };
        let Some(msg) = next else {
            anyhow::bail!("the events consumer ended");
        };
        let msg = msg.map_err(|e| anyhow::anyhow!("events: {e}"))?;
        match serde_json::from_slice::<Event>(&msg.payload) {
            Ok(e) if wanted(&e) => printer.print(&e)?,
            Ok(_) => {}
            Err(e) => eprintln!("skipping an undecodable event on {}: {e}", msg.subject),
        }
        msg.ack()
            .await
            .map_err(|e| anyhow::anyhow!("acknowledging an event: {e}"))?;
    }
}

/// The last `--limit` events matching the name and subject filter (newest last).
async fn recent(store: &HubStore, a: &EventsArgs) -> anyhow::Result<Vec<Event>> {
    let stream = store
        .jetstream()
        .get_stream(subjects::STREAM_EVENTS)
        .await
        .context("events stream")?;
    let info = stream.get_info().await.context("events stream info")?;
    let (first, mut seq) = (info.state.first_sequence, info.state.last_sequence);
    let mut out = Vec::new();
    while seq >= first && seq > 0 && out.len() < a.limit {
        if let Ok(m) = stream.get_raw_message(seq).await
            && subject_matches(&a.subject, &m.subject)
            && let Ok(e) = serde_json::from_slice::<Event>(&m.payload)
            && a.name
                .as_deref()
                .is_none_or(|n| e.involved_object.name == n)
        {
            out.push(e);
        }
        seq -= 1;
    }
    out.reverse();
    Ok(out)
}

/// NATS subject matching (`*` one token, `>` the rest).
pub fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut f = filter.split('.');
    let mut s = subject.split('.');
    loop {
        match (f.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn subjects_match() {
        use super::subject_matches as m;
        assert!(m("tether.v1.events.>", "tether.v1.events.health.c1"));
        assert!(m("tether.v1.events.*.c1", "tether.v1.events.health.c1"));
        assert!(!m(
            "tether.v1.events.health.>",
            "tether.v1.events.managedcluster.c1"
        ));
        assert!(!m("a.b", "a.b.c"));
    }
}
