//! Talking to the Docker daemon: the client (connected and version-negotiated on first
//! use), errors turned into advice for the operator, the startup sweep of an earlier run's
//! containers and runtime entries (or, keeping kernels, the hand-over to `keep/`), and
//! finding and removing this broker's containers.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use bollard::errors::Error as DockerError;
use bollard::models::ContainerSummary;
use bollard::query_parameters::{ListContainersOptions, RemoveContainerOptions};
use bollard::Docker;
use tokio::time::timeout;
use uuid::Uuid;

use super::engine::Engine;
use super::{unavailable, unavailable_by, Inner, BACKEND, LABEL_DATA_DIR_HASH, LABEL_MANAGED};
use crate::sandbox::cgroup::ContainerCgroup;
use crate::sandbox::fsutil;
use crate::sandbox::pause::keep_recorded;
use crate::sandbox::SandboxError;
use crate::sync::lock;

impl Inner {
    pub(super) fn unreachable(&self, why: impl std::fmt::Display) -> SandboxError {
        unavailable(format!(
            "cannot reach the Docker daemon at {} ({why}); start dockerd (or Podman's API \
             service), or check --docker-socket and that the broker may use it (root or the \
             docker group)",
            self.cfg.socket
        ))
    }

    /// The connected client; connects (and negotiates the API version) on first use.
    pub(super) async fn client(&self) -> Result<Docker, SandboxError> {
        self.client
            .get_or_try_init(|| async {
                let connect = |version: &bollard::ClientVersion| {
                    Docker::connect_with_unix(&self.socket_path, self.cfg.api_timeout.as_secs(), version)
                        .map_err(|e| self.unreachable(error_text(&e)))
                };
                // One `/version` says both the API version to speak and which engine answers
                // (Docker Engine or Podman: a few requests differ). Podman answers it by
                // asking its runtime and conmon for theirs: tens of seconds on an emulated host
                // while it removes containers.
                let probe = connect(bollard::API_DEFAULT_VERSION)?;
                let limit = self.cfg.api_timeout;
                let answer = timeout(limit, probe.version())
                    .await
                    .map_err(|_| self.unreachable(format!("no answer within {limit:?}")))?
                    .map_err(|e| self.unreachable(error_text(&e)))?;
                let version = negotiated(answer.api_version.as_deref());
                let docker = connect(&version)?;
                let engine = Engine::of(&answer);
                tracing::debug!(socket = %self.cfg.socket, engine = engine.name(), api = %format!("{}.{}", version.major_version, version.minor_version), "connected to the Docker daemon");
                Ok((docker, engine))
            })
            .await
            .map(|(docker, _)| docker.clone())
    }

    /// The engine behind the socket (connects first, as [`Self::client`]).
    pub(super) async fn engine(&self) -> Result<Engine, SandboxError> {
        self.client().await?;
        Ok(self.client.get().map_or(Engine::Docker, |(_, e)| *e))
    }

    /// A Docker error as text that tells the operator what to do.
    pub(super) fn advice(&self, e: &DockerError) -> String {
        match e {
            DockerError::DockerResponseServerError {
                status_code,
                message,
            } => {
                if *status_code == 404 && message.contains("image") {
                    format!(
                        "{message}; build the image with docker/build-offline.sh or \
                         `docker build -f docker/Dockerfile -t {} .`",
                        self.cfg.image
                    )
                } else {
                    format!("the Docker daemon refused ({status_code}): {message}")
                }
            }
            DockerError::RequestTimeoutError => format!(
                "the Docker daemon at {} did not answer within {} s (--docker-api-timeout)",
                self.cfg.socket,
                self.cfg.api_timeout.as_secs()
            ),
            _ => format!(
                "cannot talk to the Docker daemon at {} ({}); is dockerd running? \
                 (check --docker-socket)",
                self.cfg.socket,
                error_text(e)
            ),
        }
    }

    /// Creates the directories and removes what an earlier run left (with `--keep-sessions`,
    /// what its kept kernels do not need: see `keep/`); once.
    pub(super) async fn startup(&self) -> Result<(), SandboxError> {
        self.started
            .get_or_try_init(|| async {
                let docker = self.client().await?;
                let keep = self.cfg.keep_kernels;
                let sweep: fn(&Path) -> Result<usize, SandboxError> =
                    if keep { |_| Ok(0) } else { empty_dir };
                fsutil::prepare_state_dirs(
                    BACKEND,
                    &self.cfg.data_dir,
                    &self.workspaces,
                    &self.run_base,
                    sweep,
                )
                .await?;
                // Copies cut short are never kept: their images hold a kernel's memory.
                // Paused kernels with their records are, with their workspaces.
                let copies = self.copies_dir();
                let _ = tokio::task::spawn_blocking(move || {
                    crate::sandbox::criu::sweep_copies(&copies);
                })
                .await;
                // So are snapshots (they hold no workspace: their files are archived).
                let paused = keep_recorded(self.paused_dir(), "paused kernels").await;
                let spared: HashSet<Uuid> = paused.iter().filter_map(|p| p.own_workspace).collect();
                let snapshots = keep_recorded(self.snapshots_dir(), "snapshots").await;
                self.found.set(paused, snapshots);
                if keep {
                    self.take_over(&docker).await?;
                    self.parents.sweep(&docker).await;
                    // The workspaces of the sandboxes whose kernels were kept stay.
                    let mut kept = spared;
                    kept.extend(lock(&self.kept).values().filter_map(|t| t.own));
                    self.sweep_own(kept).await;
                    return Ok(());
                }
                self.sweep_own(spared).await;
                self.forget_tickets().await;
                let stale = self
                    .our_containers(&docker)
                    .await
                    .map_err(|e| unavailable_by(self.advice(&e), e))?;
                for id in &stale {
                    self.remove_container(&docker, id).await;
                }
                if !stale.is_empty() {
                    tracing::info!(
                        count = stale.len(),
                        "removed kernel containers left by an earlier run"
                    );
                }
                self.parents.sweep(&docker).await;
                Ok(())
            })
            .await
            .copied()
    }

    /// Ids of every container (running or not) with this broker's labels.
    pub(super) async fn our_containers(&self, docker: &Docker) -> Result<Vec<String>, DockerError> {
        let list = self.our_container_summaries(docker).await?;
        Ok(list.into_iter().filter_map(|c| c.id).collect())
    }

    /// Every container (running or not) with this broker's labels, as the daemon lists them.
    pub(super) async fn our_container_summaries(
        &self,
        docker: &Docker,
    ) -> Result<Vec<ContainerSummary>, DockerError> {
        let filters = HashMap::from([(
            "label".to_string(),
            vec![
                format!("{LABEL_MANAGED}=true"),
                format!("{LABEL_DATA_DIR_HASH}={}", self.hash),
            ],
        )]);
        docker
            .list_containers(Some(ListContainersOptions {
                all: true,
                filters: Some(filters),
                ..Default::default()
            }))
            .await
    }

    /// Force-removes a container; a missing one is fine, other errors are logged. Its
    /// kernels' leaves frozen as checkpoints (a broker killed while it held some) are
    /// thawed first: a frozen process does not die, and the engine would not remove it.
    pub(super) async fn remove_container(&self, docker: &Docker, id: &str) {
        let pid = docker
            .inspect_container(id, None)
            .await
            .ok()
            .and_then(|c| c.state?.pid)
            .and_then(|p| i32::try_from(p).ok())
            .filter(|p| *p > 0);
        if let Some(pid) = pid {
            let thawed = tokio::task::spawn_blocking(move || {
                if let Ok(cgroup) = ContainerCgroup::of_process(pid) {
                    cgroup.thaw_all();
                }
            });
            let _ = thawed.await;
        }
        let opts = RemoveContainerOptions {
            force: true,
            ..Default::default()
        };
        match docker.remove_container(id, Some(opts)).await {
            Ok(()) => tracing::debug!(container = %id, "container removed"),
            Err(e) if status_of(&e) == Some(404) => {}
            // 409: removal already in progress.
            Err(e) if status_of(&e) == Some(409) => {}
            Err(e) => {
                tracing::warn!(container = %id, error = %self.advice(&e), "cannot remove a kernel container")
            }
        }
    }
}

/// The HTTP status of a daemon's error answer.
pub(super) fn status_of(e: &DockerError) -> Option<u16> {
    match e {
        DockerError::DockerResponseServerError { status_code, .. } => Some(*status_code),
        _ => None,
    }
}

/// An error with its chain of causes (hyper's errors say little at the top).
pub(super) fn error_text(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// The socket's file path from a path or `unix://` URL.
pub(super) fn socket_path(socket: &str) -> Result<String, SandboxError> {
    let path = socket.strip_prefix("unix://").unwrap_or(socket);
    if path.contains("://") || !path.starts_with('/') {
        return Err(unavailable(format!(
            "the Docker socket {socket:?} is not a unix socket path; use e.g. \
             /var/run/docker.sock or unix:///run/podman/podman.sock"
        )));
    }
    Ok(path.to_string())
}

/// Removes everything inside `dir` (an earlier run's per-user runtime directories).
fn empty_dir(dir: &Path) -> Result<usize, SandboxError> {
    let entries = std::fs::read_dir(dir).map_err(|source| SandboxError::Io {
        what: "cannot list the runtime directory",
        path: dir.to_path_buf(),
        source,
    })?;
    let mut removed = 0;
    for entry in entries.filter_map(Result::ok) {
        let path = entry.path();
        let result = match entry.file_type() {
            Ok(t) if t.is_dir() => std::fs::remove_dir_all(&path),
            _ => std::fs::remove_file(&path),
        };
        match result {
            Ok(()) => removed += 1,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove a stale runtime entry")
            }
        }
    }
    Ok(removed)
}

/// The API version to speak: the daemon's if older than this client's, else this client's
/// (what bollard's `negotiate_version` does, from a `/version` answer already at hand).
fn negotiated(daemon: Option<&str>) -> bollard::ClientVersion {
    let ours = bollard::API_DEFAULT_VERSION;
    let theirs = daemon.and_then(|v| {
        let (major, minor) = v.trim().split_once('.')?;
        Some(bollard::ClientVersion {
            major_version: major.parse().ok()?,
            minor_version: minor.parse().ok()?,
        })
    });
    match theirs {
        Some(t)
            if (t.major_version, t.minor_version) < (ours.major_version, ours.minor_version) =>
        {
            t
        }
        _ => *ours,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sockets_are_paths_or_unix_urls() {
        assert_eq!(
            socket_path("/var/run/docker.sock").unwrap(),
            "/var/run/docker.sock"
        );
        assert_eq!(
            socket_path("unix:///run/podman/podman.sock").unwrap(),
            "/run/podman/podman.sock"
        );
        assert!(socket_path("tcp://127.0.0.1:2375").is_err());
        assert!(socket_path("docker.sock").is_err());
    }

    #[test]
    fn the_older_api_version_is_spoken() {
        let ours = bollard::API_DEFAULT_VERSION;
        let v = |s: &str| negotiated(Some(s));
        // Podman 4.3 and Docker 20.10 answer 1.41; a daemon newer than this client, ours.
        assert_eq!((v("1.41").major_version, v("1.41").minor_version), (1, 41));
        assert_eq!(v("1.99").minor_version, ours.minor_version);
        assert_eq!(v("2.0").major_version, ours.major_version);
        for bad in [None, Some(""), Some("x"), Some("1"), Some("1.x")] {
            assert_eq!(negotiated(bad).minor_version, ours.minor_version, "{bad:?}");
        }
    }
}

/// A Docker error told with the operator's advice ([`DockerSandbox::advice`]), the error
/// kept as the source.
#[derive(Debug, thiserror::Error)]
#[error("{advice}")]
pub(super) struct Advised {
    pub advice: String,
    #[source]
    pub source: bollard::errors::Error,
}
