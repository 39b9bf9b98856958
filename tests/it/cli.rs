//! The command line client (`kernel-broker sessions|exec|files|fork|kill`, issue 34) against a
//! real broker: what each prints and its exit status, charts saved to files, workspace paths
//! with spaces, another user's session, a refused token, no broker, and paths that try to
//! leave the workspace.

use crate::common;

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use common::spawned::SpawnedBroker;
use common::*;

/// Runs `kernel-broker ARGS` as the user of `token` against `broker`, in `cwd`, with `stdin`.
async fn cli(url: &str, token: &str, cwd: &Path, args: &[&str], stdin: &str) -> Output {
    let (url, token, cwd) = (url.to_string(), token.to_string(), cwd.to_path_buf());
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let stdin = stdin.to_string();
    let run = tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kernel-broker"))
            .args(&args)
            .current_dir(&cwd)
            .env("KERNEL_BROKER_URL", &url)
            .env("KERNEL_BROKER_TOKEN", &token)
            .env_remove("KERNEL_BROKER_DATA_DIR")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(stdin.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    });
    within(120, "the command", run).await.unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).to_string()
}

#[tokio::test]
async fn sessions_exec_files_and_kill_against_a_running_broker() {
    let broker = SpawnedBroker::start(&[], None);
    let url = format!("http://{}", broker.addr);
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path();
    let run =
        |args: &'static [&'static str], stdin: &'static str| cli(&url, ALICE, cwd, args, stdin);

    let o = run(&["sessions"], "").await;
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout), "no live sessions\n");

    // A new session: its id on stderr, the output on stdout.
    let o = run(&["exec", "new", "x = 6 * 7\nprint('x is', x)\nx"], "").await;
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout), "x is 42\n42\n");
    let id = text(&o.stderr)
        .lines()
        .find_map(|l| l.strip_prefix("session ").map(str::to_string))
        .unwrap_or_else(|| panic!("no session id in {}", text(&o.stderr)));

    let o = run(&["sessions"], "").await;
    let line = text(&o.stdout)
        .lines()
        .find(|l| l.starts_with(&id))
        .map(str::to_string);
    assert!(
        line.as_deref().is_some_and(|l| l.contains(" rest ")),
        "the session, made by the REST API: {}",
        text(&o.stdout)
    );
    let o = run(&["sessions", "--json"], "").await;
    let list: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(list[0]["id"], id.as_str());

    // The start of the id names it; the code from stdin; the state is the session's.
    let short = &id[..8];
    let o = cli(&url, ALICE, cwd, &["exec", short, "-"], "print(x + 1)\n").await;
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout), "43\n");

    // A fork: its id on stdout; it holds the session's state and goes its own way.
    let o = cli(&url, ALICE, cwd, &["fork", short], "").await;
    assert!(o.status.success(), "{}", text(&o.stderr));
    let forked = text(&o.stdout).trim().to_string();
    assert_eq!(forked.len(), 36, "one id: {forked:?}");
    assert_ne!(forked, id);
    let o = cli(
        &url,
        ALICE,
        cwd,
        &["exec", &forked, "x = x + 100\nprint(x)"],
        "",
    )
    .await;
    assert_eq!(text(&o.stdout), "142\n", "{}", text(&o.stderr));
    let o = cli(&url, ALICE, cwd, &["exec", &id, "print(x)"], "").await;
    assert_eq!(text(&o.stdout), "42\n", "{}", text(&o.stderr));
    let o = cli(&url, ALICE, cwd, &["fork", &forked, "--count", "2"], "").await;
    assert!(o.status.success(), "{}", text(&o.stderr));
    let two: Vec<String> = text(&o.stdout).lines().map(str::to_string).collect();
    assert_eq!(two.len(), 2, "{two:?}");
    for s in two.iter().chain([&forked]) {
        let o = cli(&url, ALICE, cwd, &["kill", s], "").await;
        assert!(o.status.success(), "{}", text(&o.stderr));
    }
    // Another user cannot fork it; nor can a count the API refuses.
    let o = cli(&url, BOB, cwd, &["fork", &id], "").await;
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    assert!(text(&o.stdout).is_empty());
    let o = cli(&url, ALICE, cwd, &["fork", &id, "--count", "0"], "").await;
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("count"), "{}", text(&o.stderr));

    // A chart is saved to a file whose path is printed.
    let charts = cwd.join("charts");
    std::fs::create_dir(&charts).unwrap();
    let code = "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()";
    let o = cli(
        &url,
        ALICE,
        cwd,
        &["exec", &id, code, "--charts", charts.to_str().unwrap()],
        "",
    )
    .await;
    assert!(o.status.success(), "{}", text(&o.stderr));
    let saved = text(&o.stderr)
        .lines()
        .find_map(|l| l.strip_prefix("chart saved: ").map(str::to_string))
        .unwrap_or_else(|| panic!("no chart in {}", text(&o.stderr)));
    let png = std::fs::read(&saved).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");

    // An error: the traceback on stderr, exit status 1.
    let o = cli(&url, ALICE, cwd, &["exec", &id, "1 / 0"], "").await;
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o.stderr).contains("ZeroDivisionError"),
        "{}",
        text(&o.stderr)
    );

    // Files: a name with a space and a `#`, up and down and away.
    let local = cwd.join("sales data.csv");
    std::fs::write(&local, "a,b\n1,2\n").unwrap();
    let o = cli(
        &url,
        ALICE,
        cwd,
        &[
            "files",
            &id,
            "put",
            local.to_str().unwrap(),
            "in/sales #1.csv",
        ],
        "",
    )
    .await;
    assert!(o.status.success(), "{}", text(&o.stderr));
    let o = cli(&url, ALICE, cwd, &["files", &id, "ls"], "").await;
    assert!(
        text(&o.stdout).contains("in/sales #1.csv"),
        "{}",
        text(&o.stdout)
    );
    let o = cli(
        &url,
        ALICE,
        cwd,
        &["exec", &id, "print(open('in/sales #1.csv').read(), end='')"],
        "",
    )
    .await;
    assert_eq!(text(&o.stdout), "a,b\n1,2\n");
    let o = cli(
        &url,
        ALICE,
        cwd,
        &["files", &id, "get", "in/sales #1.csv"],
        "",
    )
    .await;
    assert_eq!(text(&o.stdout), "a,b\n1,2\n");
    // Paths that try to leave the workspace get nothing of the host.
    for bad in [
        "../../../../etc/passwd",
        "/etc/passwd",
        "in/../../../etc/passwd",
    ] {
        let o = cli(&url, ALICE, cwd, &["files", &id, "get", bad], "").await;
        assert!(
            !text(&o.stdout).contains("root:"),
            "{bad}: {}",
            text(&o.stdout)
        );
        assert!(!o.status.success() || o.stdout.is_empty(), "{bad}");
    }
    let o = cli(
        &url,
        ALICE,
        cwd,
        &["files", &id, "rm", "in/sales #1.csv"],
        "",
    )
    .await;
    assert!(o.status.success(), "{}", text(&o.stderr));
    let o = cli(&url, ALICE, cwd, &["files", &id, "ls"], "").await;
    assert!(!text(&o.stdout).contains("sales"), "{}", text(&o.stdout));

    // Another user's session is not found, by id or by its start.
    for other in [id.as_str(), short] {
        let o = cli(&url, BOB, cwd, &["exec", other, "x"], "").await;
        assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
        assert!(!text(&o.stdout).contains("42"));
        let o = cli(&url, BOB, cwd, &["kill", other], "").await;
        assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    }

    let o = cli(&url, ALICE, cwd, &["kill", short], "").await;
    assert!(o.status.success(), "{}", text(&o.stderr));
    let o = cli(&url, ALICE, cwd, &["exec", &id, "x"], "").await;
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o.stderr).contains("404"), "{}", text(&o.stderr));

    // A refused token and no broker: exit 2, saying what to do.
    let o = cli(&url, "not-a-token", cwd, &["sessions"], "").await;
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o.stderr).contains("refused the token"),
        "{}",
        text(&o.stderr)
    );
    let o = cli("http://127.0.0.1:1", ALICE, cwd, &["sessions"], "").await;
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o.stderr).contains("no broker answers at"),
        "{}",
        text(&o.stderr)
    );
    let o = cli(&url, "", cwd, &["sessions"], "").await;
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o.stderr).contains("no token"), "{}", text(&o.stderr));
    broker.stop().await;
}

/// `kernel-broker console` on a real terminal (a pseudo-terminal the test drives as a
/// person would type): cells one line and several, state kept between them, output as it
/// comes, `input()` answered at the prompt, a chart saved to a file, an error's traceback,
/// Ctrl-C interrupting a running cell with the variables kept, and Ctrl-D leaving with the
/// session still alive.
#[tokio::test]
async fn console_on_a_terminal() {
    use std::io::{Read, Write};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::os::unix::process::CommandExt;
    use std::sync::{Arc, Mutex};

    let broker = SpawnedBroker::start(&[], None);
    let api = broker.api(ALICE);
    let id = api.create().await;
    let charts = tempfile::tempdir().unwrap();

    let (mut master, mut slave) = (0, 0);
    // SAFETY: openpty fills the two descriptors; no name, termios or window size given.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors were just opened and are owned here alone.
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    let slave_fd = slave.as_raw_fd();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kernel-broker"));
    cmd.args(["console", &id[..8], "--charts"])
        .arg(charts.path())
        .env("KERNEL_BROKER_URL", format!("http://{}", broker.addr))
        .env("KERNEL_BROKER_TOKEN", ALICE)
        .stdin(slave.try_clone().unwrap())
        .stdout(slave.try_clone().unwrap())
        .stderr(slave.try_clone().unwrap());
    // SAFETY: setsid and the TIOCSCTTY ioctl are async-signal-safe: the terminal becomes the
    // child's controlling terminal, so Ctrl-C on it is SIGINT to the child, as in a shell.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() < 0 || libc::ioctl(slave_fd, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    drop(slave);
    let screen = Arc::new(Mutex::new(String::new()));
    let mut reader = std::fs::File::from(master.try_clone().unwrap());
    {
        let screen = screen.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
                screen
                    .lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
    }
    let mut keys = std::fs::File::from(master);
    let mut seen = 0usize;
    // Waits until `text` shows after what was already looked at; the screen from there.
    let mut expect = |text: &str| {
        let deadline = std::time::Instant::now() + scaled(Duration::from_secs(60));
        loop {
            {
                let s = screen.lock().unwrap();
                if let Some(at) = s[seen..].find(text) {
                    seen += at + text.len();
                    return;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "{text:?} never showed; the terminal shows:\n{}",
                    &*s
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let mut typed = |keys_: &str| keys.write_all(keys_.as_bytes()).unwrap();

    expect(&format!("session {id}"));
    expect(">>> ");
    typed("x = 41\r");
    expect(">>> ");
    typed("print(x + 1)\r");
    expect("42");
    typed("for i in range(2):\r");
    expect("... ");
    typed("    print('lo' + 'op', i)\r");
    expect("... ");
    typed("\r");
    expect("loop 1");
    typed("name = input('who? ')\r");
    expect("who? ");
    typed("ada\r");
    expect(">>> ");
    typed("print(name.upper())\r");
    expect("ADA");
    typed("import matplotlib.pyplot as plt; plt.plot([1, 2]); plt.show()\r");
    expect("[chart saved: ");
    typed("1 / 0\r");
    expect("ZeroDivisionError");
    typed("import time; print('sl' + 'eeping', flush=True); time.sleep(600)\r");
    expect("sleeping");
    typed("\x03");
    expect("KeyboardInterrupt");
    expect(">>> ");
    typed("print(x * 2)\r");
    expect("82");
    expect(">>> ");
    typed("\x04");
    let status = within(
        30,
        "the console to leave",
        tokio::task::spawn_blocking(move || child.wait()),
    )
    .await
    .unwrap()
    .unwrap();
    assert!(status.success(), "{status}");
    let png: Vec<_> = std::fs::read_dir(charts.path()).unwrap().collect();
    assert_eq!(png.len(), 1, "{png:?}");
    // The session lives on, with its variables.
    let v = api.execute(&id, "x").await;
    assert_eq!(v["results"][0]["data"]["text/plain"], "41", "{v}");
    broker.stop().await;
}

/// `exec new --secret NAME` gives the new session the secret NAME from the command's own
/// environment (never its command line); the output shows the marker, the kernel the value.
#[tokio::test]
async fn exec_new_takes_secrets_from_its_environment() {
    let broker = SpawnedBroker::start(&[], None);
    let url = format!("http://{}", broker.addr);
    let exec = |with_value: bool| {
        let url = url.clone();
        tokio::task::spawn_blocking(move || {
            let code = "import os\nprint(os.environ['CLI_SECRET'])\nlen(os.environ['CLI_SECRET'])";
            let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kernel-broker"));
            cmd.args(["exec", "new", "--secret", "CLI_SECRET", code])
                .env("KERNEL_BROKER_URL", &url)
                .env("KERNEL_BROKER_TOKEN", ALICE)
                .env_remove("KERNEL_BROKER_DATA_DIR")
                .env_remove("CLI_SECRET");
            if with_value {
                cmd.env("CLI_SECRET", "cli-secret-value-1234");
            }
            cmd.output().unwrap()
        })
    };
    let o = within(120, "the command", exec(true)).await.unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout), "[secret:CLI_SECRET]\n21\n");
    let o = within(120, "the command", exec(false)).await.unwrap();
    assert!(!o.status.success());
    assert!(
        text(&o.stderr).contains("set the environment variable CLI_SECRET"),
        "{}",
        text(&o.stderr)
    );
}
