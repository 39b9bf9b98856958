//! The command line client (`kernel-broker sessions|exec|files|kill`, issue 34) against a
//! real broker: what each prints and its exit status, charts saved to files, workspace paths
//! with spaces, another user's session, a refused token, no broker, and paths that try to
//! leave the workspace.

use crate::common;

use std::path::Path;
use std::process::Output;

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
    assert!(text(&o.stdout).contains(&id), "{}", text(&o.stdout));
    let o = run(&["sessions", "--json"], "").await;
    let list: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(list[0]["id"], id.as_str());

    // The start of the id names it; the code from stdin; the state is the session's.
    let short = &id[..8];
    let o = cli(&url, ALICE, cwd, &["exec", short, "-"], "print(x + 1)\n").await;
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout), "43\n");

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
