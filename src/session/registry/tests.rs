//! The registry against the fake sandbox and scripted kernels, under paused time: quotas,
//! ownership, expiry with its tombstones, and creation from the warm pool.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::{CreateOptions, Registry};
use crate::session::testing::fake_sandbox::user;
use crate::session::testing::{config, FakeSandbox, TestRecorder};
use crate::session::{
    EndedBy, FrontDoor, LifecycleEvent, SessionConfig, SessionError, SessionState, WorkspaceChoice,
};
use crate::sync::lock;

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
        matches!(&third, Err(e @ SessionError::TooManySessions { .. }) if e.to_string().contains("already has 2 sessions")),
        "{:?}",
        third.map(|s| s.id)
    );
    // Another user's quota is their own.
    within(create(&bob)).await.expect("bob's first");
    // Deleting one makes room.
    within(registry.delete("alice", a1.id, EndedBy::Client(FrontDoor::Rest)))
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
        within(registry.delete("bob", s.id, EndedBy::Client(FrontDoor::Rest))).await,
        Err(SessionError::NotFound(_))
    ));
    assert!(registry.list("bob").is_empty());
    assert_eq!(registry.list("alice").len(), 1);

    // Proposing a live session's id is refused, and the session is untouched.
    let opts = CreateOptions {
        id: Some(s.id),
        ..Default::default()
    };
    let b = within(registry.create(&user("bob"), 5, opts)).await;
    assert!(matches!(b, Err(SessionError::IdTaken { id }) if id == s.id));
    assert_eq!(registry.get("alice", s.id).map(|x| x.id).ok(), Some(s.id));
    within(registry.shutdown()).await;
}

#[tokio::test(start_paused = true)]
async fn a_session_id_is_never_reused() {
    let (registry, _, _) = registry(config());
    let (alice, bob) = (user("alice"), user("bob"));
    let propose = |id| CreateOptions {
        id: Some(id),
        ..Default::default()
    };
    // Two creates proposing one new id at once: exactly one gets it.
    let fresh = uuid::Uuid::new_v4();
    let (a, b) = within(futures::future::join(
        registry.create(&alice, 5, propose(fresh)),
        registry.create(&bob, 5, propose(fresh)),
    ))
    .await;
    let won = [&a, &b].iter().filter(|r| r.is_ok()).count();
    assert_eq!(won, 1, "{:?} {:?}", a.map(|s| s.id), b.map(|s| s.id));
    assert!([a, b]
        .into_iter()
        .any(|r| matches!(r, Err(SessionError::IdTaken { id }) if id == fresh)));
    let owner = ["alice", "bob"]
        .into_iter()
        .find(|u| registry.get(u, fresh).is_ok())
        .expect("the winner's session");
    // Ended (deleted: no tombstone, only its recording): refused to anyone, its owner too.
    within(registry.delete(owner, fresh, EndedBy::Client(FrontDoor::Rest)))
        .await
        .expect("delete");
    for u in [&alice, &bob] {
        let r = within(registry.create(u, 5, propose(fresh))).await;
        assert!(matches!(r, Err(SessionError::IdTaken { id }) if id == fresh));
    }
    // A refusal gives back its place in the quota: one session left, it can be created.
    let r = within(registry.create(&alice, 1, CreateOptions::default())).await;
    assert!(r.is_ok());
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

/// A user whose total fits `n` sessions of 256 MiB.
fn user_fitting(name: &str, n: u64) -> crate::sandbox::SandboxUser {
    let mut u = user(name);
    u.limits.memory_bytes = n * (256 << 20);
    u.limits.session_memory_bytes = 256 << 20;
    u
}

#[tokio::test(start_paused = true)]
async fn memory_is_admitted_against_the_users_total_and_comes_back() {
    let (registry, sandbox, _) = registry(config());
    let alice = user_fitting("alice", 3);
    let create = |memory_limit_bytes| {
        registry.create(
            &alice,
            20,
            CreateOptions {
                memory_limit_bytes,
                ..Default::default()
            },
        )
    };
    let big = within(create(Some(512 << 20))).await.expect("512 MiB fits");
    assert_eq!(big.limits.memory_bytes, 512 << 20);
    assert_eq!(sandbox.launched()[0].limits.memory_bytes, 512 << 20);
    let small = within(create(None)).await.expect("256 MiB fits");
    assert_eq!(small.info().memory_limit_bytes, 256 << 20);
    let refused = within(create(None)).await;
    assert!(
        matches!(&refused, Err(e @ SessionError::NoMemoryLeft { .. }) if e.to_string().contains("alice's 2 sessions use 768 MiB of 768 MiB")
            && e.to_string().contains("this one asks for 256 MiB")),
        "{:?}",
        refused.map(|s| s.id)
    );
    // Asking for more than the total, or less than 16 MiB, is a bad request.
    for bad in [Some(1 << 30), Some(1 << 20)] {
        assert!(matches!(
            within(create(bad)).await,
            Err(SessionError::InvalidMemoryLimit { .. })
        ));
    }
    assert_eq!(registry.memory_use("alice").session_bytes, 768 << 20);
    within(registry.delete("alice", big.id, EndedBy::Client(FrontDoor::Rest)))
        .await
        .expect("delete");
    assert_eq!(registry.memory_use("alice").session_bytes, 256 << 20);
    within(create(Some(512 << 20))).await.expect("room again");
    within(registry.shutdown()).await;
    assert_eq!(registry.memory_use("alice").total_bytes(), 0);
}

#[tokio::test(start_paused = true)]
async fn the_pool_uses_only_free_room_and_makes_way_for_sessions() {
    let mut config = config();
    config.pool.size = 1;
    let (registry, sandbox, _) = registry(config);
    let alice = user_fitting("alice", 2);
    let opts = CreateOptions::default;
    within(registry.create(&alice, 20, opts()))
        .await
        .expect("first");
    within(async {
        while registry.pooled() != 1 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let used = registry.memory_use("alice");
    assert_eq!((used.sessions, used.pooled), (1, 1));
    // A session of other limits cannot take the pooled kernel: the pool is shut down to
    // make room for it.
    let other = CreateOptions {
        memory_limit_bytes: Some(200 << 20),
        ..Default::default()
    };
    let second = within(registry.create(&alice, 20, other))
        .await
        .expect("the pool made way");
    assert_eq!(registry.pooled(), 0);
    assert!(sandbox.kernel(1).terminated(), "the pooled kernel is gone");
    let used = registry.memory_use("alice");
    assert_eq!((used.sessions, used.pooled), (2, 0));
    assert_eq!(used.session_bytes, 456 << 20);
    // No room for another pooled kernel now (456 + 256 > 512): none is started.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(sandbox.launched().len(), 3);
    assert_eq!(registry.memory_use("alice").pooled, 0);
    within(registry.delete("alice", second.id, EndedBy::Client(FrontDoor::Rest)))
        .await
        .expect("delete");
    within(registry.shutdown()).await;
}

#[tokio::test(start_paused = true)]
async fn waiters_see_a_deleted_session_end() {
    let (registry, _, _) = registry(config());
    let s = within(registry.create(&user("alice"), 5, CreateOptions::default()))
        .await
        .expect("create");
    let waiter = tokio::spawn({
        let s = s.clone();
        async move { s.ended().await }
    });
    assert!(
        tokio::time::timeout(Duration::from_secs(60), s.ended())
            .await
            .is_err(),
        "a live session has not ended"
    );
    within(registry.delete("alice", s.id, EndedBy::Client(FrontDoor::Rest)))
        .await
        .expect("delete");
    within(waiter).await.expect("the waiter ends");
    assert_eq!(s.state(), SessionState::Closed);
    within(registry.shutdown()).await;
}

#[tokio::test(start_paused = true)]
async fn an_own_workspace_is_shared_by_its_contexts_and_removed_after_the_last() {
    let (registry, sandbox, _) = registry(config());
    let (alice, bob) = (user("alice"), user("bob"));
    let own = |workspace| CreateOptions {
        workspace,
        ..CreateOptions::default()
    };
    let by = EndedBy::Client(FrontDoor::Rest);
    let sbx = within(registry.create(&alice, 5, own(WorkspaceChoice::Own)))
        .await
        .expect("own");
    assert_eq!(sbx.own_workspace, Some(sbx.id));
    let ctx = within(registry.create(&alice, 5, own(WorkspaceChoice::OwnOf(sbx.id))))
        .await
        .expect("a context of it");
    assert_eq!(ctx.own_workspace, Some(sbx.id));
    let shared = within(registry.create(&alice, 5, CreateOptions::default()))
        .await
        .expect("shared");
    assert_eq!(shared.own_workspace, None);
    // The kernels were launched in it (none of them from the warm pool).
    let in_it = sandbox
        .launched()
        .iter()
        .filter(|k| k.own_workspace == Some(sbx.id))
        .count();
    assert_eq!(in_it, 2);
    // Another user's session, or one that is not live, has no workspace to share.
    let stolen = within(registry.create(&bob, 5, own(WorkspaceChoice::OwnOf(sbx.id)))).await;
    assert!(
        matches!(stolen, Err(SessionError::NotFound(_))),
        "{:?}",
        stolen.map(|s| s.id)
    );
    let gone =
        within(registry.create(&alice, 5, own(WorkspaceChoice::OwnOf(uuid::Uuid::new_v4())))).await;
    assert!(matches!(gone, Err(SessionError::NotFound(_))));
    // Removed only after the last session working in it.
    within(registry.delete("alice", sbx.id, by))
        .await
        .expect("delete");
    assert!(
        lock(&sandbox.own_removed).is_empty(),
        "removed under a context"
    );
    within(registry.delete("alice", ctx.id, by))
        .await
        .expect("delete");
    assert_eq!(*lock(&sandbox.own_removed), vec![sbx.id]);
    within(registry.delete("alice", shared.id, by))
        .await
        .expect("delete");
    assert_eq!(lock(&sandbox.own_removed).len(), 1);
    // A broker shutdown that keeps nothing removes those of the sessions it ends.
    let last = within(registry.create(&alice, 5, own(WorkspaceChoice::Own)))
        .await
        .expect("own");
    within(registry.shutdown()).await;
    assert_eq!(*lock(&sandbox.own_removed), vec![sbx.id, last.id]);
}
