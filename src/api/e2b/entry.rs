//! envd's `EntryInfo` as the broker renders a workspace entry, and the filesystem service's
//! shared pieces (its errors, its paths): used by the Connect filesystem calls (`envd.rs`)
//! and the watch events (`watching.rs`).

use serde_json::{json, Value};

use super::connect::ConnectError;
use super::{inside_path, workspace_relative};
use crate::api::error::{file_error_kind, FileErrorKind};
use crate::session::files::{Entry, EntryKind};
use crate::session::{SessionError, Workspace};

/// `e` as envd's `EntryInfo`; owner and group named as `ws`'s sandbox names them
/// (`user`, `root`; envd reads the names from the sandbox's user database).
pub(super) fn entry_json(e: &Entry, ws: &Workspace) -> Value {
    let rel = e.rel.to_string_lossy();
    let name = e
        .rel
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let kind = match e.kind {
        EntryKind::File => "FILE_TYPE_FILE",
        EntryKind::Directory => "FILE_TYPE_DIRECTORY",
        EntryKind::Symlink => "FILE_TYPE_SYMLINK",
        EntryKind::Other => "FILE_TYPE_UNSPECIFIED",
    };
    json!({
        "name": name,
        "type": kind,
        "path": inside_path(&rel),
        "size": e.size.to_string(),
        "mode": e.mode & 0o7777,
        "permissions": permissions(e.mode),
        "owner": ws.account_name(e.uid),
        "group": ws.account_name(e.gid),
        "modifiedTime": e.modified.to_rfc3339_opts(chrono::SecondsFormat::Nanos, true),
        "isSymlink": e.kind == EntryKind::Symlink,
        "symlinkTarget": e.link_target.as_deref().map(|t| link_target(&rel, &t.to_string_lossy())),
        "metadata": e.metadata,
    })
}

/// A symlink's target as the sandbox names it, as envd reports it (an absolute path): the
/// link's text made absolute against the link's directory and cleaned of `.` and `..`,
/// without looking at the host (the text is the kernel's to choose; nothing is followed).
/// A relative link's directory is named with the workspace's inside name
/// (`super::inside_path`). envd resolves every link of a chain; this does not (the host
/// is not the sandbox's view), see docs/API.md.
fn link_target(link_rel: &str, text: &str) -> String {
    let base = if text.starts_with('/') {
        String::new()
    } else {
        let dir = link_rel.rsplit_once('/').map_or("", |(d, _)| d);
        inside_path(dir)
    };
    let mut parts: Vec<&str> = Vec::new();
    for part in base.split('/').chain(text.split('/')) {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    format!("/{}", parts.join("/"))
}

/// `-rw-r--r--`, as `ls` shows it.
fn permissions(mode: u32) -> String {
    let kind = match mode & libc::S_IFMT {
        libc::S_IFDIR => 'd',
        libc::S_IFLNK => 'l',
        _ => '-',
    };
    let mut s = String::from(kind);
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

pub(super) fn fs_error(e: SessionError) -> ConnectError {
    let message = e.to_string();
    match file_error_kind(&e) {
        Some(FileErrorKind::NotFound) => ConnectError::not_found(message),
        Some(FileErrorKind::Invalid) => ConnectError::invalid(message),
        Some(FileErrorKind::Conflict) => ConnectError::new("already_exists", message),
        Some(FileErrorKind::TooLarge) => ConnectError::new("resource_exhausted", message),
        _ => {
            let other = e;
            tracing::warn!(error = %other, "E2B filesystem call failed");
            ConnectError::new("internal", other.to_string())
        }
    }
}

pub(super) fn rel_of(path: &str) -> Result<String, ConnectError> {
    workspace_relative(path).map_err(|e| ConnectError::invalid(e.message))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symlink_targets_are_absolute_inside_the_sandbox() {
        for (link, text, want) in [
            ("a/link", "data.csv", "/home/user/a/data.csv"),
            ("link", "../etc/passwd", "/home/etc/passwd"),
            ("link", "../../etc/passwd", "/etc/passwd"),
            ("a/b/link", "../../x", "/home/user/x"),
            ("link", "/etc", "/etc"),
            ("link", "/home/user/./x/../y", "/home/user/y"),
            ("link", "../../../../..", "/"),
        ] {
            assert_eq!(link_target(link, text), want, "{link} -> {text}");
        }
    }

    #[test]
    fn permissions_read_like_ls() {
        assert_eq!(permissions(libc::S_IFREG | 0o644), "-rw-r--r--");
        assert_eq!(permissions(libc::S_IFDIR | 0o755), "drwxr-xr-x");
    }
}
