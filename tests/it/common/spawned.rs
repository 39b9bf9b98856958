//! The real `kernel-broker` binary in a process of its own, for tests that need what an
//! in-process broker cannot give: its own descriptor limit, its own memory to measure, its
//! log. Local backend, users alice and bob.

use std::io::BufRead;
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{repo, within, Api};

pub struct SpawnedBroker {
    pub addr: SocketAddr,
    child: Child,
    log: Arc<Mutex<Vec<String>>>,
    /// What it was started with, for a restart on the same data directory.
    args: Vec<String>,
    nofile: Option<u64>,
    cgroup: Option<String>,
    _tmp: tempfile::TempDir,
}

/// How a broker is stopped before a restart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// SIGTERM: an orderly stop.
    Term,
    /// SIGKILL: no stop at all.
    Kill,
}

impl SpawnedBroker {
    /// Start the binary with `args` added to the defaults (a [`restartable_addr`], no pool,
    /// a cgroup name of its own), and at most `nofile` descriptors when given.
    pub fn start(args: &[&str], nofile: Option<u64>) -> Self {
        let cgroup = format!("kernel-broker-test-{}", uuid::Uuid::new_v4().simple());
        Self::spawn(args, nofile, Some(cgroup))
    }

    /// Start the binary with `args` and the broker's own default cgroup name and uid range
    /// (derived from its data directory).
    pub fn start_with_defaults(args: &[&str]) -> Self {
        Self::spawn(args, None, None)
    }

    /// Start the binary listening on `addr`, chosen beforehand (a cluster node advertises
    /// its address in its arguments).
    pub fn start_on(addr: SocketAddr, args: &[&str]) -> Self {
        let cgroup = format!("kernel-broker-test-{}", uuid::Uuid::new_v4().simple());
        Self::spawn_on(args, None, Some(cgroup), Some(addr))
    }

    fn spawn(args: &[&str], nofile: Option<u64>, cgroup: Option<String>) -> Self {
        Self::spawn_on(args, nofile, cgroup, None)
    }

    fn spawn_on(
        args: &[&str],
        nofile: Option<u64>,
        cgroup: Option<String>,
        at: Option<SocketAddr>,
    ) -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let users = tmp.path().join("users.toml");
        std::fs::write(&users, super::users_toml()).unwrap();
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let (child, addr, log) = launch_retrying(tmp.path(), &args, nofile, cgroup.as_deref(), at);
        SpawnedBroker {
            addr,
            child,
            log,
            args,
            nofile,
            cgroup,
            _tmp: tmp,
        }
    }

    /// Stops the broker (`how`) and starts it again on the same data directory, cgroup
    /// name and address, with `args` instead of the first run's extra arguments.
    pub async fn restart_with(&mut self, how: Stop, args: &[&str]) {
        self.halt(how).await;
        self.args = args.iter().map(|a| a.to_string()).collect();
        self.resume();
    }

    /// Stops the broker (`how`) and waits until it has exited; [`Self::resume`] starts it
    /// again.
    pub async fn halt(&mut self, how: Stop) {
        let signal = match how {
            Stop::Term => libc::SIGTERM,
            Stop::Kill => libc::SIGKILL,
        };
        // SAFETY: a plain signal to the child we started.
        unsafe { libc::kill(self.child.id() as i32, signal) };
        let child = &mut self.child;
        let status = within(60, "broker stop", async {
            loop {
                if let Some(status) = child.try_wait().unwrap() {
                    return status;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        if how == Stop::Term {
            assert!(status.success(), "{status:?}");
        }
    }

    /// Starts the broker again after [`Self::halt`], as it was started, on the same address.
    pub fn resume(&mut self) {
        let (child, addr, log) = launch_retrying(
            self._tmp.path(),
            &self.args,
            self.nofile,
            self.cgroup.as_deref(),
            Some(self.addr),
        );
        self.child = child;
        self.addr = addr;
        self.log = log;
    }

    /// Sends `signal` to the broker.
    pub fn signal(&self, signal: i32) {
        // SAFETY: a plain signal to the child we started.
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }

    /// Waits (at most `secs`) for the broker to exit by itself; its exit status.
    pub async fn exited(&mut self, secs: u64) -> std::process::ExitStatus {
        let child = &mut self.child;
        within(secs, "the broker's exit", async {
            loop {
                if let Some(status) = child.try_wait().unwrap() {
                    return status;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await
    }

    /// The broker's cgroup name, when the test chose it.
    pub fn cgroup_name(&self) -> Option<&str> {
        self.cgroup.as_deref()
    }

    /// [`Self::restart_with`] the same arguments.
    pub async fn restart(&mut self, how: Stop) {
        let args = self.args.clone();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.restart_with(how, &args).await;
    }

    /// The broker's data directory and users file.
    pub fn data_dir(&self) -> std::path::PathBuf {
        self._tmp.path().join("data")
    }

    pub fn users_file(&self) -> std::path::PathBuf {
        self._tmp.path().join("users.toml")
    }

    pub fn api(&self, token: &str) -> Api {
        Api {
            http: reqwest::Client::new(),
            base: format!("http://{}", self.addr),
            token: token.into(),
        }
    }

    /// Log lines so far that contain `text`.
    pub fn log_lines(&self, text: &str) -> Vec<String> {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(text))
            .cloned()
            .collect()
    }

    /// The broker process's resident memory now, in bytes.
    pub fn rss_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap();
        kib * 1024
    }

    /// The most resident memory the broker process has had so far (`VmHWM`), in bytes: a
    /// peak no sampling can miss.
    pub fn peak_rss_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap();
        kib * 1024
    }

    /// SIGTERM, and the broker must stop cleanly within a minute.
    pub async fn stop(mut self) {
        // SAFETY: a plain signal to the child we started.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let child = &mut self.child;
        let stopped = within(60, "broker shutdown", async {
            loop {
                if let Some(status) = child.try_wait().unwrap() {
                    return status;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await;
        assert!(stopped.success(), "{stopped:?}");
    }
}

/// An address for a broker that may be started again on it: a port below the machine's
/// ephemeral range (`net.ipv4.ip_local_port_range`), which no outgoing connection and no
/// bind to port 0 of any process is given, so nothing takes it while the broker is down
/// (with port 0, a restart after a kill found its port taken under CI's load). Free when
/// chosen; another test's random choice of the same one is met by choosing again.
pub fn restartable_addr() -> SocketAddr {
    let first_ephemeral: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768);
    let low = 10_000.min(first_ephemeral / 2);
    for _ in 0..100 {
        if first_ephemeral <= low + 1_000 {
            break;
        }
        let span = u128::from(first_ephemeral - low);
        let port = low + (uuid::Uuid::new_v4().as_u128() % span) as u16;
        if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            return l.local_addr().unwrap();
        }
    }
    // No room below the range: a port the system picks.
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// The broker's log, its stderr read to the end (so it never blocks on a full pipe).
type Log = Arc<Mutex<Vec<String>>>;

/// [`launch`] on `at`, again for up to 10 s while it is in use (a port taken for a moment,
/// or the killed broker's socket not yet gone); without `at`, on a [`restartable_addr`],
/// another one while the chosen port turns out taken.
fn launch_retrying(
    dir: &std::path::Path,
    args: &[String],
    nofile: Option<u64>,
    cgroup: Option<&str>,
    at: Option<SocketAddr>,
) -> (Child, SocketAddr, Log) {
    for _ in 0..20 {
        if let Some(up) = launch(
            dir,
            args,
            nofile,
            cgroup,
            at.unwrap_or_else(restartable_addr),
        ) {
            return up;
        }
        if at.is_some() {
            std::thread::sleep(Duration::from_millis(500));
        }
    }
    match at {
        Some(addr) => panic!("{addr} stayed in use for 10 s: the broker cannot start on it again"),
        None => panic!("no free port for the broker in 20 tries"),
    }
}

/// Starts the binary on `dir` (its `users.toml` and `data/`) listening on `addr`; returns
/// the child, the address it listens on and its log, or None when it exited because the
/// address is in use.
fn launch(
    dir: &std::path::Path,
    args: &[String],
    nofile: Option<u64>,
    cgroup: Option<&str>,
    addr: SocketAddr,
) -> Option<(Child, SocketAddr, Log)> {
    let listen = addr.to_string();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kernel-broker"));
    cmd.arg("serve")
        .args(["--listen", &listen, "--pool-size", "0"])
        .arg("--users-file")
        .arg(dir.join("users.toml"))
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--kernels-dir")
        .arg(repo().join("kernels"))
        .args(args)
        .env_remove("KERNEL_BROKER_TOKEN")
        .env("KERNEL_BROKER_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(cgroup) = cgroup {
        cmd.args(["--cgroup-name", cgroup]);
    }
    if let Some(n) = nofile {
        // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                let limit = libc::rlimit {
                    rlim_cur: n,
                    rlim_max: n,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let mut child = cmd.spawn().unwrap();
    let stderr = child.stderr.take().unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let (addr_tx, addr_rx) = std::sync::mpsc::channel::<SocketAddr>();
    {
        let log = log.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                if let Some(rest) = line.split("ready on http://").nth(1) {
                    let addr = rest.split_whitespace().next().unwrap_or_default();
                    if let Ok(a) = addr.parse() {
                        let _ = addr_tx.send(a);
                    }
                }
                log.lock().unwrap().push(line);
            }
        });
    }
    let deadline = std::time::Instant::now() + super::scaled(Duration::from_secs(60));
    let mut exited_at = None;
    while std::time::Instant::now() < deadline {
        if let Ok(addr) = addr_rx.recv_timeout(Duration::from_millis(100)) {
            return Some((child, addr, log));
        }
        let in_use = || {
            log.lock()
                .unwrap()
                .iter()
                .any(|l| l.contains("Address already in use"))
        };
        if exited_at.is_none() && !matches!(child.try_wait(), Ok(None)) {
            exited_at = Some(std::time::Instant::now());
        }
        // Its last lines may still be on their way from the pipe.
        match exited_at {
            Some(_) if in_use() => return None,
            Some(at) if at.elapsed() > Duration::from_secs(2) => break,
            _ => {}
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!(
        "the broker did not start:\n{}",
        log.lock().unwrap().join("\n")
    );
}

impl Drop for SpawnedBroker {
    fn drop(&mut self) {
        // A test that failed half-way: the broker must not outlive it, and shuts its kernels
        // down on the way out.
        stop_child(&mut self.child);
        if self.args.iter().any(|a| a == "--keep-sessions") {
            // Its kernels outlived it: one more start without the flag sweeps them (and
            // says so in the log), then an orderly stop.
            let args: Vec<String> = self
                .args
                .iter()
                .filter(|a| *a != "--keep-sessions")
                .cloned()
                .collect();
            let (mut child, _, _) =
                launch_retrying(self._tmp.path(), &args, None, self.cgroup.as_deref(), None);
            stop_child(&mut child);
        }
        // Workspace file systems a killed broker left mounted below the directory.
        let top = self._tmp.path().to_string_lossy().to_string();
        let points: Vec<String> = std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
            .filter(|p| p.starts_with(&top))
            .collect();
        for point in points.iter().rev() {
            let _ = Command::new("umount").args(["-l", point]).status();
        }
    }
}

/// SIGTERM, and SIGKILL after 30 s.
fn stop_child(child: &mut Child) {
    if matches!(child.try_wait(), Ok(None)) {
        // SAFETY: a plain signal to a child we started.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        for _ in 0..300 {
            if !matches!(child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}
