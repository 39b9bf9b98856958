//! The registry against the fake sandbox and scripted kernels, under paused time: quotas,
//! ownership, expiry with its tombstones, and creation from the warm pool.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::{CreateOptions, Registry};
use crate::session::testing::fake_sandbox::user;
use crate::session::testing::{config, FakeSandbox, TestRecorder};
use crate::session::{LifecycleEvent, SessionConfig, SessionError, SessionState};

fn registry(config: SessionConfig) -> (Registry, Arc<FakeSandbox>, Arc<TestRecorder>) {
    let sandbox = FakeSandbox::new();
    let recorder = TestRecorder::new();
    let registry = Registry::new(
        sandbox.clone(),
        config,
        vec!["script".into(), "other".into()],
        recorder.clone(),
    );
    (registry, sandbox, recorder)
}

/// Fails the test instead of hanging it.
async fn within<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(600), f)
        .await
        .expect("the test hung")
}

#[tokio::test(start_paused = true)]
async fn each_user_has_a_quota_of_sessions() {
    let (registry, _, _) = registry(config());
    let (alice, bob) = (user("alice"), user("bob"));
    let create = |u| registry.create(u, 2, CreateOptions::default());
    let a1 = within(create(&alice)).await.expect("first");
    within(create(&alice)).await.expect("second");
    let third = within(create(&alice)).await;
    assert!(
        matches!(&third, Err(SessionError::Quota(m)) if m.contains("already has 2 sessions")),
        "{:?}",
        third.map(|s| s.id)
    );
    // Another user's quota is their own.
    within(create(&bob)).await.expect("bob's first");
    // Deleting one makes room.
    within(registry.delete("alice", a1.id))
        .await
        .expect("delete");
    within(create(&alice)).await.expect("room again");
    assert_eq!(registry.list("alice").len(), 2);
    within(registry.shutdown()).await;
}

#[tokio::test(start_paused = true)]
async fn another_users_session_is_not_found() {
    let (registry, _, _) = registry(config());
    let s = within(registry.create(&user("alice"), 5, CreateOptions::default()))
        .await
        .expect("create");
    assert!(registry.get("alice", s.id).is_ok());
    assert!(matches!(registry.get("bob", s.id), Err(SessionError::NotFound(id)) if id == s.id));
    assert!(matches!(
        within(registry.delete("bob", s.id)).await,
        Err(SessionError::NotFound(_))
    ));
    assert!(registry.list("bob").is_empty());
    assert_eq!(registry.list("alice").len(), 1);

    // Proposing a taken id gets a fresh one (and tells nothing about the owner).
    let opts = CreateOptions {
        id: Some(s.id),
        ..Default::default()
    };
    let b = within(registry.create(&user("bob"), 5, opts))
        .await
        .expect("create");
    assert_ne!(b.id, s.id);
    assert_eq!(registry.get("alice", s.id).map(|x| x.id).ok(), Some(s.id));
    within(registry.shutdown()).await;
}

#[tokio::test(start_paused = true)]
async fn an_unknown_kernel_is_refused_and_the_first_is_the_default() {
    let (registry, _, _) = registry(config());
    let opts = CreateOptions {
        kernel: Some("nope".into()),
        ..Default::default()
    };
    let r = within(registry.create(&user("alice"), 5, opts)).await;
    assert!(matches!(r, Err(SessionError::UnknownKernel(k)) if k == "nope"));
    let s = within(registry.create(&user("alice"), 5, CreateOptions::default()))
        .await
        .expect("create");
    assert_eq!(s.kernel_name, "script");
    within(registry.shutdown()).await;
}

#[tokio::test(start_paused = true)]
async fn idle_sessions_expire_leave_a_tombstone_and_are_forgotten() {
    let mut config = config();
    config.tombstone_ttl = Duration::from_secs(60);
    let (registry, sandbox, recorder) = registry(config);
    let opts = CreateOptions {
        idle_timeout_seconds: Some(10),
        ..Default::default()
    };
    let s = within(registry.create(&user("alice"), 5, opts))
        .await
        .expect("create");

    // Activity postpones expiry.
    tokio::time::sleep(Duration::from_secs(6)).await;
    s.touch();
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(registry.get("alice", s.id).is_ok(), "12 s old, 6 s idle");

    tokio::time::sleep(Duration::from_secs(5)).await;
    match registry.get("alice", s.id) {
        Err(SessionError::Expired { id, idle_secs, .. }) => {
            assert_eq!((id, idle_secs), (s.id, 10))
        }
        other => panic!("expected Expired, got {:?}", other.map(|s| s.id)),
    }
    // Only to its owner: anyone else gets "not found".
    assert!(matches!(
        registry.get("bob", s.id),
        Err(SessionError::NotFound(_))
    ));
    assert_eq!(s.state(), SessionState::Expired);
    assert!(sandbox.kernel(0).terminated(), "the kernel is gone");
    assert_eq!(sandbox.users_idle.load(Ordering::Acquire), 1);
    assert!(recorder
        .events()
        .iter()
        .any(|e| matches!(e, LifecycleEvent::SessionExpired)));

    // Past tombstone_ttl the id is forgotten: 404, and the tombstone is swept.
    tokio::time::sleep(Duration::from_secs(61)).await;
    assert!(matches!(
        registry.get("alice", s.id),
        Err(SessionError::NotFound(_))
    ));
    assert!(registry.table().tombstones.is_empty(), "swept on time");
    within(registry.shutdown()).await;
}

#[tokio::test(start_paused = true)]
async fn a_session_without_idle_timeout_never_expires() {
    let (registry, _, _) = registry(config());
    let opts = CreateOptions {
        idle_timeout_seconds: Some(0),
        ..Default::default()
    };
    let s = within(registry.create(&user("alice"), 5, opts))
        .await
        .expect("create");
    tokio::time::sleep(Duration::from_secs(30 * 86_400)).await;
    assert!(registry.get("alice", s.id).is_ok());
    assert_eq!(s.info().expires_at, None);
    within(registry.shutdown()).await;
}

#[tokio::test(start_paused = true)]
async fn the_second_session_takes_a_pooled_kernel() {
    let mut config = config();
    config.pool.size = 1;
    let (registry, sandbox, recorder) = registry(config);
    let alice = user("alice");
    let first = within(registry.create(&alice, 5, CreateOptions::default()))
        .await
        .expect("create");
    within(async {
        while registry.pooled() != 1 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let second = within(registry.create(&alice, 5, CreateOptions::default()))
        .await
        .expect("create");
    assert_ne!(first.id, second.id);
    let started: Vec<bool> = recorder
        .events()
        .iter()
        .filter_map(|e| match e {
            LifecycleEvent::KernelStarted { pooled, .. } => Some(*pooled),
            _ => None,
        })
        .collect();
    assert_eq!(started, [false, true]);
    // Both kernels were launched for alice; the second session's is the pooled one.
    assert!(sandbox.launched().iter().all(|k| k.user == "alice"));
    let x = within(second.execute_wait("print pooled".into(), Duration::from_secs(5)))
        .await
        .expect("executes");
    assert_eq!(x.stdout, "pooled");
    within(registry.shutdown()).await;
    assert_eq!(registry.pooled(), 0, "shutdown drains the pool");
}
