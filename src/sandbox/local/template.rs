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
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use async_trait::async_trait;
use tokio::io::unix::AsyncFd;
use tokio::io::{BufReader, Interest};
use tokio::sync::oneshot;
use uuid::Uuid;

use super::files::endpoints_for;
use super::output::Tail;
use super::process::StartOptions;
use super::reaper::{sandbox_command_pid, LocalKernel, Reaper, Watched, LOST};
use super::{LocalSandbox, BOOT_DIR_INSIDE, RUN_DIR_INSIDE, TERMINATE_TIMEOUT};
use crate::sandbox::boot::{self, BOOT_SCRIPT_NAME};
use crate::sandbox::cgroup::{CgroupVersion, Cgroups, Leaf};
use crate::sandbox::fork_server::{find_child, read_ready, ForkServer};
use crate::sandbox::fsutil::{self, launch_err, FileMode};
use crate::sandbox::pidfd;
use crate::sandbox::procfs::{namespace_pid, state_of};
use crate::sandbox::template_slots::{TemplateHandle, TemplateSlots};
use crate::sandbox::watched::{KernelWatch, WatchedKernel};
use crate::sandbox::{
    KernelLimits, KernelProcess, LaunchSpec, Launched, SandboxError, SandboxUser,
};
use crate::sync::lock;

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

/// A child of a template, in a cgroup leaf of its own, waiting to be told which kernel to
/// become. Its leaf is its own from the start: it has run nothing but the fork. Dropped
/// before it became a kernel (a launch given up half-way), it is killed and its leaf
/// removed.
struct Stem {
    /// Its id with the template, and the name of its runtime directory once it is a kernel.
    name: String,
    host_pid: i32,
    /// These three are taken when it becomes a kernel (its reaper has them then); the leaf
    /// also when it is discarded.
    pidfd: Option<OwnedFd>,
    status: Option<oneshot::Receiver<i32>>,
    leaf: Option<Leaf>,
    cgroups: Arc<Cgroups>,
}

impl Stem {
    /// Kills it and removes its leaf.
    async fn discard(mut self, server: &ForkServer) {
        self.kill();
        server.drop_child(&self.name).await;
        if let Some(leaf) = self.leaf.take() {
            self.cgroups.remove_leaf(&leaf).await;
        }
    }

    fn kill(&self) {
        if let Some(pidfd) = &self.pidfd {
            let _ = pidfd::signal(pidfd, pidfd::Signal::KILL);
        }
    }

    /// Its pidfd, exit status and leaf, for the kernel it becomes.
    fn into_parts(mut self) -> Option<(OwnedFd, oneshot::Receiver<i32>, Leaf)> {
        Some((self.pidfd.take()?, self.status.take()?, self.leaf.take()?))
    }

    /// Whether it cannot become a kernel: it has ended (its pidfd polls readable), or is
    /// stopped (a kernel of the same user may SIGSTOP it: released, it would never answer).
    fn unusable(&self) -> bool {
        let Some(pidfd) = &self.pidfd else {
            return true;
        };
        if !matches!(state_of(self.host_pid), Some('R' | 'S' | 'D')) {
            return true;
        }
        // A poll that fails counts as ended: the stem is not trusted with a kernel.
        pidfd::ended(pidfd).unwrap_or(true)
    }
}

impl Drop for Stem {
    fn drop(&mut self) {
        let Some(leaf) = self.leaf.take() else { return };
        self.kill();
        let cgroups = self.cgroups.clone();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { cgroups.remove_leaf(&leaf).await });
        }
    }
}

impl Template {
    fn take_stem(&self) -> Option<Stem> {
        lock(&self.stem).take()
    }

    /// Makes the next stem in the background, unless there is one or one is on its way.
    /// Only on cgroup v1: a stem's leaf becomes the session's by a rename, which v2 does not
    /// allow (there a kernel is forked and moved when it is asked for).
    fn ensure_stem(self: &Arc<Self>, user: &SandboxUser, cgroups: &Arc<Cgroups>) {
        if cgroups.version() != CgroupVersion::V1
            || self.ended.load(Ordering::SeqCst)
            || !self.server.usable()
            || lock(&self.stem).is_some()
            || self.stemming.swap(true, Ordering::SeqCst)
        {
            return;
        }
        let (template, user, cgroups) = (self.clone(), user.clone(), cgroups.clone());
        tokio::spawn(async move {
            let limits = template_limits(&user);
            match new_stem(&template, &user, Uuid::new_v4(), limits, &cgroups).await {
                Ok(stem) => {
                    *lock(&template.stem) = Some(stem);
                    // `end` sets `ended` before it takes the stem: either it took this one,
                    // or this sees it ended.
                    if template.ended.load(Ordering::SeqCst) {
                        if let Some(stem) = template.take_stem() {
                            stem.discard(&template.server).await;
                        }
                    }
                }
                Err(e) => {
                    tracing::info!(user = %user.name, error = %e, "no stem made; the next kernel is forked when asked")
                }
            }
            template.stemming.store(false, Ordering::SeqCst);
        });
    }
}

/// A child of `template` in a new leaf named `leaf_name` with `limits`.
async fn new_stem(
    template: &Template,
    user: &SandboxUser,
    leaf_name: Uuid,
    limits: KernelLimits,
    cgroups: &Arc<Cgroups>,
) -> Result<Stem, String> {
    let server = &template.server;
    let leaf = {
        let (cg, name, user_limits) = (cgroups.clone(), user.name.clone(), user.limits.clone());
        tokio::task::spawn_blocking(move || cg.create_leaf(&name, &user_limits, &limits, leaf_name))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?
    };
    let name = server.next_name();
    let child = match server.fork_stem(&name).await {
        Ok(child) => child,
        Err(e) => {
            cgroups.remove_leaf(&leaf).await;
            return Err(e.to_string());
        }
    };
    let inner_pid = child.inner_pid;
    // The child waits for `go`; until then only the broker acts on it.
    let Some((host_pid, pidfd)) = find_child(template.host_pid, inner_pid) else {
        server.drop_child(&name).await;
        server.set_broken();
        cgroups.remove_leaf(&leaf).await;
        return Err(format!("its child {inner_pid} is not among its processes"));
    };
    let stem = Stem {
        name,
        host_pid,
        pidfd: Some(pidfd),
        status: Some(child.status),
        leaf: Some(leaf),
        cgroups: cgroups.clone(),
    };
    // The move into the leaf waits for an RCU grace period (cgroup v1): off the runtime.
    let (stem, entered) = tokio::task::spawn_blocking(move || {
        let entered = stem
            .leaf
            .as_ref()
            .map_or(Ok(()), |l| l.enter(stem.host_pid));
        (stem, entered)
    })
    .await
    .map_err(|e| e.to_string())?;
    if let Err(e) = entered {
        stem.discard(server).await;
        return Err(format!("cannot move it into its cgroup: {e}"));
    }
    Ok(stem)
}

/// Makes `stem` (made ahead of need) the child of `session`: alive, its leaf renamed after
/// the session and given the session's limits.
async fn claim(
    stem: Stem,
    template: &Template,
    session: Uuid,
    limits: KernelLimits,
    cgroups: &Arc<Cgroups>,
) -> Result<Stem, String> {
    if stem.unusable() {
        stem.discard(&template.server).await;
        return Err("it has ended or is stopped".into());
    }
    let cg = cgroups.clone();
    let (stem, claimed) = tokio::task::spawn_blocking(move || {
        let mut stem = stem;
        let claimed = match stem.leaf.as_mut() {
            Some(leaf) => cg.claim_leaf(leaf, session, &limits),
            None => Ok(()),
        };
        (stem, claimed)
    })
    .await
    .map_err(|e| e.to_string())?;
    if let Err(e) = claimed {
        stem.discard(&template.server).await;
        return Err(e.to_string());
    }
    Ok(stem)
}

/// A template's own leaf limits, which a stem has until it is claimed: no memory limit of
/// its own (the user's total binds it), one session's processes.
fn template_limits(user: &SandboxUser) -> KernelLimits {
    KernelLimits {
        memory_bytes: 0,
        pids: user.limits.session_pids,
    }
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
        };
        let script = format!("{BOOT_DIR_INSIDE}/{BOOT_SCRIPT_NAME}");
        let argv = boot::template_argv(boot.python, &script, boot.preload);
        let started = self
            .start_sandbox(
                template_spec,
                argv,
                boot.spec_env.clone(),
                None,
                Some(cgroups.clone()),
                StartOptions {
                    boot_script: true,
                    control: true,
                },
            )
            .await?;
        let process = started.launched.process;
        let fail = |why: String| launch_err(user, format!("the template: {why}"));
        let Some((stdin, stdout)) = started.control else {
            process.terminate().await;
            return Err(fail("no control channel".into()));
        };
        let mut stdout = BufReader::new(stdout);
        let ready = match read_ready(&mut stdout).await {
            Ok(r) => r,
            Err(e) => {
                process.terminate().await;
                return Err(fail(e.to_string()));
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
            return Err(fail("its process was not found".into()));
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
        let fail = |why: String| launch_err(user, format!("forking from the template: {why}"));
        if self.kernels.contains(&session) {
            return Err(fail(format!("session {session} already has a kernel")));
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
                .map_err(&fail)?,
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
    ) -> Result<Launched, String> {
        let user = &spec.user;
        let session = spec.session_id;
        let server = &template.server;
        let dir = template.rundir.join(&stem.name);
        let inside = format!("{RUN_DIR_INSIDE}/{}", stem.name);
        let prepared = async {
            let endpoints = endpoints_for(&dir)?;
            let ids = self.kernel_ids(user).map_err(|e| e.to_string())?;
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
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
            Ok::<_, String>(endpoints)
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
                return Err(e.to_string());
            }
        };
        let (name, host_pid) = (stem.name.clone(), stem.host_pid);
        let Some((pidfd, status, leaf)) = stem.into_parts() else {
            return Err("the stem was taken apart".into());
        };
        let (watch, exit) = KernelWatch::new(session, user.name.clone(), LOST);
        let kernel = Arc::new(LocalKernel {
            watch,
            init_pid: OnceLock::new(),
            bwrap_pid: None,
            kernel_pid: Some(host_pid),
            memory_usage: leaf.memory_usage_file(),
        });
        // SAFETY: an OwnedFd is a valid open descriptor that stays the same until the
        // AsyncFd that owns it drops it.
        let pidfd = match unsafe { AsyncFd::register_with_interest(pidfd, Interest::READABLE) } {
            Ok(fd) => fd,
            Err(e) => {
                kill(host_pid);
                cgroups.remove_leaf(&leaf).await;
                fsutil::remove_dir_logged(dir).await;
                server.drop_child(&name).await;
                return Err(format!("cannot watch the kernel: {e}"));
            }
        };
        let reaper = Reaper {
            process: Watched::Forked { pidfd, status },
            kernel: kernel.clone(),
            exit,
            leaf: Some(leaf),
            cgroups: Some(cgroups.clone()),
            rundir: dir,
            limits: spec.limits,
            workspace,
            quota_bytes: user.limits.workspace_quota_bytes,
            table: self.kernels.clone(),
            tail: Tail::default(),
            kept: None,
        };
        self.kernels.insert(session, kernel.clone());
        tokio::spawn(reaper.run());
        let handle = WatchedKernel::new(kernel, TERMINATE_TIMEOUT);
        let connection_inside = format!("{inside}/connection.json");
        let args: Vec<String> = boot
            .args
            .iter()
            .map(|a| a.replace("{connection_file}", &connection_inside))
            .collect();
        let env: HashMap<&str, &str> = spec
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        if let Err(e) = server.go_as(&name, &args, &env, &connection_inside).await {
            handle.terminate().await;
            return Err(e.to_string());
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
