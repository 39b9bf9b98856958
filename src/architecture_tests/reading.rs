//! Reading the source as text: the files, their module paths, the paths they name
//! (`use` trees expanded), and the circles of a graph.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

pub(super) struct Source {
    /// The path below `src/`, e.g. `api/e2b/envd.rs`.
    pub(super) rel: PathBuf,
    /// The module path, e.g. `["api", "e2b", "envd"]` (`mod.rs`: its folder's).
    pub(super) module: Vec<String>,
    /// The code without comments and without a trailing `#[cfg(test)]` module.
    pub(super) code: String,
}

pub(super) fn sources() -> Vec<Source> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    collect(&root, &mut files);
    let mut out = Vec::new();
    for path in files {
        let rel = path.strip_prefix(&root).unwrap().to_path_buf();
        let name = rel.file_name().unwrap().to_str().unwrap();
        let in_testing = rel.components().any(|c| c.as_os_str() == "testing");
        let test_dir = rel.components().any(|c| {
            c.as_os_str() == "tests" || c.as_os_str().to_string_lossy().ends_with("_tests")
        });
        if name == "tests.rs" || name.ends_with("_tests.rs") || in_testing || test_dir {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let mut module: Vec<String> = rel
            .with_extension("")
            .components()
            .map(|c| c.as_os_str().to_str().unwrap().to_string())
            .collect();
        if matches!(
            module.last().map(String::as_str),
            Some("mod" | "lib" | "main")
        ) {
            module.pop();
        }
        out.push(Source {
            code: product_code(&text),
            rel,
            module,
        });
    }
    out
}

pub(super) fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            collect(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The text with `//` comments dropped and cut before a `#[cfg(test)]` inline module.
pub(super) fn product_code(text: &str) -> String {
    let mut code = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#[cfg(test)]") {
            let next = lines.peek().map(|l| l.trim_start()).unwrap_or("");
            if (next.starts_with("mod ") || next.starts_with("pub mod ")) && next.ends_with('{') {
                break;
            }
        }
        let kept = match line.find("//") {
            // `//` inside a string (a URL) is rare in code that names modules; a line cut
            // there loses only what follows it on that line.
            Some(i) => &line[..i],
            None => line,
        };
        code.push_str(kept);
        code.push('\n');
    }
    code
}

/// Every `crate::`, `super::` and `self::` path the code names, expanded from `use` trees
/// (`use crate::a::{b, c::d}` gives `crate::a::b` and `crate::a::c::d`).
pub(super) fn named_paths(code: &str) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    // Use declarations, whole (they may span lines).
    let mut rest = code;
    while let Some(i) = find_use(rest) {
        let after = &rest[i..];
        let end = after.find(';').unwrap_or(after.len());
        let tree: String = after["use ".len()..end]
            .replace(" as ", "@")
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect();
        expand(&tree, &mut Vec::new(), &mut paths);
        rest = &after[end..];
    }
    // Paths in code: `crate::x::y(...)`, `super::Thing`.
    let bytes = code.as_bytes();
    for start in ["crate::", "super::", "self::"] {
        let mut from = 0;
        while let Some(i) = code[from..].find(start) {
            let at = from + i;
            from = at + start.len();
            if at > 0 && (bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_') {
                continue;
            }
            let mut path = Vec::new();
            for seg in code[at..].split("::") {
                let ident: String = seg
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if ident.is_empty() {
                    break;
                }
                let whole = ident.len() == seg.len();
                path.push(ident);
                if !whole {
                    break;
                }
            }
            paths.push(path);
        }
    }
    paths
}

/// The paths of other crates the code names (`hyper::Client`, `use axum::{..}`): every
/// `name::` not preceded by an identifier character or `:`.
pub(super) fn crate_paths(code: &str) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let bytes = code.as_bytes();
    let mut from = 0;
    while let Some(i) = code[from..].find("::") {
        let at = from + i;
        from = at + 2;
        let start = code[..at]
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(0, |p| p + 1);
        if start == at || (start > 0 && bytes[start - 1] == b':') {
            continue;
        }
        paths.push(vec![code[start..at].to_string()]);
    }
    paths
}

/// The byte offset of the next `use ` declaration (at a line's start, `pub`/`pub(crate)` too).
pub(super) fn find_use(code: &str) -> Option<usize> {
    let mut offset = 0;
    for line in code.split_inclusive('\n') {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        for prefix in ["use ", "pub use ", "pub(crate) use ", "pub(super) use "] {
            if trimmed.starts_with(prefix) {
                return Some(offset + indent + prefix.len() - "use ".len());
            }
        }
        offset += line.len();
    }
    None
}

pub(super) fn expand(tree: &str, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    let tree = tree.trim_start_matches("::");
    if let Some(open) = tree.find('{') {
        let head: Vec<String> = tree[..open]
            .split("::")
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
        let depth = prefix.len();
        prefix.extend(head);
        for part in split_top(inner) {
            expand(part, prefix, out);
        }
        prefix.truncate(depth);
    } else {
        let mut path = prefix.clone();
        let plain = tree.split('@').next().unwrap_or(tree);
        path.extend(
            plain
                .split("::")
                .filter(|s| !s.is_empty() && *s != "*" && *s != "self")
                .map(String::from),
        );
        out.push(path);
    }
}

/// Splits `a, b::{c, d}, e` at its top-level commas.
pub(super) fn split_top(s: &str) -> Vec<&str> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts.into_iter().filter(|p| !p.is_empty()).collect()
}

/// A named path made absolute (from the crate root), given the naming module.
pub(super) fn absolute(path: &[String], module: &[String]) -> Option<Vec<String>> {
    let first = path.first()?;
    // In `a/b.rs` and in `a/b/mod.rs` (both module a::b) `super` is `a`.
    let mut base: Vec<String> = match first.as_str() {
        "crate" => Vec::new(),
        "self" => module.to_vec(),
        "super" => module.to_vec(),
        _ => return None,
    };
    let mut rest = &path[1..];
    if first == "super" {
        base.pop()?;
    }
    while rest.first().is_some_and(|s| s == "super") {
        base.pop()?;
        rest = &rest[1..];
    }
    base.extend(rest.iter().cloned());
    Some(base)
}

/// The strongly connected components of more than one node (Tarjan).
pub(super) fn strongly_connected(edges: &[BTreeSet<usize>]) -> Vec<Vec<usize>> {
    struct State<'a> {
        edges: &'a [BTreeSet<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(s: &mut State, v: usize) {
        s.index[v] = Some(s.next);
        s.low[v] = s.next;
        s.next += 1;
        s.stack.push(v);
        s.on_stack[v] = true;
        for &w in s.edges[v].iter() {
            match s.index[w] {
                None => {
                    visit(s, w);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on_stack[w] => s.low[v] = s.low[v].min(iw),
                _ => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack[w] = false;
                component.push(w);
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.out.push(component);
            }
        }
    }
    let n = edges.len();
    let mut s = State {
        edges,
        index: vec![None; n],
        low: vec![0; n],
        on_stack: vec![false; n],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if s.index[v].is_none() {
            visit(&mut s, v);
        }
    }
    s.out
}

/// Whether the fn signature starting at line `n` returns `Result<_, String>`.
pub(super) fn signature_returns_string_error(code: &str, n: usize) -> bool {
    let sig: String = code.lines().skip(n).take(12).collect::<Vec<_>>().join(" ");
    let sig = sig.split('{').next().unwrap_or("");
    let sig: String = sig.chars().filter(|c| !c.is_whitespace()).collect();
    let Some(ret) = sig.split("->").nth(1) else {
        return false;
    };
    ret.starts_with("Result<") && ret.trim_end_matches(|c| c != '>').ends_with(",String>")
}
