//! A running user container as the other files see it: who it is and its memory limit
//! ([`ContainerInfo`]), the host pid of its init, whether and why it stopped, and one-off
//! commands run in it ([`exec_output`]). Both the container's lifecycle (`container.rs`)
//! and the kernels' execs (`exec.rs`, `reaper.rs`, `watch.rs`) rest on it.

use std::sync::Mutex;

use bollard::errors::Error as DockerError;
use bollard::exec::{CreateExecOptions, StartExecOptions, StartExecResults};
use bollard::Docker;
use futures::StreamExt;

use super::daemon::status_of;
use super::MAX_EXEC_OUTPUT;
use crate::sandbox::ExitReason;

/// A running user container.
pub(super) struct ContainerInfo {
    pub id: String,
    pub name: String,
    pub memory_limit: u64,
    /// OOM kills in this container already attributed to a kernel.
    pub oom_claimed: Mutex<u64>,
    /// Held while a reaper runs in this container: two reapers at once would each see the
    /// other's victims half-dead and race on the fixed point. An async mutex because it is
    /// held across the reaper's exec.
    pub reaping: tokio::sync::Mutex<()>,
    /// The own-workspace key of a sandbox's own container (`own.rs`); `None`: the user's.
    pub own: Option<uuid::Uuid>,
}

/// The host pid of a running container's init (its namespaces are the kernels').
pub(super) async fn init_pid(docker: &Docker, container: &ContainerInfo) -> Option<i32> {
    let info = docker.inspect_container(&container.id, None).await.ok()?;
    let pid = info.state?.pid?;
    i32::try_from(pid).ok().filter(|p| *p > 0)
}

/// `Some(reason)` if the container no longer runs.
pub(super) async fn container_reason(
    docker: &Docker,
    container: &ContainerInfo,
) -> Option<ExitReason> {
    match docker.inspect_container(&container.id, None).await {
        Ok(info) => {
            let state = info.state.as_ref()?;
            if state.running == Some(true) {
                return None;
            }
            if state.oom_killed == Some(true) {
                return Some(ExitReason::OutOfMemory {
                    limit_bytes: container.memory_limit,
                });
            }
            Some(ExitReason::Lost(format!(
                "the user's container stopped: {}",
                describe_state(&info)
            )))
        }
        Err(e) if status_of(&e) == Some(404) => Some(ExitReason::Lost(
            "the user's container was removed".to_string(),
        )),
        Err(_) => None,
    }
}

pub(super) fn describe_state(info: &bollard::models::ContainerInspectResponse) -> String {
    let Some(state) = &info.state else {
        return "state unknown".to_string();
    };
    let mut text = state
        .status
        .map(|s| s.to_string())
        .unwrap_or_else(|| "unknown".to_string());
    if let Some(code) = state.exit_code {
        text.push_str(&format!(", exit code {code}"));
    }
    if state.oom_killed == Some(true) {
        text.push_str(", out of memory");
    }
    if let Some(err) = state.error.as_deref().filter(|e| !e.is_empty()) {
        text.push_str(&format!(", {err}"));
    }
    text
}

/// Runs a command in the container and collects its output (cut at [`MAX_EXEC_OUTPUT`])
/// and exit code.
pub(super) async fn exec_output(
    docker: &Docker,
    container: &str,
    cmd: &[&str],
) -> Result<(i64, String), DockerError> {
    let exec = docker
        .create_exec(
            container,
            CreateExecOptions {
                cmd: Some(cmd.iter().map(|s| s.to_string()).collect()),
                attach_stdout: Some(true),
                attach_stderr: Some(true),
                ..Default::default()
            },
        )
        .await?;
    let mut text = Vec::new();
    if let StartExecResults::Attached { mut output, .. } = docker.start_exec(&exec.id, None).await?
    {
        while let Some(chunk) = output.next().await {
            let bytes = chunk?.into_bytes();
            let room = MAX_EXEC_OUTPUT.saturating_sub(text.len());
            text.extend_from_slice(&bytes[..bytes.len().min(room)]);
        }
    }
    let code = docker.inspect_exec(&exec.id).await?.exit_code.unwrap_or(-1);
    Ok((code, String::from_utf8_lossy(&text).into_owned()))
}

/// Starts exec `exec_id`: attached (its streams come back in the result) or, with `detach`,
/// left to run on its own.
pub(super) async fn start_exec(
    docker: &Docker,
    exec_id: &str,
    detach: bool,
) -> Result<StartExecResults, DockerError> {
    docker
        .start_exec(
            exec_id,
            Some(StartExecOptions {
                detach,
                ..Default::default()
            }),
        )
        .await
}
