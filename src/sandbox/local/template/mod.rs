//! Fork-server starts: per user and kernel spec, a template process in a sandbox of the
//! user's own (same uid, limits, workspace, seccomp filter, no network) that has imported
//! the data stack once; each new kernel is forked from it and becomes an ordinary
//! ipykernel with its own connection file, key, sockets, pid and cgroup leaf. The forked
//! kernels share the template's imported pages copy-on-write.
//!
//! The broker talks to the template over its stdin and stdout (`kernels/
//! kernel_broker_boot.py` describes the protocol). A fork: the broker makes the kernel's
//! runtime directory inside the template's (`<template>/<n>/`, seen as `/run/kernel/<n>`)
//! and its leaf, asks for a fork, finds the child's host pid among the template's children
//! (by its pid inside the sandbox, checked again through a pidfd), moves it into the leaf,
//! and only then lets it run: everything the kernel allocates from its first instruction is
//! its own. The kernel's end is seen through that pidfd; its status comes from the template,
//! which reaps it.
//!
//! Stems (cgroup v1): the fork and the move into a leaf are done ahead of need. After each
//! launch the template forks one more child, a *stem*, which the broker moves into a leaf
//! of its own and which waits, having run nothing but the fork, to be told what kernel to
//! become; the next launch renames its leaf after the session, sets the session's limits
//! and releases it with the kernel's arguments. The launch so skips the fork and the move,
//! whose `cgroup.procs` write waits for an RCU grace period on v1 (~10 ms measured). A stem
//! found dead or stopped (a kernel of the same user may kill or stop it) is discarded and
//! the launch forks; a stem ends with its template, and does not keep an idle template
//! alive.
//!
//! What forked kernels of one user share that started ones do not: the template's pid, IPC
//! and mount namespaces (so its `/tmp`) — the user's trust domain, as one container is for
//! the Docker backend. Each forked kernel is non-dumpable and removes its connection file
//! once loaded, so another kernel of the same uid cannot read its key; the seccomp filter
//! forbids ptrace. The template's output is untrusted: lines are bounded, and a pid it
//! names is used only if it is the template's own child.
//!
//! A template is used only with cgroups (each kernel's leaf is what kills all of it) and
//! without `--keep-sessions` (a kept kernel must outlive the broker on its own; a forked one
//! lives in its template's sandbox). Whatever goes wrong falls back to a plain start; a
//! template that failed is not tried again for [`RETRY_AFTER`].

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_trait::async_trait;
use tokio::io::unix::AsyncFd;
use tokio::io::{BufReader, Interest};
use uuid::Uuid;

use super::files::endpoints_for;
use super::process::{SandboxCommand, StartOptions};
use super::reaper::{sandbox_command_pid, Reaped, Watched};
use super::{LocalSandbox, BOOT_DIR_INSIDE, RUN_DIR_INSIDE, TERMINATE_TIMEOUT};
use crate::sandbox::boot::{self, BOOT_SCRIPT_NAME};
use crate::sandbox::cgroup::Cgroups;
use crate::sandbox::fork::ForkOrigin;
use crate::sandbox::fork_server::{read_ready, ForkServer, NotReady, RequestFailed};
use crate::sandbox::fsutil::{self, launch_failed, FileMode, SocketPathError};
use crate::sandbox::procfs::namespace_pid;
use crate::sandbox::template_slots::{TemplateHandle, TemplateSlots};
use crate::sandbox::watched::WatchedKernel;
use crate::sandbox::{KernelProcess, LaunchSpec, Launched, SandboxError, SandboxUser};
use crate::sync::lock;

mod stem;

use self::stem::{claim, new_stem, template_limits, Stem, StemError};

/// Why a kernel could not be forked from its template.
#[derive(Debug, thiserror::Error)]
enum ForkError {
    #[error("session {0} already has a kernel")]
    SessionHasKernel(Uuid),
    #[error(transparent)]
    Stem(StemError),
    #[error(transparent)]
    SocketPath(#[from] SocketPathError),
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    #[error(transparent)]
    Interrupted(#[from] tokio::task::JoinError),
    #[error("the stem was taken apart")]
    StemTakenApart,
    #[error("cannot watch the kernel: {0}")]
    Unwatchable(#[source] std::io::Error),
    #[error(transparent)]
    Release(#[from] RequestFailed),
}

/// Why a started template cannot serve forks.
#[derive(Debug, thiserror::Error)]
enum TemplateNotStarted {
    #[error("the template: no control channel")]
    NoControlChannel,
    #[error("the template: {0}")]
    NotReady(#[source] NotReady),
    #[error("the template: its process was not found")]
    ProcessNotFound,
}

/// A fork from the template that failed, as a launch reports it.
#[derive(Debug, thiserror::Error)]
#[error("forking from the template: {0}")]
struct ForkFailed(#[source] ForkError);

/// The templates of one sandbox, by user and kernel spec.
#[derive(Default)]
pub(super) struct Templates {
    slots: TemplateSlots<Template>,
    /// Per user, a count of launches: an idle user's templates end only if no launch came
    /// during the grace period.
    launches: Mutex<HashMap<String, u64>>,
}

impl Templates {
    /// Counts a launch for `user` (see [`Self::end_idle`]).
    pub fn launched(&self, user: &str) -> u64 {
        let mut launches = lock(&self.launches);
        let n = launches.entry(user.to_string()).or_default();
        *n += 1;
        *n
    }

    /// The launch count of `user` now.
    pub fn launches(&self, user: &str) -> u64 {
        lock(&self.launches).get(user).copied().unwrap_or(0)
    }

    /// Ends `user`'s templates that have no kernel alive, unless a launch came since
    /// `launches` was read (the user is back). A template holds the imported stack (~130 MB);
    /// an idle user does not keep it.
    pub async fn end_idle(&self, user: &str, launches: u64) {
        if self.launches(user) != launches {
            return;
        }
        self.slots
            .end(Some(user), true, || self.launches(user) == launches)
            .await;
    }

    /// Ends every template (broker shutdown); their kernels are ended by then.
    pub async fn shutdown(&self) {
        self.slots.end(None, false, || true).await;
    }
}

/// One running template.
pub(super) struct Template {
    /// Its sandbox, watched like a kernel's (its reaper removes its leaf and directory).
    process: Box<dyn KernelProcess>,
    /// Host pid of the template's Python (pid 2 in its sandbox).
    host_pid: i32,
    /// Its runtime directory on the host (`/run/kernel` inside).
    rundir: PathBuf,
    server: ForkServer,
    /// A child forked and placed ahead of need, for the next launch.
    stem: Mutex<Option<Stem>>,
    /// Whether a stem is being made.
    stemming: AtomicBool,
    /// Set when it is ended: a stem made meanwhile is discarded, not kept.
    ended: AtomicBool,
}

#[async_trait]
impl TemplateHandle for Template {
    fn server(&self) -> &ForkServer {
        &self.server
    }
    /// Its stem is not a kernel: a template with only a stem is idle.
    fn has_children(&self) -> bool {
        self.server.children() > usize::from(lock(&self.stem).is_some())
    }
    async fn end(&self) {
        self.ended.store(true, Ordering::SeqCst);
        let stem = self.take_stem();
        self.process.terminate().await;
        if let Some(stem) = stem {
            stem.discard(&self.server).await;
        }
    }
}

/// A kernel's launch, resolved against its spec: what a fork needs.
pub(super) struct Bootable<'a> {
    pub python: &'a str,
    pub args: &'a [String],
    pub preload: &'a [String],
    pub spec_env: &'a HashMap<String, String>,
}

impl LocalSandbox {
    /// The user's template for `spec`'s kernel spec, started if there is none (the first
    /// launch waits for it: about as long as a plain start with the same imports).
    pub(super) async fn template(
        &self,
        spec: &LaunchSpec,
        boot: &Bootable<'_>,
        cgroups: &Arc<Cgroups>,
    ) -> Option<Arc<Template>> {
        self.templates
            .slots
            .get_or_start(
                &spec.user.name,
                &spec.kernel_name,
                |_| true,
                || self.start_template(spec, boot, cgroups),
            )
            .await
    }

    async fn start_template(
        &self,
        spec: &LaunchSpec,
        boot: &Bootable<'_>,
        cgroups: &Arc<Cgroups>,
    ) -> Result<Template, SandboxError> {
        let user = &spec.user;
        let id = Uuid::new_v4();
        let started_at = Instant::now();
        let template_spec = LaunchSpec {
            session_id: id,
            user: user.clone(),
            kernel_name: spec.kernel_name.clone(),
            key: String::new(),
            env: Vec::new(),
            // No memory limit of its own (the user's total binds it): the template runs no
            // user code, and its leaf is charged for what forking costs (page tables, the
            // pages a child touches before it is moved out), which grows with the number of
            // kernels; a limit of one session's size was reached at ~75 forks (measured),
            // and the template's end takes its forked kernels along.
            limits: template_limits(user),
            own_workspace: None,
        };
        let script = format!("{BOOT_DIR_INSIDE}/{BOOT_SCRIPT_NAME}");
        let argv = boot::template_argv(boot.python, &script, boot.preload);
        let started = self
            .start_sandbox(
                template_spec,
                SandboxCommand {
                    argv,
                    env: boot.spec_env.clone(),
                    resource_dir: None,
                },
                Some(cgroups.clone()),
                StartOptions {
                    boot_script: true,
                    control: true,
                    restore: None,
                },
            )
            .await?;
        let process = started.launched.process;
        let fail = |why: TemplateNotStarted| launch_failed(user, why);
        let Some((stdin, stdout)) = started.control else {
            process.terminate().await;
            return Err(fail(TemplateNotStarted::NoControlChannel));
        };
        let mut stdout = BufReader::new(stdout);
        let ready = match read_ready(&mut stdout).await {
            Ok(r) => r,
            Err(e) => {
                process.terminate().await;
                return Err(fail(TemplateNotStarted::NotReady(e)));
            }
        };
        let host_pid = started
            .kernel
            .init_pid
            .get()
            .and_then(|init| sandbox_command_pid(*init))
            .filter(|pid| namespace_pid(*pid) == Some(ready.pid));
        let Some(host_pid) = host_pid else {
            process.terminate().await;
            return Err(fail(TemplateNotStarted::ProcessNotFound));
        };
        let server = ForkServer::new(
            Box::new(stdin),
            stdout,
            format!("{}/{}", user.name, spec.kernel_name),
        );
        tracing::info!(
            user = %user.name,
            kernel = %spec.kernel_name,
            modules = ?ready.modules,
            threads = ready.threads,
            import_seconds = ready.seconds,
            seconds = started_at.elapsed().as_secs_f64(),
            "fork-server template ready"
        );
        Ok(Template {
            process,
            host_pid,
            rundir: self.run_base.join(id.to_string()),
            server,
            stem: Mutex::new(None),
            stemming: AtomicBool::new(false),
            ended: AtomicBool::new(false),
        })
    }

    /// A kernel forked from `template`: its own directory, connection file, key, leaf.
    /// The template's stem is used when it has one (forked and placed in a leaf ahead of
    /// need, so the launch skips the fork and the move into the leaf, which on cgroup v1
    /// waits for an RCU grace period: ~10 ms); otherwise a child is forked and placed now.
    /// Either way the next stem is made once this kernel is released.
    pub(super) async fn fork_kernel(
        &self,
        template: &Arc<Template>,
        spec: &LaunchSpec,
        boot: &Bootable<'_>,
        cgroups: &Arc<Cgroups>,
    ) -> Result<Launched, SandboxError> {
        let user = &spec.user;
        let session = spec.session_id;
        let fail = |e: ForkError| launch_failed(user, ForkFailed(e));
        if self.kernels.contains(&session) {
            return Err(fail(ForkError::SessionHasKernel(session)));
        }
        let stem = match template.take_stem() {
            Some(stem) => match claim(stem, template, session, spec.limits, cgroups).await {
                Ok(stem) => Some(stem),
                Err(e) => {
                    tracing::info!(%session, error = %e, "the template's stem cannot be used; forking");
                    None
                }
            },
            None => None,
        };
        let stem = match stem {
            Some(stem) => stem,
            None => new_stem(template, user, session, spec.limits, cgroups)
                .await
                .map_err(|e| fail(ForkError::Stem(e)))?,
        };
        let launched = self
            .release_stem(template, stem, spec, boot, cgroups)
            .await
            .map_err(&fail);
        if launched.is_ok() {
            template.ensure_stem(user, cgroups);
        }
        launched
    }

    /// Makes `stem` the kernel of `spec`: its runtime directory and connection file, its
    /// reaper, and the release.
    async fn release_stem(
        &self,
        template: &Arc<Template>,
        stem: Stem,
        spec: &LaunchSpec,
        boot: &Bootable<'_>,
        cgroups: &Arc<Cgroups>,
    ) -> Result<Launched, ForkError> {
        let user = &spec.user;
        let session = spec.session_id;
        let server = &template.server;
        let dir = template.rundir.join(&stem.name);
        let inside = format!("{RUN_DIR_INSIDE}/{}", stem.name);
        let prepared = async {
            let endpoints = endpoints_for(&dir)?;
            let ids = self.kernel_ids(user)?;
            let connection = fsutil::connection_file(spec, &format!("{inside}/k"));
            let (rundir, name, dir) = (template.rundir.clone(), stem.name.clone(), dir.clone());
            // The template's runtime directory is the kernel's to write: a kernel of the user
            // may swap what this makes for a symlink at any moment. So everything goes
            // through descriptors (docs/SECURITY.md): the kernel's directory is made in the
            // opened template directory and must be the one made (never a symlink, never a
            // directory of the kernel's), chowned through its descriptor, and the connection
            // file is created in that descriptor.
            tokio::task::spawn_blocking(move || -> Result<(), SandboxError> {
                let parent = fsutil::open_tree_root(&rundir).map_err(fsutil::io_err(
                    "cannot open the template's directory",
                    &rundir,
                ))?;
                let own = fsutil::make_dir_at(parent.as_fd(), Path::new(&name), 0o700, ids)
                    .map_err(fsutil::io_err("cannot create the kernel's directory", &dir))?;
                fsutil::write_connection_file(
                    own.as_fd(),
                    &dir,
                    &connection,
                    FileMode::Masked(0o600),
                    ids,
                )
            })
            .await??;
            Ok::<_, ForkError>(endpoints)
        };
        let endpoints = match prepared.await {
            Ok(endpoints) => endpoints,
            Err(e) => {
                stem.discard(server).await;
                fsutil::remove_dir_logged(dir).await;
                return Err(e);
            }
        };
        let workspace = match self.workspace_path(user) {
            Ok(w) => w,
            Err(e) => {
                stem.discard(server).await;
                fsutil::remove_dir_logged(dir).await;
                return Err(e.into());
            }
        };
        let (name, host_pid) = (stem.name.clone(), stem.host_pid);
        let Some((pidfd, status, leaf)) = stem.into_parts() else {
            return Err(ForkError::StemTakenApart);
        };
        // SAFETY: an OwnedFd is a valid open descriptor that stays the same until the
        // AsyncFd that owns it drops it.
        let pidfd = match unsafe { AsyncFd::register_with_interest(pidfd, Interest::READABLE) } {
            Ok(fd) => fd,
            Err(e) => {
                kill(host_pid);
                cgroups.remove_leaf(&leaf).await;
                fsutil::remove_dir_logged(dir).await;
                server.drop_child(&name).await;
                return Err(ForkError::Unwatchable(e.into_parts().1));
            }
        };
        let process = Watched::Forked { pidfd, status };
        let kernel = Reaped {
            kernel_pid: Some(host_pid),
            fork_origin: Some(ForkOrigin {
                host_pid,
                uid: self.kernel_ids(user).ok().flatten().map(|(uid, _)| uid),
                dir: template.rundir.clone(),
                inside: RUN_DIR_INSIDE.to_string(),
                pid_namespace: None,
                kernel: None,
                own_workspace: None,
            }),
            leaf: Some(leaf),
            cgroups: Some(cgroups.clone()),
            ..Reaped::new(session, user, process, dir, spec.limits, workspace)
        }
        .spawn(&self.kernels);
        let handle = WatchedKernel::new(kernel, TERMINATE_TIMEOUT);
        let connection_inside = format!("{inside}/connection.json");
        let args: Vec<String> = boot
            .args
            .iter()
            .map(|a| a.replace("{connection_file}", &connection_inside))
            .collect();
        // Its forks' runtime directories go beside its own, in the template's directory
        // (`sandbox/fork.rs`): not in its own, which goes when it ends.
        let env: HashMap<&str, &str> = spec
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .chain([(boot::FORK_ROOT_ENV, RUN_DIR_INSIDE)])
            .collect();
        if let Err(e) = server.go_as(&name, &args, &env, &connection_inside).await {
            handle.terminate().await;
            return Err(e.into());
        }
        tracing::info!(%session, user = %user.name, kernel = %spec.kernel_name, pid = host_pid, "kernel forked from its template");
        Ok(Launched {
            endpoints,
            process: Box::new(handle),
        })
    }

    /// Whether this launch may use a template: a bootable spec with something to preload,
    /// cgroups in force, kernels that end with the broker, and the switches on.
    pub(super) fn forks_for(&self, user: &SandboxUser, spec_raw: &serde_json::Value) -> bool {
        self.cfg.fork_server
            && self.kept.is_none()
            && boot::spec_fork_server(spec_raw).unwrap_or(true)
            && !user.name.is_empty()
    }
}

fn kill(pid: i32) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe { libc::kill(pid, libc::SIGKILL) };
}
