//! What the local sandbox learns about this host once, when it is made: where programs
//! are, and which directories make up the kernels' Python installation (shown read-only
//! to kernels at neutral paths, `python.rs`).

use std::path::Path;
use std::process::Stdio;

use super::python::KernelPython;
use crate::sandbox::SandboxError;

/// Runs the interpreter once to learn its venv and installation directories, which the
/// sandbox shows read-only at neutral paths (`python.rs`).
pub(super) fn discover_python(python: &Path) -> Result<KernelPython, SandboxError> {
    const SCRIPT: &str =
        "import os, sys; print(sys.prefix); print(sys.base_prefix); print(os.path.realpath(sys.executable))";
    let output = std::process::Command::new(python)
        .args(["-I", "-c", SCRIPT])
        .env_clear()
        .stdin(Stdio::null())
        .output()
        .map_err(|e| {
            let reason = format!(
                "cannot run the kernels' Python {}: {e}; create it with kernels/setup.sh",
                python.display()
            );
            unavailable_by(reason, e)
        })?;
    if !output.status.success() {
        return Err(unavailable(format!(
            "the kernels' Python {} failed ({}): {}",
            python.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    let [prefix, base_prefix, executable] = lines[..] else {
        return Err(unavailable(format!(
            "unexpected answer from {}: {stdout:?}",
            python.display()
        )));
    };
    let found = KernelPython::from_host(
        Path::new(prefix),
        Path::new(base_prefix),
        Path::new(executable),
    )
    .with_programs_found();
    if found.host_dirs().iter().any(|d| d == Path::new("/")) {
        return Err(unavailable(format!(
            "the kernels' Python {} is installed at /, which cannot be shown to kernels alone",
            python.display()
        )));
    }
    tracing::debug!(python = ?found, "kernels' Python found");
    Ok(found)
}

pub(super) use crate::sandbox::fsutil::find_program;

/// The local sandbox cannot work here, saying why.
pub(super) fn unavailable(reason: impl Into<String>) -> SandboxError {
    crate::sandbox::fsutil::unavailable(super::BACKEND, reason)
}

/// [`unavailable`] because of `source`, kept as the error's source.
pub(super) fn unavailable_by(
    reason: impl Into<String>,
    source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> SandboxError {
    crate::sandbox::fsutil::unavailable_by(super::BACKEND, reason, source)
}
