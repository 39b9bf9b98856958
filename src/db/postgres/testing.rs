//! A real PostgreSQL for tests: the server of the test run when `KB_TEST_POSTGRES_URL` names
//! one (`scripts/test` starts it: `scripts/pg-test-server`), else one started for this test
//! process from Debian's `postgresql` (initdb in a temporary directory, a free port on
//! 127.0.0.1, stopped when the process ends). Each caller gets a database of its own.
//!
//! Depends on nothing of the crate, so integration tests can include it too.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The base URL of the server (without a database).
fn server() -> &'static str {
    static SERVER: OnceLock<String> = OnceLock::new();
    SERVER.get_or_init(|| match std::env::var("KB_TEST_POSTGRES_URL") {
        Ok(url) if !url.is_empty() => url.trim_end_matches('/').to_string(),
        _ => start_private(),
    })
}

/// A new, empty database; its URL.
pub async fn fresh_database() -> String {
    let base = server();
    let name = format!("kb_{}", uuid::Uuid::new_v4().simple());
    let (client, conn) =
        tokio_postgres::connect(&format!("{base}/postgres"), tokio_postgres::NoTls)
            .await
            .expect("connect to the test PostgreSQL server");
    let task = tokio::spawn(conn);
    client
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .expect("create a test database");
    drop(client);
    let _ = task.await;
    format!("{base}/{name}")
}

/// The directory of the newest PostgreSQL's programs.
fn bin_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("KB_PG_BIN") {
        return dir.into();
    }
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL is not installed (apt-get install postgresql)")
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((v, bin))
        })
        .collect();
    found.sort();
    found
        .pop()
        .expect("no /usr/lib/postgresql/*/bin/initdb (apt-get install postgresql)")
        .1
}

/// As root, the server runs as the `postgres` user (it refuses root).
fn run_as() -> Option<(u32, u32)> {
    // SAFETY: getuid has no preconditions; getpwnam returns a pointer into static storage,
    // read at once.
    unsafe {
        if libc::getuid() != 0 {
            return None;
        }
        let pw = libc::getpwnam(c"postgres".as_ptr());
        assert!(
            !pw.is_null(),
            "no `postgres` user to run the test server as"
        );
        Some(((*pw).pw_uid, (*pw).pw_gid))
    }
}

fn command(bin: &Path, name: &str, user: Option<(u32, u32)>) -> Command {
    use std::os::unix::process::CommandExt;
    let mut c = Command::new(bin.join(name));
    if let Some((uid, gid)) = user {
        c.uid(uid).gid(gid);
        c.env("HOME", "/tmp");
    }
    c
}

fn start_private() -> String {
    use std::os::unix::process::CommandExt;
    remove_stale_dirs();
    let bin = bin_dir();
    let user = run_as();
    let dir = std::env::temp_dir().join(format!("kb-pgsrv-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir(&dir).unwrap();
    if let Some((uid, gid)) = user {
        std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).unwrap();
    }
    let data = dir.join("data");
    let out = command(&bin, "initdb", user)
        .args([
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "-E",
            "UTF8",
            "-D",
        ])
        .arg(&data)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "initdb failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut server = command(&bin, "postgres", user);
    server
        .arg("-D")
        .arg(&data)
        .args(["-p", &port.to_string(), "-k"])
        .arg(&dir)
        .args([
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            "fsync=off",
            "-c",
            "max_connections=200",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    // SAFETY: prctl is async-signal-safe. The server shuts down (fast) when the thread that
    // started it ends, which is this process's end: that thread only waits for it.
    unsafe {
        server.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGINT) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut child = server.spawn().expect("start postgres");
        tx.send(()).unwrap();
        let _ = child.wait();
    });
    rx.recv().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ready = command(&bin, "pg_isready", None)
            .args(["-q", "-h", "127.0.0.1", "-p", &port.to_string()])
            .status()
            .is_ok_and(|s| s.success());
        if ready {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the test PostgreSQL did not start"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    format!("postgres://postgres@127.0.0.1:{port}")
}

/// Directories of private servers whose test process is gone.
fn remove_stale_dirs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("kb-pgsrv-"))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}
