//! The kernel's `ipc://` socket layout and its connection file, the same for both
//! backends.

use std::io;
use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};

use super::{io_err, write_new_file_at, FileMode};
use crate::sandbox::{KernelEndpoints, LaunchSpec, SandboxError};

/// Ports of the kernel's five channels; their sockets are `k-1` .. `k-5`.
pub(crate) const SHELL_PORT: u16 = 1;
pub(crate) const IOPUB_PORT: u16 = 2;
pub(crate) const STDIN_PORT: u16 = 3;
pub(crate) const CONTROL_PORT: u16 = 4;
pub(crate) const HB_PORT: u16 = 5;

/// The connection file the kernel reads: `ipc` transport, sockets `<ip>-<port>` (ipykernel
/// binds `ipc://{ip}-{port}`), HMAC-SHA256 with the launch's key.
pub(crate) fn connection_file(spec: &LaunchSpec, ip: &str) -> serde_json::Value {
    serde_json::json!({
        "transport": "ipc",
        "ip": ip,
        "shell_port": SHELL_PORT,
        "iopub_port": IOPUB_PORT,
        "stdin_port": STDIN_PORT,
        "control_port": CONTROL_PORT,
        "hb_port": HB_PORT,
        "key": spec.key,
        "signature_scheme": "hmac-sha256",
        "kernel_name": spec.kernel_name,
    })
}

/// Writes `connection` as `connection.json` (a new file) in the open directory `dir`, which
/// is `path` (for errors).
pub(crate) fn write_connection_file(
    dir: BorrowedFd<'_>,
    path: &Path,
    connection: &serde_json::Value,
    mode: FileMode,
    owner: Option<(u32, u32)>,
) -> Result<(), SandboxError> {
    let path = path.join("connection.json");
    let text = serde_json::to_vec_pretty(connection).map_err(|e| SandboxError::Io {
        what: "cannot encode the connection file",
        path: path.clone(),
        source: io::Error::other(e),
    })?;
    write_new_file_at(dir, Path::new("connection.json"), &text, mode, owner)
        .map_err(io_err("cannot write the connection file", &path))
}

/// Why a runtime directory cannot hold the kernel's sockets.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SocketPathError {
    #[error("the runtime directory {} is not UTF-8", .0.display())]
    NotUtf8(PathBuf),
    /// `longest` is not shorter than `limit` bytes; `advice` says what to configure.
    #[error(
        "the socket path {longest} is too long ({} bytes, the limit is {limit}); {advice}",
        longest.len()
    )]
    TooLong {
        longest: String,
        limit: usize,
        advice: &'static str,
    },
}

/// The host-side endpoints of the sockets `<rundir>/k-<port>`. Fails if `rundir` is not
/// UTF-8, or if the longest socket path is not shorter than `max_socket_path` (`advice`
/// then says what to configure).
pub(crate) fn ipc_endpoints(
    rundir: &Path,
    max_socket_path: usize,
    advice: &'static str,
) -> Result<KernelEndpoints, SocketPathError> {
    let dir = rundir
        .to_str()
        .ok_or_else(|| SocketPathError::NotUtf8(rundir.to_path_buf()))?;
    let longest = format!("{dir}/k-{HB_PORT}");
    if longest.len() >= max_socket_path {
        return Err(SocketPathError::TooLong {
            longest,
            limit: max_socket_path,
            advice,
        });
    }
    let ep = |port: u16| format!("ipc://{dir}/k-{port}");
    Ok(KernelEndpoints {
        shell: ep(SHELL_PORT),
        iopub: ep(IOPUB_PORT),
        stdin: ep(STDIN_PORT),
        control: ep(CONTROL_PORT),
        hb: ep(HB_PORT),
    })
}
