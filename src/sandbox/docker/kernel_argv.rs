//! A kernel's command line in the user's container: the shells around it that wait for its
//! `go`, record its pid and exit status, and run it under `tini`, and the kernel's own argv
//! (Python's through the bootstrap script; another spec's as written, behind the relay where
//! it binds TCP only), passed to those shells as arguments.

use super::place::wait_for_go;
use super::{PYTHON_INSIDE, RUN_DIR_INSIDE, TINI_INSIDE, VENV_INSIDE};
use crate::kernel::spec::KernelSpec;
use crate::sandbox::boot::{self, BOOT_SCRIPT_NAME};

/// ipykernel's option that keeps IPython's history in memory (see [`kernel_command`]).
pub(super) const HISTORY: &str = "--HistoryManager.hist_file=:memory:";

/// The file of a kernel's session directory its command writes the kernel's exit status to
/// (see [`kernel_command`]). Written by the kernel's own shell, so only as trustworthy as
/// the kernel: read only for a kernel whose exec's process is gone, and only about itself.
pub(super) const STATUS_FILE: &str = "status";

/// Where a kernel's stderr goes in its container (the container's `/tmp`: bounded, the
/// user's), to explain a crash.
pub(super) fn kernel_log(dir: &str) -> String {
    format!("/tmp/kernel-{dir}.log")
}

/// The kernel's command: waits for its `go` (see `place.rs`), runs the kernel under
/// `tini -s` (a child subreaper that reaps zombies: see the module comment, "No process
/// outlives its session"), whose child records its pid (`$$`, kept by `exec`) so that
/// interrupts reach the kernel itself, and sends the kernel's stderr to `/tmp` (the
/// container's tmpfs: bounded, private to the user) to explain a crash. The shell that is
/// the exec's process stays, and when the kernel has ended writes its exit status to
/// [`STATUS_FILE`] before exiting with it: Podman never reports a detached exec's end
/// (`engine.rs`), so there the watcher takes the status from that file once the exec's
/// process is gone. Its stdout only carries ipykernel's connection banner (user output goes
/// to iopub), so it is dropped. IPython's history stays in memory: a file in the shared
/// workspace would make every kernel of the user queue on one SQLite lock.
///
/// A plain start goes through the bootstrap script (`boot.rs`, installed in the user's
/// runtime directory) so that it gets what a forked kernel gets (the inline backend, E2B's
/// hooks), and preloads nothing: the data stack is preloaded in the user's template
/// (`template.rs`), and a fallback stays about as quick as a kernel without it.
pub(super) fn kernel_command(dir: &str, privileged: bool, argv: &[String]) -> Vec<String> {
    // Without root, the broker connects to the kernel's sockets as "other".
    let umask = if privileged { "" } else { "umask 000; " };
    let d = format!("{RUN_DIR_INSIDE}/{dir}");
    // The kernel's argv reaches the shells as their positional parameters ("$@"), never as
    // text of a script.
    let script = format!(
        "{umask}{wait}{TINI_INSIDE} -s -- sh -c 'echo $$ > {d}/pid; exec \"$@\"' kernel \"$@\" \
         >/dev/null 2>{log}; s=$?; echo $s > {d}/{STATUS_FILE}; exit $s",
        wait = wait_for_go(dir),
        log = kernel_log(dir)
    );
    // The connection file as an argument of its own (the script's `$0`, unused): the exec's
    // process is how the reaper (`REAPER`) recognises this kernel's subtree.
    let mut cmd = vec![
        "sh".to_string(),
        "-c".to_string(),
        script,
        format!("{d}/connection.json"),
    ];
    cmd.extend(argv.iter().cloned());
    cmd
}

/// A plain Python kernel's argv: the bootstrap script, preloading nothing (see
/// [`kernel_command`]).
pub(super) fn python_argv(dir: &str) -> Vec<String> {
    let d = format!("{RUN_DIR_INSIDE}/{dir}");
    [
        PYTHON_INSIDE,
        "-I",
        &format!("{RUN_DIR_INSIDE}/{BOOT_SCRIPT_NAME}"),
        "kernel",
        "--preload",
        "",
        "--",
        "-f",
        &format!("{d}/connection.json"),
        HISTORY,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Where the image holds the kernel specs' own files (`{resource_dir}`: docker/Dockerfile).
pub(super) const KERNELS_INSIDE: &str = "/opt/kernel-broker-kernels";

/// Another kernel's argv in the container: its spec's, `python` the image's interpreter,
/// `{prefix}` the image's environment, `{resource_dir}` the spec's files in the image, the
/// connection file the session directory's; a kernel that binds TCP only behind the relay
/// (`boot::relay_argv`), installed beside the bootstrap script.
pub(super) fn spec_argv(spec: &KernelSpec, dir: &str) -> Vec<String> {
    let d = format!("{RUN_DIR_INSIDE}/{dir}");
    let ipc_file = format!("{d}/connection.json");
    let tcp = boot::spec_wants_tcp(&spec.raw);
    let connection = if tcp {
        boot::tcp_connection_file(&ipc_file)
    } else {
        ipc_file.clone()
    };
    let resource_dir = format!("{KERNELS_INSIDE}/{}", spec.name);
    let argv = boot::substitute_argv(
        &spec.argv,
        PYTHON_INSIDE,
        VENV_INSIDE,
        Some(&resource_dir),
        &connection,
    );
    if !tcp {
        return argv;
    }
    boot::relay_argv(
        PYTHON_INSIDE,
        &format!("{RUN_DIR_INSIDE}/{}", boot::RELAY_SCRIPT_NAME),
        &spec.raw,
        (&ipc_file, &connection),
        &argv,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn a_plain_python_kernel_runs_the_bootstrap_script_in_the_session_directory() {
        let cmd = kernel_command("0123456789ab", true, &python_argv("0123456789ab"));
        assert_eq!(cmd[..2], ["sh", "-c"]);
        // The kernel starts only once the broker has placed it in its cgroup leaf.
        assert!(
            cmd[2].starts_with("i=0; while [ ! -e /run/kernel/0123456789ab/go ]; do"),
            "{}",
            cmd[2]
        );
        // tini's child records the kernel's own pid (what interrupts signal), then becomes
        // the kernel.
        assert!(
            cmd[2].contains(
                "; done; /usr/bin/tini -s -- sh -c 'echo $$ > /run/kernel/0123456789ab/pid; \
                 exec \"$@\"' kernel \"$@\" >/dev/null 2>/tmp/kernel-0123456789ab.log; "
            ),
            "{}",
            cmd[2]
        );
        // The shell stays, writes the kernel's exit status and exits with it.
        assert!(
            cmd[2].ends_with("; s=$?; echo $s > /run/kernel/0123456789ab/status; exit $s"),
            "{}",
            cmd[2]
        );
        assert!(kernel_command("d", false, &[])[2].starts_with("umask 000; "));
        // The reaper's key: the connection file, an argument of the exec's own process;
        // then the kernel's argv, as arguments.
        assert_eq!(cmd[3], "/run/kernel/0123456789ab/connection.json");
        assert_eq!(
            cmd[4..],
            [
                "/opt/kernel-venv/bin/python",
                "-I",
                "/run/kernel/kernel_broker_boot.py",
                "kernel",
                "--preload",
                "",
                "--",
                "-f",
                "/run/kernel/0123456789ab/connection.json",
                "--HistoryManager.hist_file=:memory:"
            ]
        );
    }

    #[test]
    fn other_kernels_run_their_specs_argv_in_the_image() {
        let specs = crate::kernel::spec::KernelSpecs::load(Path::new("kernels")).unwrap();
        let sql = spec_argv(specs.get("sql").unwrap(), "d1");
        assert_eq!(
            sql,
            [
                "/opt/kernel-venv/bin/python",
                "-I",
                "/opt/kernel-broker-kernels/sql/kernel_broker_sql.py",
                "-f",
                "/run/kernel/d1/connection.json"
            ]
        );
        // Deno binds TCP only: behind the relay, which writes the TCP file it reads (and
        // puts Deno's late results before their idle).
        let deno = spec_argv(specs.get("javascript").unwrap(), "d1");
        assert_eq!(
            deno[..7],
            [
                "/opt/kernel-venv/bin/python",
                "-I",
                "/run/kernel/kernel_broker_relay.py",
                "--idle-last",
                "/run/kernel/d1/connection.json",
                "/run/kernel/d1/connection-tcp.json",
                "--"
            ]
        );
        assert_eq!(
            deno[7..],
            [
                "deno",
                "jupyter",
                "--kernel",
                "--conn",
                "/run/kernel/d1/connection-tcp.json"
            ]
        );
        let java = spec_argv(specs.get("java").unwrap(), "d1");
        assert!(
            java.contains(&"/opt/kernel-venv/share/jupyter/kernels/java/jjava.jar".to_string()),
            "{java:?}"
        );
    }
}
