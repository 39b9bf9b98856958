//! What an expression may name, as dotted paths: `o.system` is `os.system` after
//! `import os as o`. Flat: the cell's import aliases and simple assignments (`s = os.system`,
//! `a, b = x, y`, `(s := os.system)`) count everywhere in it, and a name keeps its own meaning
//! too (a builtin, or a module an earlier cell imported), so a name may have several paths.
//! Some literal lookups resolve: `getattr(x, "n")`, `__import__("m")`,
//! `importlib.import_module("m")`, `builtins.x`, `__builtins__["x"]`, `globals()["x"]`,
//! `vars(x)["n"]`, `x.__dict__["n"]`, `sys.modules["m"]`, `[os.system][0]`.

use std::borrow::Cow;
use std::collections::HashMap;

use ruff_python_ast::visitor::{self, Visitor};
use ruff_python_ast::{Expr, ExprCall, Stmt};

use super::finding::MAX_TREE_DEPTH;
use super::literal::{argument, literal_str};
use super::pattern::Pattern;
use super::Rule;

/// The builtins module's path; `builtins.x` is `x`.
const BUILTINS: &str = "builtins";
/// What `globals()`, `locals()` and `vars()` return.
const NAMESPACE: &str = "globals()";
/// What `get_ipython()` returns.
pub(super) const SHELL: &str = "get_ipython()";

pub(super) const GET_IPYTHON: &[&str] = &[
    "get_ipython",
    "IPython.get_ipython",
    "IPython.core.getipython.get_ipython",
    "IPython.InteractiveShell.instance",
    "IPython.core.interactiveshell.InteractiveShell.instance",
    "ipykernel.zmqshell.ZMQInteractiveShell.instance",
];
pub(super) const IMPORT_FUNCTIONS: &[&str] = &[
    "__import__",
    "importlib.__import__",
    "importlib.import_module",
    "runpy.run_module",
];

/// The first parts of the paths worth keeping whatever the rules: the ones the checks look
/// for themselves (`getattr`, `__import__`, `get_ipython()`, `sys.modules` …).
const ROOTS: &str = "builtins __dict__ globals() get_ipython() sys importlib runpy inspect \
    operator timeit cProfile profile pdb IPython ipykernel getattr setattr delattr hasattr vars \
    globals locals __import__ exec eval compile get_ipython";

/// Which paths can matter: those whose first part a rule's pattern or [`ROOTS`] has. The
/// others (most names of a cell) are dropped as they are found, which keeps the paths of a
/// name assigned many times in a long cell few.
pub(super) struct Roots {
    patterns: Vec<Pattern>,
}

impl Roots {
    pub(super) fn new(rules: &[&Rule]) -> Roots {
        let patterns = rules.iter().flat_map(|r| r.imports.iter().chain(&r.calls));
        Roots {
            patterns: patterns.map(Pattern::first).collect(),
        }
    }

    fn keep(&self, path: &str) -> bool {
        let root = path.split('.').next().unwrap_or(path);
        ROOTS.split_whitespace().any(|r| r == root)
            || self.patterns.iter().any(|p| p.matches_whole(root))
    }
}

/// The most paths one expression may have (more is refused: too many meanings to check).
const MAX_PATHS: usize = 64;
/// The deepest expression resolved (deeper has no path: `a.b.c…` of 32 attributes).
const MAX_DEPTH: u32 = 32;
/// The most steps to resolve one expression.
const MAX_STEPS: u32 = 10_000;

/// An expression with too many meanings, or too much work to find them.
#[derive(Debug)]
pub(super) struct TooMany;

enum Bound<'a> {
    Path(String),
    Expr(&'a Expr),
}

/// The bindings of one cell.
#[derive(Default)]
pub(super) struct Bindings<'a> {
    names: HashMap<&'a str, Vec<Bound<'a>>>,
    /// The modules of `from m import *`.
    star: Vec<&'a str>,
    /// The depth of the walk (bounded like the check's).
    depth: u32,
}

impl<'a> Bindings<'a> {
    pub(super) fn collect(body: &'a [Stmt]) -> Bindings<'a> {
        let mut bindings = Bindings::default();
        bindings.visit_body(body);
        bindings
    }

    fn bind(&mut self, target: &'a Expr, value: &'a Expr) {
        match (target, value) {
            (Expr::Name(name), _) => {
                self.names
                    .entry(name.id.as_str())
                    .or_default()
                    .push(Bound::Expr(value));
            }
            (Expr::Tuple(t), Expr::Tuple(v)) if t.elts.len() == v.elts.len() => {
                t.elts
                    .iter()
                    .zip(&v.elts)
                    .for_each(|(t, v)| self.bind(t, v));
            }
            (Expr::List(t), Expr::List(v)) if t.elts.len() == v.elts.len() => {
                t.elts
                    .iter()
                    .zip(&v.elts)
                    .for_each(|(t, v)| self.bind(t, v));
            }
            _ => {}
        }
    }
}

impl<'a> Visitor<'a> for Bindings<'a> {
    fn visit_stmt(&mut self, stmt: &'a Stmt) {
        match stmt {
            Stmt::Import(import) => {
                for alias in &import.names {
                    if let Some(asname) = &alias.asname {
                        let path = Bound::Path(alias.name.as_str().to_owned());
                        self.names.entry(asname.as_str()).or_default().push(path);
                    }
                }
            }
            Stmt::ImportFrom(import) if import.level == 0 => {
                let Some(module) = &import.module else { return };
                for alias in &import.names {
                    let name = alias.name.as_str();
                    if name == "*" {
                        self.star.push(module.as_str());
                    } else {
                        let bound = alias.asname.as_ref().map_or(name, |a| a.as_str());
                        let path = Bound::Path(format!("{}.{name}", module.as_str()));
                        self.names.entry(bound).or_default().push(path);
                    }
                }
            }
            Stmt::Assign(assign) => {
                assign
                    .targets
                    .iter()
                    .for_each(|t| self.bind(t, &assign.value));
            }
            Stmt::AnnAssign(assign) => {
                if let Some(value) = &assign.value {
                    self.bind(&assign.target, value);
                }
            }
            _ => {}
        }
        if self.depth < MAX_TREE_DEPTH {
            self.depth += 1;
            visitor::walk_stmt(self, stmt);
            self.depth -= 1;
        }
    }

    fn visit_expr(&mut self, expr: &'a Expr) {
        if let Expr::Named(named) = expr {
            self.bind(&named.target, &named.value);
        }
        if self.depth < MAX_TREE_DEPTH {
            self.depth += 1;
            visitor::walk_expr(self, expr);
            self.depth -= 1;
        }
    }
}

/// `path.attr`, where `builtins.attr` is `attr`.
fn join(path: &str, attr: &str) -> String {
    if path == BUILTINS {
        attr.to_owned()
    } else {
        format!("{path}.{attr}")
    }
}

/// Resolves expressions of one cell against its bindings.
pub(super) struct Resolver<'b, 'a> {
    bindings: &'b Bindings<'a>,
    roots: &'b Roots,
    cache: HashMap<&'a str, Vec<String>>,
    in_progress: Vec<&'a str>,
    steps: u32,
}

impl<'b, 'a> Resolver<'b, 'a> {
    pub(super) fn new(bindings: &'b Bindings<'a>, roots: &'b Roots) -> Self {
        Resolver {
            bindings,
            roots,
            cache: HashMap::new(),
            in_progress: Vec::new(),
            steps: 0,
        }
    }

    /// Whether `expr` is a name the cell binds (an import or an assignment may have made
    /// `compile` `re.compile`).
    pub(super) fn rebound(&self, expr: &Expr) -> bool {
        let bound = |name: &str| self.bindings.names.contains_key(name);
        matches!(expr, Expr::Name(n) if bound(n.id.as_str()) || !self.bindings.star.is_empty())
    }

    /// The paths `expr` may name (none: nothing known).
    pub(super) fn resolve(&mut self, expr: &'a Expr) -> Result<Vec<String>, TooMany> {
        self.steps = 0;
        self.expr(expr, 0)
    }

    fn expr(&mut self, expr: &'a Expr, depth: u32) -> Result<Vec<String>, TooMany> {
        self.steps += 1;
        if self.steps > MAX_STEPS {
            return Err(TooMany);
        }
        if depth > MAX_DEPTH {
            return Ok(Vec::new());
        }
        let mut paths = match expr {
            Expr::Name(name) => self.name(name.id.as_str())?,
            Expr::Attribute(a) => {
                let value = self.expr(&a.value, depth + 1)?;
                value.iter().map(|p| join(p, a.attr.as_str())).collect()
            }
            Expr::Call(call) => self.call(call, depth)?,
            Expr::Subscript(s) => self.subscript(&s.value, &s.slice, depth)?,
            Expr::Named(named) => self.expr(&named.value, depth + 1)?,
            Expr::If(e) => self.union([&*e.body, &*e.orelse], depth)?,
            Expr::BoolOp(e) => self.union(&e.values, depth)?,
            _ => Vec::new(),
        };
        paths.retain(|path| self.roots.keep(path));
        if paths.len() > MAX_PATHS {
            return Err(TooMany);
        }
        Ok(paths)
    }

    fn union(
        &mut self,
        exprs: impl IntoIterator<Item = &'a Expr>,
        depth: u32,
    ) -> Result<Vec<String>, TooMany> {
        let mut paths = Vec::new();
        for expr in exprs {
            paths.extend(self.expr(expr, depth + 1)?);
            if paths.len() > MAX_PATHS {
                return Err(TooMany);
            }
        }
        Ok(paths)
    }

    fn name(&mut self, id: &'a str) -> Result<Vec<String>, TooMany> {
        if let Some(paths) = self.cache.get(id) {
            return Ok(paths.clone());
        }
        let own = if super::pattern::BUILTINS.contains(&id) {
            BUILTINS
        } else {
            id
        };
        let mut paths = vec![own.to_owned()];
        paths.extend(
            self.bindings
                .star
                .iter()
                .map(|module| format!("{module}.{id}")),
        );
        if self.in_progress.contains(&id) {
            return Ok(paths);
        }
        let bindings: &'b Bindings<'a> = self.bindings;
        if let Some(bounds) = bindings.names.get(id) {
            self.in_progress.push(id);
            for bound in bounds {
                match bound {
                    Bound::Path(path) => paths.push(path.clone()),
                    Bound::Expr(expr) => match self.expr(expr, 1) {
                        Ok(more) => paths.extend(more),
                        Err(e) => {
                            self.in_progress.pop();
                            return Err(e);
                        }
                    },
                }
            }
            self.in_progress.pop();
        }
        paths.retain(|path| self.roots.keep(path));
        paths.sort_unstable();
        paths.dedup();
        if paths.len() > MAX_PATHS {
            return Err(TooMany);
        }
        self.cache.insert(id, paths.clone());
        Ok(paths)
    }

    /// What a call returns, when it is a name: `getattr(x, "n")`, `__import__("m")`,
    /// `get_ipython()`, `vars(x)` (its `__dict__`), `globals()`.
    fn call(&mut self, call: &'a ExprCall, depth: u32) -> Result<Vec<String>, TooMany> {
        let callee = self.expr(&call.func, depth + 1)?;
        let has = |names: &[&str]| callee.iter().any(|p| names.contains(&p.as_str()));
        let mut paths = Vec::new();
        if has(&["getattr", "inspect.getattr_static"]) {
            let name = argument(call, 1, "name").and_then(literal_str);
            if let (Some(object), Some(name)) = (argument(call, 0, "obj"), name) {
                let objects = self.expr(object, depth + 1)?;
                paths.extend(objects.iter().map(|p| join(p, &name)));
            }
        }
        if has(IMPORT_FUNCTIONS) {
            if let Some(module) = argument(call, 0, "name").and_then(literal_str) {
                if let Some((top, _)) = module.split_once('.') {
                    paths.push(top.to_owned());
                }
                paths.push(module.into_owned());
            }
        }
        if has(GET_IPYTHON) {
            paths.push(SHELL.to_owned());
        }
        if has(&["vars"]) {
            match argument(call, 0, "object") {
                Some(object) => {
                    let objects = self.expr(object, depth + 1)?;
                    paths.extend(objects.iter().map(|p| join(p, "__dict__")));
                }
                None => paths.push(NAMESPACE.to_owned()),
            }
        }
        if has(&["globals", "locals"]) {
            paths.push(NAMESPACE.to_owned());
        }
        Ok(paths)
    }

    fn subscript(
        &mut self,
        value: &'a Expr,
        key: &'a Expr,
        depth: u32,
    ) -> Result<Vec<String>, TooMany> {
        let Some(key) = literal_str(key) else {
            // `[os.system][0]`: any element of a literal list or tuple.
            return match value {
                Expr::List(list) => self.union(&list.elts, depth),
                Expr::Tuple(tuple) => self.union(&tuple.elts, depth),
                _ => Ok(Vec::new()),
            };
        };
        let mut paths = Vec::new();
        for path in self.expr(value, depth + 1)? {
            if path == BUILTINS || path == "sys.modules" {
                paths.push(key.clone().into_owned());
            } else if path == NAMESPACE {
                match &key {
                    Cow::Borrowed(name) => paths.extend(self.name(name)?),
                    Cow::Owned(name) => paths.push(name.clone()),
                }
            } else if path == "__dict__" {
                paths.push(key.clone().into_owned()); // `builtins.__dict__`
            } else if let Some(object) = path.strip_suffix(".__dict__") {
                paths.push(join(object, &key));
            }
        }
        Ok(paths)
    }
}
