//! Checks of the layering that no compiler enforces, read from the sources: the cluster
//! knows no HTTP (its requests to peers are the api layer's), the recording and the cluster
//! do not know each other, the database layer knows neither; and the owners' PostgreSQL
//! migrations make one sequence of versions.

use std::path::PathBuf;

/// The `.rs` files under `src/<dir>`, with their text (each file's path relative to `src`).
fn sources(dir: &str) -> Vec<(String, String)> {
    let root = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/src"));
    let mut stack = vec![root.join(dir)];
    let mut files = Vec::new();
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                let name = path.strip_prefix(&root).unwrap().display().to_string();
                files.push((name, text));
            }
        }
    }
    assert!(!files.is_empty(), "no sources under src/{dir}");
    files
}

/// The places in `text` where a path starts with one of `crates` (`name::` after anything
/// but a letter, digit, `_` or `:`): a use or a path of that crate or module.
fn names(text: &str, crates: &[&str]) -> Vec<String> {
    let mut found = Vec::new();
    for (n, line) in text.lines().enumerate() {
        for c in crates {
            let needle = format!("{c}::");
            let mut from = 0;
            while let Some(i) = line[from..].find(&needle) {
                let at = from + i;
                let before = line[..at].chars().next_back();
                if !before.is_some_and(|b| b.is_alphanumeric() || b == '_' || b == ':') {
                    found.push(format!("line {}: {}", n + 1, line.trim()));
                }
                from = at + needle.len();
            }
        }
    }
    found
}

#[test]
fn the_cluster_names_no_http_crate() {
    let http = [
        "axum",
        "hyper",
        "hyper_util",
        "http",
        "http_body",
        "http_body_util",
        "reqwest",
        "tower",
        "tower_http",
    ];
    for (file, text) in sources("cluster") {
        let found = names(&text, &http);
        assert!(found.is_empty(), "{file} names an HTTP crate: {found:?}");
    }
}

#[test]
fn the_recording_and_the_cluster_do_not_import_each_other() {
    for (file, text) in sources("cluster") {
        let found = names(&text, &["crate::recording", "recording"]);
        assert!(found.is_empty(), "{file} names the recording: {found:?}");
    }
    for (file, text) in sources("recording") {
        let found = names(&text, &["crate::cluster", "cluster"]);
        assert!(found.is_empty(), "{file} names the cluster: {found:?}");
    }
    for (file, text) in sources("db") {
        let found = names(
            &text,
            &["crate::cluster", "crate::recording", "cluster", "recording"],
        );
        assert!(found.is_empty(), "{file} names a layer above it: {found:?}");
    }
}

#[test]
fn names_finds_paths_not_words() {
    assert_eq!(names("use hyper::Client;", &["hyper"]).len(), 1);
    assert_eq!(
        names("let x = axum::body::Body::empty();", &["axum"]).len(),
        1
    );
    assert_eq!(
        names("use crate::recording::close;", &["crate::recording"]).len(),
        1
    );
    assert!(names("//! `http://HOST:PORT`", &["http"]).is_empty());
    assert!(names("use hyper_util::rt;", &["hyper"]).is_empty());
    assert!(names("use crate::db::postgres::pool;", &["postgres"]).is_empty());
}

#[test]
fn every_schema_version_has_one_owner() {
    let mut versions: Vec<i64> = crate::recording::POSTGRES_MIGRATIONS
        .iter()
        .chain(crate::cluster::schema::MIGRATIONS)
        .map(|m| m.version)
        .collect();
    versions.sort();
    let want: Vec<i64> = (1..=crate::db::postgres::SCHEMA_VERSION).collect();
    assert_eq!(versions, want);
}
