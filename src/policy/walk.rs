//! The walk of a parsed cell: each finding (an import, a call or use of a function, an
//! attribute, a magic) goes to the rules as it is met; the first one denied stops the walk.

use ruff_python_ast::visitor::{self, Visitor};
use ruff_python_ast::{Expr, ExprCall, ExprContext, Stmt};
use ruff_python_parser::Mode;

use super::finding::{line_of, Checker, Finding, Lang, MagicForm, MAX_TREE_DEPTH};
use super::literal::{argument, literal_source, literal_str};
use super::resolve::{Resolver, TooMany, IMPORT_FUNCTIONS, SHELL};
use super::Refusal;

/// Functions that run a literal source: the callee, and where the source may be.
const CODE_FUNCTIONS: &[(&str, usize, &str)] = &[
    ("exec", 0, "source"),
    ("eval", 0, "source"),
    ("compile", 0, "source"),
    ("timeit.timeit", 0, "stmt"),
    ("timeit.timeit", 1, "setup"),
    ("timeit.repeat", 0, "stmt"),
    ("timeit.repeat", 1, "setup"),
    ("timeit.Timer", 0, "stmt"),
    ("timeit.Timer", 1, "setup"),
    ("cProfile.run", 0, "statement"),
    ("profile.run", 0, "statement"),
    ("pdb.run", 0, "statement"),
];
const ATTRIBUTE_FUNCTIONS: &[&str] = &[
    "getattr",
    "setattr",
    "delattr",
    "hasattr",
    "inspect.getattr_static",
];
const ATTRIBUTE_METHODS: &[&str] = &[
    "__getattribute__",
    "__getattr__",
    "__setattr__",
    "__delattr__",
];

pub(super) struct Walker<'a, 'c> {
    pub(super) ctx: &'c mut dyn Checker,
    text: &'a str,
    resolver: Resolver<'a, 'a>,
    pub(super) nesting: u32,
    depth: u32,
    pub(super) result: Result<(), Refusal>,
}

impl<'a> Walker<'a, '_> {
    /// The context, for a check of code in code at this depth.
    pub(super) fn ctx(&mut self) -> &mut dyn Checker {
        self.ctx.set_depth(self.depth);
        &mut *self.ctx
    }

    pub(super) fn line(&self, offset: impl Into<u32>) -> u32 {
        line_of(self.text, offset.into())
    }

    pub(super) fn deny(&mut self, finding: Finding<'_>, offset: u32) -> bool {
        if self.result.is_ok() {
            if let Err(refusal) = self.ctx.deny(finding, 0) {
                self.result = Err(Refusal {
                    line: self.line(offset),
                    ..refusal
                });
            }
        }
        self.result.is_err()
    }

    pub(super) fn resolve(&mut self, expr: &'a Expr, offset: u32) -> Vec<String> {
        match self.resolver.resolve(expr) {
            Ok(paths) => paths,
            Err(TooMany) => {
                let what = "a name with too many possible meanings to check".to_owned();
                self.result = Err(Refusal::policy(what, self.line(offset)));
                Vec::new()
            }
        }
    }

    pub(super) fn nested(&mut self, code: &str, lang: Lang, offset: u32, via: &str) {
        if self.result.is_ok() {
            let (line, nesting) = (self.line(offset), self.nesting);
            self.result = self.ctx().nested(code, lang, nesting, (line, false), via);
        }
    }

    /// A use of what `expr` names (not a call of it).
    pub(super) fn uses(&mut self, expr: &'a Expr, offset: u32) {
        for path in self.resolve(expr, offset) {
            if self.deny(Finding::Use(&path), offset) {
                return;
            }
            // `map(__import__, names)`: what it imports is not known here.
            let dynamic = if IMPORT_FUNCTIONS.contains(&path.as_str()) {
                Some(Finding::DynamicImport)
            } else if ATTRIBUTE_FUNCTIONS.contains(&path.as_str()) {
                Some(Finding::DynamicAttribute)
            } else {
                None
            };
            if dynamic.is_some_and(|finding| self.deny(finding, offset)) {
                return;
            }
            let magic = match path.strip_prefix(SHELL).and_then(|m| m.strip_prefix('.')) {
                Some("system" | "system_raw" | "system_piped" | "getoutput") => {
                    Finding::Magic("system", MagicForm::Api)
                }
                Some(
                    "run_line_magic" | "run_cell_magic" | "find_line_magic" | "find_cell_magic"
                    | "find_magic" | "magic",
                ) => Finding::DynamicMagic,
                _ => continue,
            };
            if self.deny(magic, offset) {
                return;
            }
        }
    }
}

impl<'a, 'c> Walker<'a, 'c> {
    pub(super) fn new(
        ctx: &'c mut dyn Checker,
        text: &'a str,
        resolver: Resolver<'a, 'a>,
        nesting: u32,
    ) -> Self {
        let depth = ctx.depth();
        Walker {
            ctx,
            text,
            resolver,
            nesting,
            depth,
            result: Ok(()),
        }
    }

    pub(super) fn finish(self) -> Result<(), Refusal> {
        self.result
    }

    fn call(&mut self, call: &'a ExprCall) {
        let offset = u32::from(call.range_start);
        let callee = self.resolve(&call.func, offset);
        for path in &callee {
            if self.deny(Finding::Call(path), offset) {
                return;
            }
        }
        let has = |names: &[&str]| callee.iter().any(|p| names.contains(&p.as_str()));
        if has(IMPORT_FUNCTIONS) {
            match argument(call, 0, "name").map(literal_str) {
                Some(Some(module)) if module.starts_with('.') => {}
                Some(Some(module)) => {
                    if self.deny(Finding::Import(&module), offset) {
                        return;
                    }
                    // `__import__("os", fromlist=["system"])` may import `os.system`.
                    if let Some(Expr::List(list)) = argument(call, 3, "fromlist") {
                        for name in list.elts.iter().filter_map(literal_str) {
                            if self.deny(Finding::Import(&format!("{module}.{name}")), offset) {
                                return;
                            }
                        }
                    }
                }
                _ => {
                    if self.deny(Finding::DynamicImport, offset) {
                        return;
                    }
                }
            }
        }
        let attribute_method = matches!(&*call.func, Expr::Attribute(a)
            if ATTRIBUTE_METHODS.contains(&a.attr.as_str()));
        if has(ATTRIBUTE_FUNCTIONS) || attribute_method {
            // `getattr(x, "n")`; `object.__getattribute__(x, "n")` or `x.__getattribute__("n")`.
            let mut names = vec![argument(call, 1, "name").and_then(literal_str)];
            if attribute_method {
                names.push(argument(call, 0, "name").and_then(literal_str));
            }
            let mut literal = false;
            for name in names.into_iter().flatten() {
                literal = true;
                if self.deny(Finding::Attribute(&name), offset) {
                    return;
                }
            }
            if !literal && self.deny(Finding::DynamicAttribute, offset) {
                return;
            }
        }
        if has(&["operator.attrgetter"]) {
            for arg in call.arguments.args.iter() {
                let found = match literal_str(arg) {
                    Some(names) => names
                        .split('.')
                        .any(|name| self.deny(Finding::Attribute(name), offset)),
                    None => self.deny(Finding::DynamicAttribute, offset),
                };
                if found {
                    return;
                }
            }
        }
        // A name the cell also binds may not be the builtin (`from re import compile`): what
        // it is given is checked when it parses, and not refused when it does not.
        let rebound = self.resolver.rebound(&call.func);
        for &(function, position, keyword) in CODE_FUNCTIONS {
            if has(&[function]) {
                if let Some(source) = argument(call, position, keyword).and_then(literal_source) {
                    let source = match function {
                        "eval" => source.trim_start_matches([' ', '\t']),
                        _ => &source,
                    };
                    let check = match rebound {
                        false => Ok(true),
                        true => self.ctx().parses(source, Mode::Module),
                    };
                    match check {
                        Ok(true) => {
                            let via = format!("code run by {function}");
                            self.nested(source, Lang::Python, offset, &via);
                        }
                        Ok(false) => {}
                        Err(refusal) => self.result = Err(refusal),
                    }
                }
            }
        }
        for path in &callee {
            if let Some(method) = path.strip_prefix(SHELL).and_then(|m| m.strip_prefix('.')) {
                self.shell_call(method, call, offset);
            }
        }
    }

    /// The callee of a call: its use is the call, already checked.
    fn visit_callee(&mut self, func: &'a Expr) {
        match func {
            Expr::Attribute(attribute) => {
                let offset = u32::from(attribute.range.start());
                if !self.deny(Finding::Attribute(attribute.attr.as_str()), offset) {
                    self.visit_expr(&attribute.value);
                }
            }
            Expr::Name(_) => {}
            _ => self.visit_expr(func),
        }
    }

    // Not inlined: the walk's recursion (`visit_expr`, `walk_expr`) keeps small frames.
    #[inline(never)]
    fn check_expr(&mut self, expr: &'a Expr) {
        match expr {
            Expr::Call(call) => {
                // What the call returns may be a name: `getattr(os, "system")`.
                self.call(call);
                if self.result.is_ok() {
                    self.uses(expr, u32::from(call.range_start));
                }
            }
            Expr::Name(name) if name.ctx == ExprContext::Load => {
                self.uses(expr, u32::from(name.range.start()));
            }
            Expr::Attribute(attribute) => {
                let offset = u32::from(attribute.range.start());
                let denied = self.deny(Finding::Attribute(attribute.attr.as_str()), offset);
                if !denied && attribute.ctx == ExprContext::Load {
                    self.uses(expr, offset);
                }
            }
            Expr::Subscript(subscript) => {
                let offset = u32::from(subscript.range.start());
                // `x.__dict__["n"]`, `vars(x)["n"]`: the attribute `n`.
                let dict = match &*subscript.value {
                    Expr::Attribute(a) => a.attr.as_str() == "__dict__",
                    Expr::Call(call) => {
                        matches!(&*call.func, Expr::Name(n) if n.id.as_str() == "vars")
                            && !call.arguments.args.is_empty()
                    }
                    _ => false,
                };
                let key = literal_str(&subscript.slice);
                let found = match &key {
                    Some(key) => Finding::Attribute(key),
                    None => Finding::DynamicAttribute,
                };
                if dict && self.deny(found, offset) {
                    return;
                }
                // `sys.modules["m"]`: the module `m`.
                if let Some(key) = &key {
                    let modules = self.resolve(&subscript.value, offset);
                    if modules.iter().any(|p| p == "sys.modules")
                        && self.deny(Finding::Import(key), offset)
                    {
                        return;
                    }
                }
                if subscript.ctx == ExprContext::Load {
                    self.uses(expr, offset);
                }
            }
            Expr::IpyEscapeCommand(command) => {
                self.escape(
                    command.kind,
                    &command.value,
                    u32::from(command.range.start()),
                );
            }
            _ => {}
        }
    }

    #[inline(never)]
    fn check_stmt(&mut self, stmt: &'a Stmt) {
        match stmt {
            Stmt::Import(import) => {
                let offset = u32::from(import.range.start());
                for alias in &import.names {
                    if self.deny(Finding::Import(alias.name.as_str()), offset) {
                        return;
                    }
                }
            }
            Stmt::ImportFrom(import) if import.level == 0 => {
                let offset = u32::from(import.range.start());
                if let Some(module) = &import.module {
                    if self.deny(Finding::Import(module.as_str()), offset) {
                        return;
                    }
                    for alias in import.names.iter().filter(|a| a.name.as_str() != "*") {
                        let path = format!("{}.{}", module.as_str(), alias.name.as_str());
                        if self.deny(Finding::Import(&path), offset) {
                            return;
                        }
                    }
                }
            }
            Stmt::IpyEscapeCommand(command) => {
                self.escape(
                    command.kind,
                    &command.value,
                    u32::from(command.range.start()),
                );
            }
            _ => {}
        }
    }
}

impl<'a> Visitor<'a> for Walker<'a, '_> {
    fn visit_stmt(&mut self, stmt: &'a Stmt) {
        if self.result.is_err() {
            return;
        }
        self.check_stmt(stmt);
        if self.result.is_ok() {
            self.depth += 1;
            if self.depth > MAX_TREE_DEPTH {
                let what = "the code nests too deeply to check".to_owned();
                self.result = Err(Refusal::policy(what, 0));
                return;
            }
            visitor::walk_stmt(self, stmt);
            self.depth -= 1;
        }
    }

    fn visit_expr(&mut self, expr: &'a Expr) {
        if self.result.is_err() {
            return;
        }
        self.depth += 1;
        if self.depth > MAX_TREE_DEPTH {
            let what = "the code nests too deeply to check".to_owned();
            self.result = Err(Refusal::policy(what, 0));
            return;
        }
        self.check_expr(expr);
        if self.result.is_ok() {
            match expr {
                Expr::Call(call) => {
                    self.visit_callee(&call.func);
                    self.visit_arguments(&call.arguments);
                }
                _ => visitor::walk_expr(self, expr),
            }
        }
        self.depth -= 1;
    }
}
