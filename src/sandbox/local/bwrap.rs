//! The bwrap command line: the kernel's namespaces, its view of the file system, its
//! environment, and the drop to its uid. Pure: from the sandbox's options, what the host
//! looks like ([`HostRoot`], probed by the caller) and one run's request, it builds the
//! argv; nothing here runs anything, so every rule is tested on data below.
//!
//! What a kernel sees: `/usr` read-only, its Python at `/opt/kernel-venv` over
//! `/opt/kernel-python` (read-only, `python.rs`), a tiny `/etc`, a private `/proc`, `/dev`,
//! `/tmp` and home `/home/kernel` (tmpfs), its workspace at `/workspace` and its runtime
//! directory at `/run/kernel`. Nothing else of the host. The network namespace is empty
//! (loopback only).

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};

use super::files::login_name;
use super::python::{KernelPython, PythonMount};
use super::{
    BOOT_DIR_INSIDE, ENV_FILE_INSIDE, HOME_INSIDE, HOSTNAME, RUN_DIR_INSIDE, WORKSPACE_INSIDE,
};
use crate::sandbox::own_workspace::{OwnDirs, HOME_INSIDE as OWN_HOME_INSIDE};

/// Host files that are harmless to show read-only in the sandbox's `/etc`, if present.
const ETC_RO_FILES: &[&str] = &[
    "/etc/ld.so.cache",
    "/etc/localtime",
    "/etc/fonts",
    "/etc/ssl/certs",
    "/etc/alternatives",
    "/etc/mime.types",
    // R's configuration (`/usr/lib/R/etc` links here): the kernel `r`.
    "/etc/R",
];

/// Whether a name in the host's `/etc` is a JDK's configuration (`java-17-openjdk`: its
/// security policy and properties, which the JDK's `conf` links to), shown like
/// [`ETC_RO_FILES`] for the kernel `java`.
fn is_jdk_config(name: &str) -> bool {
    name.strip_prefix("java-")
        .and_then(|rest| rest.strip_suffix("-openjdk"))
        .is_some_and(|version| !version.is_empty() && version.bytes().all(|b| b.is_ascii_digit()))
}
/// Top-level host directories mirrored (as the symlink they are, or read-only).
const ROOT_TOPS: &[&str] = &["bin", "sbin", "lib", "lib64", "lib32", "libx32"];

/// What the sandbox decided once, when it was made.
#[derive(Debug, Clone, Default)]
pub(super) struct BwrapOptions {
    /// The broker runs as root: kernels get their own uid through `setpriv`, no user
    /// namespace.
    pub privileged: bool,
    /// `setpriv`, to drop to the kernel's uid inside the sandbox (root mode).
    pub setpriv: Option<PathBuf>,
    /// This bwrap knows `--size` (tmpfs size caps).
    pub has_size: bool,
    /// This bwrap knows `--disable-userns`.
    pub has_disable_userns: bool,
    /// The kernels' Python installation, shown at neutral paths (`python.rs`).
    pub python: KernelPython,
    /// The sandbox dies with the broker (`--die-with-parent`); not with `--keep-sessions`,
    /// whose kernels must outlive it (its next run adopts them).
    pub die_with_parent: bool,
    /// The broker's tools directory (`sudo.rs`), shown read-only at [`TOOLS_INSIDE`].
    pub tools_dir: Option<PathBuf>,
}

/// Where the tools directory appears in the sandbox (on the `PATH`, after the kernels'
/// Python).
pub(super) const TOOLS_INSIDE: &str = "/opt/kernel-broker-tools";

/// What a top-level host directory (`/bin`, `/lib`, ...) is.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum RootEntry {
    /// A symlink to this target (merged-`/usr` systems).
    Symlink(PathBuf),
    /// A real directory.
    Dir,
}

/// What of the host's root the sandbox mirrors; probed at each launch, so that a change on
/// the host (an extra bind created later) is seen by the next kernel.
#[derive(Debug, Clone, Default)]
pub(super) struct HostRoot {
    /// `/bin`, `/lib`, ... that exist, and what they are.
    pub tops: Vec<(PathBuf, RootEntry)>,
    /// The [`ETC_RO_FILES`] that exist.
    pub etc_files: Vec<PathBuf>,
    /// The configured extra read-only binds that are existing absolute paths.
    pub extra_ro_binds: Vec<PathBuf>,
    /// A CA bundle shown at `egress::CA_FILE_INSIDE` (`--egress-ca-file`).
    pub ca_file: Option<PathBuf>,
}

/// The JDK configurations in the host's `/etc`, in order.
fn jdk_configs() -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/etc")
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter(|e| e.file_name().to_str().is_some_and(is_jdk_config))
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found
}

impl HostRoot {
    /// Looks at the host.
    pub fn probe(extra_ro_binds: &[PathBuf]) -> Self {
        let mut tops = Vec::new();
        for top in ROOT_TOPS {
            let host = Path::new("/").join(top);
            match std::fs::read_link(&host) {
                Ok(target) => tops.push((host, RootEntry::Symlink(target))),
                Err(_) if host.is_dir() => tops.push((host, RootEntry::Dir)),
                Err(_) => {}
            }
        }
        Self {
            tops,
            etc_files: ETC_RO_FILES
                .iter()
                .map(PathBuf::from)
                .filter(|p| p.exists())
                .chain(jdk_configs())
                .collect(),
            extra_ro_binds: extra_ro_binds
                .iter()
                .filter(|d| d.is_absolute() && d.exists())
                .cloned()
                .collect(),
            ca_file: None,
        }
    }

    /// With the CA bundle of `--egress-ca-file`, if any.
    pub fn with_ca_file(mut self, ca_file: Option<&Path>) -> Self {
        self.ca_file = ca_file.map(Path::to_path_buf);
        self
    }
}

/// What bwrap should build for one run.
pub(super) struct BwrapRequest<'a> {
    pub workspace: &'a Path,
    pub rundir: &'a Path,
    pub ids: Option<(u32, u32)>,
    pub tmp_size: Option<u64>,
    pub resource_dir: Option<&'a Path>,
    /// The host directory holding the bootstrap script, shown read-only at
    /// [`BOOT_DIR_INSIDE`].
    pub boot_dir: Option<&'a Path>,
    /// A descriptor bwrap inherits holding the kernel's whole environment **and its
    /// command** as a script ([`crate::sandbox::environ::launch_script`]): bwrap copies it to
    /// [`ENV_FILE_INSIDE`], and `/bin/sh` reads it there as the kernel's uid, after the drop,
    /// changes to the workspace (bwrap, without capabilities by then, could not enter the
    /// kernel's 0700 workspace) and becomes the command. bwrap and setpriv run with an empty
    /// environment and no argument a tenant chose.
    pub env_fd: RawFd,
    /// A session with a workspace of its own (`own_workspace.rs`): its home bound at
    /// `/home/user` (and `/workspace`, `workspace` is the same directory) and its `/tmp`
    /// shared with the session's other kernels and commands, instead of tmpfs ones.
    pub own: Option<&'a OwnDirs>,
    /// The command is CRIU restoring a copied kernel (`copy.rs`): it runs as the kernel's
    /// uid with `CAP_CHECKPOINT_RESTORE` and `CAP_SETPCAP` (ambient, the only ones in its
    /// bounding set) and without the syscall filter, which CRIU puts back on the kernel it
    /// restores, from the image.
    pub restore: bool,
}

/// Builds bwrap's file system arguments. bwrap creates missing parents of a mount point
/// with mode 0700, which would hide everything below them from a non-root kernel, so every
/// parent is created explicitly with 0755 first; and a bind inside a read-only bind made
/// earlier (say, a Python under `/usr`) is skipped, as it is visible already.
#[derive(Default)]
struct MountPlan {
    args: Vec<OsString>,
    /// Directories that exist in the sandbox (created or mounted).
    dirs: BTreeSet<PathBuf>,
    /// Read-only binds of a host path onto the same path.
    ro_roots: Vec<PathBuf>,
}

impl MountPlan {
    fn flag(&mut self, flag: &str) {
        self.args.push(flag.into());
    }

    fn push<I, S>(&mut self, args: I)
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
    }

    fn covered(&self, path: &Path) -> bool {
        self.ro_roots.iter().any(|root| path.starts_with(root))
    }

    /// Creates `dir` and its missing parents, 0755.
    fn dir(&mut self, dir: &Path) {
        let mut missing: Vec<&Path> = dir
            .ancestors()
            .filter(|a| *a != Path::new("/") && !a.as_os_str().is_empty())
            .take_while(|a| !self.dirs.contains(*a) && !self.covered(a))
            .collect();
        missing.reverse();
        for d in missing {
            self.args
                .extend(["--perms".into(), "0755".into(), "--dir".into(), d.into()]);
            self.dirs.insert(d.to_path_buf());
        }
    }

    fn parents(&mut self, dest: &Path) {
        if let Some(parent) = dest.parent() {
            self.dir(parent);
        }
    }

    fn ro_bind(&mut self, src: &Path, dest: &Path) {
        if self.covered(dest) {
            return;
        }
        self.parents(dest);
        self.args
            .extend(["--ro-bind".into(), src.into(), dest.into()]);
        if src == dest {
            self.ro_roots.push(dest.to_path_buf());
        }
        self.dirs.insert(dest.to_path_buf());
    }

    fn bind(&mut self, src: &Path, dest: &Path) {
        self.parents(dest);
        self.args.extend(["--bind".into(), src.into(), dest.into()]);
        self.dirs.insert(dest.to_path_buf());
    }

    /// The host's `/usr`, read-only, and the top-level directories and symlinks beside it
    /// (`/bin`, `/lib`, ...).
    fn host_system(&mut self, host: &HostRoot) {
        self.ro_bind(Path::new("/usr"), Path::new("/usr"));
        for (path, entry) in &host.tops {
            match entry {
                RootEntry::Symlink(target) => self.symlink(target, path),
                RootEntry::Dir => self.ro_bind(path, path),
            }
        }
    }

    fn symlink(&mut self, target: &Path, link: &Path) {
        self.parents(link);
        self.args
            .extend(["--symlink".into(), target.into(), link.into()]);
    }
}

/// The bwrap arguments after `--info-fd`: namespaces, the syscall filter (read from
/// `seccomp_fd`, which bwrap must inherit), the file system, the command.
pub(super) fn bwrap_args(
    opts: &BwrapOptions,
    host: &HostRoot,
    req: &BwrapRequest<'_>,
    seccomp_fd: Option<RawFd>,
) -> Vec<OsString> {
    let mut fs = MountPlan::default();
    fs.flag("--unshare-pid");
    fs.flag("--unshare-net");
    fs.flag("--unshare-ipc");
    fs.flag("--unshare-uts");
    fs.flag("--unshare-cgroup-try");
    if !opts.privileged {
        // As root, a user namespace would leave setpriv no uid to switch to.
        fs.flag("--unshare-user");
        if opts.has_disable_userns {
            fs.flag("--disable-userns");
        }
    }
    if let Some(fd) = seccomp_fd {
        // bwrap installs it last, right before exec'ing the command: after its own
        // namespace and mount work, before setpriv (whose setresuid, setgroups, capset
        // and prctl the filter allows).
        fs.push(["--seccomp".to_string(), fd.to_string()]);
    }
    if opts.die_with_parent {
        fs.flag("--die-with-parent");
    }
    // As root, bwrap hands its child every capability unless told otherwise. The child is
    // setpriv, which needs only these three to become the kernel's uid with none at all
    // (setresuid, setgroups, and the bounding set); without setpriv it needs none.
    fs.push(["--cap-drop", "ALL"]);
    if opts.setpriv.is_some() && req.ids.is_some() {
        for cap in ["CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP"] {
            fs.push(["--cap-add", cap]);
        }
        if req.restore {
            fs.push(["--cap-add", "CAP_CHECKPOINT_RESTORE"]);
        }
    }
    fs.flag("--new-session");
    fs.push(["--hostname", HOSTNAME]);

    fs.host_system(host);
    // The private mounts come before the binds, so that a bind below /tmp (a venv
    // there, say) lands on the tmpfs instead of being hidden by it.
    fs.push(["--proc", "/proc", "--dev", "/dev"]);
    fs.dirs.insert(PathBuf::from("/dev"));
    // /tmp, and /dev/shm for POSIX semaphores and shared memory (multiprocessing). With a
    // workspace of its own, /tmp is the session's (its file system bounds it).
    if let Some(own) = req.own {
        fs.bind(&own.tmp, Path::new("/tmp"));
    }
    for tmp in ["/tmp", "/dev/shm"] {
        if tmp == "/tmp" && req.own.is_some() {
            continue;
        }
        fs.push(["--perms", "1777"]);
        if let (Some(size), true) = (req.tmp_size, opts.has_size) {
            // tmpfs pages count against the memory cgroup anyway; the cap keeps a
            // tmpfs from claiming more than the user may use at all.
            fs.push(["--size".to_string(), size.to_string()]);
        }
        fs.push(["--tmpfs", tmp]);
        fs.dirs.insert(PathBuf::from(tmp));
    }
    // The kernel's home: its caches (matplotlib, fontconfig, IPython) stay out of the
    // workspace the user lists. A tmpfs of its own, capped like /tmp; world-writable as
    // /tmp is, since as root bwrap cannot give it to the kernel's uid (nothing else runs in
    // this mount namespace).
    // With a workspace of its own, home is that workspace (`/home/user`, bound below).
    if req.own.is_none() {
        fs.parents(Path::new(HOME_INSIDE));
        fs.push(["--perms", "1777"]);
        if let (Some(size), true) = (req.tmp_size, opts.has_size) {
            fs.push(["--size".to_string(), size.to_string()]);
        }
        fs.push(["--tmpfs", HOME_INSIDE]);
        fs.dirs.insert(PathBuf::from(HOME_INSIDE));
    }
    for mount in opts.python.mounts(req.rundir) {
        match mount {
            PythonMount::RoBind { src, dest } => fs.ro_bind(&src, &dest),
            PythonMount::Symlink { target, link } => fs.symlink(&target, &link),
            PythonMount::Tmpfs(dir) => {
                fs.parents(&dir);
                fs.push([
                    "--perms".into(),
                    "0755".into(),
                    "--tmpfs".into(),
                    OsString::from(&dir),
                ]);
                fs.dirs.insert(dir);
            }
            PythonMount::RemountRo(dir) => fs.push(["--remount-ro".into(), OsString::from(&dir)]),
        }
    }
    for dir in &host.extra_ro_binds {
        fs.ro_bind(dir, dir);
    }
    if let Some(dir) = req.resource_dir {
        fs.ro_bind(dir, dir);
    }
    if let Some(dir) = req.boot_dir {
        fs.ro_bind(dir, Path::new(BOOT_DIR_INSIDE));
    }
    if let Some(dir) = &opts.tools_dir {
        fs.ro_bind(dir, Path::new(TOOLS_INSIDE));
    }
    fs.dir(Path::new("/etc"));
    for path in &host.etc_files {
        fs.ro_bind(path, path);
    }
    if let Some(ca) = &host.ca_file {
        fs.ro_bind(ca, Path::new(crate::egress::CA_FILE_INSIDE));
    }
    for name in ["passwd", "group", "hosts"] {
        fs.ro_bind(&req.rundir.join(name), &Path::new("/etc").join(name));
    }
    // The kernel's environment, copied from the inherited descriptor (which bwrap closes)
    // into the sandbox's own root: readable by the kernel, whose environment it is.
    fs.push([
        "--perms".to_string(),
        "0444".to_string(),
        "--file".to_string(),
        req.env_fd.to_string(),
        ENV_FILE_INSIDE.to_string(),
    ]);

    fs.bind(req.rundir, Path::new(RUN_DIR_INSIDE));
    fs.bind(req.workspace, Path::new(WORKSPACE_INSIDE));
    if let Some(own) = req.own {
        fs.bind(&own.home, Path::new(OWN_HOME_INSIDE));
    }
    // The shell changes there after the drop (the kernel's working directory).
    let cwd = if req.own.is_some() {
        OWN_HOME_INSIDE
    } else {
        WORKSPACE_INSIDE
    };

    let mut args = fs.args;
    args.push("--".into());
    if let (Some(setpriv), Some((uid, gid))) = (&opts.setpriv, req.ids) {
        args.push(setpriv.into());
        args.push(format!("--reuid={uid}").into());
        args.push(format!("--regid={gid}").into());
        let caps: &[&str] = if req.restore {
            &RESTORE_CAPS
        } else {
            &[
                "--clear-groups",
                "--inh-caps=-all",
                "--bounding-set=-all",
                "--no-new-privs",
                "--",
            ]
        };
        for a in caps {
            args.push(a.into());
        }
    }
    args.extend(
        crate::sandbox::environ::apply_then_exec(ENV_FILE_INSIDE, cwd)
            .into_iter()
            .map(OsString::from),
    );
    args
}

/// setpriv's arguments for CRIU restoring a copy: the kernel's uid with the two
/// capabilities a restore needs (`clone3` with a chosen pid, the restored task's
/// capability sets) kept across the exec as ambient ones, nothing else possible.
const RESTORE_CAPS: [&str; 6] = [
    "--clear-groups",
    "--inh-caps=-all,+checkpoint_restore,+setpcap",
    "--ambient-caps=+checkpoint_restore,+setpcap",
    "--bounding-set=-all,+checkpoint_restore,+setpcap",
    "--no-new-privs",
    "--",
];

/// Where a workspace copy's source and destination are inside its sandbox.
pub(super) const COPY_FROM: &str = "/copy/from";
pub(super) const COPY_TO: &str = "/copy/to";

/// bwrap's arguments for copying an own workspace (`copy.rs`): `from`'s `home` and
/// `tmp` shown read-only at [`COPY_FROM`], `to`'s writable at [`COPY_TO`] (emptied first),
/// the copy run by `cp` in a [`workspace_tool_args`] sandbox: a tenant's files are read
/// only with its own rights, and a symlink among them is copied, never followed.
pub(super) fn copy_args(
    opts: &BwrapOptions,
    host: &HostRoot,
    from: &OwnDirs,
    to: &OwnDirs,
    ids: (u32, u32),
) -> Option<Vec<OsString>> {
    let mut binds = Vec::new();
    for (dirs, inside, writable) in [(from, COPY_FROM, false), (to, COPY_TO, true)] {
        for (dir, name) in [(&dirs.home, "home"), (&dirs.tmp, "tmp")] {
            binds.push((dir.as_path(), Path::new(inside).join(name), writable));
        }
    }
    // What the destination held goes first (a rewind puts a checkpoint's files in place of
    // the session's; a fork's workspace is new and empty), unless some of it cannot go
    // (`EMPTIED_CHECK`): then nothing is touched. `dir/.`: the directory's entries, hidden
    // ones too, into the existing directory.
    let script = format!(
        "{} && \
         find {COPY_TO}/home {COPY_TO}/tmp -mindepth 1 -maxdepth 1 -exec rm -rf -- {{}} + && \
         cp -a --reflink=auto {COPY_FROM}/home/. {COPY_TO}/home/ && \
         cp -a --reflink=auto {COPY_FROM}/tmp/. {COPY_TO}/tmp/",
        crate::sandbox::criu::emptied_check(&[
            &format!("{COPY_TO}/home"),
            &format!("{COPY_TO}/tmp")
        ])
    );
    let command = ["/bin/sh", "-c", script.as_str()].map(OsString::from);
    workspace_tool_args(opts, host, &binds, ids, &command)
}

/// bwrap's arguments for running `command` over an own workspace's directories (`binds`:
/// each host directory, where it is shown, writable or not), in namespaces of its own with
/// nothing else of the host but `/usr`, as the kernel's uid `ids` with no capabilities and
/// `no_new_privs`: what a tenant's files hold is read or written only with its own rights.
pub(super) fn workspace_tool_args(
    opts: &BwrapOptions,
    host: &HostRoot,
    binds: &[(&Path, PathBuf, bool)],
    ids: (u32, u32),
    command: &[OsString],
) -> Option<Vec<OsString>> {
    let setpriv = opts.setpriv.as_ref()?;
    let mut fs = MountPlan::default();
    for flag in [
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
    ] {
        fs.flag(flag);
    }
    fs.push(["--cap-drop", "ALL"]);
    for cap in ["CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP"] {
        fs.push(["--cap-add", cap]);
    }
    fs.host_system(host);
    fs.push(["--proc", "/proc", "--dev", "/dev"]);
    for (dir, inside, writable) in binds {
        if *writable {
            fs.bind(dir, inside);
        } else {
            fs.ro_bind(dir, inside);
        }
    }
    let mut args = fs.args;
    args.push("--".into());
    args.push(setpriv.into());
    args.push(format!("--reuid={}", ids.0).into());
    args.push(format!("--regid={}", ids.1).into());
    for a in [
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
    ] {
        args.push(a.into());
    }
    args.extend(command.iter().cloned());
    Some(args)
}

/// The kernel's fixed environment: the first part of what the kernel's `/bin/sh` reads
/// after the drop (`BwrapRequest::env_fd`); the broker's own environment is not inherited,
/// and bwrap and setpriv see none of it.
pub(super) fn kernel_env(python: &KernelPython, user: &str) -> Vec<(String, String)> {
    let login = login_name(user);
    let path = format!(
        "{}:{TOOLS_INSIDE}:/usr/local/bin:/usr/bin:/bin",
        python.bin_inside().to_string_lossy()
    );
    let library_path = python.library_path();
    [
        ("PATH", path.as_str()),
        ("HOME", HOME_INSIDE),
        ("USER", login.as_str()),
        ("LOGNAME", login.as_str()),
        ("LANG", "C.UTF-8"),
        ("TMPDIR", "/tmp"),
        ("PYTHONUNBUFFERED", "1"),
        ("MPLBACKEND", "module://matplotlib_inline.backend_inline"),
        // debugpy warns about frozen modules on every start otherwise.
        ("PYDEVD_DISABLE_FILE_VALIDATION", "1"),
    ]
    .into_iter()
    .chain(library_path.as_deref().map(|p| ("LD_LIBRARY_PATH", p)))
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

#[cfg(test)]
#[path = "bwrap_tests.rs"]
mod tests;
