//! The bwrap argv, tested on data: each rule of `bwrap.rs` as a case.

use super::*;
use crate::sandbox::local::python::KernelPython;
use std::collections::HashMap;

#[test]
fn mount_plan_creates_every_parent_once_with_0755() {
    let mut fs = MountPlan::default();
    fs.ro_bind(Path::new("/usr"), Path::new("/usr"));
    fs.ro_bind(
        Path::new("/root/.pyenv/v/3.11"),
        Path::new("/root/.pyenv/v/3.11"),
    );
    fs.ro_bind(
        Path::new("/root/.pyenv/v/other"),
        Path::new("/root/.pyenv/v/other"),
    );
    fs.ro_bind(Path::new("/usr/lib/python3"), Path::new("/usr/lib/python3"));
    let args: Vec<String> = fs
        .args
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        args,
        [
            "--ro-bind",
            "/usr",
            "/usr",
            "--perms",
            "0755",
            "--dir",
            "/root",
            "--perms",
            "0755",
            "--dir",
            "/root/.pyenv",
            "--perms",
            "0755",
            "--dir",
            "/root/.pyenv/v",
            "--ro-bind",
            "/root/.pyenv/v/3.11",
            "/root/.pyenv/v/3.11",
            "--ro-bind",
            "/root/.pyenv/v/other",
            "/root/.pyenv/v/other",
        ]
    );
}

/// The argv as strings.
fn text(args: &[OsString]) -> Vec<String> {
    args.iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect()
}

/// Whether `args` holds `seq` as consecutive arguments.
fn has(args: &[String], seq: &[&str]) -> bool {
    args.windows(seq.len())
        .any(|w| w.iter().zip(seq).all(|(a, b)| a == b))
}

fn host() -> HostRoot {
    HostRoot {
        tops: vec![
            (
                PathBuf::from("/bin"),
                RootEntry::Symlink(PathBuf::from("usr/bin")),
            ),
            (PathBuf::from("/lib64"), RootEntry::Dir),
        ],
        etc_files: vec![PathBuf::from("/etc/localtime")],
        extra_ro_binds: vec![PathBuf::from("/opt/data")],
        ca_file: None,
    }
}

fn root() -> BwrapOptions {
    BwrapOptions {
        privileged: true,
        setpriv: Some(PathBuf::from("/usr/bin/setpriv")),
        has_size: true,
        has_disable_userns: true,
        python: KernelPython::Host {
            bin: PathBuf::from("/opt/py/3.11/bin"),
            dirs: vec![PathBuf::from("/opt/py/3.11")],
        },
        die_with_parent: true,
        tools_dir: None,
    }
}

fn unprivileged() -> BwrapOptions {
    BwrapOptions {
        privileged: false,
        setpriv: None,
        ..root()
    }
}

/// The shell that reads the kernel's environment and command after the drop.
const SHELL: &str = ". /etc/kernel-broker.env || exit 126; cd -- \"$0\" || exit 126; exec \"$@\"";

/// One run: options, tmpfs size, uid, resource dir, seccomp fd → the argv.
fn run(
    opts: &BwrapOptions,
    tmp_size: Option<u64>,
    ids: Option<(u32, u32)>,
    resource_dir: Option<&Path>,
    seccomp: Option<RawFd>,
) -> Vec<String> {
    let req = BwrapRequest {
        workspace: Path::new("/data/workspaces/alice"),
        rundir: Path::new("/run/kb/0000"),
        ids,
        tmp_size,
        resource_dir,
        boot_dir: None,
        env_fd: 9,
        own: None,
        restore: false,
    };
    text(&bwrap_args(opts, &host(), &req, seccomp))
}

#[test]
fn argv_cases() {
    struct Case {
        name: &'static str,
        args: Vec<String>,
        present: Vec<&'static [&'static str]>,
        absent: Vec<&'static [&'static str]>,
    }
    let res = Path::new("/k/spec");
    let cases = [
        Case {
            name: "root: own namespaces, no network, uid dropped by setpriv",
            args: run(&root(), None, Some((200_001, 200_001)), None, None),
            present: vec![
                &["--unshare-pid"],
                &["--unshare-net"],
                &["--unshare-ipc"],
                &["--unshare-uts"],
                &["--unshare-cgroup-try"],
                &["--die-with-parent"],
                &["--new-session"],
                &["--hostname", "kernel"],
                &[
                    "--",
                    "/usr/bin/setpriv",
                    "--reuid=200001",
                    "--regid=200001",
                    "--clear-groups",
                    "--inh-caps=-all",
                    "--bounding-set=-all",
                    "--no-new-privs",
                    "--",
                    "/bin/sh",
                ],
                &["--", "/bin/sh", "-c", SHELL, "/workspace"],
            ],
            absent: vec![&["--unshare-user"], &["--seccomp"], &["--size"]],
        },
        Case {
            name: "unprivileged: a user namespace, no nested ones, no setpriv",
            args: run(&unprivileged(), None, None, None, None),
            present: vec![
                &["--unshare-net"],
                &["--unshare-user"],
                &["--disable-userns"],
                &["--", "/bin/sh", "-c"],
                &["--", "/bin/sh", "-c", SHELL, "/workspace"],
            ],
            absent: vec![&["/usr/bin/setpriv"]],
        },
        Case {
            name: "an old bwrap without --disable-userns",
            args: run(
                &BwrapOptions {
                    has_disable_userns: false,
                    ..unprivileged()
                },
                None,
                None,
                None,
                None,
            ),
            present: vec![&["--unshare-user"]],
            absent: vec![&["--disable-userns"]],
        },
        Case {
            name: "read-only host: /usr, Python, /lib64, extra binds, /etc files",
            args: run(&root(), None, None, None, None),
            present: vec![
                &["--ro-bind", "/usr", "/usr"],
                &["--symlink", "usr/bin", "/bin"],
                &["--ro-bind", "/lib64", "/lib64"],
                &["--ro-bind", "/opt/py/3.11", "/opt/py/3.11"],
                &["--ro-bind", "/opt/data", "/opt/data"],
                &["--ro-bind", "/etc/localtime", "/etc/localtime"],
                &["--ro-bind", "/run/kb/0000/passwd", "/etc/passwd"],
                &["--ro-bind", "/run/kb/0000/group", "/etc/group"],
                &["--ro-bind", "/run/kb/0000/hosts", "/etc/hosts"],
                &["--perms", "0755", "--dir", "/opt"],
            ],
            absent: vec![&["--bind", "/usr"], &["--ro-bind", "/k/spec"]],
        },
        Case {
            name: "writable: only the workspace and the runtime directory",
            args: run(&root(), None, None, None, None),
            present: vec![
                &["--bind", "/run/kb/0000", "/run/kernel"],
                &["--bind", "/data/workspaces/alice", "/workspace"],
                // The kernel's own shell changes there, after the drop.
                &["--", "/bin/sh", "-c", SHELL, "/workspace"],
                &["--proc", "/proc", "--dev", "/dev"],
                &["--perms", "1777", "--tmpfs", "/tmp"],
                &["--perms", "1777", "--tmpfs", "/dev/shm"],
            ],
            absent: vec![],
        },
        Case {
            name: "the memory limit caps the tmpfs when bwrap can",
            args: run(&root(), Some(64 << 20), None, None, None),
            present: vec![
                &["--perms", "1777", "--size", "67108864", "--tmpfs", "/tmp"],
                &[
                    "--perms", "1777", "--size", "67108864", "--tmpfs", "/dev/shm",
                ],
            ],
            absent: vec![],
        },
        Case {
            name: "a bwrap without --size gets no cap",
            args: run(
                &BwrapOptions {
                    has_size: false,
                    ..root()
                },
                Some(64 << 20),
                None,
                None,
                None,
            ),
            present: vec![&["--perms", "1777", "--tmpfs", "/tmp"]],
            absent: vec![&["--size"]],
        },
        Case {
            name: "the syscall filter and the kernel spec's resource directory",
            args: run(&root(), None, None, Some(res), Some(7)),
            present: vec![&["--seccomp", "7"], &["--ro-bind", "/k/spec", "/k/spec"]],
            absent: vec![],
        },
    ];
    for case in cases {
        for seq in &case.present {
            assert!(
                has(&case.args, seq),
                "{}: missing {seq:?} in {:?}",
                case.name,
                case.args
            );
        }
        for seq in &case.absent {
            assert!(
                !has(&case.args, seq),
                "{}: unexpected {seq:?} in {:?}",
                case.name,
                case.args
            );
        }
    }
}

#[test]
fn an_egress_ca_file_is_shown_read_only_at_a_neutral_path() {
    let req = BwrapRequest {
        workspace: Path::new("/data/workspaces/alice"),
        rundir: Path::new("/run/kb/0000"),
        ids: Some((1, 1)),
        tmp_size: None,
        resource_dir: None,
        boot_dir: None,
        env_fd: 9,
        own: None,
        restore: false,
    };
    let with = host().with_ca_file(Some(Path::new("/srv/site-ca.pem")));
    let args = text(&bwrap_args(&root(), &with, &req, None));
    assert!(has(
        &args,
        &["--ro-bind", "/srv/site-ca.pem", "/etc/kernel-broker-ca.pem"]
    ));
    let without = text(&bwrap_args(&root(), &host(), &req, None));
    assert!(!without.iter().any(|a| a.contains("kernel-broker-ca")));
}

#[test]
fn private_mounts_come_before_binds_that_may_land_on_them() {
    let args = run(&root(), None, Some((1, 1)), None, None);
    let at = |seq: &[&str]| {
        args.windows(seq.len())
            .position(|w| w.iter().zip(seq).all(|(a, b)| a == b))
            .unwrap_or_else(|| panic!("{seq:?} missing"))
    };
    assert!(at(&["--tmpfs", "/tmp"]) < at(&["--ro-bind", "/opt/py/3.11"]));
    // The command comes last, after the file system.
    assert!(
        at(&["--bind", "/data/workspaces/alice", "/workspace"]) < at(&["--", "/usr/bin/setpriv"])
    );
}

/// bwrap as root keeps every capability for its child unless told: only what setpriv
/// needs to drop to the kernel's uid survives, and nothing at all without setpriv. The
/// environment is read after the drop: the command bwrap runs is setpriv with fixed
/// arguments, then the shell that reads the environment's descriptor, then the kernel.
#[test]
fn privileged_helpers_get_fixed_inputs_and_only_the_capabilities_they_need() {
    let req = BwrapRequest {
        workspace: Path::new("/data/workspaces/alice"),
        rundir: Path::new("/run/kb/0000"),
        ids: Some((7, 7)),
        tmp_size: None,
        resource_dir: None,
        boot_dir: None,
        env_fd: 9,
        own: None,
        restore: false,
    };
    let args = text(&bwrap_args(&root(), &host(), &req, None));
    let caps: Vec<&str> = args
        .windows(2)
        .filter(|w| w[0] == "--cap-add")
        .map(|w| w[1].as_str())
        .collect();
    assert!(has(&args, &["--cap-drop", "ALL"]));
    assert_eq!(caps, ["CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP"]);
    let dash = args.iter().position(|a| a == "--").unwrap();
    let after: Vec<&str> = args[dash + 1..].iter().map(String::as_str).collect();
    assert_eq!(after[0], "/usr/bin/setpriv");
    let sh = after.iter().position(|a| *a == "/bin/sh").unwrap();
    assert_eq!(after[sh - 1], "--", "the shell is setpriv's command");
    assert!(
        after[sh + 2].starts_with(". /etc/kernel-broker.env "),
        "{after:?}"
    );
    assert!(has(
        &args,
        &["--perms", "0444", "--file", "9", "/etc/kernel-broker.env"]
    ));
    assert_eq!(
        &after[sh + 3..],
        ["/workspace"],
        "nothing a tenant chose: the command is in the script"
    );
    assert!(
        !args.iter().any(|a| a == "--chdir"),
        "bwrap has no capability left to enter it"
    );

    let unpriv = text(&bwrap_args(&unprivileged(), &host(), &req, None));
    assert!(has(&unpriv, &["--cap-drop", "ALL"]));
    assert!(!unpriv.iter().any(|a| a == "--cap-add"));
}

#[test]
fn the_kernel_environment_is_built_not_inherited() {
    let python = KernelPython::Host {
        bin: PathBuf::from("/opt/venv/bin"),
        dirs: vec![],
    };
    let env: HashMap<String, String> = kernel_env(&python, "a:b").into_iter().collect();
    assert_eq!(
        env["PATH"],
        "/opt/venv/bin:/opt/kernel-broker-tools:/usr/local/bin:/usr/bin:/bin"
    );
    assert_eq!(env["HOME"], "/home/kernel");
    assert_eq!(env["USER"], "a_b");
    assert_eq!(env["LOGNAME"], "a_b");
    assert_eq!(env["TMPDIR"], "/tmp");
    assert_eq!(env.len(), 9);

    // A venv over a relocated base: neutral PATH, and libpython found at its new place.
    let python = KernelPython::Venv {
        venv: PathBuf::from("/work/kb/kernels/.venv"),
        base: PathBuf::from("/root/.pyenv/versions/3.11.7"),
        interpreter: PathBuf::from("bin/python3.11"),
        programs: Vec::new(),
    };
    let env: HashMap<String, String> = kernel_env(&python, "a").into_iter().collect();
    assert!(env["PATH"].starts_with("/opt/kernel-venv/bin:"));
    assert_eq!(env["LD_LIBRARY_PATH"], "/opt/kernel-python/lib");
    assert!(env
        .values()
        .all(|v| !v.contains("/root") && !v.contains("/work")));
}

#[test]
fn the_venv_and_the_home_are_at_neutral_paths() {
    let opts = BwrapOptions {
        python: KernelPython::Venv {
            venv: PathBuf::from("/work/kb/kernels/.venv"),
            base: PathBuf::from("/root/.pyenv/versions/3.11.7"),
            interpreter: PathBuf::from("bin/python3.11"),
            programs: Vec::new(),
        },
        ..root()
    };
    let args = run(&opts, Some(64 << 20), Some((1, 1)), None, None);
    for seq in [
        &[
            "--ro-bind",
            "/root/.pyenv/versions/3.11.7",
            "/opt/kernel-python",
        ][..],
        &["--ro-bind", "/work/kb/kernels/.venv", "/opt/kernel-venv"],
        &[
            "--ro-bind",
            "/run/kb/0000/pyvenv.cfg",
            "/opt/kernel-venv/pyvenv.cfg",
        ],
        &["--perms", "0755", "--tmpfs", "/opt/kernel-venv/bin"],
        &[
            "--symlink",
            "/opt/kernel-python/bin/python3.11",
            "/opt/kernel-venv/bin/python",
        ],
        &["--remount-ro", "/opt/kernel-venv/bin"],
        &["--perms", "0755", "--dir", "/home"],
        &[
            "--perms",
            "1777",
            "--size",
            "67108864",
            "--tmpfs",
            "/home/kernel",
        ],
    ] {
        assert!(has(&args, seq), "missing {seq:?} in {args:?}");
    }
    // Nothing of the host's Python is shown at its own path.
    assert!(!args
        .iter()
        .any(|a| a == "/root" || a.starts_with("/root/.pyenv/versions/3.11.7/")));
}

#[test]
fn only_jdk_configurations_of_etc_are_shown_for_java() {
    assert!(is_jdk_config("java-17-openjdk"));
    assert!(is_jdk_config("java-21-openjdk"));
    for name in [
        "java-openjdk",
        "java--openjdk",
        "java-17-openjdk-x",
        "java-../-openjdk",
        "shadow",
        "java-17",
    ] {
        assert!(!is_jdk_config(name), "{name}");
    }
}
