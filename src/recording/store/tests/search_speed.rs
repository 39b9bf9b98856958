//! How fast the recordings list is searched and filtered over many sessions: a store
//! filled through the writer with sessions of realistic size (executions with a few KB of
//! output each), then each kind of list timed. The 10,000-session run is a measurement
//! (ignored by default; numbers in BENCHMARKS.md); a 500-session run checks, in every test
//! run, that the same queries find what they should.

use std::time::{Duration, Instant};

use super::*;
use crate::recording::search::{ListQuery, StateFilter};

/// Words the generated code and output are made of.
const WORDS: &[&str] = &[
    "import", "pandas", "numpy", "frame", "print", "result", "value", "column", "index", "mean",
    "total", "count", "group", "sales", "region", "north", "south", "plot", "figure", "series",
    "merge", "filter", "apply", "lambda", "return", "data", "model", "train", "score", "error",
    "warning", "loaded", "rows", "float64", "int64", "object", "dtype",
];

/// A small deterministic generator (no dependency, same data every run).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn words(&mut self, bytes: usize) -> String {
        let mut s = String::with_capacity(bytes + 16);
        while s.len() < bytes {
            s.push_str(WORDS[(self.next() % WORDS.len() as u64) as usize]);
            s.push(if self.next().is_multiple_of(8) {
                '\n'
            } else {
                ' '
            });
        }
        s
    }
}

/// Fills `store` with `sessions` sessions of alice (and one of bob's per hundred), each of
/// 10 executions printing about 3 KB; one session in a thousand prints a rare word, one in
/// ten fails, half are closed.
async fn fill(store: &RecordingStore, sessions: usize) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let t0 = micros(Utc::now()) - sessions as i64 * 1_000_000;
    for i in 0..sessions {
        let mut k = key(Uuid::new_v4());
        k.created_at = t0 + i as i64 * 1_000_000;
        if i % 100 == 99 {
            k.user = "bob".into();
        }
        for x in 0..10 {
            let code = format!("df{x} = load({})\nprint(df{x}.describe())", rng.words(80));
            let req = msg(
                "execute_request",
                "",
                json!({"code": code, "silent": false}),
            );
            store.report_message(k.clone(), Direction::ToKernel, Channel::Shell, &req);
            for _ in 0..3 {
                let mut text = rng.words(1000);
                if x == 5 && i % 1000 == 7 {
                    text.push_str(" xylophone-quartz ");
                }
                let s = msg(
                    "stream",
                    &req.msg_id,
                    json!({"name": "stdout", "text": text}),
                );
                store.report_message(k.clone(), Direction::FromKernel, Channel::Iopub, &s);
            }
            let failed = x == 9 && i % 10 == 3;
            if failed {
                let e = msg(
                    "error",
                    &req.msg_id,
                    json!({"ename": "KeyError", "evalue": "'region'", "traceback": ["KeyError: 'region'"]}),
                );
                store.report_message(k.clone(), Direction::FromKernel, Channel::Iopub, &e);
            } else {
                let r = msg(
                    "execute_result",
                    &req.msg_id,
                    json!({"data": {"text/plain": rng.words(200)}, "metadata": {}}),
                );
                store.report_message(k.clone(), Direction::FromKernel, Channel::Iopub, &r);
            }
            let status = if failed { "error" } else { "ok" };
            let reply = msg("execute_reply", &req.msg_id, json!({"status": status}));
            store.report_message(k.clone(), Direction::FromKernel, Channel::Shell, &reply);
            let idle = msg("status", &req.msg_id, json!({"execution_state": "idle"}));
            store.report_message(k.clone(), Direction::FromKernel, Channel::Iopub, &idle);
        }
        if i % 4 < 2 {
            let by = crate::session::EndedBy::Client(crate::session::FrontDoor::Rest);
            store.report_event(k.clone(), LifecycleEvent::SessionClosed { by });
        }
        if i % 200 == 199 {
            store.flush().await;
        }
    }
    store.flush().await;
}

/// The lists timed: a name, the query, and how many sessions it finds among `sessions`.
fn lists(sessions: usize) -> Vec<(&'static str, ListQuery, usize)> {
    let alice = sessions - sessions / 100;
    let q = |f: &dyn Fn(&mut ListQuery)| {
        let mut q = ListQuery::of("alice", 200);
        f(&mut q);
        q
    };
    let rare = sessions / 1000 + usize::from(sessions % 1000 > 7);
    let failing = (0..sessions)
        .filter(|i| i % 10 == 3 && i % 100 != 99)
        .count();
    vec![
        ("newest 200, no filter", q(&|_| {}), alice.min(200)),
        (
            "q: a rare word",
            q(&|l| l.q = Some("XYLOPHONE-quartz".into())),
            rare,
        ),
        (
            "q: a word in every session",
            q(&|l| l.q = Some("pandas".into())),
            alice.min(200),
        ),
        ("q: two characters", q(&|l| l.q = Some("q5".into())), 0),
        (
            "q: an error name",
            q(&|l| l.q = Some("keyerror".into())),
            failing.min(200),
        ),
        (
            "state=ended & has_errors=true",
            q(&|l| {
                l.state = Some(StateFilter::Ended);
                l.has_errors = Some(true);
            }),
            (0..sessions)
                .filter(|i| i % 10 == 3 && i % 4 < 2 && i % 100 != 99)
                .count()
                .min(200),
        ),
        (
            "q: a rare word & state=live & since",
            q(&|l| {
                l.q = Some("xylophone".into());
                l.state = Some(StateFilter::Live);
                l.since = Some(Utc::now() - chrono::Duration::days(1));
            }),
            (0..sessions)
                .filter(|i| i % 1000 == 7 && i % 2 == 1)
                .count(),
        ),
    ]
}

/// Times each list `runs` times; checks what it finds.
async fn time_lists(store: &RecordingStore, sessions: usize, runs: usize) {
    for (name, query, want) in lists(sessions) {
        let mut took: Vec<Duration> = Vec::with_capacity(runs);
        for _ in 0..runs {
            let t = Instant::now();
            let found = store.find(query.clone()).await.unwrap();
            took.push(t.elapsed());
            assert_eq!(found.len(), want, "{name}");
            if query.q.is_some() {
                assert!(found.iter().all(|l| !l.matches.is_empty()), "{name}");
            }
        }
        took.sort();
        let p = |q: f64| took[((took.len() - 1) as f64 * q) as usize];
        eprintln!(
            "{sessions} sessions, {name}: {want} found, p50 {:.1} ms, p95 {:.1} ms",
            p(0.5).as_secs_f64() * 1000.0,
            p(0.95).as_secs_f64() * 1000.0
        );
    }
}

async fn measure(backend: Backend, sessions: usize, runs: usize) {
    let store = open_store(backend, |_| {}).await;
    let t = Instant::now();
    fill(&store, sessions).await;
    eprintln!(
        "{backend:?}: {sessions} sessions filled in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    time_lists(&store, sessions, runs).await;
    store.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: cargo test --release --lib search_speed -- --ignored --nocapture (KB_BENCH_BACKEND=postgres for PostgreSQL)"]
async fn search_speed() {
    let backend = match std::env::var("KB_BENCH_BACKEND").as_deref() {
        Ok("postgres") => Backend::Postgres,
        _ => Backend::Sqlite,
    };
    measure(backend, 10_000, 50).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn search_speed_smoke() {
    measure(Backend::Sqlite, 500, 3).await;
}
