//! Environment variables a tenant chooses (E2B's `envVars` and `commands.run` `envs`, a
//! session's extra environment): what may be asked for, and how it reaches a kernel or a
//! command without passing through any process that runs with more privilege than they.
//!
//! Two rules, both needed (docs/SECURITY.md, "Privileged helpers"):
//! - **Refused at the edge** ([`check_user_env`]): names that are not plain identifiers,
//!   values with NUL, sizes past [`MAX_ENV_BYTES`], and every variable the dynamic loader
//!   or glibc reads as an instruction (`LD_*`, `GCONV_PATH`, `GLIBC_TUNABLES`, ...: glibc's
//!   own list of variables it drops in secure-execution mode). The front doors map the
//!   refusal to a 400.
//! - **Applied only after the drop** ([`launch_script`]): the backends give privileged
//!   helpers (bwrap, setpriv) a fixed, empty environment; the kernel's whole environment,
//!   fixed and tenant parts alike, travels in a sealed memfd that bwrap copies into the
//!   sandbox (`--file`) and `/bin/sh` reads as the kernel's uid, after `setpriv` dropped
//!   every capability. So even a variable this check
//!   missed could only affect a process that is the kernel's already.
//!
//! Pure but for [`env_memfd`], which only creates an anonymous file.

use std::io::{self, Write};
use std::os::fd::OwnedFd;

/// The most bytes (names and values) a tenant's variables may take together: the
/// environment travels in the command line of nothing, but still through the kernel's
/// `execve`, whose arguments and environment share a few hundred KiB at most.
pub const MAX_ENV_BYTES: usize = 64 << 10;
/// The most variables a tenant may set at once.
pub const MAX_ENV_VARS: usize = 256;
/// The longest name accepted.
const MAX_NAME: usize = 128;

/// Variables glibc ignores for setuid programs because they steer the loader or libc
/// (glibc's `unsecvars.h`), plus the loader's whole `LD_` family: a tenant has no use for
/// them that the kernel's own `os.environ` does not serve, and every use of them against a
/// privileged process is an attack.
const LOADER_VARIABLES: &[&str] = &[
    "GCONV_PATH",
    "GETCONF_DIR",
    "GLIBC_TUNABLES",
    "HOSTALIASES",
    "LOCALDOMAIN",
    "LOCPATH",
    "MALLOC_TRACE",
    "NIS_PATH",
    "NLSPATH",
    "RESOLV_HOST_CONF",
    "RES_OPTIONS",
];

/// Why a tenant's environment was refused; the message names the variable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvRefused {
    #[error("{name:?} is not a valid environment variable name (letters, digits and _, not starting with a digit)")]
    BadName { name: String },
    #[error("{name} steers the dynamic loader or the C library and cannot be set")]
    Loader { name: String },
    #[error("the value of {name} contains a NUL byte")]
    NulInValue { name: String },
    #[error("{count} environment variables are more than the {limit} allowed")]
    TooMany { count: usize, limit: usize },
    #[error("the environment variables take {bytes} bytes, more than the {limit} allowed")]
    TooLarge { bytes: usize, limit: usize },
}

/// Whether `name` is a variable name a shell and `execve` agree on: `[A-Za-z_][A-Za-z0-9_]*`.
pub fn is_env_name(name: &str) -> bool {
    let mut chars = name.chars();
    name.len() <= MAX_NAME
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Whether `name` is one the loader or the C library obeys ([`LOADER_VARIABLES`], `LD_*`).
pub fn is_loader_variable(name: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    upper.starts_with("LD_") || LOADER_VARIABLES.contains(&upper.as_str())
}

/// Checks the variables a tenant asked for (see the module comment).
pub fn check_user_env<'a>(
    vars: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Result<(), EnvRefused> {
    let (mut count, mut bytes) = (0usize, 0usize);
    for (name, value) in vars {
        if !is_env_name(name) {
            return Err(EnvRefused::BadName {
                name: name.chars().take(MAX_NAME).collect(),
            });
        }
        if is_loader_variable(name) {
            return Err(EnvRefused::Loader { name: name.into() });
        }
        if value.contains('\0') {
            return Err(EnvRefused::NulInValue { name: name.into() });
        }
        count += 1;
        bytes += name.len() + value.len() + 2;
    }
    if count > MAX_ENV_VARS {
        return Err(EnvRefused::TooMany {
            count,
            limit: MAX_ENV_VARS,
        });
    }
    if bytes > MAX_ENV_BYTES {
        return Err(EnvRefused::TooLarge {
            bytes,
            limit: MAX_ENV_BYTES,
        });
    }
    Ok(())
}

/// A POSIX shell script that exports `vars` (later ones win) and then sets the positional
/// parameters to `argv` (`set -- ...`), for [`apply_then_exec`]'s shell to `exec "$@"`: the
/// command a kernel or command runs travels here too, never in the argv of a privileged
/// process. Each value and argument in single quotes, a quote in it as `'\''`, so no byte of
/// one is ever read as shell syntax. A name that is not a plain identifier, or a NUL, is an
/// error: the caller checked them already, and a script must not be built around one it did
/// not.
pub fn launch_script(vars: &[(String, String)], argv: &[String]) -> Result<Vec<u8>, EnvRefused> {
    fn quoted(out: &mut Vec<u8>, value: &str) {
        out.push(b'\'');
        out.extend_from_slice(value.replace('\'', r"'\''").as_bytes());
        out.push(b'\'');
    }
    let mut out = Vec::with_capacity(
        vars.iter()
            .map(|(k, v)| k.len() + v.len() + 12)
            .sum::<usize>()
            + argv.iter().map(|a| a.len() + 3).sum::<usize>()
            + 8,
    );
    for (name, value) in vars {
        if !is_env_name(name) {
            return Err(EnvRefused::BadName { name: name.clone() });
        }
        if value.contains('\0') {
            return Err(EnvRefused::NulInValue { name: name.clone() });
        }
        out.extend_from_slice(b"export ");
        out.extend_from_slice(name.as_bytes());
        out.push(b'=');
        quoted(&mut out, value);
        out.push(b'\n');
    }
    out.extend_from_slice(b"set --");
    for arg in argv {
        if arg.contains('\0') {
            return Err(EnvRefused::NulInValue {
                name: "an argument".into(),
            });
        }
        out.push(b' ');
        quoted(&mut out, arg);
    }
    out.push(b'\n');
    Ok(out)
}

/// The command that, run as the kernel's uid, reads the script at `script` (a fixed path
/// inside the sandbox, not quoted for a shell) into its environment and positional
/// parameters ([`launch_script`]), changes to `cwd` and becomes the command:
/// `/bin/sh -c '...' CWD`. Nothing a tenant chose is in it.
pub fn apply_then_exec(script: &str, cwd: &str) -> Vec<String> {
    vec![
        "/bin/sh".to_string(),
        "-c".to_string(),
        format!(". {script} || exit 126; cd -- \"$0\" || exit 126; exec \"$@\""),
        cwd.to_string(),
    ]
}

/// A close-on-exec memfd holding `script`, sealed against any change and positioned at
/// its start, for the sandbox to inherit (bwrap copies it into the sandbox with `--file`
/// and closes it before anything of the kernel's runs).
pub fn env_memfd(script: &[u8]) -> io::Result<OwnedFd> {
    use rustix::fs::{fcntl_add_seals, memfd_create, MemfdFlags, SealFlags};
    use std::io::Seek;
    let fd = memfd_create(
        "kernel-broker-env",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )?;
    let mut file = std::fs::File::from(fd);
    file.write_all(script)?;
    file.rewind()?;
    fcntl_add_seals(
        &file,
        SealFlags::SEAL | SealFlags::SHRINK | SealFlags::GROW | SealFlags::WRITE,
    )?;
    Ok(file.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(vars: &[(&str, &str)]) -> Option<EnvRefused> {
        check_user_env(vars.iter().copied()).err()
    }

    #[test]
    fn loader_variables_and_bad_names_are_refused() {
        for name in [
            "LD_PRELOAD",
            "LD_LIBRARY_PATH",
            "LD_AUDIT",
            "ld_preload",
            "LD_",
            "GCONV_PATH",
            "GLIBC_TUNABLES",
        ] {
            assert!(
                matches!(refused(&[(name, "x")]), Some(EnvRefused::Loader { .. })),
                "{name}"
            );
        }
        for name in ["", "1A", "A-B", "A=B", "A B", "A\0", "é", &"A".repeat(200)] {
            assert!(
                matches!(refused(&[(name, "x")]), Some(EnvRefused::BadName { .. })),
                "{name:?}"
            );
        }
        assert!(matches!(
            refused(&[("A", "x\0y")]),
            Some(EnvRefused::NulInValue { .. })
        ));
        let many: Vec<(String, String)> = (0..=MAX_ENV_VARS)
            .map(|i| (format!("V{i}"), String::new()))
            .collect();
        assert!(matches!(
            check_user_env(many.iter().map(|(k, v)| (k.as_str(), v.as_str()))),
            Err(EnvRefused::TooMany { .. })
        ));
        let big = "x".repeat(MAX_ENV_BYTES);
        assert!(matches!(
            refused(&[("A", &big)]),
            Some(EnvRefused::TooLarge { .. })
        ));
        assert_eq!(
            refused(&[("PATH", "/x"), ("_A1", "'; rm -rf /"), ("PYTHONPATH", "")]),
            None
        );
    }

    #[test]
    fn the_script_quotes_every_value_and_argument() {
        let script = launch_script(
            &[
                ("A".into(), "it's $HOME `x` \"q\" \\n\nline".into()),
                ("B".into(), String::new()),
            ],
            &["sh".into(), "-c".into(), "echo 'hi'".into()],
        )
        .unwrap();
        assert_eq!(
            String::from_utf8(script).unwrap(),
            "export A='it'\\''s $HOME `x` \"q\" \\n\nline'\nexport B=''\n\
             set -- 'sh' '-c' 'echo '\\''hi'\\'''\n"
        );
        assert!(launch_script(&[("A B".into(), "x".into())], &[]).is_err());
        assert!(launch_script(&[("A".into(), "\0".into())], &[]).is_err());
        assert!(launch_script(&[], &["\0".into()]).is_err());
    }

    /// The script read by a real `/bin/sh` gives back every value and argument byte for
    /// byte, from the memfd's start, and the shell becomes the command in `cwd`.
    #[test]
    fn a_shell_reads_the_script_back_exactly() {
        let vars = vec![
            (
                "A".to_string(),
                "it's $(id) `id` \"q\" \\ \n; exit 3".to_string(),
            ),
            ("B".to_string(), "é ✓ '' '".to_string()),
            ("PATH".to_string(), "/usr/bin:/bin".to_string()),
        ];
        let argv = [
            "/bin/sh".to_string(),
            "-c".to_string(),
            "printf '%s\\0%s\\0%s\\0' \"$A\" \"$B\" \"$0\"; pwd".to_string(),
            "it's; $(id) \n".to_string(),
        ];
        let fd = env_memfd(&launch_script(&vars, &argv).unwrap()).unwrap();
        let mut copy = tempfile::NamedTempFile::new().unwrap();
        std::io::copy(&mut std::fs::File::from(fd), &mut copy).unwrap();
        let shell = apply_then_exec(copy.path().to_str().unwrap(), "/");
        assert!(
            !shell.iter().any(|a| a.contains("printf")),
            "the command is not in the shell's argv"
        );
        let out = std::process::Command::new(&shell[0])
            .args(&shell[1..])
            .env_clear()
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let text = String::from_utf8(out.stdout).unwrap();
        let mut parts = text.split('\0');
        assert_eq!(parts.next(), Some(vars[0].1.as_str()));
        assert_eq!(parts.next(), Some(vars[1].1.as_str()));
        assert_eq!(parts.next(), Some(argv[3].as_str()));
        assert_eq!(parts.next(), Some("/\n"));
    }

    #[test]
    fn the_memfd_is_sealed() {
        let fd = env_memfd(b"export A='1'\n").unwrap();
        let mut file = std::fs::File::from(fd);
        assert!(file.write_all(b"x").is_err());
    }
}
