//! Request/reply subjects served by the addon-manager: one queue subscription per subject (so
//! several replicas share the work), a bounded number of requests in flight per subject, and the
//! error reply every client expects — `{"error": "<reason>"}` with the reason also in the
//! `ERROR_HEADER` header.

use std::future::Future;

use futures::StreamExt;
use tether_control::connect::ERROR_HEADER;
use tokio_util::sync::CancellationToken;

use crate::ManagerError;

/// What a handler answers: the reply body (`None`: publish nothing, e.g. an auth-callout
/// request that was not understood), or the reason the request was refused — the text every
/// client reads from the error reply.
pub type Answer = Result<Option<bytes::Bytes>, String>;

/// Subscribes to every `(subject, kind)` of `table` in queue group `queue` and runs `handler`
/// for each message, at most `max_inflight` at once per subject, until `shutdown`. The answer is
/// published to the message's reply subject, if it has one. `what` names the subjects in logs.
pub async fn serve_subjects<K, H, Fut>(
    client: &async_nats::Client,
    queue: &'static str,
    table: impl IntoIterator<Item = (&'static str, K)>,
    max_inflight: usize,
    what: &'static str,
    shutdown: &CancellationToken,
    handler: H,
) -> Result<Vec<tokio::task::JoinHandle<()>>, ManagerError>
where
    K: Copy + Send + Sync + 'static,
    H: Fn(K, async_nats::Message) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Answer> + Send + 'static,
{
    let mut handles = Vec::new();
    for (subject, kind) in table {
        let sub = client
            .queue_subscribe(subject, queue.to_string())
            .await
            .map_err(|e| ManagerError::Subscribe {
                subject: subject.into(),
                reason: e.to_string(),
            })?;
        let stop = shutdown.clone();
        let client = client.clone();
        let handler = handler.clone();
        handles.push(tokio::spawn(async move {
            let work = sub.for_each_concurrent(max_inflight, |msg| {
                let client = client.clone();
                let handler = handler.clone();
                async move {
                    let reply = msg.reply.clone();
                    let request_subject = msg.subject.clone();
                    let answer = handler(kind, msg).await;
                    let Some(reply) = reply else { return };
                    let res = match answer {
                        Ok(Some(body)) => client.publish(reply, body).await,
                        Ok(None) => Ok(()),
                        Err(e) => {
                            tracing::info!(subject = %request_subject, error = %e, "{what} request refused");
                            client.publish_with_headers(reply, error_headers(&e), error_body(&e)).await
                        }
                    };
                    if let Err(e) = res {
                        tracing::debug!(error = %e, "cannot publish reply");
                    }
                }
            });
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = work => tracing::warn!(subject, "{what} subscription ended"),
            }
        }));
    }
    Ok(handles)
}

fn error_headers(reason: &str) -> async_nats::HeaderMap {
    let mut h = async_nats::HeaderMap::new();
    h.insert(ERROR_HEADER, reason.replace(['\r', '\n'], " ").as_str());
    h
}

fn error_body(reason: &str) -> bytes::Bytes {
    serde_json::json!({ "error": reason }).to_string().into()
}

#[cfg(test)]
mod tests {
    #[test]
    fn error_replies_name_the_reason_on_one_line() {
        let h = super::error_headers("bad\r\nthing");
        assert_eq!(
            h.get(tether_control::connect::ERROR_HEADER)
                .map(|v| v.as_str()),
            Some("bad  thing")
        );
        let body: serde_json::Value = serde_json::from_slice(&super::error_body("x")).unwrap();
        assert_eq!(body["error"], "x");
    }
}
