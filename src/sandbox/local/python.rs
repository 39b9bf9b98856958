//! Where kernels find their Python: the same neutral paths on both backends, so no host path
//! appears in a traceback, `sys.path` or an error message. The Docker image builds its venv
//! at `/opt/kernel-venv` over Debian's Python in `/usr`; the local sandbox shows the host's
//! venv (`kernels/.venv`, wherever the clone is) at `/opt/kernel-venv` and the venv's base
//! installation (a pyenv build under `/root`, say) at `/opt/kernel-python`.
//!
//! A venv cannot simply be bound elsewhere: its `bin/python` is a symlink to the base's
//! absolute host path and its `pyvenv.cfg` names the base's host directory (Python finds its
//! standard library from there). So the sandbox lays the venv out afresh: the host venv
//! read-only, a `pyvenv.cfg` of its own over the host's ([`PYVENV_CFG`], written in each
//! runtime directory), and a small tmpfs over `bin` holding only the interpreter's links. The
//! venv's console scripts (`pip`, `jupyter`) are not shown: their `#!` lines name the host
//! path; `python -m pip` works. A base built with an absolute `RUNPATH` to its `libpython`
//! (pyenv does that) finds it through `LD_LIBRARY_PATH`.
//!
//! Pure: the layout is data ([`PythonMount`]), applied by `bwrap.rs` and tested below.

use std::path::{Path, PathBuf};

/// The kernels' venv, as kernels see it (also the Docker image's).
pub(super) const VENV_INSIDE: &str = "/opt/kernel-venv";
/// The venv's base installation, as kernels see it (a symlink when it lives under `/usr`).
pub(super) const BASE_INSIDE: &str = "/opt/kernel-python";
/// The `pyvenv.cfg` every runtime directory holds, shown over the host venv's own. The
/// host's names host paths (`home`, `executable`, `command`); only `home` and the system
/// site-packages switch are read by Python (`kernels/setup.sh` makes venvs without it).
pub(super) const PYVENV_CFG: &str =
    "home = /opt/kernel-python/bin\ninclude-system-site-packages = false\n";
/// Its name in the runtime directory.
pub(super) const PYVENV_CFG_NAME: &str = "pyvenv.cfg";

/// The kernels' Python installation on the host, learned once (`host.rs`).
#[derive(Debug, Clone, PartialEq)]
pub(super) enum KernelPython {
    /// A venv, shown at [`VENV_INSIDE`] over its base at [`BASE_INSIDE`].
    Venv {
        /// The venv's directory on the host (`sys.prefix`).
        venv: PathBuf,
        /// The base installation on the host (`sys.base_prefix`).
        base: PathBuf,
        /// The real interpreter, relative to `base` (`bin/python3.11`).
        interpreter: PathBuf,
        /// The native programs of the venv's `bin` (executables, not `#!` scripts: Deno's
        /// `deno`, installed from PyPI), shown beside the interpreter's links.
        programs: Vec<String>,
    },
    /// An interpreter that is not in a venv (or whose binary lies outside its prefix):
    /// its directories are shown at their host paths, as they are.
    Host {
        /// The directory whose programs go first on `PATH`.
        bin: PathBuf,
        /// Host directories shown read-only at the same place.
        dirs: Vec<PathBuf>,
    },
}

impl Default for KernelPython {
    fn default() -> Self {
        Self::Host {
            bin: PathBuf::from("/usr/bin"),
            dirs: Vec::new(),
        }
    }
}

/// One step of the Python's part of the sandbox's file system, in order.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum PythonMount {
    RoBind {
        src: PathBuf,
        dest: PathBuf,
    },
    Symlink {
        target: PathBuf,
        link: PathBuf,
    },
    /// A fresh tmpfs (mode 0755), writable only while bwrap builds the file system.
    Tmpfs(PathBuf),
    RemountRo(PathBuf),
}

/// Whether `path` starts like an executable (ELF), not a script.
fn is_elf(path: &Path) -> bool {
    use std::io::Read;
    let mut head = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut head))
        .is_ok_and(|()| head == *b"\x7fELF")
}

impl KernelPython {
    /// What `host.rs` learned: `sys.prefix`, `sys.base_prefix` and the real executable.
    pub fn from_host(prefix: &Path, base: &Path, executable: &Path) -> Self {
        let interpreter = executable.strip_prefix(base).ok().map(Path::to_path_buf);
        match interpreter {
            Some(interpreter) if prefix != base => Self::Venv {
                venv: prefix.to_path_buf(),
                base: base.to_path_buf(),
                interpreter,
                programs: Vec::new(),
            },
            _ => {
                let mut dirs: Vec<PathBuf> = Vec::new();
                for dir in [prefix, base] {
                    if !dir.starts_with("/usr") && !dirs.iter().any(|d| d == dir) {
                        dirs.push(dir.to_path_buf());
                    }
                }
                // An interpreter binary outside both prefixes (unusual): its directory too.
                if !executable.starts_with("/usr")
                    && !dirs.iter().any(|d| executable.starts_with(d))
                {
                    if let Some(bin) = executable.parent() {
                        dirs.push(bin.to_path_buf());
                    }
                }
                Self::Host {
                    bin: prefix.join("bin"),
                    dirs,
                }
            }
        }
    }

    /// The venv's native programs in `bin` (ELF executables; scripts name host paths in
    /// their `#!` line and are left out), read from the host. Nothing for a `Host`.
    pub fn with_programs_found(self) -> Self {
        let Self::Venv {
            venv,
            base,
            interpreter,
            ..
        } = self
        else {
            return self;
        };
        let mut programs: Vec<String> = std::fs::read_dir(venv.join("bin"))
            .map(|rd| {
                rd.filter_map(Result::ok)
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
                    .filter(|e| is_elf(&e.path()))
                    .filter_map(|e| e.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default();
        programs.sort();
        Self::Venv {
            venv,
            base,
            interpreter,
            programs,
        }
    }

    /// The environment's prefix inside the sandbox (`{prefix}` in a spec's argv: where pip
    /// put a kernel's own files, as jjava's jars under `share/jupyter/kernels/java`).
    pub fn prefix_inside(&self) -> PathBuf {
        match self {
            Self::Venv { .. } => PathBuf::from(VENV_INSIDE),
            Self::Host { bin, .. } => bin.parent().map_or_else(|| bin.clone(), Path::to_path_buf),
        }
    }

    /// The directory whose programs go first on the kernel's `PATH`.
    pub fn bin_inside(&self) -> PathBuf {
        match self {
            Self::Venv { .. } => Path::new(VENV_INSIDE).join("bin"),
            Self::Host { bin, .. } => bin.clone(),
        }
    }

    /// The interpreter a kernel spec's `python` names, inside the sandbox (`host`: the
    /// configured one, used as it is when the sandbox shows it at its host path).
    pub fn interpreter_inside(&self, host: &Path) -> PathBuf {
        match self {
            Self::Venv { .. } => Path::new(VENV_INSIDE).join("bin/python"),
            Self::Host { .. } => host.to_path_buf(),
        }
    }

    /// `LD_LIBRARY_PATH` for a base shown away from its host path: its `libpython` is found
    /// by an absolute `RUNPATH` naming that host path otherwise.
    pub fn library_path(&self) -> Option<String> {
        match self {
            Self::Venv { base, .. } if !base.starts_with("/usr") => {
                Some(format!("{BASE_INSIDE}/lib"))
            }
            _ => None,
        }
    }

    /// Host directories a sandbox must be able to show (for the checks of `Host` paths).
    pub fn host_dirs(&self) -> Vec<PathBuf> {
        match self {
            Self::Venv { venv, base, .. } => vec![venv.clone(), base.clone()],
            Self::Host { dirs, .. } => dirs.clone(),
        }
    }

    /// The mounts, in order, for a launch whose runtime directory is `rundir` (holding
    /// [`PYVENV_CFG_NAME`]).
    pub fn mounts(&self, rundir: &Path) -> Vec<PythonMount> {
        let Self::Venv {
            venv,
            base,
            interpreter,
            programs,
        } = self
        else {
            let Self::Host { dirs, .. } = self else {
                return Vec::new();
            };
            return dirs
                .iter()
                .map(|d| PythonMount::RoBind {
                    src: d.clone(),
                    dest: d.clone(),
                })
                .collect();
        };
        let (base_inside, venv_inside) = (Path::new(BASE_INSIDE), Path::new(VENV_INSIDE));
        let bin = venv_inside.join("bin");
        let mut out = vec![
            if base.starts_with("/usr") {
                // Visible already (the sandbox shows /usr): a link gives it the same name.
                PythonMount::Symlink {
                    target: base.clone(),
                    link: base_inside.to_path_buf(),
                }
            } else {
                PythonMount::RoBind {
                    src: base.clone(),
                    dest: base_inside.to_path_buf(),
                }
            },
            PythonMount::RoBind {
                src: venv.clone(),
                dest: venv_inside.to_path_buf(),
            },
            PythonMount::RoBind {
                src: rundir.join(PYVENV_CFG_NAME),
                dest: venv_inside.join(PYVENV_CFG_NAME),
            },
            PythonMount::Tmpfs(bin.clone()),
        ];
        let mut names = vec!["python".to_string(), "python3".to_string()];
        if let Some(name) = interpreter.file_name().and_then(|n| n.to_str()) {
            if !names.iter().any(|n| n == name) {
                names.push(name.to_string());
            }
        }
        for name in &names {
            out.push(PythonMount::Symlink {
                target: base_inside.join(interpreter),
                link: bin.join(name),
            });
        }
        for name in programs {
            if names.iter().any(|n| n == name) || name.contains('/') {
                continue;
            }
            out.push(PythonMount::RoBind {
                src: venv.join("bin").join(name),
                dest: bin.join(name),
            });
        }
        out.push(PythonMount::RemountRo(bin));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> PathBuf {
        PathBuf::from(s)
    }

    #[test]
    fn what_the_host_has_decides_the_layout() {
        // (prefix, base_prefix, real executable) → layout
        let pyenv = KernelPython::from_host(
            &p("/work/kb/kernels/.venv"),
            &p("/root/.pyenv/versions/3.11.7"),
            &p("/root/.pyenv/versions/3.11.7/bin/python3.11"),
        );
        assert_eq!(
            pyenv,
            KernelPython::Venv {
                venv: p("/work/kb/kernels/.venv"),
                base: p("/root/.pyenv/versions/3.11.7"),
                interpreter: p("bin/python3.11"),
                programs: Vec::new(),
            }
        );
        assert_eq!(pyenv.bin_inside(), p("/opt/kernel-venv/bin"));
        assert_eq!(pyenv.prefix_inside(), p("/opt/kernel-venv"));
        assert_eq!(
            pyenv.library_path().as_deref(),
            Some("/opt/kernel-python/lib")
        );

        let debian = KernelPython::from_host(
            &p("/srv/kb/kernels/.venv"),
            &p("/usr"),
            &p("/usr/bin/python3.11"),
        );
        assert!(matches!(debian, KernelPython::Venv { .. }));
        assert_eq!(debian.library_path(), None);

        // Not a venv: shown as it is.
        let plain =
            KernelPython::from_host(&p("/opt/py"), &p("/opt/py"), &p("/opt/py/bin/python3.12"));
        assert_eq!(
            plain,
            KernelPython::Host {
                bin: p("/opt/py/bin"),
                dirs: vec![p("/opt/py")],
            }
        );
        assert_eq!(plain.bin_inside(), p("/opt/py/bin"));
        assert_eq!(plain.prefix_inside(), p("/opt/py"));
        assert_eq!(plain.library_path(), None);
    }

    #[test]
    fn a_venv_is_laid_out_at_neutral_paths() {
        let rundir = p("/run/kb/0000");
        let pyenv = KernelPython::Venv {
            venv: p("/work/kb/kernels/.venv"),
            base: p("/root/.pyenv/versions/3.11.7"),
            interpreter: p("bin/python3.11"),
            // A native program (Deno) is shown; a name that is the interpreter's, or not a
            // plain name, never is.
            programs: vec!["deno".into(), "python".into(), "../x".into()],
        };
        let link = |name: &str| PythonMount::Symlink {
            target: p("/opt/kernel-python/bin/python3.11"),
            link: p("/opt/kernel-venv/bin").join(name),
        };
        assert_eq!(
            pyenv.mounts(&rundir),
            [
                PythonMount::RoBind {
                    src: p("/root/.pyenv/versions/3.11.7"),
                    dest: p("/opt/kernel-python"),
                },
                PythonMount::RoBind {
                    src: p("/work/kb/kernels/.venv"),
                    dest: p("/opt/kernel-venv"),
                },
                PythonMount::RoBind {
                    src: p("/run/kb/0000/pyvenv.cfg"),
                    dest: p("/opt/kernel-venv/pyvenv.cfg"),
                },
                PythonMount::Tmpfs(p("/opt/kernel-venv/bin")),
                link("python"),
                link("python3"),
                link("python3.11"),
                PythonMount::RoBind {
                    src: p("/work/kb/kernels/.venv/bin/deno"),
                    dest: p("/opt/kernel-venv/bin/deno"),
                },
                PythonMount::RemountRo(p("/opt/kernel-venv/bin")),
            ]
        );
        let debian = KernelPython::Venv {
            venv: p("/srv/venv"),
            base: p("/usr"),
            interpreter: p("bin/python3"),
            programs: Vec::new(),
        };
        let mounts = debian.mounts(&rundir);
        assert_eq!(
            mounts[0],
            PythonMount::Symlink {
                target: p("/usr"),
                link: p("/opt/kernel-python"),
            }
        );
        // python3 is the interpreter's own name: linked once.
        assert_eq!(mounts.len(), 7);
        assert!(PYVENV_CFG.starts_with(&format!("home = {BASE_INSIDE}/bin\n")));
    }

    #[test]
    fn only_the_venvs_native_programs_are_found() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::write(bin.join("deno"), b"\x7fELF\x02\x01\x01rest").unwrap();
        std::fs::write(bin.join("pip"), b"#!/host/path/python\n").unwrap();
        std::fs::write(bin.join("short"), b"\x7f").unwrap();
        std::os::unix::fs::symlink("/usr/bin/python3", bin.join("python")).unwrap();
        let found = KernelPython::Venv {
            venv: dir.path().to_path_buf(),
            base: p("/usr"),
            interpreter: p("bin/python3"),
            programs: Vec::new(),
        }
        .with_programs_found();
        let KernelPython::Venv { programs, .. } = found else {
            panic!("still a venv")
        };
        assert_eq!(programs, ["deno"]);
    }
}
