//! The recordings list, filtered and searched in the database: each filter, their
//! combinations, hostile search text, another user's sessions never found, the matches'
//! snippets.

use super::*;
use crate::recording::postgres::MIGRATIONS;
use crate::recording::search::{ListQuery, ListedRecording, MatchField, StateFilter};
use crate::recording::stored::StoredForkedFrom;
use crate::session::{EndedBy, FrontDoor, Metadata, Provenance};

/// One execution of session `k`, as a Jupyter client or an agent runs it: the request,
/// its printed text, an error if any, idle.
fn execute(store: &RecordingStore, k: &SessionKey, code: &str, out: &str, error: Option<&str>) {
    let req = msg(
        "execute_request",
        "",
        json!({"code": code, "silent": false}),
    );
    store.report_message(k.clone(), Direction::ToKernel, Channel::Shell, &req);
    let stream = msg(
        "stream",
        &req.msg_id,
        json!({"name": "stdout", "text": out}),
    );
    store.report_message(k.clone(), Direction::FromKernel, Channel::Iopub, &stream);
    if let Some(ename) = error {
        let e = msg(
            "error",
            &req.msg_id,
            json!({"ename": ename, "evalue": "it broke", "traceback": [format!("\u{1b}[31m{ename}\u{1b}[0m")]}),
        );
        store.report_message(k.clone(), Direction::FromKernel, Channel::Iopub, &e);
    }
    let status = if error.is_some() { "error" } else { "ok" };
    let reply = msg("execute_reply", &req.msg_id, json!({"status": status}));
    store.report_message(k.clone(), Direction::FromKernel, Channel::Shell, &reply);
    let idle = msg("status", &req.msg_id, json!({"execution_state": "idle"}));
    store.report_message(k.clone(), Direction::FromKernel, Channel::Iopub, &idle);
}

fn ids(found: &[ListedRecording]) -> Vec<Uuid> {
    found.iter().map(|l| l.info.id).collect()
}

async fn sessions_are_found_by_text_and_filters(backend: Backend) {
    // Common text (in more rows than the cap) is looked for another way: both find the same.
    for cap in [crate::recording::listing::CANDIDATES, 0] {
        found_by_text_and_filters(backend, cap).await;
    }
}

async fn found_by_text_and_filters(backend: Backend, cap: usize) {
    let store = open_store(backend, |_| {}).await;
    let t0 = Utc::now();
    let (a, b, c) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    let ka = key(a);
    let kb = SessionKey {
        created_at: ka.created_at + 1_000,
        ..key(b)
    };
    let kc = SessionKey {
        user: "bob".into(),
        ..key(c)
    };
    let metadata = Metadata::lenient([
        ("team".to_string(), "Ópera Blue".to_string()),
        ("client".to_string(), "my-agent".to_string()),
    ]);
    store.report_event(
        ka.clone(),
        LifecycleEvent::SessionCreated {
            kernel: "python3".into(),
            idle_timeout_seconds: None,
            provenance: Provenance::new(FrontDoor::E2b).with_metadata(metadata),
            forked_from: None,
            own_workspace: false,
        },
    );
    execute(
        &store,
        &ka,
        "print('Needle qz')",
        "Needle in the HAYSTACK, 100%_done\n",
        None,
    );
    execute(&store, &kb, "1 / 0", "", Some("ZeroDivisionError"));
    store.report_event(
        kb.clone(),
        LifecycleEvent::SessionClosed {
            by: EndedBy::Client(FrontDoor::Rest),
        },
    );
    execute(
        &store,
        &kc,
        "print('Needle')",
        "Needle in the HAYSTACK\n",
        None,
    );
    store.flush().await;

    let find = |f: &dyn Fn(&mut ListQuery)| {
        let mut q = ListQuery::of("alice", 200);
        f(&mut q);
        let store = store.store.clone();
        async move { store.find_capped(q, cap).await.unwrap() }
    };
    let text = |s: &'static str| move |q: &mut ListQuery| q.q = Some(s.to_string());

    // Unfiltered: alice's two, newest first; bob's never.
    let all = find(&|_| {}).await;
    assert_eq!(ids(&all), vec![b, a]);
    assert_eq!((all[0].errors, all[1].errors), (1, 0));
    assert_eq!(all[0].ended_by.as_deref(), Some("rest"));
    assert_eq!(all[1].ended_by, None);
    assert_eq!(all[1].front_door.as_deref(), Some("e2b"));
    assert_eq!(all[1].metadata["team"], "Ópera Blue");
    assert_eq!(all[1].metadata.len(), 2);
    assert_eq!(all[0].front_door, None);
    assert!(all[0].metadata.is_empty());
    assert!(all.iter().all(|l| l.matches.is_empty()));

    // Text: case-insensitive, in code, output and error; through the trigram index and,
    // shorter than three characters, without it.
    let found = find(&text("haystack")).await;
    assert_eq!(ids(&found), vec![a]);
    let m = &found[0].matches;
    assert_eq!(m.len(), 1, "{m:?}");
    assert_eq!(m[0].field, MatchField::Output);
    assert_eq!(m[0].snippet, "Needle in the HAYSTACK, 100%_done\n");
    let found = find(&text("NEEDLE")).await;
    assert_eq!(ids(&found), vec![a]);
    let fields: Vec<MatchField> = found[0].matches.iter().map(|m| m.field).collect();
    assert_eq!(fields, vec![MatchField::Code, MatchField::Output]);
    assert!(found[0].matches[0].seq < found[0].matches[1].seq);
    assert_eq!(ids(&find(&text("QZ")).await), vec![a]);
    let found = find(&text("zerodivision")).await;
    assert_eq!(ids(&found), vec![b]);
    assert_eq!(found[0].matches[0].field, MatchField::Error);
    assert_eq!(
        found[0].matches[0].snippet,
        "ZeroDivisionError: it broke\nZeroDivisionError"
    );

    // Hostile text is searched for, never obeyed.
    for (q, want) in [
        ("%", vec![a]),
        ("_", vec![a]),
        ("%_d", vec![a]),
        ("%%", Vec::<Uuid>::new()),
        ("\"", Vec::<Uuid>::new()),
        ("*", Vec::<Uuid>::new()),
        ("NEAR(", Vec::<Uuid>::new()),
        ("NEAR(needle haystack)", Vec::<Uuid>::new()),
        ("needle OR zero", Vec::<Uuid>::new()),
        ("needle*", Vec::<Uuid>::new()),
        ("text:needle", Vec::<Uuid>::new()),
        ("'", vec![a]),
        ("') OR 1=1 --", Vec::<Uuid>::new()),
        ("\\", Vec::<Uuid>::new()),
        ("\0", Vec::<Uuid>::new()),
    ] {
        let q = q.to_string();
        assert_eq!(ids(&find(&|l| l.q = Some(q.clone())).await), want, "{q:?}");
    }

    // Filters, alone and together.
    let state = |s| move |q: &mut ListQuery| q.state = Some(s);
    assert_eq!(ids(&find(&state(StateFilter::Live)).await), vec![a]);
    assert_eq!(ids(&find(&state(StateFilter::Ended)).await), vec![b]);
    assert_eq!(ids(&find(&state(StateFilter::Closed)).await), vec![b]);
    assert_eq!(
        ids(&find(&state(StateFilter::Expired)).await),
        Vec::<Uuid>::new()
    );
    assert_eq!(ids(&find(&|q| q.has_errors = Some(true)).await), vec![b]);
    assert_eq!(ids(&find(&|q| q.has_errors = Some(false)).await), vec![a]);
    assert_eq!(
        ids(&find(&|q| q.front_door = Some("rest".into())).await),
        Vec::<Uuid>::new()
    );
    assert_eq!(
        ids(&find(&|q| q.front_door = Some("e2b".into())).await),
        vec![a]
    );
    // Metadata values are searched.
    let found = find(&text("my-AGENT")).await;
    assert_eq!(ids(&found), vec![a]);
    assert_eq!(found[0].matches[0].field, MatchField::Metadata);
    assert_eq!(found[0].matches[0].snippet, "my-agent\nÓpera Blue");
    assert_eq!(ids(&find(&|q| q.since = Some(t0)).await), vec![b, a]);
    let later = Utc::now() + chrono::Duration::hours(1);
    assert_eq!(
        ids(&find(&|q| q.since = Some(later)).await),
        Vec::<Uuid>::new()
    );
    assert_eq!(
        ids(&find(&|q| q.until = Some(t0)).await),
        Vec::<Uuid>::new()
    );
    let between = crate::recording::from_micros(kb.created_at);
    assert_eq!(ids(&find(&|q| q.until = Some(between)).await), vec![a]);
    assert_eq!(ids(&find(&|q| q.since = Some(between)).await), vec![b]);
    assert_eq!(ids(&find(&|q| q.limit = 1).await), vec![b]);
    let both = |q: &mut ListQuery| {
        q.q = Some("zero".into());
        q.state = Some(StateFilter::Closed);
        q.has_errors = Some(true);
    };
    assert_eq!(ids(&find(&both).await), vec![b]);
    let none = |q: &mut ListQuery| {
        q.q = Some("zero".into());
        q.state = Some(StateFilter::Live);
    };
    assert_eq!(ids(&find(&none).await), Vec::<Uuid>::new());

    // Bob finds his own only.
    let mut q = ListQuery::of("bob", 10);
    q.q = Some("needle".into());
    assert_eq!(ids(&store.find_capped(q, cap).await.unwrap()), vec![c]);

    // A deleted recording leaves nothing in the index.
    assert!(store.delete(a).await.unwrap());
    assert_eq!(ids(&find(&text("needle")).await), Vec::<Uuid>::new());
    assert_eq!(
        scalar(
            &store,
            "SELECT count(*) FROM search_text WHERE text LIKE '%HAYSTACK%'"
        )
        .await,
        Some(1)
    );
    store.close().await;
}

on_both!(sessions_are_found_by_text_and_filters);

/// A PostgreSQL database of the recording's first version, with sessions in it: migrated,
/// its sessions get their failures, front door and closer, and their code, error names and
/// printed text are found.
#[tokio::test]
async fn a_postgres_database_of_version_1_is_migrated_and_indexed() {
    let url = crate::db::postgres::testing::fresh_database().await;
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    crate::db::postgres::migrate(&client, "test", "recording", &MIGRATIONS[..1])
        .await
        .unwrap();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let sid = |id: Uuid, created: i64, ended: Option<i64>| {
        let client = &client;
        async move {
            client
                .query_one(
                    r#"INSERT INTO sessions (id, "user", kernel, node, created_at, ended_at, end_reason)
                       VALUES ($1, 'alice', 'python3', 'n', $2, $3, CASE WHEN $3::BIGINT IS NULL THEN NULL ELSE 'closed' END)
                       RETURNING sid"#,
                    &[&id.to_string(), &created, &ended],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
        }
    };
    // Recent: the retention at start would delete an old ended one.
    let now = micros(Utc::now());
    let (sa, sb) = (
        sid(a, now, Some(now + 9)).await,
        sid(b, now + 1, None).await,
    );
    let event = |sid: i64, seq: i64, direction: &'static str, what: &'static str, content: &str| {
        let (client, content) = (&client, content.to_string());
        let (msg_type, kind) = if direction == "broker" {
            (None, Some(what))
        } else {
            (Some(what), None)
        };
        async move {
            client
                .execute(
                    "INSERT INTO events (sid, seq, time, direction, msg_type, kind, content)
                     VALUES ($1, $2, 0, $3, $4, $5, $6)",
                    &[&sid, &seq, &direction, &msg_type, &kind, &content],
                )
                .await
                .unwrap();
        }
    };
    event(
        sa,
        1,
        "broker",
        "session_created",
        r#"{"kernel": "python3", "front_door": "mcp", "metadata": {"client": "claude"}}"#,
    )
    .await;
    event(
        sa,
        2,
        "to_kernel",
        "execute_request",
        r#"{"code": "import pandas"}"#,
    )
    .await;
    event(
        sa,
        3,
        "from_kernel",
        "stream",
        r#"{"name": "stdout", "text": "Hello Output"}"#,
    )
    .await;
    event(
        sa,
        4,
        "from_kernel",
        "error",
        r#"{"ename": "ZeroDivisionError", "evalue": "division by zero"}"#,
    )
    .await;
    event(
        sa,
        5,
        "broker",
        "execution_done",
        r#"{"msg_id": "m", "outcome": {"status": "error"}}"#,
    )
    .await;
    event(
        sa,
        6,
        "broker",
        "execution_done",
        r#"{"msg_id": "n", "execution": {"status": "dead"}}"#,
    )
    .await;
    event(sa, 7, "broker", "session_closed", r#"{"by": "mcp"}"#).await;
    event(sb, 1, "to_kernel", "execute_request", "not json").await;
    event(sb, 2, "from_kernel", "stream", r#"{"text": "\u0000 nul"}"#).await;

    let mut cfg = RecordingConfig::new("unused.sqlite3");
    cfg.database_url = Some(url);
    let store = RecordingStore::open(cfg).unwrap();
    let find = |text: &str| {
        let mut q = ListQuery::of("alice", 10);
        q.q = Some(text.to_string());
        let store = store.clone();
        async move { store.find(q).await.unwrap() }
    };
    let all = store.find(ListQuery::of("alice", 10)).await.unwrap();
    assert_eq!(ids(&all), vec![b, a]);
    let old = &all[1];
    assert_eq!(old.errors, 2);
    assert_eq!(old.front_door.as_deref(), Some("mcp"));
    assert_eq!(old.metadata["client"], "claude");
    assert_eq!(old.ended_by.as_deref(), Some("mcp"));
    assert_eq!((all[0].errors, all[0].ended_by.as_deref()), (0, None));
    for (text, field) in [
        ("PANDAS", MatchField::Code),
        ("o outp", MatchField::Output),
        ("zerodivision", MatchField::Error),
    ] {
        let found = find(text).await;
        assert_eq!(ids(&found), vec![a], "{text}");
        assert_eq!(found[0].matches[0].field, field, "{text}");
    }
    store.close().await;
}

/// A fork's row names its parent, the parent's execution count and the checkpoint it was
/// forked from, as the list reads them back; a session that is not a fork names none.
async fn a_fork_is_listed_with_its_parent(backend: Backend) {
    let store = open_store(backend, |_| {}).await;
    let (parent, fork, live_fork) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    let kp = key(parent);
    let kf = SessionKey {
        created_at: kp.created_at + 1_000,
        ..key(fork)
    };
    let kl = SessionKey {
        created_at: kp.created_at + 2_000,
        ..key(live_fork)
    };
    let checkpoint = Uuid::new_v4();
    let created = |forked_from| LifecycleEvent::SessionCreated {
        kernel: "python3".into(),
        idle_timeout_seconds: None,
        provenance: Provenance::new(FrontDoor::Rest),
        forked_from,
        own_workspace: false,
    };
    store.report_event(kp.clone(), created(None));
    store.report_event(
        kf.clone(),
        created(Some(crate::session::lifecycle::ForkedFrom {
            session: parent,
            execution_count: 2,
            checkpoint: Some(checkpoint),
        })),
    );
    store.report_event(
        kl.clone(),
        created(Some(crate::session::lifecycle::ForkedFrom {
            session: parent,
            execution_count: 7,
            checkpoint: None,
        })),
    );
    store.flush().await;
    let all = store.find(ListQuery::of("alice", 10)).await.unwrap();
    assert_eq!(ids(&all), vec![live_fork, fork, parent]);
    let from = |i: usize| all[i].forked_from.clone();
    assert_eq!(
        from(1),
        Some(StoredForkedFrom {
            session: parent,
            execution_count: 2,
            checkpoint: Some(checkpoint),
        })
    );
    assert_eq!(
        from(0),
        Some(StoredForkedFrom {
            session: parent,
            execution_count: 7,
            checkpoint: None,
        })
    );
    assert_eq!(from(2), None);
}

on_both!(a_fork_is_listed_with_its_parent);

/// A PostgreSQL database of the recording's version 4 (before forks were kept in the list)
/// with a fork recorded in it: migrated, the fork's row names its parent, execution count
/// and checkpoint; the other sessions name none.
#[tokio::test]
async fn a_postgres_database_of_version_4_gets_its_forks_parents() {
    let url = crate::db::postgres::testing::fresh_database().await;
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    crate::db::postgres::migrate(&client, "test", "recording", &MIGRATIONS[..2])
        .await
        .unwrap();
    let (parent, fork, odd) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    let checkpoint = Uuid::new_v4();
    let now = micros(Utc::now());
    let mut sids = Vec::new();
    for (i, id) in [parent, fork, odd].iter().enumerate() {
        let sid: i64 = client
            .query_one(
                r#"INSERT INTO sessions (id, "user", kernel, node, created_at)
                   VALUES ($1, 'alice', 'python3', 'n', $2) RETURNING sid"#,
                &[&id.to_string(), &(now + i as i64)],
            )
            .await
            .unwrap()
            .get(0);
        sids.push(sid);
    }
    let contents = [
        json!({"kernel": "python3"}).to_string(),
        json!({"kernel": "python3", "forked_from": {
            "session": parent, "execution_count": 2, "checkpoint": checkpoint}})
        .to_string(),
        // Not what a broker writes: no parent.
        json!({"forked_from": "nonsense"}).to_string(),
    ];
    for (sid, content) in sids.iter().zip(&contents) {
        client
            .execute(
                "INSERT INTO events (sid, seq, time, direction, kind, content)
                 VALUES ($1, 1, 0, 'broker', 'session_created', $2)",
                &[sid, content],
            )
            .await
            .unwrap();
    }
    client
        .execute(
            "INSERT INTO events (sid, seq, time, direction, kind, content)
             VALUES ($1, 2, 0, 'broker', 'session_forked', $2)",
            &[
                &sids[0],
                &json!({"sessions": [fork], "execution_count": 2}).to_string(),
            ],
        )
        .await
        .unwrap();

    let mut cfg = RecordingConfig::new("unused.sqlite3");
    cfg.database_url = Some(url);
    let store = RecordingStore::open(cfg).unwrap();
    let all = store.find(ListQuery::of("alice", 10)).await.unwrap();
    assert_eq!(ids(&all), vec![odd, fork, parent]);
    assert_eq!(all[0].forked_from, None);
    assert_eq!(
        all[1].forked_from,
        Some(StoredForkedFrom {
            session: parent,
            execution_count: 2,
            checkpoint: Some(checkpoint),
        })
    );
    assert_eq!(all[2].forked_from, None);
    store.close().await;
}
