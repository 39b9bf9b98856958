//! A kernel is never declared dead because the broker ran out of descriptors (issue 18).
//!
//! This module holds one test on purpose: it lowers the descriptor limit of its own process,
//! which would starve any test running beside it in the same process. nextest (the way the
//! suites run) gives every test a process of its own; under `cargo test`, run it alone.
//!
//! The heartbeat runs against the scripted kernel (real ZeroMQ sockets of the `zeromq`
//! crate, shared through `#[path]` as in kernel_client.rs) with every descriptor taken.

use std::fs::File;
use std::time::Duration;

use kernel_broker::kernel::{ConnectOptions, Heartbeat, KernelClient, KernelEvent, KernelEvents};

use crate::scripted_kernel;
use scripted_kernel::{HeartbeatMode, ScriptedKernel};

const INTERVAL: Duration = Duration::from_millis(200);
const MISSES: u32 = 3;

/// Takes every free descriptor (up to a lowered soft limit) while alive; gives them back
/// and restores the limit when dropped.
struct Exhausted {
    filler: Vec<File>,
    old: libc::rlimit,
}

impl Exhausted {
    fn now() -> Self {
        let mut old = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit/setrlimit read and write only the structs passed.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut old) }, 0);
        let highest = std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u64>().ok())
            .max()
            .unwrap();
        // A little room above what is open, then fill it (and any holes below) so that the
        // next socket() fails with EMFILE.
        let lowered = libc::rlimit {
            rlim_cur: highest + 8,
            rlim_max: old.rlim_max,
        };
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lowered) }, 0);
        let mut filler = Vec::new();
        loop {
            match File::open("/dev/null") {
                Ok(f) => filler.push(f),
                Err(e) => {
                    assert_eq!(e.raw_os_error(), Some(libc::EMFILE), "{e}");
                    break;
                }
            }
        }
        assert!(
            std::os::unix::net::UnixStream::pair().is_err(),
            "descriptors are still free"
        );
        Exhausted { filler, old }
    }
}

impl Drop for Exhausted {
    fn drop(&mut self) {
        self.filler.clear();
        // SAFETY: as above.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &self.old) };
    }
}

/// Whether a `HeartbeatLost` arrives within `within`.
async fn lost_within(events: &mut KernelEvents, within: Duration) -> bool {
    tokio::time::timeout(within, async {
        loop {
            match events.recv().await {
                Some(KernelEvent::HeartbeatLost { .. }) => return,
                Some(_) => continue,
                None => std::future::pending::<()>().await,
            }
        }
    })
    .await
    .is_ok()
}

#[tokio::test]
async fn a_kernel_is_not_declared_dead_for_the_brokers_lack_of_descriptors() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = ScriptedKernel::start(dir.path(), "key").await;
    let options = ConnectOptions {
        heartbeat: Heartbeat {
            interval: INTERVAL,
            max_misses: MISSES,
        },
        ..ConnectOptions::default()
    };
    let (_client, mut events, _) = KernelClient::connect(
        &kernel.endpoints,
        "key",
        "test",
        options,
        Duration::from_secs(15),
    )
    .await
    .expect("connect failed");
    let all_misses = INTERVAL * (MISSES + 3);

    // 1. A kernel that answers late (one interval and a half) while the broker has no
    //    descriptor to spare: the connection is kept, the stale echo skipped, no loss.
    {
        let _exhausted = Exhausted::now();
        kernel.set_heartbeat(HeartbeatMode::Hold);
        tokio::time::sleep(INTERVAL * 3 / 2).await;
        kernel.set_heartbeat(HeartbeatMode::Echo);
        assert!(
            !lost_within(&mut events, all_misses).await,
            "a late echo cost the kernel its life while descriptors were short"
        );
    }

    // 2. The heartbeat connection breaks and cannot be made again for lack of
    //    descriptors: the broker's shortage, not a miss of the kernel's.
    {
        let _exhausted = Exhausted::now();
        kernel.set_heartbeat(HeartbeatMode::Garble);
        assert!(
            !lost_within(&mut events, all_misses * 2).await,
            "the kernel was declared lost because the broker could not open a socket"
        );
        kernel.set_heartbeat(HeartbeatMode::Echo);
    }
    // With descriptors back, the connection is made again and the kernel answers.
    assert!(!lost_within(&mut events, all_misses).await);

    // 3. The heartbeat still works: a kernel that stops answering is lost.
    kernel.set_heartbeat(HeartbeatMode::Hold);
    assert!(
        lost_within(&mut events, all_misses * 2).await,
        "a silent kernel was never declared lost"
    );
}
