//! A user's container: the pure spec it is created from ([`ContainerSpec`]: image, labels,
//! limits, mounts, the locked-down host config), and its lifecycle (found running, replaced
//! when it stopped, created and started, removed after `container_idle` without kernels,
//! its end read from the daemon, under the user's parent cgroup (`parent.rs`). What the
//! container is: see the module comment of `docker/mod.rs`.

use std::collections::HashMap;
use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use bollard::models::{ContainerCreateBody, HostConfig, Mount, MountType};
use bollard::query_parameters::CreateContainerOptions;
use bollard::Docker;
use tokio::time::sleep;
use tokio_util::sync::CancellationToken;

use super::daemon::{status_of, Advised};
use super::engine::Engine;
use super::limits::{resource_limits, verify_limits, LimitsNotApplied};
use super::own::{install_accounts, prepare_own, Target, LABEL_SANDBOX};
use super::running::{describe_state, ContainerInfo};
use super::{
    unavailable_by, workspace_owner, DockerSandboxConfig, Inner, UserSlot, BACKEND, HOSTNAME,
    KERNEL_GID, KERNEL_UID, LABEL_DATA_DIR, LABEL_DATA_DIR_HASH, LABEL_MANAGED, LABEL_USER,
    MAX_SOCKET_PATH, RUN_DIR_INSIDE, SESSION_DIR_LEN, TMPFS_OPTIONS, USER_NAME_BUDGET,
    WORKSPACE_INSIDE,
};
use crate::sandbox::fsutil::{self, io_err, launch_failed, launch_step};
use crate::sandbox::workspace_fs::prepare_workspace;
use crate::sandbox::{own_workspace, sudo};
use crate::sandbox::{SandboxError, SandboxUser, KERNEL_OOM_SCORE_ADJ};
use crate::sync::lock;

/// What a user's container is made from; [`Self::body`] is pure.
pub(super) struct ContainerSpec<'a> {
    pub image: &'a str,
    /// [`LABEL_DATA_DIR_HASH`]: tells this broker's containers apart.
    pub hash: &'a str,
    pub data_dir: &'a Path,
    pub user: &'a SandboxUser,
    /// Host directories mounted at `/workspace` and `/run/kernel`.
    pub workspace: &'a Path,
    pub run_dir: &'a Path,
    /// A CA bundle shown read-only at `egress::CA_FILE_INSIDE`.
    pub ca_file: Option<&'a Path>,
    /// The cgroup to create the container under (None: the engine's default).
    pub cgroup_parent: Option<&'a str>,
    /// The engine asked (see `engine.rs` for what differs).
    pub engine: Engine,
    /// A sandbox's own container (`own.rs`): its key; `None`: the user's container.
    pub own: Option<uuid::Uuid>,
}

impl ContainerSpec<'_> {
    /// The container's create options (what `docker create` is told).
    pub fn body(&self) -> ContainerCreateBody {
        let (user, workspace, run_dir) = (self.user, self.workspace, self.run_dir);
        let mut labels = HashMap::from([
            (LABEL_MANAGED.to_string(), "true".to_string()),
            (LABEL_DATA_DIR_HASH.to_string(), self.hash.to_string()),
            (LABEL_USER.to_string(), user.name.clone()),
            (
                LABEL_DATA_DIR.to_string(),
                self.data_dir.to_string_lossy().into_owned(),
            ),
        ]);
        let bind = |source: &Path, target: &str| Mount {
            target: Some(target.to_string()),
            source: Some(source.to_string_lossy().into_owned()),
            typ: Some(MountType::BIND),
            read_only: Some(false),
            ..Default::default()
        };
        if let Some(key) = self.own {
            labels.insert(LABEL_SANDBOX.to_string(), key.to_string());
        }
        let tools = tools_dir(self.data_dir);
        let read_only = |source: &Path, target: &str| Mount {
            read_only: Some(true),
            ..bind(source, target)
        };
        // A sandbox's own container: its workspace is E2B's home too, and the kernel uid
        // is E2B's `user` (`own.rs`); the user's: her workspace is shown at E2B's home for
        // sessions that asked for their own elsewhere.
        let (working_dir, home, accounts) = match self.own {
            Some(_) => (
                own_workspace::HOME_INSIDE,
                own_workspace::HOME_INSIDE,
                vec![
                    read_only(&tools.join("passwd"), "/etc/passwd"),
                    read_only(&tools.join("group"), "/etc/group"),
                ],
            ),
            None => (WORKSPACE_INSIDE, HOME_INSIDE, vec![]),
        };
        let limits = resource_limits(&user.limits);
        ContainerCreateBody {
            image: Some(self.image.to_string()),
            hostname: Some(HOSTNAME.to_string()),
            user: Some(format!("{KERNEL_UID}:{KERNEL_GID}")),
            working_dir: Some(working_dir.to_string()),
            env: Some(vec![format!("HOME={home}")]),
            labels: Some(labels),
            // The image's tini is PID 1 and runs `sleep infinity` (its CMD).
            host_config: Some(HostConfig {
                network_mode: Some("none".to_string()),
                readonly_rootfs: Some(true),
                // The kernels' home: their caches (matplotlib, fontconfig, IPython) stay
                // out of the workspace the user lists; the same place as the local sandbox's.
                tmpfs: Some(HashMap::from([
                    ("/tmp".to_string(), TMPFS_OPTIONS.to_string()),
                    (HOME_INSIDE.to_string(), home_tmpfs_options(self.engine)),
                ])),
                cap_drop: Some(vec!["ALL".to_string()]),
                security_opt: Some(vec!["no-new-privileges".to_string()]),
                ipc_mode: Some("private".to_string()),
                memory: limits.memory,
                memory_swap: limits.memory,
                nano_cpus: limits.nano_cpus,
                pids_limit: limits.pids,
                // Kernels go first when the host runs out of memory (see the constant).
                oom_score_adj: Some(KERNEL_OOM_SCORE_ADJ),
                mounts: Some(
                    [
                        Some(bind(workspace, WORKSPACE_INSIDE)),
                        Some(bind(workspace, own_workspace::HOME_INSIDE)),
                        Some(bind(run_dir, RUN_DIR_INSIDE)),
                        // The sandbox's `sudo` (`sudo.rs`), where every PATH finds it (a
                        // login shell's /etc/profile sets its own).
                        Some(read_only(&tools.join("sudo"), SUDO_INSIDE)),
                        self.ca_file
                            .map(|ca| read_only(ca, crate::egress::CA_FILE_INSIDE)),
                    ]
                    .into_iter()
                    .flatten()
                    .chain(accounts)
                    .collect(),
                ),
                auto_remove: Some(false),
                cgroup_parent: self.cgroup_parent.map(str::to_string),
                ..Default::default()
            }),
            ..Default::default()
        }
    }
}

/// The broker's tools directory for containers (`sudo.rs`).
fn tools_dir(data_dir: &Path) -> std::path::PathBuf {
    data_dir.join(format!("{}-docker", sudo::TOOLS_DIR_NAME))
}

/// Where the sandbox's `sudo` appears in a container (the image has none).
const SUDO_INSIDE: &str = "/usr/bin/sudo";

/// Where the image's `kernel` user lives while its kernels run (its caches), a tmpfs.
const HOME_INSIDE: &str = "/home/kernel";

/// The home's tmpfs: as `/tmp`'s, but the kernel user's own.
fn home_tmpfs_options(engine: Engine) -> String {
    engine.owned_tmpfs_options(TMPFS_OPTIONS, "0700", KERNEL_UID, KERNEL_GID)
}

impl Inner {
    /// The user's container if it runs; forgets (and removes) it if it does not.
    pub(super) async fn running_container(
        &self,
        docker: &Docker,
        slot: &mut Option<Arc<ContainerInfo>>,
    ) -> Result<Option<Arc<ContainerInfo>>, SandboxError> {
        let Some(c) = slot.clone() else {
            return Ok(None);
        };
        match docker.inspect_container(&c.id, None).await {
            Ok(info) if info.state.as_ref().and_then(|s| s.running) == Some(true) => Ok(Some(c)),
            Ok(info) => {
                tracing::warn!(container = %c.name, state = %describe_state(&info), "the user's container stopped; replacing it");
                self.remove_container(docker, &c.id).await;
                *slot = None;
                Ok(None)
            }
            Err(e) if status_of(&e) == Some(404) => {
                tracing::warn!(container = %c.name, "the user's container disappeared; replacing it");
                *slot = None;
                Ok(None)
            }
            Err(e) => Err(unavailable_by(self.advice(&e), e)),
        }
    }

    /// Creates and starts the user's container, or a sandbox's own (`target`).
    pub(super) async fn create_container(
        &self,
        docker: &Docker,
        user: &SandboxUser,
        target: &Target,
    ) -> Result<Arc<ContainerInfo>, SandboxError> {
        let (workspace, own_key) = (target.workspace.as_path(), target.own);
        let run_dir = self.user_run_dir(&target.slot);
        {
            let workspace = workspace.to_path_buf();
            let run_dir = run_dir.clone();
            let privileged = self.privileged;
            let images = self.workspace_images.clone();
            let own = self.own_workspaces.clone();
            let quota = user.limits.workspace_quota_bytes;
            let tools = tools_dir(&self.cfg.data_dir);
            tokio::task::spawn_blocking(move || {
                match own_key {
                    Some(key) => {
                        prepare_own(&own, key, quota, privileged)?;
                    }
                    None => {
                        let quota = Some((&*images, quota));
                        prepare_workspace(&workspace, workspace_owner(privileged), quota)?;
                    }
                }
                sudo::install(&tools)?;
                install_accounts(&tools)?;
                prepare_user_run_dir(&run_dir)
            })
            .await
            .map_err(|e| launch_step(user, "preparing directories failed", e))??;
        }
        let name = match own_key {
            Some(key) => self.own_container_name(key),
            None => self.container_name(&user.name),
        };
        // A container of that name can only be left from a crash in the middle of a launch.
        self.remove_container(docker, &name).await;
        let placement = self
            .place_container(docker, user, &name, own_key.is_some())
            .await?;
        let body = ContainerSpec {
            image: &self.cfg.image,
            hash: &self.hash,
            data_dir: &self.cfg.data_dir,
            user,
            workspace,
            run_dir: &run_dir,
            ca_file: self.cfg.ca_file.as_deref(),
            cgroup_parent: placement.cgroup_parent.as_deref(),
            engine: self.engine().await?,
            own: own_key,
        }
        .body();
        let created = docker
            .create_container(
                Some(CreateContainerOptions {
                    name: Some(name.clone()),
                    ..Default::default()
                }),
                body,
            )
            .await
            .map_err(|e| {
                let why = Advised {
                    advice: self.advice(&e),
                    source: e,
                };
                launch_step(user, format!("cannot create the container {name}"), why)
            })?;
        for warning in &created.warnings {
            tracing::warn!(container = %name, "docker: {warning}");
        }
        if let Err(e) = docker.start_container(&created.id, None).await {
            self.remove_container(docker, &created.id).await;
            let why = Advised {
                advice: self.advice(&e),
                source: e,
            };
            return Err(launch_step(
                user,
                format!("cannot start the container {name}"),
                why,
            ));
        }
        self.verify_placement(docker, &placement, (&created.id, &name), user)
            .await?;
        if let Err(why) = verify_limits(docker, &created.id, &user.limits).await {
            if self.cfg.require_limits {
                self.remove_container(docker, &created.id).await;
                return Err(launch_failed(
                    user,
                    LimitsNotApplied {
                        container: name,
                        source: why,
                    },
                ));
            }
            tracing::warn!(container = %name, %why, "the user's container runs WITHOUT the limits the engine was asked for (require_limits = false)");
        }
        tracing::info!(container = %name, user = %user.name, "user container started");
        Ok(Arc::new(ContainerInfo {
            id: created.id,
            name,
            memory_limit: user.limits.memory_bytes,
            oom_claimed: Mutex::new(0),
            reaping: tokio::sync::Mutex::new(()),
            own: own_key,
        }))
    }

    /// Starts (or restarts) the user's idle timer: after `container_idle` without a launch,
    /// the container goes (see [`Self::remove_idle_container`]). Stopped by shutdown.
    pub(super) fn start_idle_timer(self: &Arc<Self>, user: &str) {
        if self.shutdown.is_cancelled() {
            return;
        }
        let slot = self.slot(user);
        let token = CancellationToken::new();
        if let Some(old) = lock(&slot.idle).replace(token.clone()) {
            old.cancel();
        }
        let inner = self.clone();
        let name = user.to_string();
        let delay = inner.cfg.container_idle;
        tokio::spawn(async move {
            tokio::select! {
                () = sleep(delay) => {}
                () = token.cancelled() => return,
                () = inner.shutdown.cancelled() => return,
            }
            inner.remove_idle_container(&name, &slot, &token).await;
        });
    }

    /// After `container_idle` without sessions: removes the user's container, unless a
    /// launch came meanwhile.
    async fn remove_idle_container(&self, user: &str, slot: &UserSlot, token: &CancellationToken) {
        let mut guard = slot.container.lock().await;
        if token.is_cancelled() {
            return;
        }
        let live = self.kernels.has_user(user);
        if live {
            return;
        }
        lock(&slot.idle).take();
        let Some(container) = guard.take() else {
            return;
        };
        let Ok(docker) = self.client().await else {
            return;
        };
        // The user's templates end with their container (no kernel of theirs is alive).
        self.templates.end_all(Some(user)).await;
        self.remove_container(&docker, &container.id).await;
        self.parents.remove_if_unused(user).await;
        tracing::info!(container = %container.name, user, "removed the idle user container");
    }
}

/// Picks the runtime base directory (see [`DockerSandboxConfig::run_dir`]).
pub(super) fn choose_run_base(
    cfg: &DockerSandboxConfig,
    hash: &str,
    privileged: bool,
    euid: u32,
) -> Result<PathBuf, SandboxError> {
    let layout = fsutil::RunBaseLayout {
        backend: BACKEND,
        data_dir: &cfg.data_dir,
        run_dir: cfg.run_dir.as_deref(),
        default_name: "run-docker",
        fallback_name: "kernel-broker-docker",
        // `/<user>/<dir>/k-5`
        room: 1 + USER_NAME_BUDGET + 1 + SESSION_DIR_LEN + 4,
        max_socket_path: MAX_SOCKET_PATH,
    };
    fsutil::choose_run_base(&layout, hash, privileged, euid)
}

/// The user's runtime directory, mounted at `/run/kernel`: the kernel needs to reach (not
/// list or write) it; session directories inside it are the kernel's.
pub(super) fn prepare_user_run_dir(dir: &Path) -> Result<(), SandboxError> {
    let err = |what: &'static str| io_err(what, dir);
    match std::fs::DirBuilder::new().mode(0o711).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(err("cannot create the user's runtime directory")(e)),
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))
        .map_err(err("cannot set the runtime directory's permissions"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::UserLimits;

    #[test]
    fn run_base_falls_back_when_socket_paths_would_be_too_long() {
        let short = DockerSandboxConfig::new("/var/lib/kernel-broker");
        assert_eq!(
            choose_run_base(&short, "abcd1234", true, 0).unwrap(),
            PathBuf::from("/var/lib/kernel-broker/run-docker")
        );
        let long = DockerSandboxConfig::new(format!("/srv/{}", "d".repeat(60)));
        assert_eq!(
            choose_run_base(&long, "abcd1234", true, 0).unwrap(),
            PathBuf::from("/run/kernel-broker-docker-abcd1234")
        );
        let mut explicit = long.clone();
        explicit.run_dir = Some(PathBuf::from(format!("/{}", "r".repeat(70))));
        assert!(choose_run_base(&explicit, "abcd1234", true, 0).is_err());
    }

    /// The spec of alice's container with these limits.
    fn body(limits: UserLimits) -> ContainerCreateBody {
        let user = SandboxUser {
            name: "alice".into(),
            index: 0,
            limits,
        };
        ContainerSpec {
            image: "img:1",
            hash: "abcd1234",
            data_dir: Path::new("/var/lib/kb"),
            user: &user,
            workspace: Path::new("/var/lib/kb/workspaces-docker/alice"),
            run_dir: Path::new("/var/lib/kb/run-docker/alice"),
            ca_file: None,
            cgroup_parent: None,
            engine: Engine::Docker,
            own: None,
        }
        .body()
    }

    #[test]
    fn the_container_is_locked_down_and_labelled() {
        let b = body(UserLimits::default());
        assert_eq!(b.image.as_deref(), Some("img:1"));
        assert_eq!(b.user.as_deref(), Some("1000:1000"));
        assert_eq!(b.hostname.as_deref(), Some("kernel"));
        assert_eq!(b.working_dir.as_deref(), Some("/workspace"));
        let labels = b.labels.unwrap();
        assert_eq!(labels[LABEL_MANAGED], "true");
        assert_eq!(labels[LABEL_DATA_DIR_HASH], "abcd1234");
        assert_eq!(labels[LABEL_USER], "alice");
        assert_eq!(labels[LABEL_DATA_DIR], "/var/lib/kb");
        let h = b.host_config.unwrap();
        assert_eq!(h.network_mode.as_deref(), Some("none"));
        assert_eq!(h.readonly_rootfs, Some(true));
        assert_eq!(h.cap_drop, Some(vec!["ALL".to_string()]));
        assert_eq!(h.security_opt, Some(vec!["no-new-privileges".to_string()]));
        assert_eq!(h.ipc_mode.as_deref(), Some("private"));
        assert_eq!(h.auto_remove, Some(false));
        assert_eq!(h.oom_score_adj, Some(500));
        let tmpfs = h.tmpfs.unwrap();
        assert_eq!(tmpfs["/tmp"], "rw,nosuid,nodev,size=256m,mode=1777");
        assert_eq!(
            tmpfs["/home/kernel"],
            "rw,nosuid,nodev,size=256m,mode=0700,uid=1000,gid=1000"
        );
        assert_eq!(b.env, Some(vec!["HOME=/home/kernel".to_string()]));
        let mounts: Vec<(String, String, bool)> = h
            .mounts
            .unwrap()
            .into_iter()
            .map(|m| {
                assert_eq!(m.typ, Some(MountType::BIND));
                (m.source.unwrap(), m.target.unwrap(), m.read_only.unwrap())
            })
            .collect();
        assert_eq!(
            mounts,
            [
                (
                    "/var/lib/kb/workspaces-docker/alice".to_string(),
                    "/workspace".to_string(),
                    false
                ),
                (
                    "/var/lib/kb/workspaces-docker/alice".to_string(),
                    "/home/user".to_string(),
                    false
                ),
                (
                    "/var/lib/kb/run-docker/alice".to_string(),
                    "/run/kernel".to_string(),
                    false
                ),
                (
                    "/var/lib/kb/tools-docker/sudo".to_string(),
                    "/usr/bin/sudo".to_string(),
                    true
                ),
            ]
        );
    }

    #[test]
    fn a_sandbox_container_is_e2b_shaped() {
        let user = SandboxUser {
            name: "alice".into(),
            index: 0,
            limits: UserLimits::default(),
        };
        let key = uuid::Uuid::new_v4();
        let b = ContainerSpec {
            image: "img:1",
            hash: "abcd1234",
            data_dir: Path::new("/var/lib/kb"),
            user: &user,
            workspace: Path::new("/var/lib/kb/sandboxes-docker/k/home"),
            run_dir: Path::new("/var/lib/kb/run-docker/+k"),
            ca_file: None,
            cgroup_parent: None,
            engine: Engine::Docker,
            own: Some(key),
        }
        .body();
        assert_eq!(b.working_dir.as_deref(), Some("/home/user"));
        assert_eq!(b.env, Some(vec!["HOME=/home/user".to_string()]));
        let labels = b.labels.unwrap();
        assert_eq!(labels[LABEL_SANDBOX], key.to_string());
        assert_eq!(labels[LABEL_USER], "alice");
        let h = b.host_config.unwrap();
        // Its own /tmp; the user's limits.
        assert!(h.tmpfs.unwrap().contains_key("/tmp"));
        assert_eq!(h.memory, resource_limits(&user.limits).memory);
        let mounts: Vec<(String, String, bool)> = h
            .mounts
            .unwrap()
            .into_iter()
            .map(|m| (m.source.unwrap(), m.target.unwrap(), m.read_only.unwrap()))
            .collect();
        let home = "/var/lib/kb/sandboxes-docker/k/home".to_string();
        for want in [
            (home.clone(), "/workspace".to_string(), false),
            (home, "/home/user".to_string(), false),
            (
                "/var/lib/kb/run-docker/+k".to_string(),
                "/run/kernel".to_string(),
                false,
            ),
            (
                "/var/lib/kb/tools-docker/passwd".to_string(),
                "/etc/passwd".to_string(),
                true,
            ),
            (
                "/var/lib/kb/tools-docker/group".to_string(),
                "/etc/group".to_string(),
                true,
            ),
        ] {
            assert!(mounts.contains(&want), "{want:?} in {mounts:?}");
        }
    }

    #[test]
    fn limits_appear_in_the_host_config() {
        struct Case {
            limits: UserLimits,
            memory: Option<i64>,
            nano_cpus: Option<i64>,
            pids: Option<i64>,
        }
        let limits = |memory_bytes, cpus, pids| UserLimits {
            memory_bytes,
            cpus,
            pids,
            workspace_quota_bytes: 0,
            ..UserLimits::default()
        };
        for case in [
            Case {
                limits: limits(256 << 20, 0.5, 64),
                memory: Some(256 << 20),
                nano_cpus: Some(500_000_000),
                pids: Some(64),
            },
            Case {
                limits: limits(0, 2.0, 0),
                memory: None,
                nano_cpus: Some(2_000_000_000),
                pids: None,
            },
            Case {
                limits: limits(u64::MAX, 0.0, u64::MAX),
                memory: Some(i64::MAX),
                nano_cpus: None,
                pids: Some(i64::MAX),
            },
        ] {
            let h = body(case.limits.clone()).host_config.unwrap();
            assert_eq!(h.memory, case.memory, "{:?}", case.limits);
            // No swap on top of the memory limit.
            assert_eq!(h.memory_swap, case.memory, "{:?}", case.limits);
            assert_eq!(h.nano_cpus, case.nano_cpus, "{:?}", case.limits);
            assert_eq!(h.pids_limit, case.pids, "{:?}", case.limits);
        }
    }
}
