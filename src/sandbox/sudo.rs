//! `sudo` in a sandbox: E2B's sandboxes give their user passwordless sudo; here nothing in
//! a sandbox ever runs with privileges (setpriv's `no_new_privs`, no capabilities, the
//! syscall filter), so `sudo` is a script that grants nothing and says why, and which
//! setting gives what the user was after: exit code 1, a sentence on stderr, never "command
//! not found". It is the only file of [`TOOLS_DIR_NAME`], a directory of the broker's
//! (root's, 0755) shown read-only in the sandbox, first on the `PATH`.

use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::sync::Mutex;

use super::fsutil::io_err;
use super::SandboxError;
use crate::sync::lock;

/// The tools directory's name in a backend's own directory.
pub const TOOLS_DIR_NAME: &str = "tools";

/// What `sudo` says.
pub const SUDO_REFUSAL: &str = "sudo: kernel-broker's sandboxes grant no privileges: \
commands and kernels run as the sandbox's user and nothing in them can become root. \
To add Python packages, install them into the kernels' environment (the kernel image, \
or the venv of the broker's --kernels-dir); for network access, the operator sets \
--egress (egress_allow). See docs/API.md (E2B).";

fn script() -> String {
    // The sentence is fixed: printed as it is, whatever the arguments.
    format!("#!/bin/sh\ncat >&2 <<'EOF'\n{SUDO_REFUSAL}\nEOF\nexit 1\n")
}

/// Held by whoever writes into a tools directory: launches of different users prepare
/// their directories at the same time, and each writes through the same temporary names
/// (`.sudo.new`, `.passwd.new`), which one writer's clean-up would remove under another's
/// rename (seen as a failed launch, NotFound or AlreadyExists).
pub(crate) static TOOLS_WRITE: Mutex<()> = Mutex::new(());

/// Writes the tools directory `dir` (0755) with `sudo` (0755) in it, replacing what an
/// earlier run wrote. `dir` is the broker's own (no kernel writes there). Blocking.
pub(crate) fn install(dir: &Path) -> Result<(), SandboxError> {
    let _writing = lock(&TOOLS_WRITE);
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)
        .map_err(io_err("cannot create the sandbox tools directory", dir))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
        .map_err(io_err("cannot set the sandbox tools directory's mode", dir))?;
    let path = dir.join("sudo");
    let temp = dir.join(".sudo.new");
    let _ = std::fs::remove_file(&temp);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o755)
        .open(&temp)
        .and_then(|mut f| io::Write::write_all(&mut f, script().as_bytes()))
        .and_then(|()| std::fs::set_permissions(&temp, std::fs::Permissions::from_mode(0o755)))
        .and_then(|()| std::fs::rename(&temp, &path));
    written.map_err(io_err("cannot write the sandbox's sudo", &path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sudo_grants_nothing_and_says_why() {
        let dir = tempfile::tempdir().unwrap();
        let tools = dir.path().join(TOOLS_DIR_NAME);
        install(&tools).unwrap();
        install(&tools).unwrap();
        let out = std::process::Command::new(tools.join("sudo"))
            .args(["id", "-u"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1));
        assert!(out.stdout.is_empty());
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(
            err.contains("grant no privileges") && err.contains("--egress"),
            "{err}"
        );
    }

    #[test]
    fn concurrent_installs_all_succeed() {
        // Launches of different users prepare their directories at the same time.
        let dir = tempfile::tempdir().unwrap();
        let tools = dir.path().join(TOOLS_DIR_NAME);
        std::thread::scope(|s| {
            let writers: Vec<_> = (0..8)
                .map(|_| s.spawn(|| (0..50).try_for_each(|_| install(&tools))))
                .collect();
            for w in writers {
                w.join().unwrap().unwrap();
            }
        });
    }
}
