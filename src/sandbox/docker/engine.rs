//! Which engine serves the Docker API ([`Engine`]): Docker Engine, or Podman's
//! Docker-compatible service (`podman system service`), told apart by the components its
//! `/version` names, and the few places where the backend must ask them differently.
//!
//! Podman takes the same container spec, with one difference found so far: it rejects the
//! `uid=`/`gid=` tmpfs options (Podman 4.3: "unknown mount option"), and instead has its own
//! `U` option, which gives the tmpfs to the container's user (the `kernel` user, uid 1000,
//! or what it maps to in a rootless Podman's user namespace). Docker passes options to
//! mount(2) unchanged and knows no `U`.
//!
//! The other: Podman (4.3) never updates a detached exec session after its process ends
//! while no client is attached: `GET /exec/{id}/json` keeps answering `Running: true`,
//! `ExitCode: 0` and the old pid (its conmon writes the exit code to a file of Podman's own
//! storage, and records it only when its exit command runs, 5 minutes later by default).
//! So under Podman a kernel's watcher holds a pidfd on the exec's process (a host pid) and
//! sees its end there, and the kernel's command writes the kernel's exit status to its
//! session directory (`kernel_argv::STATUS_FILE`); a kernel that ended while no broker watched it
//! (`--keep-sessions`) is found dead by its pid ([`exec_process_gone`]) and its status read
//! the same way. Without a status file how it ended is not known
//! (see `watch::classify_unreported_end`).

use bollard::models::SystemVersion;

/// The engine behind the socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Docker,
    Podman,
}

impl Engine {
    /// The engine a `/version` answer describes: Podman names a "Podman Engine" component
    /// (Docker names "Engine"); anything else is taken for Docker Engine.
    pub fn of(version: &SystemVersion) -> Self {
        let podman = version
            .components
            .iter()
            .flatten()
            .any(|c| c.name.to_ascii_lowercase().contains("podman"));
        if podman {
            Engine::Podman
        } else {
            Engine::Docker
        }
    }

    /// The engine's name, for logs and errors.
    pub fn name(self) -> &'static str {
        match self {
            Engine::Docker => "Docker Engine",
            Engine::Podman => "Podman",
        }
    }

    /// The options of a tmpfs owned by `uid:gid` (`base`: the options of a root-owned one,
    /// its mode replaced by `mode`).
    pub fn owned_tmpfs_options(self, base: &str, mode: &str, uid: u32, gid: u32) -> String {
        let base = base.replace("mode=1777", &format!("mode={mode}"));
        match self {
            Engine::Docker => format!("{base},uid={uid},gid={gid}"),
            // `U`: chown to the container's user, which is `uid:gid` (the spec's `User`).
            Engine::Podman => format!("{base},U"),
        }
    }
}

/// Whether the process a daemon reports for an exec (a host pid) is gone: no such process,
/// or one that is not in the container's pid namespace (`init_pid`: the container's init),
/// which is a reused pid. Unknown (a `/proc` entry unreadable) counts as not gone.
pub fn exec_process_gone(pid: i64, init_pid: i32) -> bool {
    let ns = |pid: i64| std::fs::read_link(format!("/proc/{pid}/ns/pid"));
    match (ns(pid), ns(i64::from(init_pid))) {
        (Err(e), _) if e.kind() == std::io::ErrorKind::NotFound => true,
        (Ok(exec), Ok(init)) => exec != init,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bollard::models::SystemVersionComponents;

    fn version(names: &[&str]) -> SystemVersion {
        SystemVersion {
            components: Some(
                names
                    .iter()
                    .map(|n| SystemVersionComponents {
                        name: n.to_string(),
                        version: "1".into(),
                        details: None,
                    })
                    .collect(),
            ),
            ..Default::default()
        }
    }

    #[test]
    fn podman_is_told_by_its_component() {
        // As Podman 4.3 and Docker 28 answer.
        let podman = version(&["Podman Engine", "Conmon", "OCI Runtime (runc)", "Engine"]);
        assert_eq!(Engine::of(&podman), Engine::Podman);
        let docker = version(&["Engine", "containerd", "runc", "docker-init"]);
        assert_eq!(Engine::of(&docker), Engine::Docker);
        assert_eq!(Engine::of(&SystemVersion::default()), Engine::Docker);
    }

    #[test]
    fn an_exec_pid_is_gone_when_missing_or_outside_the_container() {
        let me = i64::from(std::process::id());
        let init = i32::try_from(me).unwrap_or(1);
        // Alive, and in the same pid namespace as the "init" given.
        assert!(!exec_process_gone(me, init));
        // No such process (above pid_max, which is at most 2^22).
        assert!(exec_process_gone(1 << 23, init));
    }

    #[test]
    fn owned_tmpfs_options_per_engine() {
        let base = "rw,nosuid,nodev,size=256m,mode=1777";
        assert_eq!(
            Engine::Docker.owned_tmpfs_options(base, "0700", 1000, 1000),
            "rw,nosuid,nodev,size=256m,mode=0700,uid=1000,gid=1000"
        );
        assert_eq!(
            Engine::Podman.owned_tmpfs_options(base, "0700", 1000, 1000),
            "rw,nosuid,nodev,size=256m,mode=0700,U"
        );
    }
}
