//! The actor against a scripted kernel and a fake sandbox (see `session::testing`), under
//! paused time: timeouts, interrupts, restarts, death and the execute queue, in
//! milliseconds and without Python.
//!
//! Paused time auto-advances whenever the runtime has nothing to do. The scripted kernel
//! runs in the same runtime and answers at once, so whatever it was sent is already in a
//! socket buffer when the runtime looks for work, and the clock only jumps when everything
//! waits on a timer: then the jump is what the test is about (a deadline, a grace).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, Notify};
use tokio::time::Instant;
use uuid::Uuid;

use super::running::{IDLE_AFTER_REPLY, INTERRUPT_UNANNOUNCED};
use super::Actor;
use crate::sandbox::{ExitReason, Sandbox};
use crate::session::handle::{HandleParts, Session};
use crate::session::launch::start_kernel;
use crate::session::memory::{Holder, Ledger};
use crate::session::pool::Pool;
use crate::session::testing::fake_sandbox::user;
use crate::session::testing::{config, FakeSandbox, TestRecorder};
use crate::session::{
    ExecRequest, Execution, ExecutionStatus, LifecycleEvent, SessionConfig, SessionState,
};
use crate::wire::Signer;

struct Harness {
    session: Arc<Session>,
    sandbox: Arc<FakeSandbox>,
    recorder: Arc<TestRecorder>,
}

/// A session whose actor runs on a scripted kernel (the fake sandbox's kernel 0).
async fn start(config: SessionConfig) -> Harness {
    start_with_secrets(config, Default::default()).await
}

/// As [`start`], the session holding these secrets (name to value).
async fn start_with_secrets(
    config: SessionConfig,
    secrets: std::collections::BTreeMap<String, String>,
) -> Harness {
    let sandbox = FakeSandbox::new();
    let dyn_sandbox: Arc<dyn Sandbox> = sandbox.clone();
    let recorder = TestRecorder::new();
    let (commands, commands_rx) = mpsc::channel(config.max_queue + 64);
    let ledger = Ledger::new();
    let alice = user("alice");
    let memory = ledger
        .reserve(
            "alice",
            0,
            alice.limits.session_memory_bytes,
            Holder::Session,
        )
        .expect("no total");
    let session = Arc::new(Session::new(
        Uuid::new_v4(),
        user("alice"),
        HandleParts {
            kernel_name: "script".into(),
            idle_timeout: None,
            limits: alice.limits.kernel(None),
            provenance: Default::default(),
            memory,
            commands,
            event_budget: 1 << 20,
            max_queue: config.max_queue,
            notify_registry: Arc::new(Notify::new()),
            kept: None,
            restored: None,
            own_workspace: None,
            paused_records: None,
            secrets: crate::session::secrets::SessionSecrets::new(
                Default::default(),
                None,
                Uuid::new_v4(),
                Arc::new(secrets),
            ),
        },
    ));
    let spec = session.launch_spec(Signer::random_key());
    let live = within(start_kernel(&dyn_sandbox, spec, config.kernel))
        .await
        .expect("the scripted kernel starts");
    let pool = Pool::new(
        config.pool.clone(),
        dyn_sandbox.clone(),
        config.kernel,
        ledger,
    );
    let actor = Actor::new(
        session.clone(),
        dyn_sandbox,
        config,
        commands_rx,
        Some(live),
        recorder.clone(),
        pool,
    );
    tokio::spawn(actor.run());
    Harness {
        session,
        sandbox,
        recorder,
    }
}

/// Fails the test instead of hanging it (an hour of paused time passes in an instant).
async fn within<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(3600), f)
        .await
        .expect("the test hung")
}

impl Harness {
    /// Queue `code` without waiting for it.
    fn submit(&self, code: &str, timeout: Duration) -> oneshot::Receiver<Execution> {
        let (done, rx) = oneshot::channel();
        self.session
            .execute(ExecRequest {
                code: code.into(),
                timeout,
                allow_stdin: false,
                stream: None,
                hooks: None,
                env_code: None,
                checked: true,
                done,
            })
            .expect("the queue takes it");
        rx
    }

    async fn run(&self, code: &str) -> Execution {
        self.run_with(code, Duration::from_secs(60)).await
    }

    async fn run_with(&self, code: &str, timeout: Duration) -> Execution {
        within(self.session.execute_wait(code.into(), timeout))
            .await
            .expect("the session answers")
    }
}

async fn done(rx: oneshot::Receiver<Execution>) -> Execution {
    within(rx).await.expect("the execution is answered")
}

fn ename(x: &Execution) -> &str {
    x.error.as_ref().map_or("", |e| e.ename.as_str())
}

fn evalue(x: &Execution) -> &str {
    x.error.as_ref().map_or("", |e| e.evalue.as_str())
}

#[tokio::test(start_paused = true)]
async fn a_timeout_whose_interrupt_is_ignored_restarts_the_kernel_and_loses_its_state() {
    let h = start(config()).await;
    assert_eq!(h.run("set x 1").await.status, ExecutionStatus::Ok);

    let asked = Instant::now();
    let x = h.run_with("hang", Duration::from_secs(2)).await;
    assert_eq!(x.status, ExecutionStatus::Timeout, "{x:?}");
    assert_eq!(ename(&x), "TimeoutError");
    assert!(evalue(&x).contains("the kernel was restarted"), "{x:?}");
    assert!(evalue(&x).contains("variables are lost"), "{x:?}");
    // The deadline, then the grace after the interrupt: not earlier, not much later.
    let waited = asked.elapsed();
    assert!(
        waited >= Duration::from_secs(2 + 5) && waited < Duration::from_secs(2 + 5 + 1),
        "{waited:?}"
    );

    let old = h.sandbox.kernel(0);
    assert!(
        old.kernel.interrupts() >= 1,
        "the kernel was interrupted first"
    );

    // The new kernel (the actor starts it before it takes the next command) knows no x.
    let x = h.run("get x").await;
    assert_eq!(x.status, ExecutionStatus::Error);
    assert_eq!(ename(&x), "NameError");
    assert_eq!(h.sandbox.launched().len(), 2, "a fresh kernel was launched");
    assert!(old.terminated(), "the deaf kernel was terminated");
    assert_eq!(h.sandbox.kernel(1).kernel.received(), ["get x"]);
    assert_eq!(h.session.state(), SessionState::Idle);

    let events = h.recorder.events();
    assert!(events
        .iter()
        .any(|e| matches!(e, LifecycleEvent::ExecutionTimeout { timeout_seconds, .. } if *timeout_seconds == 2.0)));
    assert!(events
        .iter()
        .any(|e| matches!(e, LifecycleEvent::KernelRestarted { reason } if reason.contains("did not stop"))));
}

#[tokio::test(start_paused = true)]
async fn a_timeout_whose_interrupt_works_keeps_the_kernel_and_its_state() {
    let h = start(config()).await;
    assert_eq!(h.run("set x 1").await.status, ExecutionStatus::Ok);

    let asked = Instant::now();
    let x = h.run_with("sleep", Duration::from_secs(2)).await;
    assert_eq!(x.status, ExecutionStatus::Timeout, "{x:?}");
    let waited = asked.elapsed();
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    assert_eq!(ename(&x), "TimeoutError");
    assert!(evalue(&x).contains("variables are kept"), "{x:?}");
    assert_eq!(h.sandbox.kernel(0).kernel.interrupts(), 1);
    assert_eq!(h.sandbox.launched().len(), 1, "no restart");

    let x = h.run("get x").await;
    assert_eq!(x.status, ExecutionStatus::Ok, "{x:?}");
    assert_eq!(x.stdout, "1");
}

#[tokio::test(start_paused = true)]
async fn death_while_busy_answers_the_running_and_queued_executions_dead() {
    let h = start(config()).await;
    let running = h.submit("sleep", Duration::from_secs(60));
    let queued = [
        h.submit("print a", Duration::from_secs(60)),
        h.submit("print b", Duration::from_secs(60)),
    ];
    let kernel = h.sandbox.kernel(0);
    within(kernel.kernel.wait_received(1)).await;
    kernel.exit(ExitReason::OutOfMemory {
        limit_bytes: 1 << 30,
    });

    let x = done(running).await;
    assert_eq!(x.status, ExecutionStatus::Dead, "{x:?}");
    assert_eq!(ename(&x), "KernelDied");
    assert!(evalue(&x).contains("out of memory"), "{x:?}");
    for rx in queued {
        let x = done(rx).await;
        assert_eq!(x.status, ExecutionStatus::Dead, "{x:?}");
        assert_eq!(ename(&x), "KernelDied");
        assert!(evalue(&x).contains("out of memory"), "{x:?}");
    }
    assert_eq!(
        kernel.kernel.received(),
        ["sleep"],
        "the queued code never ran"
    );
    assert_eq!(h.session.state(), SessionState::Dead);
    let reason = h.session.dead_reason().unwrap_or_default();
    assert!(reason.contains("out of memory"), "{reason}");

    // A dead session answers at once, and is not restarted behind the client's back.
    let x = h.run("print c").await;
    assert_eq!(x.status, ExecutionStatus::Dead);
    assert_eq!(h.sandbox.launched().len(), 1);
    assert!(h.recorder.events().iter().any(
        |e| matches!(e, LifecycleEvent::KernelDied { reason } if reason.contains("out of memory"))
    ));
}

#[tokio::test(start_paused = true)]
async fn a_kernel_that_exits_by_itself_names_its_exit_code() {
    let h = start(config()).await;
    let x = h.run("die 3").await;
    assert_eq!(x.status, ExecutionStatus::Dead, "{x:?}");
    assert!(evalue(&x).contains("exited with code 3"), "{x:?}");
    assert_eq!(h.session.state(), SessionState::Dead);
    let reason = h.session.dead_reason().unwrap_or_default();
    assert!(reason.contains("exited with code 3"), "{reason}");
}

#[tokio::test(start_paused = true)]
async fn queued_executions_run_one_at_a_time_in_arrival_order() {
    let h = start(config()).await;
    // The first one holds the kernel until released, so the others queue behind it.
    let first = h.submit("gate first", Duration::from_secs(60));
    let rest: Vec<_> = (1..=8)
        .map(|i| h.submit(&format!("print {i}"), Duration::from_secs(60)))
        .collect();
    let kernel = h.sandbox.kernel(0);
    within(kernel.kernel.wait_received(1)).await;
    within(h.recorder.wait_replies(1)).await;
    assert_eq!(
        kernel.kernel.received(),
        ["gate first"],
        "nothing is sent while an execution runs"
    );
    kernel.kernel.release();
    assert_eq!(done(first).await.stdout, "first");
    let mut counts = Vec::new();
    for (i, rx) in rest.into_iter().enumerate() {
        let x = done(rx).await;
        assert_eq!(x.status, ExecutionStatus::Ok);
        assert_eq!(x.stdout, (i + 1).to_string());
        counts.push(x.execution_count.unwrap_or_default());
    }
    let expected: Vec<String> = std::iter::once("gate first".to_string())
        .chain((1..=8).map(|i| format!("print {i}")))
        .collect();
    assert_eq!(kernel.kernel.received(), expected);
    assert_eq!(counts, (2..=9).collect::<Vec<u64>>());
}

#[tokio::test(start_paused = true)]
async fn a_restart_during_an_execution_ends_it_and_the_queue_runs_on_the_new_kernel() {
    let h = start(config()).await;
    assert_eq!(h.run("set x 1").await.status, ExecutionStatus::Ok);
    let running = h.submit("hang", Duration::from_secs(600));
    let after = h.submit("print after", Duration::from_secs(60));
    within(h.sandbox.kernel(0).kernel.wait_received(2)).await;

    within(h.session.restart())
        .await
        .expect("the restart works");
    let x = done(running).await;
    assert_eq!(x.status, ExecutionStatus::Interrupted, "{x:?}");
    assert_eq!(ename(&x), "KernelRestarted");
    assert_eq!(evalue(&x), "the kernel was restarted by request");
    assert!(h.sandbox.kernel(0).terminated());

    let x = done(after).await;
    assert_eq!(x.status, ExecutionStatus::Ok, "{x:?}");
    assert_eq!(x.stdout, "after");
    assert_eq!(h.sandbox.kernel(1).kernel.received(), ["print after"]);
    assert_eq!(x.execution_count, Some(1), "the count starts again");
    assert_eq!(h.run("get x").await.status, ExecutionStatus::Error);
    assert_eq!(h.session.state(), SessionState::Idle);
}

#[tokio::test(start_paused = true)]
async fn a_failed_restart_leaves_the_session_dead() {
    let h = start(config()).await;
    h.sandbox
        .refuse
        .store(true, std::sync::atomic::Ordering::Release);
    let r = within(h.session.restart()).await;
    assert!(r.is_err(), "{r:?}");
    assert_eq!(h.session.state(), SessionState::Dead);
    let reason = h.session.dead_reason().unwrap_or_default();
    assert!(reason.contains("the restart failed"), "{reason}");
    assert_eq!(h.run("print a").await.status, ExecutionStatus::Dead);
}

#[tokio::test(start_paused = true)]
async fn an_execution_completes_only_after_the_idle_status_for_it() {
    let h = start(config()).await;
    // The kernel replies at once, but sends output and the idle status only when released.
    let rx = h.submit("gate late output", Duration::from_secs(60));
    let kernel = h.sandbox.kernel(0);
    within(h.recorder.wait_replies(1)).await;
    // The actor has taken the reply in; give anything it spawned a chance to run.
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    let mut rx = rx;
    assert!(
        matches!(rx.try_recv(), Err(oneshot::error::TryRecvError::Empty)),
        "the execution was answered on the reply, before its idle status"
    );
    kernel.kernel.release();
    let x = done(rx).await;
    assert_eq!(x.status, ExecutionStatus::Ok);
    assert_eq!(
        x.stdout, "late output",
        "output after the reply belongs to it"
    );
}

#[tokio::test(start_paused = true)]
async fn a_secret_split_around_the_reply_is_masked_whole() {
    // The secret's start is printed before the reply, its rest only after it (the reply
    // overtook the last output): the start is held until the rest comes and the whole is
    // masked, not released at the reply and masked piece by piece.
    let secret = "kb-test-0123456789abcdef";
    let values = [("API_TOKEN".to_string(), secret.to_string())].into();
    let h = start_with_secrets(config(), values).await;
    let rx = h.submit("split kb-test-01 23456789abcdef", Duration::from_secs(60));
    let kernel = h.sandbox.kernel(0);
    within(kernel.kernel.wait_received(1)).await;
    // The start is printed and the actor has taken it in (and held it) before the reply.
    tokio::time::sleep(Duration::from_millis(50)).await;
    kernel.kernel.release();
    within(h.recorder.wait_replies(1)).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    kernel.kernel.release();
    let x = done(rx).await;
    assert_eq!(x.status, ExecutionStatus::Ok, "{x:?}");
    assert!(!x.stdout.contains(secret), "{x:?}");
    assert!(
        !x.stdout.contains("kb-test-01"),
        "the held start leaked: {x:?}"
    );
    assert_eq!(x.stdout, "[secret:API_TOKEN]");
}

#[tokio::test(start_paused = true)]
async fn without_an_idle_status_an_execution_completes_after_the_grace() {
    let h = start(config()).await;
    let rx = h.submit("noidle", Duration::from_secs(60));
    within(h.recorder.wait_replies(1)).await;
    let replied = Instant::now();
    let x = done(rx).await;
    assert_eq!(x.status, ExecutionStatus::Ok, "{x:?}");
    let waited = replied.elapsed();
    assert!(
        waited >= IDLE_AFTER_REPLY && waited < IDLE_AFTER_REPLY + Duration::from_secs(1),
        "waited {waited:?}"
    );
    // The kernel is still usable.
    assert_eq!(h.run("print next").await.stdout, "next");
}

#[tokio::test(start_paused = true)]
async fn a_user_interrupt_ends_the_execution_as_interrupted() {
    let h = start(config()).await;
    let rx = h.submit("sleep", Duration::from_secs(60));
    within(h.sandbox.kernel(0).kernel.wait_received(1)).await;
    within(h.session.interrupt())
        .await
        .expect("the interrupt is sent");
    let x = done(rx).await;
    assert_eq!(x.status, ExecutionStatus::Interrupted, "{x:?}");
    assert_eq!(h.sandbox.launched().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn an_interrupt_waits_for_its_execution_to_be_announced_at_most_a_while() {
    // A kernel that never announces the execution (no `execute_input`) is interrupted
    // once the wait is over, not never.
    let h = start(config()).await;
    let rx = h.submit("unannounced", Duration::from_secs(60));
    within(h.sandbox.kernel(0).kernel.wait_received(1)).await;
    let asked = Instant::now();
    within(h.session.interrupt())
        .await
        .expect("the interrupt is taken");
    let x = done(rx).await;
    let waited = asked.elapsed();
    assert_eq!(x.status, ExecutionStatus::Interrupted, "{x:?}");
    assert!(
        waited >= INTERRUPT_UNANNOUNCED && waited < INTERRUPT_UNANNOUNCED + Duration::from_secs(1),
        "waited {waited:?}"
    );
    assert_eq!(h.sandbox.kernel(0).kernel.interrupts(), 1);
}

#[tokio::test(start_paused = true)]
async fn output_over_the_message_limit_is_cut_and_the_session_carries_on() {
    let mut c = config();
    c.output_limit = 1 << 20;
    // The smallest limit the configuration allows.
    c.kernel.limits.max_message = 1 << 20;
    let h = start(c).await;
    assert_eq!(h.run("set x 1").await.status, ExecutionStatus::Ok);
    let x = h.run("big 3000000").await;
    assert_eq!(x.status, ExecutionStatus::Ok, "{}", &x.stdout[..100]);
    assert!(x.truncated);
    // The stream's first 256 KiB of content are kept, then the marker; the forged message
    // (its signature fails over the discarded bytes) is dropped; the rest goes on.
    let marker = x.stdout.find("\n[kernel-broker:").expect("a marker");
    assert!(x.stdout[..marker].bytes().all(|b| b == b'y'));
    assert!((250_000..262_144).contains(&marker), "{marker}");
    assert!(
        x.stdout[marker..].starts_with("\n[kernel-broker: an output message of "),
        "{}",
        &x.stdout[marker..]
    );
    assert!(
        x.stdout.ends_with("characters]\ndone"),
        "{}",
        &x.stdout[marker..]
    );
    assert!(!x.stdout.contains("fff"));
    assert_eq!(x.results.len(), 1);
    let display = x.results[0].data["text/plain"].as_str().unwrap_or_default();
    assert!(
        display.starts_with("[kernel-broker: an output message (display_data) of ")
            && display.ends_with(" bytes was cut]"),
        "{display}"
    );
    let cuts: Vec<(String, u64)> = h
        .recorder
        .events()
        .into_iter()
        .filter_map(|e| match e {
            LifecycleEvent::OutputCut {
                msg_type, bytes, ..
            } => Some((msg_type, bytes)),
            _ => None,
        })
        .collect();
    assert_eq!(cuts.len(), 2, "{cuts:?}");
    assert_eq!(cuts[0].0, "stream");
    assert_eq!(cuts[1].0, "display_data");
    assert!(cuts.iter().all(|(_, b)| *b > 3_000_000), "{cuts:?}");
    // The session is alive, with its state.
    let x = h.run("get x").await;
    assert_eq!(x.stdout, "1", "{x:?}");
    assert!(!x.truncated);
    assert_eq!(h.session.state(), SessionState::Idle);
}

#[tokio::test(start_paused = true)]
async fn waiters_see_the_status_the_actor_publishes() {
    let h = start(config()).await;
    let before = h.session.status().last_activity_at;
    let first = h.submit("gate first", Duration::from_secs(60));
    let busy = within(h.session.wait_for(|s| s.state == SessionState::Busy)).await;
    assert!(busy.busy_since.is_some(), "{busy:?}");
    assert!(busy.last_activity_at >= before);
    let kernel = h.sandbox.kernel(0);
    within(kernel.kernel.wait_received(1)).await;
    within(h.recorder.wait_replies(1)).await;
    kernel.kernel.release();
    let idle = within(
        h.session
            .wait_for(|s| s.state == SessionState::Idle && s.execution_count == 1),
    )
    .await;
    assert_eq!(idle.busy_since, None);
    assert_eq!(done(first).await.stdout, "first");
    assert_eq!(h.session.state(), SessionState::Idle);

    // A session that dies is seen dead, with its reason, by whoever waits.
    let dead = tokio::spawn({
        let session = h.session.clone();
        async move { session.wait_for(|s| s.state == SessionState::Dead).await }
    });
    assert_eq!(h.run("die 3").await.status, ExecutionStatus::Dead);
    let dead = within(dead).await.expect("the waiter ends");
    assert!(
        dead.dead_reason
            .as_deref()
            .is_some_and(|r| r.contains("exited with code 3")),
        "{dead:?}"
    );
}
