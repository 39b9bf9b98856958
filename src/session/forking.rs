//! Forking one connected kernel into a new one (issue 36), as a fork, a checkpoint and a
//! rewind all do: the sandbox prepares the child's directory, the kernel is sent
//! `kb_fork_request`, its reply (untrusted: bounded in size and time, one integer pid) is
//! checked, the sandbox adopts the pid (`sandbox/fork.rs`) and the child is connected.
//! Whatever fails, nothing of the child is left.

use std::borrow::Borrow;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::timeout;
use uuid::Uuid;

use super::error::SessionError;
use super::launch::{ready_kernel, Connected, Live};
use crate::kernel::{ConnectOptions, KernelClient, KernelEvent, KernelEvents};
use crate::sandbox::fork::ForkError;
use crate::sandbox::fork::PreparedFork;
use crate::sandbox::{KernelProcess, LaunchSpec, Sandbox};
use crate::wire::{Channel, Message};

/// How long the kernel may take to answer a fork request beyond the sandbox's launch
/// timeout (30 s by default, the kernel module's own limit for a child to listen).
pub(super) const FORK_REPLY_GRACE: Duration = Duration::from_secs(10);
/// The largest reply content accepted (a good one is about 40 bytes).
const MAX_REPLY_BYTES: usize = 4096;

/// Sends `process` SIGCONT (`KernelProcess::continue_stopped`) on a blocking thread, not
/// waited for: whatever it is sent meanwhile waits in its socket until it runs.
pub(crate) fn continue_beside(process: &Arc<dyn KernelProcess>) {
    let p = process.clone();
    drop(tokio::task::spawn_blocking(move || p.continue_stopped()));
}

/// How often a checkpoint asked to fork is sent SIGCONT again until it answers.
pub(crate) const CONTINUE_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// Forks `source` (a kernel nobody else reads from now: a checkpoint, or the live kernel
/// of an actor that waits for this) into a connected kernel for `spec`. `session` names
/// the session in errors.
pub(super) async fn fork_connected(
    sandbox: &Arc<dyn Sandbox>,
    options: ConnectOptions,
    session: Uuid,
    source: &mut Live,
    spec: LaunchSpec,
) -> Result<Live, SessionError> {
    let key = spec.key.clone();
    let user = spec.user.name.clone();
    // A held checkpoint's leaf move done first (`sandbox/held.rs`): the child is checked
    // to start in its parent's cgroup.
    source.process.settle().await;
    let prepared = sandbox
        .prepare_fork(&*source.process, spec)
        .await
        .map_err(|e| fork_error(session, e))?;
    let (prepared, msg_id) = send_fork_request(sandbox, session, source, prepared).await?;
    let reply = reply_while_alive(source, &msg_id);
    let ended = "the kernel ended before it answered";
    adopt_connected(
        sandbox, options, session, prepared, key, &user, reply, ended,
    )
    .await
}

/// Sends `prepared`'s `kb_fork_request` to `source`: the request and the id its answer
/// will name. If it cannot be sent, the prepared fork is given up.
pub(super) async fn send_fork_request(
    sandbox: &Arc<dyn Sandbox>,
    session: Uuid,
    source: &mut Live,
    prepared: PreparedFork,
) -> Result<(PreparedFork, String), SessionError> {
    // Not recorded: a message of the broker's to its kernel, holding a new kernel's key.
    let m = source.client.request("kb_fork_request", &prepared.request);
    if let Err(e) = source.client.send(Channel::Shell, &m).await {
        sandbox.discard_fork(prepared).await;
        return Err(SessionError::ForkFailed {
            session,
            why: "the request could not be sent to the kernel".into(),
            source: Some(Box::new(e)),
        });
    }
    Ok((prepared, m.msg_id))
}

/// Sends `prepared`'s `kb_fork_request` to `source` and waits (within the sandbox's launch
/// timeout and [`FORK_REPLY_GRACE`]) for the pid its answer names, checked as a reply; on
/// any failure the prepared fork is given up. For a child the sandbox adopts whole, not
/// connected (a held one).
pub(super) async fn requested_pid(
    sandbox: &Arc<dyn Sandbox>,
    session: Uuid,
    source: &mut Live,
    prepared: PreparedFork,
) -> Result<(PreparedFork, i64), SessionError> {
    let (prepared, msg_id) = send_fork_request(sandbox, session, source, prepared).await?;
    let limit = sandbox.launch_timeout() + FORK_REPLY_GRACE;
    let reply = reply_while_alive(source, &msg_id);
    let ended = "the kernel ended before it answered";
    match bounded_reply(session, limit, reply, ended)
        .await
        .and_then(|r| pid_of_reply(session, &r))
    {
        Ok(pid) => Ok((prepared, pid)),
        Err(e) => {
            sandbox.discard_fork(prepared).await;
            Err(e)
        }
    }
}

/// The kernel's shell answer to the request `msg_id` among its `events`; `None` once it
/// can no longer come (the kernel ended).
pub(super) async fn shell_reply(events: &mut KernelEvents, msg_id: &str) -> Option<Message> {
    loop {
        match events.recv().await {
            Some(KernelEvent::Message(Channel::Shell, r))
                if r.parent_msg_id.as_deref() == Some(msg_id) =>
            {
                return Some(r)
            }
            // Anything else (iopub status, a heartbeat missed while frozen) is not the
            // answer.
            Some(_) => {}
            None => return None,
        }
    }
}

/// [`shell_reply`], or `None` as soon as `source`'s process ends: a kernel that dies with
/// the request unread (a checkpoint its live kernel killed while it was frozen, killed as
/// it is thawed) does not always close its sockets' connections at once, and the answer
/// would be waited for to its bound.
async fn reply_while_alive(source: &mut Live, msg_id: &str) -> Option<Message> {
    let process = source.process.clone();
    tokio::select! {
        biased;
        reply = shell_reply(&mut source.events, msg_id) => reply,
        _ = process.wait() => None,
    }
}

/// The kernel's answer `reply` to a fork request, awaited for at most `limit`; `ended`
/// says why when it can no longer come.
pub(super) async fn bounded_reply<R>(
    session: Uuid,
    limit: Duration,
    reply: impl Future<Output = Option<R>>,
    ended: &str,
) -> Result<R, SessionError> {
    match timeout(limit, reply).await {
        Ok(Some(r)) => Ok(r),
        Ok(None) => Err(SessionError::ForkFailed {
            session,
            why: ended.to_string(),
            source: None,
        }),
        Err(_) => Err(SessionError::ForkTimedOut { session, limit }),
    }
}

/// The rest of a fork once `kb_fork_request` is sent for `prepared`: waits for `reply`
/// (the kernel's answer; `None` if it can no longer come, which `ended` says why), for at
/// most the sandbox's launch timeout and [`FORK_REPLY_GRACE`], while connecting to the
/// child's sockets,
/// has the sandbox adopt the pid the answer names, and returns the child connected and
/// ready. `session` names the forked session in errors; whatever fails, nothing of the
/// child is left.
///
/// The connection is begun before the child exists (it retries until the sockets are
/// bound), so the child is ready about when its pid is known and adopted instead of a
/// connection and a readiness probe later. Nothing but readiness probes reaches it before
/// then, and the connection is dropped if the fork is not adopted. Until adoption the
/// sockets' directory is the parent kernel's to write as well: a kernel, as untrusted as
/// the child will be, of the same user.
#[allow(clippy::too_many_arguments)]
pub(super) async fn adopt_connected<R: Borrow<Message>>(
    sandbox: &Arc<dyn Sandbox>,
    options: ConnectOptions,
    session: Uuid,
    prepared: PreparedFork,
    key: String,
    user: &str,
    reply: impl Future<Output = Option<R>>,
    ended: &str,
) -> Result<Live, SessionError> {
    let started = std::time::Instant::now();
    let limit = sandbox.launch_timeout() + FORK_REPLY_GRACE;
    let reply = bounded_reply(session, limit, reply, ended);
    let (endpoints, k, u) = (prepared.endpoints.clone(), key.clone(), user.to_string());
    let connect = async move { KernelClient::connect(&endpoints, &k, &u, options, limit).await };
    tokio::pin!(connect, reply);
    let mut early: Option<Connected> = None;
    let replied = loop {
        tokio::select! {
            replied = &mut reply => break replied,
            connected = &mut connect, if early.is_none() => early = Some(connected),
        }
    };
    let pid = match replied.and_then(|r| pid_of_reply(session, r.borrow())) {
        Ok(pid) => pid,
        Err(e) => {
            sandbox.discard_fork(prepared).await;
            return Err(e);
        }
    };
    let replied = started.elapsed();
    let launched = sandbox
        .adopt_fork(prepared, pid)
        .await
        .map_err(|e| fork_error(session, e))?;
    let adopted = started.elapsed();
    let connected = async move {
        match early {
            Some(connected) => connected,
            None => connect.await,
        }
    };
    // Continued while it is readied, past the first moments: a kernel of its session (its
    // parent, or its checkpoint's parent) may stop it (SIGSTOP) before it is ready, which
    // would leave the fork to wait out its bound.
    let process: Arc<dyn KernelProcess> = Arc::from(launched.process);
    let ready = ready_kernel(process.clone(), key, connected);
    tokio::pin!(ready);
    let start = tokio::time::Instant::now() + CONTINUE_EVERY;
    let mut again = tokio::time::interval_at(start, CONTINUE_EVERY);
    let readied = loop {
        tokio::select! {
            biased;
            readied = &mut ready => break readied,
            _ = again.tick() => continue_beside(&process),
        }
    };
    let live = readied.map_err(|e| SessionError::ForkFailed {
        session,
        // What ended it (the child died, a channel failed) is the caller's to see.
        why: format!("the fork did not become ready: {e}"),
        source: Some(Box::new(e)),
    })?;
    tracing::debug!(
        %session,
        replied_us = replied.as_micros() as u64,
        adopted_us = adopted.as_micros() as u64,
        ready_us = started.elapsed().as_micros() as u64,
        "forked kernel ready"
    );
    Ok(live)
}

/// The pid a `kb_fork_reply` of session `session`'s kernel names, or why it is refused.
pub(super) fn pid_of_reply(session: Uuid, m: &Message) -> Result<i64, SessionError> {
    reply_pid(m).map_err(|why| SessionError::ForkFailed {
        session,
        why,
        source: None,
    })
}

/// The pid a `kb_fork_reply` names, or why the reply is not accepted.
fn reply_pid(m: &Message) -> Result<i64, String> {
    if m.msg_type != "kb_fork_reply" {
        return Err(format!(
            "the kernel answered with a message of another type ({:.64})",
            m.msg_type
        ));
    }
    if m.content.len() > MAX_REPLY_BYTES {
        return Err(format!(
            "the kernel's reply has {} bytes; a fork reply has at most {MAX_REPLY_BYTES}",
            m.content.len()
        ));
    }
    let content: serde_json::Value = serde_json::from_slice(&m.content)
        .map_err(|_| "the kernel's reply is not JSON".to_string())?;
    let text = |key: &str| {
        let mut s = content
            .get(key)
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .to_string();
        s.truncate(s.floor_char_boundary(300));
        s
    };
    match content.get("status").and_then(|s| s.as_str()) {
        Some("ok") => content
            .get("pid")
            .and_then(serde_json::Value::as_i64)
            .ok_or_else(|| "the kernel's reply names no integer pid".to_string()),
        Some("error") => Err(format!(
            "the kernel refused: {}: {}",
            text("ename"),
            text("evalue")
        )),
        _ => Err("the kernel's reply has no status ok or error".to_string()),
    }
}

pub(super) fn fork_error(session: Uuid, e: ForkError) -> SessionError {
    match e {
        ForkError::Unsupported(why) => SessionError::ForkRefused { session, why },
        ForkError::NoRoom(why) => SessionError::NoRoomForCopy { session, why },
        e @ (ForkError::NotItsChild { .. } | ForkError::Copy(_)) => SessionError::ForkFailed {
            session,
            why: e.to_string(),
            source: None,
        },
        ForkError::Sandbox(e) => SessionError::ForkFailed {
            session,
            why: "the sandbox could not take the fork in".into(),
            source: Some(Box::new(e)),
        },
    }
}

/// A fork's error as the checkpoint operation's (a refusal stays a refusal: 409).
pub(super) fn checkpoint_failed(action: &'static str, e: SessionError) -> SessionError {
    match e {
        e @ (SessionError::ForkRefused { .. } | SessionError::KernelNotRunning) => e,
        SessionError::ForkFailed {
            session,
            why,
            source,
        } => SessionError::CheckpointFailed {
            session,
            action,
            why,
            source,
        },
        e => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(msg_type: &str, content: &str) -> Message {
        let mut m = Message::new(msg_type, &serde_json::json!({}), None, "s", "u");
        m.content = bytes::Bytes::from(content.to_string());
        m
    }

    #[test]
    fn only_a_small_ok_reply_with_an_integer_pid_is_accepted() {
        let ok = |c: &str| reply_pid(&reply("kb_fork_reply", c));
        assert_eq!(ok(r#"{"status":"ok","pid":57}"#), Ok(57));
        assert_eq!(ok(r#"{"status":"ok","pid":-3}"#), Ok(-3));
        for bad in [
            r#"{"status":"ok","pid":"57"}"#,
            r#"{"status":"ok","pid":5.5}"#,
            r#"{"status":"ok","pid":1e30}"#,
            r#"{"status":"ok"}"#,
            r#"{"pid":57}"#,
            r#"[1]"#,
            "not json",
        ] {
            assert!(ok(bad).is_err(), "{bad}");
        }
        let refused = ok(r#"{"status":"error","ename":"ForkRefused","evalue":"no"}"#);
        assert_eq!(refused, Err("the kernel refused: ForkRefused: no".into()));
        let big = format!(r#"{{"status":"ok","pid":57,"x":"{}"}}"#, "a".repeat(5000));
        assert!(ok(&big).unwrap_err().contains("bytes"));
        assert!(reply_pid(&reply("execute_reply", r#"{"status":"ok","pid":57}"#)).is_err());
    }
}
