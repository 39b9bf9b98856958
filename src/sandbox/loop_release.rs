//! An unmounted workspace's file system, waited for until it is gone (`workspace_fs.rs`):
//! unmounted in the broker's mount namespace, it may live on in another that is still being
//! torn down (an ended kernel's sandbox), writing to its image until it goes; its loop
//! device lets the image go only then. A paused session's workspace image is read (to be
//! carried to another node) only after that.

use std::path::{Path, PathBuf};

use super::SandboxError;
use std::time::{Duration, Instant};

/// How long an unmounted workspace's loop device may take to let its image go.
const LOOP_RELEASE: Duration = Duration::from_secs(10);

/// Once the workspace at `dir` is unmounted here: waits (blocking, at most
/// [`LOOP_RELEASE`]) until no loop device has its `image` as backing file, or says it is
/// still in use.
pub(crate) fn wait_released(
    backend: &'static str,
    dir: &Path,
    image: Option<PathBuf>,
) -> Result<(), SandboxError> {
    let Some(image) = image.and_then(|i| std::fs::canonicalize(i).ok()) else {
        return Ok(());
    };
    let started = Instant::now();
    while loop_holds(&image) {
        if started.elapsed() > LOOP_RELEASE {
            return Err(super::fsutil::unavailable(
                backend,
                format!(
                    "the workspace {} is unmounted, but its file system is still in use",
                    dir.display()
                ),
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Whether a loop device still has `image` as its backing file
/// (`/sys/block/loop*/loop/backing_file`, which the kernel writes; nothing a kernel of
/// ours can write).
fn loop_holds(image: &Path) -> bool {
    let Ok(devices) = std::fs::read_dir("/sys/block") else {
        return false;
    };
    let wanted = image.as_os_str().as_encoded_bytes();
    devices.flatten().any(|d| {
        d.file_name().as_encoded_bytes().starts_with(b"loop")
            && std::fs::read(d.path().join("loop/backing_file"))
                .is_ok_and(|b| b.strip_suffix(b"\n").unwrap_or(&b) == wanted)
    })
}

#[cfg(test)]
mod tests {
    /// Needs root (mount, unshare); skipped otherwise. An unmount returns only once the
    /// file system is gone from every mount namespace (its loop device let the image go):
    /// one that another namespace still holds for a moment (an ended kernel's sandbox being
    /// torn down) is waited for, so nothing writes to the image after.
    #[test]
    fn an_unmount_waits_until_no_namespace_holds_the_file_system() {
        if crate::sandbox::fsutil::current_ids().0 != 0 {
            eprintln!("skipping: needs root to mount");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let workspaces = tmp.path().join("sandboxes");
        let ws = workspaces.join("held");
        std::fs::create_dir_all(&ws).unwrap();
        let images = crate::sandbox::workspace_fs::WorkspaceImages::new("local", &workspaces, true);
        images.ensure(&ws, 32 << 20, (4242, 4242)).unwrap();
        let image = std::fs::canonicalize(images.image_of(&ws).unwrap().0).unwrap();
        assert!(super::loop_holds(&image));
        let mut holder = std::process::Command::new("unshare")
            .args(["-m", "--propagation", "private", "sleep", "1.5"])
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(300));
        let started = std::time::Instant::now();
        images.unmount(&ws).unwrap();
        assert!(
            started.elapsed() >= std::time::Duration::from_millis(700),
            "the other namespace was waited for: {:?}",
            started.elapsed()
        );
        assert!(!super::loop_holds(&image));
        assert!(!crate::sandbox::workspace_fs::is_mount_point(&ws).unwrap());
        holder.wait().unwrap();
    }
}
