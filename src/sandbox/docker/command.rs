//! A command in the user's container (E2B's `commands.run`): a `docker exec` as the
//! kernels' user (the container's 1000:1000), attached to stdin, stdout and stderr, with
//! the kernels' arrangement (`exec.rs`): it records its pid and waits for the `go` file
//! while the broker moves it into a cgroup leaf of its own with a kernel's limits, then
//! runs under its own `tini -s` (a subreaper: what the command double-forks stays in its
//! subtree). Its end, or its kill, runs the reaper exec over its subtree and the
//! container's orphans, so nothing it started outlives it. The container has no network
//! and a read-only root, as for kernels.
//!
//! With a `pty`, the exec is created and started with Docker's terminal (`Tty`), its output
//! read raw and its size set through the exec API's resize.
//!
//! The reaper recognises the exec by a path in its argv (`/run/kernel/<dir>/connection.json`,
//! as for a kernel; here a placeholder file, never a connection).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bollard::exec::{CreateExecOptions, StartExecResults};
use bollard::Docker;
use futures::StreamExt;
use tokio::io::AsyncWriteExt;
use tokio::sync::watch;
use tokio::time::timeout;
use uuid::Uuid;

use super::daemon::error_text;
use super::exec::SessionFiles;
use super::place::place_kernel;
use super::reaper::REAPER;
use super::running::{exec_output, start_exec, ContainerInfo};
use super::{Inner, EXEC_TIMEOUT, PYTHON_INSIDE, REAP_LIMIT_SECS, RUN_DIR_INSIDE, TINI_INSIDE};
use crate::sandbox::cgroup::{ContainerCgroup, Leaf};
use crate::sandbox::command::{
    CommandControl, CommandExit, CommandSpec, PtySize, ResizeError, RunningCommand,
};
use crate::sandbox::fsutil::{launch_err, launch_failed, launch_step, remove_dir_logged};
use crate::sandbox::own_workspace;
use crate::sandbox::{thread_env, LaunchRefusal, SandboxError};

/// How long the command waits for its `go` file (20 ms rounds), as a kernel does.
const GO_ROUNDS: u32 = 1500;
/// How long a command's shell may take to write its pid, its first act (under a loaded
/// daemon, seconds); within the [`GO_ROUNDS`] it then waits for `go`.
const PID_WAIT: Duration = Duration::from_secs(20);

impl Inner {
    pub(super) async fn start_command(
        self: &Arc<Self>,
        spec: CommandSpec,
    ) -> Result<RunningCommand, SandboxError> {
        let user = spec.user.clone();
        if spec.argv.is_empty() {
            return Err(launch_err(&user, LaunchRefusal::EmptyCommand));
        }
        self.startup().await?;
        let docker = self.client().await?;
        let target = self.target(&user, spec.own_workspace)?;
        let container = {
            let slot = self.slot(&target.slot);
            let mut guard = slot.container.lock().await;
            self.running_container(&docker, &mut guard)
                .await?
                .ok_or_else(|| launch_err(&user, LaunchRefusal::NoContainer))?
        };
        let id = Uuid::new_v4();
        let dir = format!("c{}", &id.simple().to_string()[..12]);
        let host_dir = self.user_run_dir(&target.slot).join(&dir);
        let files = SessionFiles {
            dir: host_dir.clone(),
            privileged: self.privileged,
            connection: Some(serde_json::Value::Null),
        };
        tokio::task::spawn_blocking(move || files.write())
            .await
            .map_err(|e| launch_step(&user, "preparing files failed", e))??;
        let marker = format!("{RUN_DIR_INSIDE}/{dir}/connection.json");
        // The exec becomes `tini -s -- sh -c ... MARKER CWD command...`: the marker stays in
        // the argv of the exec's process (the reaper's key), and the inner `sh` changes to
        // the working directory and runs the command.
        let script = format!(
            "echo $$ > {RUN_DIR_INSIDE}/{dir}/pid; i=0; \
             while [ ! -e {RUN_DIR_INSIDE}/{dir}/go ]; do i=$((i+1)); \
             [ $i -gt {GO_ROUNDS} ] && exit 125; sleep 0.02; done; \
             exec {TINI_INSIDE} -s -- sh -c 'cd -- \"$1\" || exit 1; shift; \"$@\"' \"$0\" \"$@\""
        );
        let mut cmd = vec!["sh".to_string(), "-c".to_string(), script, marker.clone()];
        // A session with a workspace of its own starts in E2B's home (its own container's,
        // `own.rs`).
        let home = match spec.own_workspace {
            Some(_) => own_workspace::HOME_INSIDE,
            None => super::WORKSPACE_INSIDE,
        };
        cmd.push(spec.cwd.clone().unwrap_or_else(|| home.into()));
        cmd.extend(spec.argv.iter().cloned());
        // The kernels' Python first on the PATH, as in the local sandbox.
        let mut env = vec![format!(
            "PATH={}:/usr/local/bin:/usr/bin:/bin",
            PYTHON_INSIDE.trim_end_matches("/python")
        )];
        env.extend(
            thread_env(&user.limits)
                .into_iter()
                .map(|(k, v)| format!("{k}={v}")),
        );
        if spec.own_workspace.is_some() {
            env.extend(super::own::own_env());
        }
        env.extend(spec.env.iter().map(|(k, v)| format!("{k}={v}")));
        let fail = |what: &'static str, e: bollard::errors::Error| launch_step(&user, what, e);
        let exec = docker
            .create_exec(
                &container.id,
                CreateExecOptions {
                    cmd: Some(cmd),
                    env: Some(env),
                    working_dir: Some(super::WORKSPACE_INSIDE.to_string()),
                    attach_stdin: Some(true),
                    attach_stdout: Some(true),
                    attach_stderr: Some(true),
                    tty: spec.pty.map(|_| true),
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| fail("cannot create the command's exec", e))?;
        let started = match spec.pty {
            None => start_exec(&docker, &exec.id, false).await,
            Some(_) => start_tty_exec(&docker, &exec.id).await,
        }
        .map_err(|e| fail("cannot start the command", e))?;
        // A terminal's size is set before the command passes its `go` file.
        if let Some(size) = spec.pty {
            resize_exec(&docker, &exec.id, size)
                .await
                .map_err(|e| launch_step(&user, "cannot size the command's terminal", e))?;
        }
        let StartExecResults::Attached { mut output, input } = started else {
            remove_dir_logged(host_dir).await;
            return Err(launch_err(&user, LaunchRefusal::ExecNotAttached));
        };
        // The shell's pid (the one the sandbox shows), before it may go: what only this
        // command's shell wrote, not yet anything the command itself ran.
        let pid = match super::place::written_pid(&host_dir, PID_WAIT).await {
            Ok(pid) => pid,
            Err(e) => {
                remove_dir_logged(host_dir).await;
                return Err(launch_failed(&user, e));
            }
        };
        let placeable = self.privileged.then_some(exec.id.as_str());
        let leaf = match place_kernel(&docker, placeable, &host_dir, &id.to_string(), &spec.limits)
            .await
        {
            Ok(leaf) => leaf.map(Arc::new),
            Err(e) => {
                remove_dir_logged(host_dir).await;
                return Err(launch_failed(&user, e));
            }
        };
        // Demultiplex the exec's output into two pipes the caller reads.
        let (mut out_w, out_r) = tokio::io::duplex(64 << 10);
        let (mut err_w, err_r) = tokio::io::duplex(64 << 10);
        let (exit_tx, exit_rx) = watch::channel(None);
        let control = Arc::new(DockerCommand {
            docker: docker.clone(),
            container: container.clone(),
            dir: dir.clone(),
            marker,
            leaf: leaf.clone(),
            exit: exit_rx,
            tty: spec.pty.map(|_| exec.id.clone()),
        });
        let reaper = control.clone();
        let exec_id = exec.id.clone();
        tokio::spawn(async move {
            while let Some(chunk) = output.next().await {
                use bollard::container::LogOutput;
                let written = match chunk {
                    Ok(LogOutput::StdOut { message }) | Ok(LogOutput::Console { message }) => {
                        out_w.write_all(&message).await
                    }
                    Ok(LogOutput::StdErr { message }) => err_w.write_all(&message).await,
                    Ok(LogOutput::StdIn { .. }) => Ok(()),
                    Err(_) => break,
                };
                // A reader that went away does not stop the command; its output is dropped.
                let _ = written;
            }
            drop((out_w, err_w));
            let code = match docker.inspect_exec(&exec_id).await {
                Ok(info) => info.exit_code,
                Err(_) => None,
            };
            reaper.reap().await;
            if let Some(leaf) = &reaper.leaf {
                ContainerCgroup::remove_leaf(leaf).await;
            }
            remove_dir_logged(host_dir).await;
            // tini reports a signal death as 128 + the signal, as a shell does.
            let code = code.and_then(|c| i32::try_from(c).ok());
            let _ = exit_tx.send(Some(CommandExit {
                code,
                signal: code.is_none().then_some(libc::SIGKILL),
            }));
        });
        tracing::info!(user = %user.name, container = %container.name, pid, "command started in the container");
        Ok(RunningCommand {
            pid,
            stdin: Box::new(input),
            stdout: Box::new(out_r),
            stderr: Box::new(err_r),
            control,
        })
    }
}

struct DockerCommand {
    docker: Docker,
    container: Arc<ContainerInfo>,
    dir: String,
    marker: String,
    leaf: Option<Arc<Leaf>>,
    exit: watch::Receiver<Option<CommandExit>>,
    /// The exec's id when it runs on a terminal (Docker's, resized through the exec API).
    tty: Option<String>,
}

impl DockerCommand {
    /// Kills the command's subtree and the container's orphans ([`REAPER`]).
    async fn reap(&self) {
        let limit = REAP_LIMIT_SECS.to_string();
        let log = format!("/tmp/{}.log", self.dir);
        let cmd = [
            PYTHON_INSIDE,
            "-I",
            "-S",
            "-c",
            REAPER,
            &self.marker,
            &log,
            &limit,
        ];
        let _serial = self.container.reaping.lock().await;
        let limit = EXEC_TIMEOUT + Duration::from_secs(u64::from(REAP_LIMIT_SECS));
        match timeout(limit, exec_output(&self.docker, &self.container.id, &cmd)).await {
            Ok(Ok((0, _))) => {}
            Ok(Ok((code, out))) => {
                tracing::warn!(code, output = %out.trim(), "the command's reaper did not finish cleanly")
            }
            Ok(Err(e)) => tracing::debug!(error = %error_text(&e), "the command's reaper failed"),
            Err(_) => tracing::warn!("the command's reaper timed out"),
        }
    }
}

#[async_trait]
impl CommandControl for DockerCommand {
    async fn signal(&self, signal: i32) {
        let script = format!(
            "p=$(cat {RUN_DIR_INSIDE}/{dir}/pid 2>/dev/null) && [ -n \"$p\" ] && \
             grep -aqF {marker} /proc/$p/cmdline 2>/dev/null && kill -{signal} $p",
            dir = self.dir,
            marker = self.marker,
        );
        let _ = timeout(
            EXEC_TIMEOUT,
            exec_output(&self.docker, &self.container.id, &["sh", "-c", &script]),
        )
        .await;
    }

    async fn kill(&self) {
        self.reap().await;
        self.wait().await;
    }

    async fn resize(&self, size: PtySize) -> Result<(), ResizeError> {
        let Some(exec) = &self.tty else {
            return Err(ResizeError::NotATerminal);
        };
        resize_exec(&self.docker, exec, size).await
    }

    async fn wait(&self) -> CommandExit {
        let mut rx = self.exit.clone();
        let seen = rx.wait_for(Option::is_some).await.map(|v| *v);
        match seen {
            Ok(Some(v)) => v,
            _ => CommandExit {
                code: None,
                signal: Some(libc::SIGKILL),
            },
        }
    }
}

/// Starts an exec created with a terminal (Docker allocates it in the container, the exec's
/// controlling terminal; its output arrives raw, as `Console`).
async fn start_tty_exec(
    docker: &Docker,
    exec_id: &str,
) -> Result<StartExecResults, bollard::errors::Error> {
    let options = bollard::exec::StartExecOptions {
        detach: false,
        tty: true,
        ..Default::default()
    };
    docker.start_exec(exec_id, Some(options)).await
}

/// Sets the size of an exec's terminal (the exec API's resize, which delivers `SIGWINCH`).
async fn resize_exec(docker: &Docker, exec_id: &str, size: PtySize) -> Result<(), ResizeError> {
    let options = bollard::exec::ResizeExecOptions {
        height: size.rows,
        width: size.cols,
    };
    timeout(EXEC_TIMEOUT, docker.resize_exec(exec_id, options))
        .await
        .map_err(|e| ResizeError::Failed(Box::new(e)))?
        .map_err(|e| ResizeError::Failed(Box::new(e)))
}
