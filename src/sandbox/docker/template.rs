//! Fork-server starts in the Docker backend: per user and kernel spec, a template process
//! in the user's container that has imported the data stack once; each new kernel of that
//! user is forked from it and becomes an ordinary ipykernel with its own session directory
//! (`/run/kernel/<dir>`), connection file, key, sockets, pid and cgroup leaf. The forked
//! kernels share the template's imported pages copy-on-write.
//!
//! The template is an exec in the user's container, as a kernel is (same uid, limits,
//! workspace, no network): `sh` waits for the broker's word while the broker moves it into a
//! leaf of the container's cgroup of its own, with no memory limit of its own (the user's
//! total binds it: forking charges the template for page tables and the pages a child
//! touches before it is moved out, which grows with the number of kernels; a limit of one
//! session's size OOM-killed the local template at ~75 forks), then becomes `tini -s --
//! python kernel_broker_boot.py template --preload ...`. `tini -s` makes what a forked
//! kernel double-forks an orphan of the template's tini, not of the container's PID 1, so
//! the reaper exec of a plain kernel of the same user never takes it for its own.
//!
//! The exec's stdin and stdout are attached through the Docker API (bollard's attached
//! `start_exec`: an input writer and a stream of demultiplexed stdout/stderr frames): stdout
//! frames are the protocol's answers (the shared client, [`crate::sandbox::fork_server`]),
//! stderr frames (the template's and its kernels' logs) go to the broker's log, cut short.
//!
//! A fork: the broker writes the kernel's session directory, asks the template for a
//! child, finds the child's host pid (the broker is root on the host: among the template's
//! children, by the last `NSpid`, re-checked through a pidfd), moves it into its own leaf
//! with the kernel's limits ([`ContainerCgroup::enter`]), then lets it go. The watcher
//! (`watch.rs`, [`watch_forked`]) sees its end through the pidfd; everything the kernel
//! started stays in its leaf whatever it is reparented to, so the leaf's removal ends it
//! all, and nothing else of the container.
//!
//! Templates are used only with root (the container's cgroup and host pids are needed)
//! where leaves can be made (not with a rootless daemon), and not with `--keep-sessions`
//! (a kept kernel must outlive the broker on its own; a forked one is its template's
//! child). Whatever goes wrong falls back to a plain start; a template that failed is not
//! tried again for [`RETRY_AFTER`]. A template ends with its user's container (removed
//! after `container_idle` with no kernel alive) or when the broker stops.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use bollard::container::LogOutput;
use bollard::exec::StartExecResults;
use bollard::Docker;
use futures::StreamExt;
use tokio::io::unix::AsyncFd;
use tokio::io::{BufReader, Interest};
use tokio_util::io::StreamReader;
use uuid::Uuid;

use super::exec::{
    base_env, connection_file, create_kernel_exec, endpoints_for, DockerKernel, ForkedPid,
    SessionFiles, HISTORY, LOST,
};
use super::place::{enter_new_leaf, exec_pid, leaf_for, let_go, wait_for_go, PlaceError};
use super::running::{start_exec, ContainerInfo};
use super::watch::{register_forked, ForkedStatus};
use super::{keep, Inner, EXEC_TIMEOUT, PYTHON_INSIDE, RUN_DIR_INSIDE, TINI_INSIDE};
use crate::sandbox::boot::{self, BOOT_SCRIPT_NAME};
use crate::sandbox::cgroup::{ContainerCgroup, Leaf};
use crate::sandbox::fork_server::{find_child, read_ready, ForkServer, NotReady, RequestFailed};
use crate::sandbox::fsutil::{remove_dir_logged, SocketPathError};
use crate::sandbox::pidfd;
use crate::sandbox::procfs::child_with_namespace_pid;
use crate::sandbox::template_slots::{TemplateHandle, TemplateSlots};
use crate::sandbox::watched::KernelWatch;
use crate::sandbox::{KernelLimits, KernelProcess, LaunchSpec, Launched, SandboxError};

/// Bytes of one stderr frame of a template kept for the broker's log.
const MAX_LOG_FRAME: usize = 2000;

/// The templates of the sandbox, by user and kernel spec.
#[derive(Default)]
pub(super) struct Templates {
    slots: TemplateSlots<Template>,
}

impl Templates {
    /// Ends the templates of `user` (all users: `None`), e.g. with the user's container.
    pub async fn end_all(&self, user: Option<&str>) {
        self.slots.end(user, false, || true).await;
    }
}

/// One running template.
struct Template {
    /// The container it runs in: a template of a container that was replaced is gone.
    container_id: String,
    /// Host pid of the template's Python (its tini's child).
    host_pid: i32,
    /// The container's cgroup, where forked kernels' leaves go.
    cgroup: ContainerCgroup,
    /// The template's own leaf (no memory limit of its own).
    leaf: Leaf,
    /// Its directory on the host (the bootstrap script).
    host_dir: PathBuf,
    server: ForkServer,
}

impl Template {
    /// Kills the template (its leaf: its sh, tini and Python; its kernels have leaves of
    /// their own) and removes its leaf and directory.
    async fn end(&self) {
        self.server.set_broken();
        ContainerCgroup::remove_leaf(&self.leaf).await;
        remove_dir_logged(self.host_dir.clone()).await;
    }
}

#[async_trait::async_trait]
impl TemplateHandle for Template {
    fn server(&self) -> &ForkServer {
        &self.server
    }
    async fn end(&self) {
        Template::end(self).await
    }
}

/// Why a user's template did not start, or a kernel was not forked from it (logged; the
/// kernel is then started plainly).
#[derive(Debug, thiserror::Error)]
enum TemplateError {
    #[error(transparent)]
    Files(#[from] SandboxError),
    #[error(transparent)]
    Interrupted(#[from] tokio::task::JoinError),
    #[error("cannot create the template's exec: {advice}")]
    ExecNotCreated {
        advice: String,
        #[source]
        source: bollard::errors::Error,
    },
    #[error("cannot start the template: {advice}")]
    ExecNotStarted {
        advice: String,
        #[source]
        source: bollard::errors::Error,
    },
    #[error("the daemon did not attach the template's stdin and stdout")]
    NotAttached,
    #[error("the daemon did not report the template's pid")]
    PidNotReported,
    #[error(transparent)]
    Place(#[from] PlaceError),
    #[error("the template: {0}")]
    NotReady(#[source] NotReady),
    #[error("the template's process was not found")]
    ProcessNotFound,
    #[error(transparent)]
    SocketPath(#[from] SocketPathError),
    #[error(transparent)]
    Request(#[from] RequestFailed),
    #[error("the template's child {0} is not among its processes")]
    ChildNotFound(i32),
    #[error("cannot move the forked kernel into its cgroup: {0}")]
    NotMoved(#[source] SandboxError),
    #[error("cannot watch the forked kernel: {0}")]
    Unwatchable(#[source] std::io::Error),
}

impl Inner {
    /// Whether launches of this sandbox may use templates at all.
    pub(super) fn forks(&self) -> bool {
        self.cfg.fork_server && !self.cfg.keep_kernels && self.privileged
    }

    /// A kernel forked from the user's template (started if there is none: the first
    /// launch waits for it), or `None`: start it plainly (the reason is logged).
    pub(super) async fn launch_forked(
        self: &Arc<Self>,
        docker: &Docker,
        container: &Arc<ContainerInfo>,
        spec: &LaunchSpec,
    ) -> Option<Launched> {
        if !self.forks() {
            return None;
        }
        let preload = boot::resolve_preload(
            self.cfg.user_preload.get(&spec.user.name),
            &serde_json::Value::Null,
            &self.cfg.preload,
        );
        if preload.is_empty() {
            return None;
        }
        let template = self.template(docker, container, spec, &preload).await?;
        match self.fork_kernel(&template, docker, container, spec).await {
            Ok(launched) => {
                tracing::info!(session = %spec.session_id, user = %spec.user.name, container = %container.name, "kernel forked from the user's template");
                Some(launched)
            }
            Err(e) => {
                tracing::warn!(session = %spec.session_id, error = %e, "fork failed; starting the kernel plainly");
                None
            }
        }
    }

    /// The user's working template, started if there is none and the last failure is
    /// older than [`RETRY_AFTER`].
    async fn template(
        &self,
        docker: &Docker,
        container: &Arc<ContainerInfo>,
        spec: &LaunchSpec,
        preload: &[String],
    ) -> Option<Arc<Template>> {
        self.templates
            .slots
            .get_or_start(
                &spec.user.name,
                &spec.kernel_name,
                |t| t.container_id == container.id,
                || self.start_template(docker, container, spec, preload),
            )
            .await
    }

    async fn start_template(
        &self,
        docker: &Docker,
        container: &ContainerInfo,
        spec: &LaunchSpec,
        preload: &[String],
    ) -> Result<Template, TemplateError> {
        let user = &spec.user;
        let started_at = Instant::now();
        let dir = format!("t{}", &Uuid::new_v4().simple().to_string()[..11]);
        let host_dir = self.user_run_dir(&user.name).join(&dir);
        let files = SessionFiles {
            dir: host_dir.clone(),
            privileged: self.privileged,
            connection: None,
        };
        // The script goes into the user's runtime directory itself (the broker's, 0711, at
        // /run/kernel in the container), never into a session directory, which the kernel
        // owns and which would be the script's sys.path[0] (see `boot::install_script`).
        let user_dir = self.user_run_dir(&user.name);
        tokio::task::spawn_blocking(move || {
            boot::install_script(&user_dir).map_err(crate::sandbox::fsutil::io_err(
                "cannot install the kernels' bootstrap script",
                &user_dir,
            ))?;
            files.write()
        })
        .await??;
        let started = self
            .run_template(docker, container, spec, preload, &dir, &host_dir)
            .await;
        let (template, ready) = match started {
            Ok(t) => t,
            Err(e) => {
                remove_dir_logged(host_dir).await;
                return Err(e);
            }
        };
        tracing::info!(
            user = %user.name,
            kernel = %spec.kernel_name,
            container = %container.name,
            modules = ?ready.modules,
            threads = ready.threads,
            import_seconds = ready.seconds,
            seconds = started_at.elapsed().as_secs_f64(),
            "fork-server template ready"
        );
        Ok(template)
    }

    /// Starts the template's exec, places it in its leaf, lets it go, and waits for its
    /// first line.
    async fn run_template(
        &self,
        docker: &Docker,
        container: &ContainerInfo,
        spec: &LaunchSpec,
        preload: &[String],
        dir: &str,
        host_dir: &std::path::Path,
    ) -> Result<(Template, crate::sandbox::fork_server::Ready), TemplateError> {
        let user = &spec.user;
        let script = format!("{RUN_DIR_INSIDE}/{BOOT_SCRIPT_NAME}");
        // Module names are checked (`boot::is_module_name`): nothing the shell reads.
        let command = format!(
            "{wait}exec {TINI_INSIDE} -s -- {}",
            boot::template_argv(PYTHON_INSIDE, &script, preload).join(" "),
            wait = wait_for_go(dir),
        );
        let cmd = vec!["sh".to_string(), "-c".to_string(), command];
        // The python3 spec's own variables (its kernel.json's `env`), which its forks
        // inherit, as the local template has them; a session's own are set in each fork.
        let mut env = base_env(&user.limits);
        env.extend(self.spec_env("python3"));
        let exec_id = create_kernel_exec(docker, &container.id, cmd, env, true)
            .await
            .map_err(|source| TemplateError::ExecNotCreated {
                advice: self.advice(&source),
                source,
            })?;
        let attached = start_exec(docker, &exec_id, false)
            .await
            .map_err(|source| TemplateError::ExecNotStarted {
                advice: self.advice(&source),
                source,
            })?;
        let StartExecResults::Attached { output, input } = attached else {
            return Err(TemplateError::NotAttached);
        };
        // Its own leaf before it runs: everything it does is charged there, and its end
        // (the leaf's removal) takes nothing else along.
        let tini = tokio::time::timeout(EXEC_TIMEOUT, exec_pid(docker, &exec_id))
            .await
            .map_err(|_| TemplateError::PidNotReported)??;
        let limits = KernelLimits {
            memory_bytes: 0,
            pids: user.limits.session_pids,
        };
        let leaf_name = format!("kb-template-{dir}");
        let (cgroup, leaf) =
            tokio::task::spawn_blocking(move || leaf_for(tini, &leaf_name, &limits)).await??;
        let fail = |leaf: Leaf, why: TemplateError| async move {
            ContainerCgroup::remove_leaf(&leaf).await;
            Err(why)
        };
        if let Err(e) = let_go(host_dir) {
            return fail(leaf, e.into()).await;
        }
        let name = format!("{}/{}", user.name, spec.kernel_name);
        let log_name = name.clone();
        let filter = self.cfg.log_filter.clone();
        // stdout frames are the answers; stderr frames go to the log (cut short, and
        // through the broker's filter: forked kernels write their stderr here).
        let stdout = output.filter_map(move |frame| {
            let out = match frame {
                Ok(LogOutput::StdOut { message }) => Some(Ok(message)),
                Ok(LogOutput::StdErr { message }) => {
                    let text = &message[..message.len().min(MAX_LOG_FRAME)];
                    let text = String::from_utf8_lossy(text);
                    let text = filter.as_ref().map_or(text.to_string(), |f| f.apply(&text));
                    tracing::debug!(template = %log_name, stderr = %text.trim_end(), "template output");
                    None
                }
                Ok(_) => None,
                Err(e) => Some(Err(std::io::Error::other(e.to_string()))),
            };
            std::future::ready(out)
        });
        let mut answers = BufReader::new(StreamReader::new(Box::pin(stdout)));
        let ready = match read_ready(&mut answers).await {
            Ok(r) => r,
            Err(e) => return fail(leaf, TemplateError::NotReady(e)).await,
        };
        // Its Python is tini's child, `ready.pid` inside the container.
        let host_pid = child_with_namespace_pid(tini, ready.pid);
        let Some(host_pid) = host_pid else {
            return fail(leaf, TemplateError::ProcessNotFound).await;
        };
        let server = ForkServer::new(Box::new(input), answers, name);
        Ok((
            Template {
                container_id: container.id.clone(),
                host_pid,
                cgroup,
                leaf,
                host_dir: host_dir.to_path_buf(),
                server,
            },
            ready,
        ))
    }

    /// A kernel forked from `template`: its own session directory, connection file, key and
    /// leaf, watched by [`watch_forked`].
    async fn fork_kernel(
        self: &Arc<Self>,
        template: &Arc<Template>,
        docker: &Docker,
        container: &Arc<ContainerInfo>,
        spec: &LaunchSpec,
    ) -> Result<Launched, TemplateError> {
        let user = &spec.user;
        let session = spec.session_id;
        let dir = keep::session_dir(session);
        let host_dir = self.user_run_dir(&user.name).join(&dir);
        let endpoints = endpoints_for(&host_dir)?;
        let files = SessionFiles {
            dir: host_dir.clone(),
            privileged: self.privileged,
            connection: Some(connection_file(spec, &dir)),
        };
        tokio::task::spawn_blocking(move || files.write()).await??;
        let forked = self
            .fork_into_leaf(template, spec, &dir)
            .await
            .map_err(|e| (e, host_dir.clone()));
        let (child, host_pid, pidfd, leaf) = match forked {
            Ok(f) => f,
            Err((e, dir)) => {
                remove_dir_logged(dir).await;
                return Err(e);
            }
        };
        let id = session.to_string();
        // The watcher's own copy: the kernel's handle keeps the other for interrupts.
        let watch_fd = pidfd.try_clone().and_then(|fd| {
            // SAFETY: an OwnedFd is a valid open descriptor that stays the same until the
            // AsyncFd that owns it drops it.
            unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
                .map_err(|e| e.into_parts().1)
        });
        let watch_fd = match watch_fd {
            Ok(fd) => fd,
            Err(e) => {
                ContainerCgroup::remove_leaf(&leaf).await;
                template.server.drop_child(&id).await;
                remove_dir_logged(host_dir).await;
                return Err(TemplateError::Unwatchable(e));
            }
        };
        let (watch, exit) = KernelWatch::new(session, user.name.clone(), LOST);
        let shared = Arc::new(DockerKernel {
            watch,
            docker: docker.clone(),
            container: container.clone(),
            dir,
            host_dir,
            exec_id: String::new(),
            forked: Some(ForkedPid {
                host_pid,
                pidfd,
                cgroup: template.cgroup.clone(),
            }),
            exec_pid: None,
            exec_pidfd: None,
            freezer: Some(template.cgroup.freezer(&leaf)),
            leaf: Some(leaf),
            limits: spec.limits,
            workspace: self.workspace_path(user)?,
            quota_bytes: user.limits.workspace_quota_bytes,
        });
        let status = ForkedStatus::Template(child.status);
        let handle = register_forked(self, session, shared, exit, watch_fd, status);
        if let Err(e) = template.server.go(&id).await {
            handle.terminate().await;
            return Err(e.into());
        }
        Ok(Launched {
            endpoints,
            process: Box::new(handle) as Box<dyn KernelProcess>,
        })
    }

    /// Asks for the child, finds it on the host and moves it into its own leaf (it waits
    /// for `go` meanwhile).
    async fn fork_into_leaf(
        &self,
        template: &Template,
        spec: &LaunchSpec,
        dir: &str,
    ) -> Result<
        (
            crate::sandbox::fork_server::Child,
            i32,
            std::os::fd::OwnedFd,
            Leaf,
        ),
        TemplateError,
    > {
        let id = spec.session_id.to_string();
        let connection = format!("{RUN_DIR_INSIDE}/{dir}/connection.json");
        let args = vec!["-f".to_string(), connection.clone(), HISTORY.to_string()];
        // Its forks' runtime directories go in the user's runtime directory beside its own
        // (`fork.rs`): not in its own, which is the kernel's and goes when it ends.
        let env: HashMap<&str, &str> = spec
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .chain([(boot::FORK_ROOT_ENV, RUN_DIR_INSIDE)])
            .collect();
        let server = &template.server;
        let child = server.fork(&id, &args, &env, &connection).await?;
        let Some((host_pid, pidfd)) = find_child(template.host_pid, child.inner_pid) else {
            server.drop_child(&id).await;
            server.set_broken();
            return Err(TemplateError::ChildNotFound(child.inner_pid));
        };
        let (cgroup, limits) = (template.cgroup.clone(), spec.limits);
        let placed =
            tokio::task::spawn_blocking(move || enter_new_leaf(&cgroup, &id, &limits, host_pid))
                .await
                .map_err(TemplateError::Interrupted)
                .and_then(|r| r.map_err(TemplateError::NotMoved));
        match placed {
            Ok(leaf) => Ok((child, host_pid, pidfd, leaf)),
            Err(e) => {
                let _ = pidfd::signal(&pidfd, pidfd::Signal::KILL);
                server.drop_child(&spec.session_id.to_string()).await;
                Err(e)
            }
        }
    }
}
