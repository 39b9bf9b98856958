//! The invariants of ARCHITECTURE.md that the source text can show, checked on every test
//! run: a change that breaks one fails here, naming the file. Product code only: test files
//! (`tests.rs`, `*_tests.rs`, `testing/`) and the `#[cfg(test)]` module at the end of a
//! file are left out, and comments are dropped before anything is read.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

mod reading;

use reading::{
    absolute, collect, crate_paths, named_paths, product_code, signature_returns_string_error,
    sources, strongly_connected,
};

/// Each top-level module and the top-level modules it may name (`crate::<module>`): the
/// layers, bottom up. A module not listed here fails the layering test until it is placed.
const LAYERS: &[(&str, &[&str])] = &[
    ("sync", &[]),
    ("descriptors", &[]),
    ("private_file", &[]),
    ("instance_lock", &[]),
    ("kept_token", &["private_file"]),
    ("cli", &["kept_token"]),
    ("wire", &["sync"]),
    ("kernel", &["wire", "sync", "descriptors"]),
    ("egress", &["sync"]),
    (
        "sandbox",
        &[
            "kernel",
            "egress",
            "wire",
            "sync",
            "descriptors",
            "private_file",
        ],
    ),
    ("policy", &[]),
    ("secrets", &["sandbox", "wire", "private_file", "sync"]),
    (
        "session",
        &[
            "policy",
            "secrets",
            "sandbox",
            "kernel",
            "egress",
            "wire",
            "sync",
            "descriptors",
            "private_file",
        ],
    ),
    ("db", &["sync"]),
    ("recording", &["db", "session", "wire", "sync"]),
    ("cluster", &["db", "sync"]),
    ("replay", &["recording", "session", "wire", "sync"]),
    (
        "api",
        &[
            "policy",
            "secrets",
            "cluster",
            "replay",
            "recording",
            "session",
            "egress",
            "kernel",
            "wire",
            "sync",
            "descriptors",
        ],
    ),
    (
        "config",
        &[
            "policy",
            "secrets",
            "cli",
            "api",
            "cluster",
            "recording",
            "session",
            "sandbox",
            "egress",
        ],
    ),
    ("mcp_stdio", &["config"]),
    (
        "server",
        &[
            "policy",
            "secrets",
            "config",
            "api",
            "cluster",
            "replay",
            "recording",
            "session",
            "sandbox",
            "egress",
            "kernel",
            "descriptors",
            "instance_lock",
            "kept_token",
            "sync",
        ],
    ),
];

/// The longest a source file may grow: past it, split it by concept.
const MAX_LINES: usize = 600;

#[test]
fn layers_only_name_the_layers_below_them() {
    let allowed: BTreeMap<&str, BTreeSet<&str>> = LAYERS
        .iter()
        .map(|(m, below)| (*m, below.iter().copied().collect()))
        .collect();
    let mut wrong = BTreeSet::new();
    for src in sources() {
        let Some(top) = src.module.first().map(String::as_str) else {
            continue; // lib.rs
        };
        let Some(may) = allowed.get(top) else {
            wrong.insert(format!(
                "src/{}: the module `{top}` has no place in the layers (architecture_tests::LAYERS)",
                src.rel.display()
            ));
            continue;
        };
        for path in named_paths(&src.code) {
            let Some(abs) = absolute(&path, &src.module) else {
                continue;
            };
            let Some(named) = abs.first().map(String::as_str) else {
                continue;
            };
            if named != top && allowed.contains_key(named) && !may.contains(named) {
                wrong.insert(format!(
                    "src/{} names crate::{} (`{top}` may name only {:?})",
                    src.rel.display(),
                    abs.join("::"),
                    may
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "layering broken:\n{}", join(&wrong));
}

#[test]
fn no_two_files_import_each_other_in_a_circle() {
    let srcs = sources();
    let modules: BTreeMap<Vec<String>, usize> = srcs
        .iter()
        .enumerate()
        .map(|(i, s)| (s.module.clone(), i))
        .collect();
    // The file a path lands in: the longest module prefix that is a file of its own.
    let file_of = |path: &[String]| -> Option<usize> {
        (1..=path.len())
            .rev()
            .find_map(|n| modules.get(&path[..n]).copied())
    };
    let mut edges: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); srcs.len()];
    for (i, src) in srcs.iter().enumerate() {
        for path in named_paths(&src.code) {
            let Some(abs) = absolute(&path, &src.module) else {
                continue;
            };
            let Some(j) = file_of(&abs) else { continue };
            // A folder's mod.rs declares and re-exports its files: that is not a use of them.
            if j != i && !srcs[j].module.starts_with(&src.module) {
                edges[i].insert(j);
            }
        }
    }
    let circles = strongly_connected(&edges);
    let described: BTreeSet<String> = circles
        .iter()
        .map(|c| {
            let names: Vec<String> = c
                .iter()
                .map(|&i| format!("src/{}", srcs[i].rel.display()))
                .collect();
            names.join(" <-> ")
        })
        .collect();
    assert!(
        described.is_empty(),
        "files that import each other in a circle (move what they share to a file of its own):\n{}",
        join(&described)
    );
}

#[test]
fn no_source_file_is_longer_than_the_limit() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    collect(&root, &mut files);
    let long: BTreeSet<String> = files
        .iter()
        .filter_map(|p| {
            let n = std::fs::read_to_string(p).unwrap().lines().count();
            (n > MAX_LINES).then(|| format!("{} ({n} lines)", p.display()))
        })
        .collect();
    assert!(
        long.is_empty(),
        "split these by concept (at most {MAX_LINES} lines a file):\n{}",
        join(&long)
    );
}

/// `src/<file> names <needle>` for each file `select` takes (by its module path) whose code
/// holds one of `needles`.
fn naming(select: impl Fn(&[String]) -> bool, needles: &[&str]) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for src in sources().iter().filter(|s| select(&s.module)) {
        for needle in needles.iter().filter(|n| src.code.contains(*n)) {
            found.insert(format!("src/{} names {needle}", src.rel.display()));
        }
    }
    found
}

#[test]
fn the_wire_layer_does_no_io() {
    let io = [
        "tokio",
        "std::fs",
        "std::net",
        "std::io::Read",
        "std::io::Write",
        "zeromq",
    ];
    let wrong = naming(|m| m.first().is_some_and(|t| t == "wire"), &io);
    assert!(
        wrong.is_empty(),
        "the wire layer must do no I/O:\n{}",
        join(&wrong)
    );
}

/// The decoders the fuzz harness compiles from their own files (`fuzz/src/lib.rs`), without
/// the rest of the crate: each may name only these modules.
const STANDALONE: &[&[&str]] = &[
    &["wire"],
    &["kernel", "zmtp"],
    &["api", "jupyter", "framing"],
    &["api", "stream", "frame"],
];

#[test]
fn the_fuzzed_decoders_stand_alone() {
    let standalone = |m: &[String]| {
        STANDALONE
            .iter()
            .any(|s| m.starts_with(&s.iter().map(|p| p.to_string()).collect::<Vec<_>>()))
    };
    let mut wrong = BTreeSet::new();
    let mut seen = 0;
    for src in sources()
        .iter()
        .filter(|s| standalone(&s.module) && s.module.last().is_none_or(|m| m != "tests"))
    {
        seen += 1;
        for path in named_paths(&src.code) {
            if let Some(target) = absolute(&path, &src.module) {
                if !standalone(&target) {
                    wrong.insert(format!(
                        "src/{} names crate::{}",
                        src.rel.display(),
                        target.join("::")
                    ));
                }
            }
        }
    }
    assert!(seen >= 8, "the standalone files were not found ({seen})");
    assert!(
        wrong.is_empty(),
        "the fuzz harness compiles these files alone (fuzz/src/lib.rs):\n{}",
        join(&wrong)
    );
}

#[test]
fn only_the_api_serves_http() {
    // The web framework (routes, extractors, responses) is the api layer's; server.rs only
    // hands it the listener.
    let outside = |m: &[String]| !matches!(m.first().map(String::as_str), Some("api" | "server"));
    let wrong = naming(outside, &["axum::", "utoipa::", "tower_http::"]);
    assert!(
        wrong.is_empty(),
        "HTTP serving outside src/api:\n{}",
        join(&wrong)
    );
}

#[test]
fn the_cluster_names_no_http_crate() {
    // Its requests to peers are the api layer's (api/cluster/peer.rs).
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
    let wrong = paths_named_in("cluster", |path| {
        path.first()
            .is_some_and(|c| http.contains(&c.as_str()))
            .then(|| path.join("::"))
    });
    assert!(
        wrong.is_empty(),
        "HTTP in the cluster layer:\n{}",
        join(&wrong)
    );
}

/// `src/<file> names <what>` for every path (of this crate, resolved, or of another crate)
/// that a file of the top-level module `top` names and `bad` describes.
fn paths_named_in(top: &str, bad: impl Fn(&[String]) -> Option<String>) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for src in sources()
        .iter()
        .filter(|s| s.module.first().is_some_and(|m| m == top))
    {
        let ours = named_paths(&src.code).into_iter().filter_map(|p| {
            absolute(&p, &src.module).map(|a| [vec!["crate".to_string()], a].concat())
        });
        for path in ours.chain(crate_paths(&src.code)) {
            if let Some(what) = bad(&path) {
                found.insert(format!("src/{} names {what}", src.rel.display()));
            }
        }
    }
    found
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

#[test]
fn the_session_layer_names_no_sandbox_backend() {
    let wrong = paths_named_in("session", |path| {
        (path.len() > 2
            && path[0] == "crate"
            && path[1] == "sandbox"
            && matches!(path[2].as_str(), "local" | "docker"))
        .then(|| path.join("::"))
    });
    assert!(
        wrong.is_empty(),
        "the session layer holds an Arc<dyn Sandbox>:\n{}",
        join(&wrong)
    );
}

#[test]
fn errors_crossing_a_module_are_typed() {
    // A function other modules call returns an error type that keeps its cause and can be
    // matched on, never a bare String.
    let mut wrong = BTreeSet::new();
    for src in sources() {
        for (n, line) in src.code.lines().enumerate() {
            let t = line.trim_start();
            let public = t.starts_with("pub fn ")
                || t.starts_with("pub async fn ")
                || t.starts_with("pub(crate) fn ")
                || t.starts_with("pub(crate) async fn ")
                || t.starts_with("pub(super) fn ")
                || t.starts_with("pub(super) async fn ");
            if public && signature_returns_string_error(&src.code, n) {
                wrong.insert(format!("src/{}:{}: {}", src.rel.display(), n + 1, t.trim()));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "Result<_, String> across modules:\n{}",
        join(&wrong)
    );
}

fn join(set: &BTreeSet<String>) -> String {
    set.iter()
        .map(|s| format!("  {s}"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_checks_see_what_they_look_for() {
    // The readers themselves: a circle, a use tree and a string error are found.
    let paths = named_paths("use crate::a::{b, c::{d, e as f}};\nfn x() { super::g::h(); }\n");
    assert!(paths.contains(&vec!["crate".into(), "a".into(), "b".into()]));
    assert!(paths.contains(&vec!["crate".into(), "a".into(), "c".into(), "e".into()]));
    assert!(paths.contains(&vec!["super".into(), "g".into(), "h".into()]));
    let module = vec!["api".to_string(), "e2b".to_string(), "envd".to_string()];
    assert_eq!(
        absolute(&["super".into(), "state".into()], &module),
        Some(vec!["api".into(), "e2b".into(), "state".into()])
    );
    let edges = vec![
        BTreeSet::from([1]),
        BTreeSet::from([0]),
        BTreeSet::from([0]),
    ];
    assert_eq!(strongly_connected(&edges), vec![vec![0, 1]]);
    let crates = crate_paths("use hyper::Client;\nlet b = axum::body::Body::empty();");
    assert_eq!(
        crates,
        vec![vec!["hyper".to_string()], vec!["axum".to_string()]]
    );
    assert!(signature_returns_string_error(
        "pub fn f(x: u8)\n    -> Result<Vec<u8>, String> {",
        0
    ));
    assert!(!signature_returns_string_error(
        "pub fn f() -> Result<String, Error> {",
        0
    ));
    assert_eq!(
        product_code("a // crate::x\n#[cfg(test)]\nmod tests {\nuse crate::y;\n}\n"),
        "a \n"
    );
}
