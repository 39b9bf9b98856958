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
    _tmp: tempfile::TempDir,
}

impl SpawnedBroker {
    /// Start the binary with `args` added to the defaults (port 0, no pool, a cgroup name of
    /// its own), and at most `nofile` descriptors when given.
    pub fn start(args: &[&str], nofile: Option<u64>) -> Self {
        let cgroup = format!("kernel-broker-test-{}", uuid::Uuid::new_v4().simple());
        Self::spawn(args, nofile, Some(cgroup))
    }

    /// Start the binary with `args` and the broker's own default cgroup name and uid range
    /// (derived from its data directory).
    pub fn start_with_defaults(args: &[&str]) -> Self {
        Self::spawn(args, None, None)
    }

    fn spawn(args: &[&str], nofile: Option<u64>, cgroup: Option<String>) -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let users = tmp.path().join("users.toml");
        std::fs::write(&users, super::users_toml()).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kernel-broker"));
        cmd.arg("serve")
            .args(["--listen", "127.0.0.1:0", "--pool-size", "0"])
            .arg("--users-file")
            .arg(&users)
            .arg("--data-dir")
            .arg(tmp.path().join("data"))
            .arg("--kernels-dir")
            .arg(repo().join("kernels"))
            .args(args)
            .env_remove("KERNEL_BROKER_TOKEN")
            .env("KERNEL_BROKER_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(cgroup) = &cgroup {
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
        // Reads the log to its end, so the broker never blocks on a full pipe.
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
        let addr = addr_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the broker did not start");
        SpawnedBroker {
            addr,
            child,
            log,
            _tmp: tmp,
        }
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

impl Drop for SpawnedBroker {
    fn drop(&mut self) {
        // A test that failed half-way: the broker must not outlive it, and shuts its kernels
        // down on the way out.
        if matches!(self.child.try_wait(), Ok(None)) {
            // SAFETY: as in `stop`.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
            for _ in 0..300 {
                if !matches!(self.child.try_wait(), Ok(None)) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
