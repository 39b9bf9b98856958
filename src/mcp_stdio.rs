//! `kernel-broker mcp --url URL --token TOKEN`: MCP over stdio for hosts that only launch
//! stdio servers (Claude Desktop and most agent frameworks), relayed to a running broker's
//! `/mcp` (Streamable HTTP). The host's session is an MCP session of the broker like any
//! other: the same tools, the same user, the same sessions.
//!
//! Both ends are the official SDK's (`rmcp`) transports, so nothing of the protocol is
//! written here: newline-delimited JSON-RPC on stdin/stdout (`AsyncRwTransport`), and the
//! Streamable HTTP client (`StreamableHttpClientTransport`: `Mcp-Session-Id`, SSE streams,
//! reconnection with `Last-Event-ID`, the `DELETE` at the end). This file only pumps
//! messages between them: what the host sends goes to the broker, what the broker sends
//! (results, progress notifications) goes to the host. Sends run concurrently, as rmcp's own
//! service loop runs them, so a long tool call does not hold up the next message.
//! A message the broker could not be sent answers the host's request with a JSON-RPC error,
//! so the host never waits for an answer that cannot come. Logs go to stderr only: stdout
//! is the protocol.

use std::collections::HashSet;

use rmcp::model::{ClientRequest, ErrorData, JsonRpcMessage, RequestId, ServerJsonRpcMessage};
use rmcp::transport::async_rw::AsyncRwTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::{StreamableHttpClientTransport, Transport};
use rmcp::RoleServer;
use tokio::task::JoinSet;

/// How long the relay waits, once one side is done, for what is still in flight.
const CLOSE_WITHIN: std::time::Duration = std::time::Duration::from_secs(5);

/// Why the relay stopped other than the host closing stdin.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("cannot write to stdout: {0}")]
    Stdout(std::io::Error),
    #[error("--url must be the broker's http:// address (e.g. http://127.0.0.1:8888), not {0:?}")]
    Url(String),
    /// rmcp's client gave up: the broker is not there, refused the token (401), or ended
    /// the session; the reason is in the log line before.
    #[error("the broker at {0} ended the MCP session or could not be reached (is it running? is the token right?)")]
    BrokerGone(String),
}

/// The broker's `/mcp` endpoint for `--url`: the broker's address, with or without `/mcp`.
pub fn endpoint(url: &str) -> Result<String, RelayError> {
    let url = url.trim().trim_end_matches('/');
    if !url.starts_with("http://") {
        // The relay's HTTP client is built without TLS (the broker serves plain HTTP).
        return Err(RelayError::Url(url.to_string()));
    }
    Ok(if url.ends_with("/mcp") {
        url.to_string()
    } else {
        format!("{url}/mcp")
    })
}

/// Relay stdin/stdout to the broker at `url` as the user of `token`, until the host closes
/// stdin or the broker's side ends.
pub async fn relay(url: &str, token: &str) -> Result<(), RelayError> {
    let endpoint = endpoint(url)?;
    tracing::info!(%endpoint, "relaying MCP between stdio and the broker");
    let mut broker = StreamableHttpClientTransport::from_config(
        StreamableHttpClientTransportConfig::with_uri(endpoint.as_str()).auth_header(token),
    );
    let (stdin, stdout) = rmcp::transport::stdio();
    let mut host = AsyncRwTransport::<RoleServer, _, _>::new_server(stdin, stdout);
    // Sends to the broker in flight; a failed one ends with the error answer it owes the
    // host, and whether it was the `initialize`.
    let mut sends: JoinSet<Option<(ServerJsonRpcMessage, bool)>> = JoinSet::new();
    // The host's requests the broker has not answered yet.
    let mut pending: HashSet<RequestId> = HashSet::new();
    let outcome = loop {
        tokio::select! {
            from_host = host.receive() => {
                let Some(message) = from_host else {
                    // The host is done. What it sent last may still be on its way: wait for
                    // those sends (bounded); one the broker did not take is answered with its
                    // error, and the relay then says the broker is gone rather than
                    // exiting 0 as if all went well.
                    if answer_failed_sends(&mut sends, &mut host, &mut pending).await {
                        break Err(RelayError::BrokerGone(endpoint.clone()));
                    }
                    // The answers the broker still owes to the host's requests are relayed
                    // for a while (a host that wrote a request and closed stdin at once,
                    // `echo ... | kernel-broker mcp`, gets its answer).
                    let deadline = tokio::time::Instant::now() + CLOSE_WITHIN;
                    while !pending.is_empty() {
                        let Ok(Some(message)) = tokio::time::timeout_at(deadline, broker.receive()).await else {
                            break;
                        };
                        settle(&mut pending, &message);
                        if host.send(message).await.is_err() {
                            break;
                        }
                    }
                    break Ok(());
                };
                let (request_id, initialize) = match &message {
                    JsonRpcMessage::Request(r) => (
                        Some(r.id.clone()),
                        matches!(r.request, ClientRequest::InitializeRequest(_)),
                    ),
                    _ => (None, false),
                };
                if let Some(id) = &request_id {
                    pending.insert(id.clone());
                }
                let send = broker.send(message);
                sends.spawn(async move {
                    let error = send.await.err()?;
                    tracing::warn!(%error, "cannot send a message to the broker");
                    // A notification is owed no answer.
                    let answer = ServerJsonRpcMessage::error(
                        ErrorData::internal_error(format!("kernel-broker mcp: the broker did not take the message: {error}"), None),
                        Some(request_id?),
                    );
                    Some((answer, initialize))
                });
            }
            from_broker = broker.receive() => {
                let Some(message) = from_broker else {
                    // The client gave up: the sends still in flight fail at once; the host
                    // gets their error answers before the relay stops (bounded, in case one
                    // does not).
                    answer_failed_sends(&mut sends, &mut host, &mut pending).await;
                    break Err(RelayError::BrokerGone(endpoint.clone()));
                };
                settle(&mut pending, &message);
                if let Err(e) = host.send(message).await {
                    break Err(RelayError::Stdout(e));
                }
            }
            Some(done) = sends.join_next(), if !sends.is_empty() => {
                if let Ok(Some((answer, initialize))) = done {
                    settle(&mut pending, &answer);
                    if let Err(e) = host.send(answer).await {
                        break Err(RelayError::Stdout(e));
                    }
                    // Without a session (a refused token, no broker) nothing can follow.
                    if initialize {
                        break Err(RelayError::BrokerGone(endpoint.clone()));
                    }
                }
            }
        }
    };
    sends.abort_all();
    // Ends the MCP session at the broker (rmcp's client sends the DELETE), so the session
    // it made for this host is deleted now rather than at its idle timeout.
    // Bounded: a broker that does not answer the DELETE must not keep the host waiting for
    // the relay to exit.
    match tokio::time::timeout(CLOSE_WITHIN, broker.close()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(error = %e, "closing the broker's side"),
        Err(_) => tracing::warn!("the broker did not end the MCP session in time; exiting"),
    }
    let _ = tokio::time::timeout(CLOSE_WITHIN, host.close()).await;
    outcome
}

/// Waits (at most [`CLOSE_WITHIN`]) for the sends to the broker still in flight; each the
/// broker did not take is answered to the host with its error. Whether any failed.
async fn answer_failed_sends<T: Transport<RoleServer>>(
    sends: &mut JoinSet<Option<(ServerJsonRpcMessage, bool)>>,
    host: &mut T,
    pending: &mut HashSet<RequestId>,
) -> bool {
    let mut failed = false;
    let drain = async {
        while let Some(done) = sends.join_next().await {
            if let Ok(Some((answer, _))) = done {
                failed = true;
                settle(pending, &answer);
                let _ = host.send(answer).await;
            }
        }
    };
    let _ = tokio::time::timeout(CLOSE_WITHIN, drain).await;
    failed
}

/// Takes the request an answer of the broker's (or the relay's) settles off `pending`.
fn settle(pending: &mut HashSet<RequestId>, message: &ServerJsonRpcMessage) {
    match message {
        JsonRpcMessage::Response(r) => {
            pending.remove(&r.id);
        }
        JsonRpcMessage::Error(e) => {
            if let Some(id) = &e.id {
                pending.remove(id);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(
            endpoint("http://127.0.0.1:8888").unwrap(),
            "http://127.0.0.1:8888/mcp"
        );
        assert_eq!(endpoint("http://h:1/mcp/").unwrap(), "http://h:1/mcp");
        assert_eq!(endpoint(" http://h:1/ ").unwrap(), "http://h:1/mcp");
        assert!(matches!(endpoint("https://h"), Err(RelayError::Url(_))));
        assert!(matches!(endpoint("h:1"), Err(RelayError::Url(_))));
    }
}
