//! The cluster's concepts against a real PostgreSQL, without brokers: two nodes of one
//! database, driven by hand (the upkeep runs too, but its lease is long).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use uuid::Uuid;

use super::*;
use crate::db::postgres::testing::fresh_database;

fn config(url: &str, node: &str) -> ClusterConfig {
    ClusterConfig {
        database_url: url.to_string(),
        node_id: node.to_string(),
        advertise_url: format!("http://{node}.invalid:8080"),
        lease: Duration::from_secs(60),
        session_capacity: 10,
        memory_capacity: Some(1 << 30),
        carry_paused: false,
        carry_key: None,
    }
}

async fn two_nodes() -> (Arc<Cluster>, Arc<Cluster>) {
    let url = fresh_database().await;
    let a = Cluster::join(config(&url, "a")).await.unwrap();
    let b = Cluster::join(config(&url, "b")).await.unwrap();
    (a, b)
}

fn alices(id: Uuid) -> Vec<Listed> {
    vec![Listed {
        id,
        user: "alice".into(),
        kernel: "python3".into(),
        created_at: 1,
        paused: false,
    }]
}

#[tokio::test]
async fn the_directory_names_the_node_that_holds_a_session_until_it_is_lost() {
    let (a, b) = two_nodes().await;
    assert_eq!(a.key(), b.key(), "one key for the cluster");
    let id = Uuid::new_v4();
    let paused = Uuid::new_v4();
    a.set_listed(move || {
        let mut l = alices(id);
        l.push(Listed {
            id: paused,
            paused: true,
            ..l[0].clone()
        });
        l
    });
    a.write_directory().await.unwrap();
    assert_eq!(
        b.directory(id, "alice").await.unwrap(),
        Directory::At("http://a.invalid:8080".into())
    );
    assert_eq!(b.directory(id, "bob").await.unwrap(), Directory::Unknown);
    assert_eq!(
        a.directory(id, "alice").await.unwrap(),
        Directory::Unknown,
        "held here"
    );
    assert_eq!(
        b.peers()
            .await
            .iter()
            .map(|p| p.id.as_str())
            .collect::<Vec<_>>(),
        ["a"]
    );

    // `a` stops renewing: `b` declares it lost and has its recordings closed.
    let closed = Arc::new(Mutex::new(Vec::new()));
    let seen = closed.clone();
    b.on_node_lost(Box::new(move |_client, node, kept| {
        seen.lock().unwrap().push((node.to_string(), kept.to_vec()));
        Box::pin(async { Ok(1) })
    }));
    b.client()
        .await
        .unwrap()
        .execute("UPDATE nodes SET lease_until = 0 WHERE id = 'a'", &[])
        .await
        .unwrap();
    b.sweep_lost().await.unwrap();
    assert_eq!(
        *closed.lock().unwrap(),
        [("a".to_string(), vec![paused.to_string()])],
        "its recordings closed, but the paused session's"
    );
    assert!(matches!(
        b.directory(id, "alice").await.unwrap(),
        Directory::Lost {
            kernel,
            created_at: 1,
            ..
        } if kernel == "python3"
    ));
    // The paused session's state is on a's disk: away, not dead.
    assert_eq!(
        b.directory(paused, "alice").await.unwrap(),
        Directory::Away {
            node: "a".into(),
            carried: false
        }
    );
    assert!(b.fresh_peers().await.is_empty());
    assert!(!a.renew().await.unwrap(), "a learns it was declared lost");
    assert_eq!(a.declared_dead_here().await.unwrap(), [id]);

    // a joins again: lost is final (its directory write does not bring `id` back), and the
    // paused session is served by a again.
    a.register().await.unwrap();
    a.write_directory().await.unwrap();
    assert!(matches!(
        b.directory(id, "alice").await.unwrap(),
        Directory::Lost { .. }
    ));
    assert_eq!(
        b.directory(paused, "alice").await.unwrap(),
        Directory::At("http://a.invalid:8080".into())
    );
}

#[tokio::test]
async fn a_new_session_goes_to_the_node_with_the_most_headroom() {
    let (a, b) = two_nodes().await;
    b.set_load(|| Load {
        sessions: 5,
        memory_reserved: 0,
    });
    assert!(a.renew().await.unwrap() && b.renew().await.unwrap());
    let placed = b.place(1 << 20).await.map(|p| p.id);
    assert_eq!(placed.as_deref(), Some("a"), "b is half full, a empty");
    assert!(
        a.place(1 << 20).await.is_none(),
        "a has the most room itself"
    );

    b.drain().await.unwrap();
    assert!(b.is_draining());
    assert!(
        a.place(1 << 20).await.is_none(),
        "a draining node takes no new session"
    );
    let placed = b.place(1 << 20).await.map(|p| p.id);
    assert_eq!(
        placed.as_deref(),
        Some("a"),
        "a draining node places elsewhere"
    );
}

#[tokio::test]
async fn a_users_creation_lock_is_let_go_when_dropped_even_while_it_waits() {
    let (a, b) = two_nodes().await;
    let held = a.lock_user("alice").await.unwrap();
    // Another user's lock is not held up.
    let bobs = tokio::time::timeout(Duration::from_secs(10), b.lock_user("bob")).await;
    drop(bobs.expect("bob's lock is his own").unwrap());
    // A creation that gives up waiting (its request dropped) ...
    let waited = tokio::time::timeout(Duration::from_millis(300), b.lock_user("alice")).await;
    assert!(waited.is_err(), "alice's lock is held");
    drop(held);
    // ... holds nothing once the lock it waited for is granted; and each lock is let go
    // before its connection is used again (a connection keeps advisory locks).
    for node in [&b, &b, &a, &b] {
        let again = tokio::time::timeout(Duration::from_secs(10), node.lock_user("alice")).await;
        drop(again.expect("alice's lock was left held").unwrap());
    }
}
