//! Connecting to a kernel's unix socket without following anything the kernel controls.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

use tokio::net::UnixStream;

/// Connects to the unix socket at `path` without following a symlink or any path the
/// kernel can change after the check: the socket's directory is opened (its last component
/// not followed), the socket is opened `O_PATH` beneath it with `openat2(RESOLVE_BENEATH |
/// RESOLVE_NO_SYMLINKS)`, checked to be a socket, and connected through
/// `/proc/self/fd/N`, which names that very inode. A kernel that renames its socket and
/// plants a symlink to a host socket in its place gets `ELOOP`, not a connection.
pub async fn connect_ipc(path: &Path) -> io::Result<UnixStream> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a socket path",
        ));
    };
    let dir = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(dir)?;
    let sock = openat2_path(&dir, name.as_bytes())?;
    let file = std::fs::File::from(sock);
    let meta = file.metadata()?;
    if !meta.file_type().is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not a socket", path.display()),
        ));
    }
    let proc_path = format!("/proc/self/fd/{}", file.as_raw_fd());
    let stream = UnixStream::connect(&proc_path).await;
    drop(file);
    stream
}

/// `openat2(dir, name, O_PATH | O_NOFOLLOW, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`.
fn openat2_path(dir: &std::fs::File, name: &[u8]) -> io::Result<OwnedFd> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    let name = std::ffi::OsStr::from_bytes(name);
    Ok(rustix::fs::openat2(
        dir,
        name,
        OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )?)
}
