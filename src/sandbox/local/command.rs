//! A command in a user's local sandbox (E2B's `commands.run`): the kernel's own bwrap
//! command line (`bwrap.rs`: the same namespaces, file system view, no network but
//! loopback, seccomp filter, the user's uid through `setpriv`, the workspace at
//! `/workspace`), started in a cgroup leaf of its own with a kernel's limits, so it can do
//! no more than the user's kernel could. It always dies with the broker
//! (`--die-with-parent`, also under `--keep-sessions`: commands are not kept), and its
//! handle's drop kills it.
//!
//! Process shape as for a kernel: bwrap (in the leaf from before `exec`) → the sandbox's
//! init → `sh` changing to the working directory → the command. Killing kills the whole
//! leaf, so whatever the command started goes with it.
//!
//! With a `pty` (`terminal.rs`), the broker allocates the terminal, passes its slave as the
//! command's three standard streams and keeps the master; `setsid --ctty` in front of the
//! `sh` makes it the command's controlling terminal.

use std::ffi::OsString;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;

use async_trait::async_trait;
use tokio::process::Child;
use tokio::sync::watch;
use uuid::Uuid;

use super::bwrap::{bwrap_args, BwrapRequest, HostRoot};
use super::own::{own_env, Placement};
use super::process::Prepared;
use super::terminal::{Resizer, Terminal, SETSID};
use super::LocalSandbox;
use crate::sandbox::cgroup::{Cgroups, Leaf};
use crate::sandbox::command::{
    CommandControl, CommandExit, CommandSpec, PtySize, ResizeError, RunningCommand,
};
use crate::sandbox::fsutil::{launch_err, launch_step, remove_dir_logged};
use crate::sandbox::own_workspace;
use crate::sandbox::LaunchRefusal;
use crate::sandbox::SandboxError;

impl LocalSandbox {
    pub(super) async fn start_command(
        &self,
        spec: CommandSpec,
    ) -> Result<RunningCommand, SandboxError> {
        let cgroups = self.startup().await?;
        let user = spec.user.clone();
        if spec.argv.is_empty() {
            return Err(launch_err(&user, LaunchRefusal::EmptyCommand));
        }
        // A runtime directory and a leaf named like a kernel's: the start-up sweeps of the
        // next run remove what a crash leaves, as they do for kernels.
        let id = Uuid::new_v4();
        let Prepared {
            workspace,
            own,
            ids,
            rundir,
            mut guard,
        } = self
            .prepare_launch(
                &user,
                id,
                serde_json::Value::Null,
                spec.limits,
                cgroups.as_ref(),
                Placement {
                    boot_dir: None,
                    own_workspace: spec.own_workspace,
                },
            )
            .await?;

        // `sh` changes to the working directory, then becomes the command: bwrap's own
        // `--chdir` is the workspace, and a missing directory must fail as the command.
        let mut argv = vec![
            "/bin/sh".to_string(),
            "-c".to_string(),
            "cd -- \"$0\" && exec \"$@\"".to_string(),
            spec.cwd.clone().unwrap_or_else(|| {
                match own {
                    Some(_) => own_workspace::HOME_INSIDE,
                    None => super::WORKSPACE_INSIDE,
                }
                .into()
            }),
        ];
        argv.extend(spec.argv.iter().cloned());
        // On a terminal: a session of its own whose controlling terminal it is (`-w`: setsid
        // forks when it leads a process group, and must wait for the command).
        let terminal = match spec.pty {
            Some(size) => {
                let t = Terminal::open(size)
                    .map_err(|e| launch_step(&user, "cannot open a pseudo-terminal", e))?;
                argv.splice(0..0, [SETSID.into(), "-w".into(), "-c".into()]);
                Some(t)
            }
            None => None,
        };
        // The tenant's variables and command reach only the command's own shell, after the
        // drop (theirs after the sandbox's own, so they may set HOME and USER).
        let mut env = match own {
            Some(_) => own_env(),
            None => Vec::new(),
        };
        env.extend(spec.env.iter().cloned());
        let environment = self.environment_memfd(&user, &env, &argv)?;
        let env_fd = environment.as_raw_fd();
        let request = BwrapRequest {
            workspace: &workspace,
            rundir: &rundir,
            ids,
            tmp_size: Some(spec.limits.memory_bytes).filter(|b| *b > 0),
            resource_dir: None,
            boot_dir: None,
            env_fd,
            own: own.as_ref(),
            restore: false,
        };
        let mut opts = self.bwrap_opts.clone();
        opts.die_with_parent = true;
        let seccomp = self
            .seccomp_memfd()
            .map_err(|e| launch_step(&user, "cannot pass the syscall filter", e))?;
        let seccomp_fd = seccomp.as_ref().map(AsRawFd::as_raw_fd);
        let args: Vec<OsString> = bwrap_args(
            &opts,
            &HostRoot::probe(&self.cfg.extra_ro_binds),
            &request,
            seccomp_fd,
        );
        let mut cmd = self.bwrap_command(
            &args,
            guard.leaf.as_ref().map(|(_, l)| l),
            [Some(env_fd), seccomp_fd].into_iter().flatten().collect(),
        );
        cmd.stdin(Stdio::piped()).kill_on_drop(true);
        if let Some(t) = &terminal {
            let [i, o, e] = t
                .slave_stdio()
                .map_err(|e| launch_step(&user, "cannot pass the pseudo-terminal", e))?;
            cmd.stdin(i).stdout(o).stderr(e);
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| launch_step(&user, format!("cannot start {}", self.bwrap.display()), e))?;
        drop(seccomp);
        drop(environment);
        let pid = child.id().unwrap_or(0);
        let (stdin, stdout, stderr, resizer): (Stdin, Stdout, Stdout, _) = match terminal {
            Some(t) => {
                let m = t
                    .into_master()
                    .map_err(|e| launch_step(&user, "cannot hold the pseudo-terminal", e))?;
                let empty: Stdout = Box::new(tokio::io::empty());
                (Box::new(m.input), Box::new(m.output), empty, Some(m.resize))
            }
            None => match (child.stdin.take(), child.stdout.take(), child.stderr.take()) {
                (Some(i), Some(o), Some(e)) => (Box::new(i), Box::new(o), Box::new(e), None),
                _ => return Err(launch_err(&user, LaunchRefusal::NoStandardStreams)),
            },
        };
        let (cgroups, leaf) = guard.disarm();
        let leaf = leaf.map(Arc::new);
        let (exit_tx, exit_rx) = watch::channel(None);
        let control = Arc::new(LocalCommand {
            leaf: leaf.clone(),
            bwrap_pid: i32::try_from(pid).ok(),
            exit: exit_rx,
            terminal: resizer,
        });
        tokio::spawn(reap(child, cgroups, leaf, rundir, exit_tx));
        tracing::info!(user = %user.name, command = %id, pid, "command started in the sandbox");
        Ok(RunningCommand {
            pid,
            stdin,
            stdout,
            stderr,
            control,
        })
    }
}

/// Waits for bwrap, then kills what is left in the leaf and removes the leaf and the
/// runtime directory; only then publishes the exit.
async fn reap(
    mut child: Child,
    cgroups: Option<Arc<Cgroups>>,
    leaf: Option<Arc<Leaf>>,
    rundir: PathBuf,
    exit: watch::Sender<Option<CommandExit>>,
) {
    use std::os::unix::process::ExitStatusExt;
    let status = child.wait().await;
    let ended = match status {
        Ok(s) => CommandExit {
            code: s.code(),
            signal: s.signal(),
        },
        Err(e) => {
            tracing::warn!(error = %e, "waiting for a command failed");
            CommandExit {
                code: None,
                signal: Some(libc::SIGKILL),
            }
        }
    };
    if let (Some(cgroups), Some(leaf)) = (&cgroups, &leaf) {
        cgroups.remove_leaf(leaf).await;
    }
    remove_dir_logged(rundir).await;
    let _ = exit.send(Some(ended));
}

/// The control half of a local command.
struct LocalCommand {
    leaf: Option<Arc<Leaf>>,
    bwrap_pid: Option<i32>,
    exit: watch::Receiver<Option<CommandExit>>,
    /// The command's pseudo-terminal, if it runs on one.
    terminal: Option<Arc<Resizer>>,
}

type Stdin = Box<dyn tokio::io::AsyncWrite + Send + Unpin>;
type Stdout = Box<dyn tokio::io::AsyncRead + Send + Unpin>;

#[async_trait]
impl CommandControl for LocalCommand {
    async fn signal(&self, signal: i32) {
        // bwrap forwards no signal, so it goes to every process of the leaf: the command
        // and what it started (a SIGTERM to bwrap or the sandbox's init ends them all too).
        let pids = match &self.leaf {
            Some(leaf) => leaf.pids(),
            None => self.bwrap_pid.into_iter().collect(),
        };
        for pid in pids.into_iter().filter(|p| *p > 0) {
            // SAFETY: kill(2) has no memory-safety preconditions.
            unsafe { libc::kill(pid, signal) };
        }
    }

    async fn kill(&self) {
        if let Some(pid) = self.bwrap_pid.filter(|p| *p > 0) {
            // The sandbox's init dies with bwrap (`--die-with-parent`), and with it the
            // whole pid namespace.
            // SAFETY: kill(2) has no memory-safety preconditions.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        if let Some(leaf) = &self.leaf {
            leaf.kill_all().await;
        }
        self.wait().await;
    }

    async fn resize(&self, size: PtySize) -> Result<(), ResizeError> {
        match &self.terminal {
            Some(t) => t.resize(size),
            None => Err(ResizeError::NotATerminal),
        }
    }

    async fn wait(&self) -> CommandExit {
        let mut rx = self.exit.clone();
        let seen = rx.wait_for(Option::is_some).await.map(|v| *v);
        match seen {
            Ok(v) => v.unwrap_or(CommandExit {
                code: None,
                signal: None,
            }),
            // The reaper is gone without a word: the runtime is shutting down.
            Err(_) => CommandExit {
                code: None,
                signal: Some(libc::SIGKILL),
            },
        }
    }
}

impl Drop for LocalCommand {
    fn drop(&mut self) {
        if self.exit.borrow().is_none() {
            if let Some(pid) = self.bwrap_pid.filter(|p| *p > 0) {
                // SAFETY: kill(2) has no memory-safety preconditions.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
}
