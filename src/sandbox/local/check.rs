//! The startup check's test run: the kernels' interpreter started in a sandbox exactly as a
//! kernel would be (binds, uid switch, syscall filter), importing ipykernel, so a broken
//! chain stops the broker before the first session needs it.

use std::io;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tokio::process::Command;
use tokio::time::timeout;
use uuid::Uuid;

use super::bwrap::{bwrap_args, kernel_env, BwrapRequest, HostRoot};
use super::files::LaunchFiles;
use super::host::{unavailable, unavailable_by};
use super::output::STDERR_TAIL_LINES;
use super::process::inherit_fd;
use super::LocalSandbox;
use crate::sandbox::fsutil::remove_dir_logged;
use crate::sandbox::{environ, SandboxError};

/// How long `check` lets its test run in the sandbox take.
const CHECK_TIMEOUT: Duration = Duration::from_secs(60);

impl LocalSandbox {
    /// Runs the kernels' interpreter in a sandbox and imports ipykernel: proves the whole
    /// chain (bwrap, binds, uid switch, venv) before the first session needs it.
    pub(super) async fn smoke_test(&self) -> Result<(), SandboxError> {
        let rundir = self.run_base.join(format!("check-{}", Uuid::new_v4()));
        let workspace = rundir.join("workspace");
        let ids = self
            .privileged
            .then_some((self.cfg.uid_base, self.cfg.uid_base));
        let files = LaunchFiles {
            workspace: workspace.clone(),
            rundir: rundir.clone(),
            ids,
            login: "check".to_string(),
            home: super::HOME_INSIDE,
            connection: serde_json::Value::Null,
            quota: None,
        };
        let prepared = tokio::task::spawn_blocking(move || files.write())
            .await
            .map_err(|e| unavailable_by(format!("preparing the test run failed: {e}"), e))?;
        let result = match prepared {
            Ok(()) => self.run_smoke_test(&rundir, &workspace, ids).await,
            Err(e) => Err(unavailable_by(
                format!("preparing the test run failed: {e}"),
                e,
            )),
        };
        remove_dir_logged(rundir).await;
        result
    }

    async fn run_smoke_test(
        &self,
        rundir: &Path,
        workspace: &Path,
        ids: Option<(u32, u32)>,
    ) -> Result<(), SandboxError> {
        // With a filter, also prove that it is in force (seccomp mode 2), so that a bwrap
        // that silently ignored it would stop the broker here.
        let code = if self.seccomp.is_some() {
            "import ipykernel, sys\n\
             status = open('/proc/self/status').read()\n\
             sys.exit(None if 'Seccomp:\\t2' in status else 'no syscall filter in the sandbox')"
        } else {
            "import ipykernel"
        };
        let argv = self.substitute_argv(
            &["python".to_string(), "-c".to_string(), code.to_string()],
            None,
        );
        let seccomp = self
            .seccomp_memfd()
            .map_err(|e| unavailable_by(format!("cannot pass the syscall filter: {e}"), e))?;
        let seccomp_fd = seccomp.as_ref().map(std::os::fd::AsRawFd::as_raw_fd);
        let environment = environ::launch_script(&kernel_env(&self.venv, "check"), &argv)
            .map_err(io::Error::other)
            .and_then(|script| environ::env_memfd(&script))
            .map_err(|e| unavailable_by(format!("cannot pass the environment: {e}"), e))?;
        let env_fd = std::os::fd::AsRawFd::as_raw_fd(&environment);
        let args = bwrap_args(
            &self.bwrap_opts,
            &HostRoot::probe(&self.cfg.extra_ro_binds),
            &BwrapRequest {
                workspace,
                rundir,
                ids,
                tmp_size: None,
                resource_dir: None,
                boot_dir: None,
                env_fd,
                own: None,
                restore: false,
            },
            seccomp_fd,
        );
        let mut cmd = Command::new(&self.bwrap);
        cmd.args(&args)
            .env_clear()
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        // SAFETY: the closure only calls fcntl, which is async-signal-safe.
        unsafe {
            cmd.pre_exec(move || {
                inherit_fd(env_fd)?;
                if let Some(fd) = seccomp_fd {
                    inherit_fd(fd)?;
                }
                Ok(())
            });
        }
        let output = match timeout(CHECK_TIMEOUT, cmd.output()).await {
            Ok(Ok(output)) => output,
            Ok(Err(e)) => return Err(unavailable_by(format!("cannot run {}: {e}", self.bwrap.display()), e)),
            Err(_) => {
                return Err(unavailable(format!(
                    "a test run of the kernels' Python in the sandbox took longer than {CHECK_TIMEOUT:?}"
                )))
            }
        };
        if output.status.success() {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(STDERR_TAIL_LINES).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        Err(unavailable(format!(
            "a test run of `{} -c 'import ipykernel'` in the sandbox failed ({}): {}. \
             Is the venv set up (kernels/setup.sh)?",
            self.cfg.python.display(),
            output.status,
            tail.join(" | ")
        )))
    }
}
