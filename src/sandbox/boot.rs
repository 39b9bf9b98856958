//! Kernels born ready for data work: the bootstrap script both backends run in place of
//! `python -m ipykernel_launcher` (`kernels/kernel_broker_boot.py`, compiled into the
//! binary and written into each runtime directory), which modules it preloads, and which
//! kernel specs it can start at all.
//!
//! A spec is bootable when its argv is `<python> -m ipykernel_launcher ARGS` (or `-m
//! ipykernel ARGS`, or `-m ipykernel.kernelapp`): the script then runs the same `IPKernelApp`
//! with the same `ARGS`, after importing the modules. Any other spec (another language, a
//! wrapper script) starts exactly as written.
//!
//! What is preloaded, most specific first: the user's `preload` (users file), the spec's
//! `metadata.kernel_broker.preload` (`kernel.json`), the broker's `--preload` (default
//! [`DEFAULT_PRELOAD`]). An empty list turns it off.

use serde_json::Value;

/// The script, as shipped in `kernels/`.
pub const BOOT_SCRIPT: &str = include_str!("../../kernels/kernel_broker_boot.py");
/// Its file name.
pub const BOOT_SCRIPT_NAME: &str = "kernel_broker_boot.py";
/// The module the script loads from its own directory into every kernel it starts: E2B's
/// result formats (charts, DataFrames), PIL display and one execution's environment,
/// active only in executions the E2B front door sends (`kernels/kernel_broker_e2b.py`).
pub const E2B_MODULE: &str = include_str!("../../kernels/kernel_broker_e2b.py");
/// Its file name.
pub const E2B_MODULE_NAME: &str = "kernel_broker_e2b.py";
/// The module the script loads the same way for the note a failed network connection's
/// traceback gets: why (no network, or only the proxy) and the setting that would allow it
/// (`kernels/kernel_broker_network.py`). Added by the kernel, to its own exception: the
/// broker reads nothing out of it.
pub const NETWORK_MODULE: &str = include_str!("../../kernels/kernel_broker_network.py");
/// Its file name.
pub const NETWORK_MODULE_NAME: &str = "kernel_broker_network.py";

/// The module the script loads the same way for the `kb_fork_request` shell message, by
/// which a live kernel forks itself into a new kernel (`kernels/kernel_broker_fork.py`,
/// `sandbox/fork.rs`).
pub const FORK_MODULE: &str = include_str!("../../kernels/kernel_broker_fork.py");
/// Its file name.
pub const FORK_MODULE_NAME: &str = "kernel_broker_fork.py";
/// The environment variable naming a kernel's fork directory (inside the sandbox).
pub const FORK_ROOT_ENV: &str = "KERNEL_BROKER_FORK_ROOT";

/// The script that puts a kernel speaking ZeroMQ over TCP only (Deno's, jjava's, IRkernel's)
/// behind the `ipc` sockets the broker connects to, splicing bytes in the kernel's sandbox
/// (`kernels/kernel_broker_relay.py`); started for specs whose
/// `metadata.kernel_broker.transport` is `"tcp"` ([`relay_argv`]).
pub const RELAY_SCRIPT: &str = include_str!("../../kernels/kernel_broker_relay.py");
/// Its file name.
pub const RELAY_SCRIPT_NAME: &str = "kernel_broker_relay.py";

/// What [`install_script`] writes, modules first: the script must never find a module
/// missing.
const INSTALLED: [(&str, &str); 5] = [
    (E2B_MODULE_NAME, E2B_MODULE),
    (NETWORK_MODULE_NAME, NETWORK_MODULE),
    (FORK_MODULE_NAME, FORK_MODULE),
    (RELAY_SCRIPT_NAME, RELAY_SCRIPT),
    (BOOT_SCRIPT_NAME, BOOT_SCRIPT),
];

/// A spec's argv with the sandbox's paths in place of its words: `python`/`python3` as the
/// program and `{python}` anywhere are `python`; `{prefix}` the kernels' environment;
/// `{resource_dir}` the spec's files (left as written when `None`); `{connection_file}`
/// the kernel's connection file. Both sandboxes lay their kernels' argv out through here.
pub fn substitute_argv(
    argv: &[String],
    python: &str,
    prefix: &str,
    resource_dir: Option<&str>,
    connection_file: &str,
) -> Vec<String> {
    argv.iter()
        .enumerate()
        .map(|(i, arg)| {
            if i == 0 && (arg == "python" || arg == "python3") {
                return python.to_string();
            }
            let arg = arg
                .replace("{python}", python)
                .replace("{prefix}", prefix)
                .replace("{connection_file}", connection_file);
            match resource_dir {
                Some(dir) => arg.replace("{resource_dir}", dir),
                None => arg,
            }
        })
        .collect()
}

/// Whether a launch's argv runs one of the broker's scripts, so that their directory must
/// be shown to it.
pub fn runs_broker_script(argv: &[String]) -> bool {
    argv.iter()
        .any(|a| a.ends_with(BOOT_SCRIPT_NAME) || a.ends_with(RELAY_SCRIPT_NAME))
}

/// Whether the spec's kernel binds TCP only (`metadata.kernel_broker.transport: "tcp"`), so
/// it is started behind the relay.
pub fn spec_wants_tcp(raw: &Value) -> bool {
    raw.get("metadata")
        .and_then(|m| m.get("kernel_broker"))
        .and_then(|k| k.get("transport"))
        .and_then(Value::as_str)
        == Some("tcp")
}

/// Whether the spec's kernel publishes results after its idle status
/// (`metadata.kernel_broker.idle_last`: Deno's), which the relay then puts back in order
/// (`--idle-last`).
pub fn spec_idle_last(raw: &Value) -> bool {
    raw.get("metadata")
        .and_then(|m| m.get("kernel_broker"))
        .and_then(|k| k.get("idle_last"))
        .and_then(Value::as_bool)
        == Some(true)
}

/// The spec's own warm-pool size (`metadata.kernel_broker.pool_size`), if it sets one: at
/// most `--pool-size` ready kernels of it per user (Java's is 0: an idle JVM holds more of
/// the user's memory than its start costs in time).
pub fn spec_pool_size(raw: &Value) -> Option<usize> {
    raw.get("metadata")?
        .get("kernel_broker")?
        .get("pool_size")?
        .as_u64()
        .and_then(|n| usize::try_from(n).ok())
}

/// Where the relay writes the kernel's TCP connection file: beside the `ipc` one.
pub fn tcp_connection_file(ipc_file: &str) -> String {
    match ipc_file.strip_suffix(".json") {
        Some(stem) => format!("{stem}-tcp.json"),
        None => format!("{ipc_file}-tcp"),
    }
}

/// `python -I <relay> [--idle-last] IPC TCP -- ARGV`: the kernel's argv (whose
/// `{connection_file}` must already name `tcp_file`) started by the relay, isolated as the
/// bootstrap script is; `spec_raw` says whether its idle statuses need putting in order
/// ([`spec_idle_last`]).
pub fn relay_argv(
    python: &str,
    script: &str,
    spec_raw: &Value,
    (ipc_file, tcp_file): (&str, &str),
    argv: &[String],
) -> Vec<String> {
    let mut out = vec![python.to_string(), "-I".to_string(), script.to_string()];
    if spec_idle_last(spec_raw) {
        out.push("--idle-last".to_string());
    }
    out.extend([ipc_file.to_string(), tcp_file.to_string(), "--".to_string()]);
    out.extend(argv.iter().cloned());
    out
}

/// Puts the script into `dir`, a directory only the broker can write (never one a kernel
/// can: the script's directory must hold nothing a kernel planted), as a root-owned 0644
/// file, replacing an older one atomically. Returns the script's path.
///
/// Run isolated (`-I`, [`template_argv`]), Python puts neither that directory nor the
/// working directory on `sys.path`, so a kernel's import path holds nothing the kernel can
/// write but what its own environment names (`PYTHONPATH`: the workspace's package
/// directory), applied by the script itself.
///
/// The modules the script loads ([`E2B_MODULE`], [`NETWORK_MODULE`]) are put beside it the
/// same way, first.
pub fn install_script(dir: &std::path::Path) -> std::io::Result<std::path::PathBuf> {
    use std::os::fd::AsFd;
    let root = super::fsutil::open_tree_root(dir)?;
    for (name, text) in INSTALLED {
        let fresh = format!(".{name}.{}", uuid::Uuid::new_v4().simple());
        super::fsutil::write_new_file_at(
            root.as_fd(),
            std::path::Path::new(&fresh),
            text.as_bytes(),
            super::fsutil::FileMode::Exact(0o644),
            None,
        )?;
        rustix::fs::renameat(&root, fresh.as_str(), &root, name)?;
    }
    Ok(dir.join(BOOT_SCRIPT_NAME))
}
/// What kernels import before their first cell by default: the data stack an agent's first
/// cell asks for (matplotlib also draws a warm-up figure).
pub const DEFAULT_PRELOAD: &[&str] = &["numpy", "pandas", "matplotlib"];

/// A kernel spec's argv split around its ipykernel module: the interpreter and what
/// follows the module name. `None`: not an ipykernel launch (start it as written).
pub fn ipykernel_args(argv: &[String]) -> Option<(&str, &[String])> {
    let python = argv.first()?;
    let at = argv.iter().position(|a| a == "-m")?;
    // Only `python -m MODULE ...`: interpreter options before `-m` would be lost.
    if at != 1 {
        return None;
    }
    let module = argv.get(at + 1)?;
    matches!(
        module.as_str(),
        "ipykernel_launcher" | "ipykernel" | "ipykernel.kernelapp"
    )
    .then(|| (python.as_str(), &argv[at + 2..]))
}

/// `python -I <script> template --preload M,N`: a fork server, isolated (see
/// [`install_script`]).
pub fn template_argv(python: &str, script: &str, preload: &[String]) -> Vec<String> {
    vec![
        python.to_string(),
        "-I".to_string(),
        script.to_string(),
        "template".to_string(),
        "--preload".to_string(),
        preload.join(","),
    ]
}

/// `python -I <script> kernel --preload M,N -- ARGS`: one kernel started plainly, without a
/// template, through the script (its preload, the inline backend, E2B's hooks), with the
/// spec's ipykernel arguments `args` after `--`, untouched.
pub fn kernel_argv(python: &str, script: &str, preload: &[String], args: &[String]) -> Vec<String> {
    let mut argv = vec![
        python.to_string(),
        "-I".to_string(),
        script.to_string(),
        "kernel".to_string(),
        "--preload".to_string(),
        preload.join(","),
        "--".to_string(),
    ];
    argv.extend(args.iter().cloned());
    argv
}

/// A module name the script may import: dotted Python identifiers, nothing a shell or the
/// script's comma-separated list could misread.
pub fn is_module_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 100
        && name.split('.').all(|part| {
            let mut chars = part.chars();
            chars
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        })
}

/// The spec's own preload list (`metadata.kernel_broker.preload` in `kernel.json`), if it
/// names one; names that are not module names are left out.
pub fn spec_preload(raw: &Value) -> Option<Vec<String>> {
    let list = raw
        .get("metadata")?
        .get("kernel_broker")?
        .get("preload")?
        .as_array()?;
    Some(
        list.iter()
            .filter_map(Value::as_str)
            .filter(|m| is_module_name(m))
            .map(str::to_string)
            .collect(),
    )
}

/// The spec's own fork-server switch (`metadata.kernel_broker.fork_server`), if it sets one.
pub fn spec_fork_server(raw: &Value) -> Option<bool> {
    raw.get("metadata")?
        .get("kernel_broker")?
        .get("fork_server")?
        .as_bool()
}

/// What one launch preloads: the user's list, else the spec's, else the broker's.
pub fn resolve_preload(
    user: Option<&Vec<String>>,
    spec_raw: &Value,
    broker: &[String],
) -> Vec<String> {
    user.cloned()
        .or_else(|| spec_preload(spec_raw))
        .unwrap_or_else(|| broker.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn tcp_only_specs_start_behind_the_relay() {
        assert!(spec_wants_tcp(
            &json!({"metadata": {"kernel_broker": {"transport": "tcp"}}})
        ));
        assert!(!spec_wants_tcp(
            &json!({"metadata": {"kernel_broker": {"transport": "ipc"}}})
        ));
        assert!(!spec_wants_tcp(&json!({"metadata": {}})));
        assert!(!spec_wants_tcp(&json!({"argv": ["x"]})));
        assert_eq!(
            spec_pool_size(&json!({"metadata": {"kernel_broker": {"pool_size": 0}}})),
            Some(0)
        );
        assert_eq!(spec_pool_size(&json!({"metadata": {}})), None);
        assert_eq!(
            spec_pool_size(&json!({"metadata": {"kernel_broker": {"pool_size": -1}}})),
            None
        );
        assert_eq!(
            tcp_connection_file("/run/kernel/connection.json"),
            "/run/kernel/connection-tcp.json"
        );
        let argv = relay_argv(
            "/py",
            "/opt/kb/kernel_broker_relay.py",
            &json!({"metadata": {"kernel_broker": {"transport": "tcp"}}}),
            ("/run/k.json", "/run/k-tcp.json"),
            &strings(&["deno", "jupyter", "--conn", "/run/k-tcp.json"]),
        );
        assert_eq!(
            argv,
            strings(&[
                "/py",
                "-I",
                "/opt/kb/kernel_broker_relay.py",
                "/run/k.json",
                "/run/k-tcp.json",
                "--",
                "deno",
                "jupyter",
                "--conn",
                "/run/k-tcp.json"
            ])
        );
        assert!(runs_broker_script(&argv));
        let deno = relay_argv(
            "/py",
            "/r.py",
            &json!({"metadata": {"kernel_broker": {"transport": "tcp", "idle_last": true}}}),
            ("/i", "/t"),
            &[],
        );
        assert_eq!(
            deno,
            strings(&["/py", "-I", "/r.py", "--idle-last", "/i", "/t", "--"])
        );
        assert!(!runs_broker_script(&strings(&["deno", "jupyter"])));
    }

    #[test]
    fn only_ipykernel_launches_are_bootable() {
        let argv = strings(&["/py", "-m", "ipykernel_launcher", "-f", "{connection_file}"]);
        let (py, args) = ipykernel_args(&argv).unwrap();
        assert_eq!(py, "/py");
        assert_eq!(args, &strings(&["-f", "{connection_file}"])[..]);
        assert!(ipykernel_args(&strings(&["/py", "-m", "ipykernel", "-f", "x"])).is_some());
        assert!(ipykernel_args(&strings(&["/py", "-m", "other", "-f", "x"])).is_none());
        assert!(ipykernel_args(&strings(&["/py", "-X", "dev", "-m", "ipykernel"])).is_none());
        assert!(ipykernel_args(&strings(&["R", "--slave"])).is_none());
        assert!(ipykernel_args(&[]).is_none());
    }

    #[test]
    fn the_script_and_its_module_replace_what_was_planted_without_following_it() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("outside.txt");
        std::fs::write(&outside, "keep").unwrap();
        let run = dir.path().join("run");
        std::fs::create_dir(&run).unwrap();
        // Symlinks where the files go: replaced as entries, never written through.
        for (name, _) in INSTALLED {
            std::os::unix::fs::symlink(&outside, run.join(name)).unwrap();
        }
        let script = install_script(&run).unwrap();
        assert_eq!(script, run.join(BOOT_SCRIPT_NAME));
        assert_eq!(std::fs::read_to_string(&outside).unwrap(), "keep");
        for (name, text) in INSTALLED {
            let meta = std::fs::symlink_metadata(run.join(name)).unwrap();
            assert!(meta.file_type().is_file(), "{name}");
            assert_eq!(meta.permissions().mode() & 0o7777, 0o644, "{name}");
            assert_eq!(std::fs::read_to_string(run.join(name)).unwrap(), text);
        }
        // Nothing else is left in the directory (no temporary names).
        let mut names: Vec<_> = std::fs::read_dir(&run)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                BOOT_SCRIPT_NAME,
                E2B_MODULE_NAME,
                FORK_MODULE_NAME,
                NETWORK_MODULE_NAME,
                RELAY_SCRIPT_NAME
            ]
        );
        // The boot script names the modules by these file names.
        for (constant, name) in [
            ("E2B_MODULE", E2B_MODULE_NAME),
            ("NETWORK_MODULE", NETWORK_MODULE_NAME),
            ("FORK_MODULE", FORK_MODULE_NAME),
        ] {
            assert!(BOOT_SCRIPT.contains(&format!(
                "{constant} = \"{}\"",
                name.trim_end_matches(".py")
            )));
        }
    }

    #[test]
    fn argv_shapes() {
        assert_eq!(
            template_argv("/py", "/b.py", &[]),
            strings(&["/py", "-I", "/b.py", "template", "--preload", ""])
        );
        // The kernel's own arguments follow `--` untouched, even ones that look like the
        // script's options.
        assert_eq!(
            kernel_argv(
                "/py",
                "/b.py",
                &strings(&["numpy", "pandas"]),
                &strings(&["-f", "/c.json", "--preload", "x", "--"])
            ),
            strings(&[
                "/py",
                "-I",
                "/b.py",
                "kernel",
                "--preload",
                "numpy,pandas",
                "--",
                "-f",
                "/c.json",
                "--preload",
                "x",
                "--"
            ])
        );
    }

    #[test]
    fn module_names_are_checked() {
        for ok in ["numpy", "matplotlib.pyplot", "_private", "sklearn2"] {
            assert!(is_module_name(ok), "{ok}");
        }
        for bad in ["", "a,b", "a b", "1abc", "a..b", ".a", "a-b", "os;rm"] {
            assert!(!is_module_name(bad), "{bad}");
        }
    }

    #[test]
    fn the_most_specific_list_wins() {
        let broker = strings(&["numpy"]);
        let spec = json!({"metadata": {"kernel_broker": {"preload": ["pandas", "bad name"]}}});
        let none = json!({});
        assert_eq!(resolve_preload(None, &none, &broker), broker);
        assert_eq!(resolve_preload(None, &spec, &broker), strings(&["pandas"]));
        let user = strings(&["scipy"]);
        assert_eq!(resolve_preload(Some(&user), &spec, &broker), user);
        assert_eq!(
            resolve_preload(Some(&vec![]), &spec, &broker),
            Vec::<String>::new()
        );
        assert_eq!(
            spec_fork_server(&json!({"metadata": {"kernel_broker": {"fork_server": false}}})),
            Some(false)
        );
        assert_eq!(spec_fork_server(&none), None);
    }
}
