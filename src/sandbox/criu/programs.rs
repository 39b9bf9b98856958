//! How the host programs of a copy (setpriv, CRIU, bwrap) are started inside a sandbox's
//! mount namespace, where they are run by descriptor: opened on the host before `nsenter`
//! enters the sandbox, named `/proc/self/fd/N` after it.
//!
//! The local sandbox shows the host's `/usr`, so a program's libraries are found there
//! ([`Programs::shown`]). A container shows its image's: there each program runs through
//! the host's dynamic loader, the host's library directories named by descriptor too
//! ([`Programs::loaded`], `ld.so --library-path /proc/self/fd/A:... /proc/self/fd/P`), so
//! nothing of the image is run as root and the image needs no CRIU. The descriptors are
//! CRIU's and its helpers' only: CRIU restores a kernel with the descriptors its images
//! name, none of these.

use std::ffi::OsString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::Stdio;

use super::NoCopyTools;

/// The host's dynamic loader and the directories the copy's programs' libraries are in,
/// as `ldd` reports them; found once.
#[derive(Debug, Clone)]
pub(crate) struct Loader {
    ld_so: PathBuf,
    lib_dirs: Vec<PathBuf>,
}

impl Loader {
    /// The loader and library directories of `programs` (`ldd`); or why not. Blocking.
    pub(crate) fn find(programs: &[&Path]) -> Result<Self, NoCopyTools> {
        let mut ld_so = None;
        let mut lib_dirs: Vec<PathBuf> = Vec::new();
        for program in programs {
            let out = std::process::Command::new("ldd")
                .arg(program)
                .env_clear()
                .env("PATH", "/usr/bin:/bin")
                .stdin(Stdio::null())
                .stderr(Stdio::null())
                .output()
                .map_err(|e| format!("cannot run ldd: {e}"))?;
            if !out.status.success() {
                return Err(format!("ldd {} failed ({})", program.display(), out.status).into());
            }
            let (loader, dirs) = parse_ldd(&String::from_utf8_lossy(&out.stdout));
            if let Some(l) = loader {
                ld_so.get_or_insert(l);
            }
            for dir in dirs {
                if !lib_dirs.contains(&dir) {
                    lib_dirs.push(dir);
                }
            }
        }
        let ld_so =
            ld_so.ok_or_else(|| NoCopyTools::from("ldd named no dynamic loader".to_string()))?;
        Ok(Self { ld_so, lib_dirs })
    }
}

/// The loader (a line with a path and no `=>`) and the directories of the libraries
/// (`name => /dir/name (0x...)`) in `ldd`'s output.
fn parse_ldd(text: &str) -> (Option<PathBuf>, Vec<PathBuf>) {
    let mut loader = None;
    let mut dirs: Vec<PathBuf> = Vec::new();
    for line in text.lines().map(str::trim) {
        let path = match line.split_once("=>") {
            Some((_, right)) => right.trim().split(' ').next().unwrap_or(""),
            None => {
                let first = line.split(' ').next().unwrap_or("");
                if first.starts_with('/') {
                    loader = Some(PathBuf::from(first));
                }
                continue;
            }
        };
        if let Some(dir) = Path::new(path).parent().filter(|_| path.starts_with('/')) {
            if !dirs.iter().any(|d| d == dir) {
                dirs.push(dir.to_path_buf());
            }
        }
    }
    (loader, dirs)
}

/// The argument vectors that start each program inside the sandbox, and the descriptors
/// they name (inherited across the exec); the files stay open while this lives.
pub(crate) struct Programs {
    pub setpriv: Vec<OsString>,
    pub criu: Vec<OsString>,
    pub bwrap: Vec<OsString>,
    pub fds: Vec<RawFd>,
    _open: Vec<File>,
}

fn fd_path(file: &File) -> OsString {
    format!("/proc/self/fd/{}", file.as_raw_fd()).into()
}

fn open(path: &Path) -> io::Result<File> {
    File::open(path).map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

impl Programs {
    /// The local sandbox, which shows the host's `/usr`: setpriv by name, CRIU by
    /// descriptor (no bwrap inside).
    pub(crate) fn shown(criu: &Path) -> io::Result<Self> {
        let criu = open(criu)?;
        Ok(Self {
            setpriv: vec!["setpriv".into()],
            criu: vec![fd_path(&criu)],
            bwrap: Vec::new(),
            fds: vec![criu.as_raw_fd()],
            _open: vec![criu],
        })
    }

    /// A container: each program through the host's loader (see the module comment).
    pub(crate) fn loaded(
        loader: &Loader,
        criu: &Path,
        setpriv: &Path,
        bwrap: &Path,
    ) -> io::Result<Self> {
        let ld_so = open(&loader.ld_so)?;
        let dirs = loader
            .lib_dirs
            .iter()
            .map(|d| open(d))
            .collect::<io::Result<Vec<_>>>()?;
        let library_path = dirs
            .iter()
            .map(|d| fd_path(d).to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(":");
        let through = |program: &File| -> Vec<OsString> {
            vec![
                fd_path(&ld_so),
                "--library-path".into(),
                library_path.clone().into(),
                fd_path(program),
            ]
        };
        let (criu, setpriv, bwrap) = (open(criu)?, open(setpriv)?, open(bwrap)?);
        let (setpriv_argv, criu_argv, bwrap_argv) =
            (through(&setpriv), through(&criu), through(&bwrap));
        let mut open = vec![ld_so, criu, setpriv, bwrap];
        open.extend(dirs);
        Ok(Self {
            setpriv: setpriv_argv,
            criu: criu_argv,
            bwrap: bwrap_argv,
            fds: open.iter().map(AsRawFd::as_raw_fd).collect(),
            _open: open,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_output_gives_the_loader_and_the_library_directories() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                    \tlibbsd.so.0 => /lib/x86_64-linux-gnu/libbsd.so.0 (0x00007f7b)\n\
                    \tlibnet.so.1 => /usr/lib/x86_64-linux-gnu/libnet.so.1 (0x1)\n\
                    \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x2)\n\
                    \tlibgone.so.1 => not found\n\
                    \t/lib64/ld-linux-x86-64.so.2 (0x00007f7bdab70000)\n";
        let (loader, dirs) = parse_ldd(text);
        assert_eq!(loader, Some(PathBuf::from("/lib64/ld-linux-x86-64.so.2")));
        assert_eq!(
            dirs,
            vec![
                PathBuf::from("/lib/x86_64-linux-gnu"),
                PathBuf::from("/usr/lib/x86_64-linux-gnu")
            ]
        );
    }

    #[test]
    fn a_program_runs_through_the_loader_by_descriptor() {
        // `true`, through the host's loader with its library directories by descriptor, as
        // a container would run it: it works, named only by /proc/self/fd paths.
        let t = Path::new("/bin/true");
        let loader = Loader::find(&[t]).unwrap();
        let programs = Programs::loaded(&loader, t, t, t).unwrap();
        assert!(programs
            .criu
            .iter()
            .all(|a| a == "--library-path" || a.to_string_lossy().starts_with("/proc/self/fd/")));
        let fds = programs.fds.clone();
        let mut cmd = std::process::Command::new(&programs.criu[0]);
        cmd.args(&programs.criu[1..]);
        use std::os::unix::process::CommandExt;
        // SAFETY: only fcntl between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                for fd in &fds {
                    crate::sandbox::fsutil::inherit_fd(*fd)?;
                }
                Ok(())
            });
        }
        assert!(cmd.status().unwrap().success());
    }
}
