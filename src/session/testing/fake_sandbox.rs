//! A fake [`Sandbox`]: `launch` starts a [`ScriptedKernel`] on `ipc://` endpoints in a
//! temporary directory, and its [`KernelProcess`] reports an exit when the script says
//! (`die`), when terminated, or when a test says so ([`FakeKernel::exit`]). It remembers
//! every kernel it launched, for whom, and what became of it.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use super::scripted_kernel::ScriptedKernel;
use crate::sandbox::watched::{ExitPublisher, KernelWatch};
use crate::sandbox::{
    ExitReason, KernelLimits, KernelProcess, LaunchRefusal, LaunchSpec, Launched, Sandbox,
    SandboxError, SandboxUser,
};
use crate::sync::lock;

/// One launched kernel, as the test sees it.
pub struct FakeKernel {
    pub kernel: ScriptedKernel,
    /// The user it was launched for.
    pub user: String,
    /// The limits it was launched with.
    pub limits: KernelLimits,
    /// The own workspace it was launched in.
    pub own_workspace: Option<uuid::Uuid>,
    /// The backends' own exit watch: `wait` behaves as theirs does.
    watch: KernelWatch,
    /// Taken by the first exit, as a backend's watcher publishes once.
    publisher: Mutex<Option<ExitPublisher>>,
    terminated: AtomicBool,
}

impl FakeKernel {
    /// The process ends now with `reason` (as an OOM kill or a crash would): the
    /// kernel's sockets close and `wait` answers `reason`.
    pub fn exit(&self, reason: ExitReason) {
        if let Some(publisher) = lock(&self.publisher).take() {
            publisher.publish(reason);
        }
        self.kernel.stop();
    }

    /// Whether the broker terminated it.
    pub fn terminated(&self) -> bool {
        self.terminated.load(Ordering::Acquire)
    }
}

struct FakeProcess(Arc<FakeKernel>);

#[async_trait]
impl KernelProcess for FakeProcess {
    async fn interrupt(&self) -> Result<(), SandboxError> {
        self.0.kernel.signal();
        Ok(())
    }

    async fn wait(&self) -> ExitReason {
        self.0.watch.wait().await
    }

    async fn terminate(&self) {
        self.0.terminated.store(true, Ordering::Release);
        self.0.exit(ExitReason::Terminated);
    }
}

impl Drop for FakeProcess {
    fn drop(&mut self) {
        // As the real backends do: no process outlives its handle.
        self.0.kernel.stop();
    }
}

/// The fake sandbox.
pub struct FakeSandbox {
    dir: tempfile::TempDir,
    launched: Mutex<Vec<Arc<FakeKernel>>>,
    /// Launches refused from now on (a broken sandbox).
    pub refuse: AtomicBool,
    /// `user_idle` calls.
    pub users_idle: AtomicUsize,
    /// The own workspaces removed, in order.
    pub own_removed: Mutex<Vec<uuid::Uuid>>,
}

impl FakeSandbox {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            dir: tempfile::Builder::new()
                .prefix("kb-fake")
                .tempdir()
                .expect("a temporary directory"),
            launched: Mutex::new(Vec::new()),
            refuse: AtomicBool::new(false),
            users_idle: AtomicUsize::new(0),
            own_removed: Mutex::new(Vec::new()),
        })
    }

    /// Every kernel launched so far, in launch order.
    pub fn launched(&self) -> Vec<Arc<FakeKernel>> {
        lock(&self.launched).clone()
    }

    /// The `n`th kernel launched (from 0).
    pub fn kernel(&self, n: usize) -> Arc<FakeKernel> {
        self.launched()[n].clone()
    }
}

#[async_trait]
impl Sandbox for FakeSandbox {
    fn name(&self) -> &'static str {
        "fake"
    }

    async fn check(&self) -> Result<(), SandboxError> {
        Ok(())
    }

    async fn launch(&self, spec: LaunchSpec) -> Result<Launched, SandboxError> {
        if self.refuse.load(Ordering::Acquire) {
            return Err(SandboxError::Launch {
                user: spec.user.name,
                reason: LaunchRefusal::CannotRun {
                    backend: "fake",
                    what: "kernels while the test refuses them",
                },
            });
        }
        let n = lock(&self.launched).len();
        let dir = self.dir.path().join(n.to_string());
        std::fs::create_dir(&dir).map_err(|source| SandboxError::Io {
            what: "creating the kernel directory",
            path: dir.clone(),
            source,
        })?;
        let kernel = ScriptedKernel::start(&dir, &spec.key).await;
        let endpoints = kernel.endpoints.clone();
        let mut died = kernel.exited();
        let (watch, publisher) = KernelWatch::new(
            spec.session_id,
            spec.user.name.clone(),
            "the fake process went away",
        );
        let fake = Arc::new(FakeKernel {
            kernel,
            limits: spec.limits,
            own_workspace: spec.own_workspace,
            user: spec.user.name,
            watch,
            publisher: Mutex::new(Some(publisher)),
            terminated: AtomicBool::new(false),
        });
        // A scripted exit (`die`) is the process ending with that code.
        let weak = Arc::downgrade(&fake);
        tokio::spawn(async move {
            let Ok(code) = died.wait_for(Option::is_some).await.map(|c| c.unwrap_or(1)) else {
                return;
            };
            if let Some(fake) = weak.upgrade() {
                fake.exit(ExitReason::Exited(code));
            }
        });
        lock(&self.launched).push(fake.clone());
        Ok(Launched {
            endpoints,
            process: Box::new(FakeProcess(fake)),
        })
    }

    fn workspace(&self, user: &SandboxUser) -> Result<PathBuf, SandboxError> {
        let dir = self.dir.path().join("ws").join(&user.name);
        std::fs::create_dir_all(&dir).map_err(|source| SandboxError::Io {
            what: "creating the workspace",
            path: dir.clone(),
            source,
        })?;
        Ok(dir)
    }

    async fn user_idle(&self, _user: &SandboxUser) {
        self.users_idle.fetch_add(1, Ordering::AcqRel);
    }

    async fn remove_own_workspace(&self, _user: &SandboxUser, key: uuid::Uuid) {
        lock(&self.own_removed).push(key);
    }

    async fn shutdown(&self) {}
}

/// A user for tests.
pub fn user(name: &str) -> SandboxUser {
    SandboxUser {
        name: name.to_string(),
        index: 0,
        limits: Default::default(),
    }
}
