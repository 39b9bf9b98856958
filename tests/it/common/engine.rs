//! Which container engine the Docker tests target: Docker Engine by default, or any
//! Docker-compatible API service (Podman's `podman system service`) when
//! `KB_DOCKER_SOCKET` names its socket. The sandboxes and brokers the tests start use that
//! socket, and the `docker` CLI the tests run to look at containers (ps, inspect, exec, rm)
//! is pointed at the same service through `DOCKER_HOST`, so the tests look at the engine
//! the backend talks to. `.ci/podman.sh` runs the Docker suites this way.

use std::process::Command;

use kernel_broker::sandbox::docker::DEFAULT_SOCKET;

/// The socket of the engine under test: `KB_DOCKER_SOCKET` if set, else Docker's default.
pub fn docker_socket() -> String {
    match std::env::var("KB_DOCKER_SOCKET") {
        Ok(s) if !s.trim().is_empty() => s,
        _ => DEFAULT_SOCKET.to_string(),
    }
}

/// The cgroup the engine under test must create containers under (`KB_DOCKER_CGROUP_PARENT`,
/// `--docker-cgroup-parent`): a rootless Podman without a systemd user session applies
/// limits only in a cgroup its user owns (`scripts/test-podman-rootless`).
pub fn docker_cgroup_parent() -> Option<String> {
    std::env::var("KB_DOCKER_CGROUP_PARENT")
        .ok()
        .filter(|s| !s.trim().is_empty())
}

/// The `docker` CLI against the engine under test.
pub fn docker_cli() -> Command {
    let socket = docker_socket();
    let mut cmd = Command::new("docker");
    if !socket.contains("://") {
        cmd.env("DOCKER_HOST", format!("unix://{socket}"));
    } else {
        cmd.env("DOCKER_HOST", socket);
    }
    cmd
}

/// Whether the engine under test is Podman (its `/version` names a "Podman Engine"
/// component), for the tests that assert where Podman differs from Docker.
pub fn is_podman() -> bool {
    docker_cli()
        .args([
            "version",
            "--format",
            "{{range .Server.Components}}{{.Name}};{{end}}",
        ])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("Podman"))
        .unwrap_or(false)
}
