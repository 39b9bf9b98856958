//! The operator's pre-execution policy for Python code (`--policy FILE`): rules over the code's
//! syntax tree that refuse an execution before it reaches the kernel. A pure module: the
//! callers decide where a [`Refusal`] goes.
//!
//! # The parser
//!
//! [`ruff_python_parser`] 0.0.10 (Ruff 0.16.4), Astral's own publication of Ruff's parser: a
//! hand-written recursive-descent parser that follows each CPython release (match statements,
//! PEP 701 f-strings, walrus, async, type parameters and `type` aliases, t-strings), recovers
//! from errors without panicking, grows its own stack on deep input, and has an IPython mode
//! whose lexer makes tokens of `%magic`, `!cmd`, `x = !cmd` and `obj?`, so a `%` in a string or
//! in brackets is not taken for a magic. Weighed against it: `rustpython-parser` 0.4, no longer
//! kept (RustPython moved to Ruff's parser) and without an IPython mode;
//! `rustpython-ruff_python_parser`, an unofficial copy of the same code; the newer
//! `ruff_python_parser` releases (up to 0.0.20), which need Rust 1.97 (this toolchain is 1.95).
//! No optional features; `ruff_python_ast` (the same release) is its tree.
//!
//! # The file
//!
//! ```toml
//! [[rule]]
//! name = "no-network"                   # required, [A-Za-z0-9_.-]+, unique, not "policy"
//! message = "network access is not allowed here"   # optional, shown in the refusal
//! users = ["alice", "bob"]              # optional: absent = every user
//! deny_imports = ["socket", "ssl", "http.client", "requests"]
//! deny_calls = ["os.system", "os.exec*", "subprocess.*", "eval"]
//! deny_attributes = ["__subclasses__", "__globals__"]
//! deny_dynamic_attributes = false       # getattr & co. with a name that is not a literal
//! deny_magics = ["system", "bash", "sh", "script"]  # IPython magics; `!cmd` is "system"
//! ```
//!
//! A pattern is a dotted name whose last part may be `*` or end in `*`; it matches a path that
//! begins with it, part by part (`socket` matches `socket.x`, not `socketserver`). A use of a
//! module's attribute is an import of it (`http.client.HTTPConnection` after `import http`).
//! Magics that run programs outside the kernel (`system`, `sx`, `!`, `bash`, `sh`, `script`,
//! `perl`, `python3`, `pip`, `conda`, the shell aliases `ls`, `rm`…, `alias`, `rehashx`) are
//! one group: denying one denies them all, since each can run the others' commands.
//!
//! # What is checked
//!
//! Imports (statements, `__import__`, `importlib.import_module`, `sys.modules["m"]`), calls and
//! uses of functions (`map(os.system, cmds)` is refused like the call) through the cell's
//! import aliases and simple assignments (`import os as o`, `s = os.system`, `getattr(os,
//! "system")`, `builtins.eval`, `__builtins__["eval"]`, `vars(os)["system"]`), attributes
//! (`x.__globals__`, `getattr(x, "__globals__")`, `x.__dict__["__globals__"]`), literal code
//! given to `exec`, `eval`, `compile`, `timeit`, `get_ipython().run_cell` (checked like the
//! cell), and IPython's syntax (see `ipython.rs`): magics, `!` lines, cell magics, automagic
//! (`system ("ls")` is `%system`), `%autocall`'s calls, help, the `/f`, `,f`, `;f` lines,
//! `get_ipython()`'s methods, the code that `%time`, `%%capture`, `%config`… run, and the
//! `{expr}` IPython evaluates in a magic's arguments and a shell command (`!echo {expr}`).
//!
//! Names resolve flatly: a binding anywhere in the cell counts everywhere in it, and a name
//! keeps its own meaning too (a builtin, or a module an earlier cell imported): `eval` stays
//! `eval` when the cell also imports an `eval`, since that import may fail or come after the
//! call. Code is bounded: at most 1 MiB ([`MAX_CODE_BYTES`]); its depth estimated from its
//! tokens before it is parsed and at most 500 with the code that contains it (see `bound.rs`);
//! code in code at most 4 levels deep; at most 4 MiB parsed in all. Code that does not parse is
//! refused (fail closed), and so is a literal given to `exec` that does not (unless the cell
//! binds the name to something else too: `from re import compile`).
//!
//! # Not a boundary
//!
//! A first line that catches the ordinary ways, not the sandbox. Code that means to evade it
//! can: with names it computes (`__import__("so" + "cket")` is refused, as a dynamic import,
//! only when the rule denies imports; `getattr(__builtins__, "__imp" + "ort__")` only with
//! `deny_dynamic_attributes`), with `vars()`, `globals()`, `__dict__` or `sys.modules` lookups
//! through variables, names bound in an earlier cell, function arguments and return values,
//! containers and classes, objects that lead to other modules (`os.sys.modules`,
//! `type(x).__mro__`), `exec` of a computed string, pickle, ctypes, code objects, modules the
//! operator did not list (`posix.system`, `asyncio.create_subprocess_shell`), files it writes
//! and then imports or runs, magics the operator did not list (`%run`, `%macro`, `%env`), or
//! what it types into the debugger or `input()` (replies on stdin are not executions). The
//! sandbox stays the boundary.

mod bound;
mod check;
mod finding;
mod ipython;
mod literal;
mod pattern;
mod resolve;
mod shell;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_ipython;
#[cfg(test)]
mod tests_python;
mod walk;

use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use pattern::Pattern;

/// The largest code checked: anything longer is refused.
pub const MAX_CODE_BYTES: usize = 1 << 20;
/// The largest policy file read.
pub const MAX_POLICY_FILE_BYTES: u64 = 1 << 20;
/// The rule name of refusals that are the policy's own (too large, does not parse, …).
pub const POLICY_RULE: &str = "policy";

/// An operator's policy: its rules, in the file's order.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    rules: Vec<Rule>,
}

/// One validated `[[rule]]`.
#[derive(Debug, Clone)]
pub(crate) struct Rule {
    name: String,
    message: Option<String>,
    users: Option<Vec<String>>,
    imports: Vec<Pattern>,
    calls: Vec<Pattern>,
    attributes: Vec<Pattern>,
    dynamic_attributes: bool,
    magics: Vec<Pattern>,
}

/// Why a policy could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("cannot read the policy file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the policy file {path} is larger than 1 MiB")]
    TooLarge { path: PathBuf },
    #[error("the policy is not valid: {0}")]
    Toml(String),
    #[error("policy rule {rule}: {field}: {message}")]
    Rule {
        rule: String,
        field: &'static str,
        message: String,
    },
}

/// A refused execution: which rule, what in the code, and where (1-based; 0: the whole code).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Refusal {
    pub rule: String,
    pub message: Option<String>,
    pub what: String,
    pub line: u32,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.rule == POLICY_RULE {
            write!(f, "refused by the policy: {}", self.what)?;
        } else {
            write!(
                f,
                "refused by the policy rule {:?}: {}",
                self.rule, self.what
            )?;
        }
        if self.line > 0 {
            write!(f, " (line {})", self.line)?;
        }
        match &self.message {
            Some(message) => write!(f, ": {message}"),
            None => Ok(()),
        }
    }
}

impl Refusal {
    /// A refusal of the policy's own (not an operator's rule).
    pub(crate) fn policy(what: String, line: u32) -> Refusal {
        Refusal {
            rule: POLICY_RULE.to_owned(),
            message: None,
            what,
            line,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    #[serde(default)]
    rule: Vec<RuleFile>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleFile {
    name: String,
    message: Option<String>,
    users: Option<Vec<String>>,
    #[serde(default)]
    deny_imports: Vec<String>,
    #[serde(default)]
    deny_calls: Vec<String>,
    #[serde(default)]
    deny_attributes: Vec<String>,
    #[serde(default)]
    deny_dynamic_attributes: bool,
    #[serde(default)]
    deny_magics: Vec<String>,
}

fn patterns(
    rule: &str,
    field: &'static str,
    texts: &[String],
    parse: fn(&str) -> Result<Pattern, pattern::PatternError>,
) -> Result<Vec<Pattern>, PolicyError> {
    texts
        .iter()
        .map(|text| parse(text))
        .collect::<Result<_, _>>()
        .map_err(|e| PolicyError::Rule {
            rule: rule.to_owned(),
            field,
            message: e.to_string(),
        })
}

impl RuleFile {
    fn validate(self, index: usize, seen: &[Rule]) -> Result<Rule, PolicyError> {
        let name_ok = !self.name.is_empty()
            && self
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
        let error = |rule: String, field, message: &str| PolicyError::Rule {
            rule,
            field,
            message: message.to_owned(),
        };
        if !name_ok {
            let message = format!("{:?} is not of [A-Za-z0-9_.-]+", self.name);
            return Err(error(format!("#{}", index + 1), "name", &message));
        }
        let rule = format!("{:?}", self.name);
        if self.name == POLICY_RULE {
            return Err(error(
                rule,
                "name",
                "\"policy\" names the policy's own refusals",
            ));
        }
        if seen.iter().any(|other| other.name == self.name) {
            return Err(error(rule, "name", "another rule has this name"));
        }
        if let Some(users) = &self.users {
            if users.is_empty() {
                let message = "empty: no user (leave it out for every user)";
                return Err(error(rule, "users", message));
            }
            if users.iter().any(|user| user.is_empty()) {
                return Err(error(rule, "users", "an empty user name"));
            }
        }
        let imports = patterns(&rule, "deny_imports", &self.deny_imports, Pattern::dotted)?;
        let calls = patterns(&rule, "deny_calls", &self.deny_calls, Pattern::dotted)?;
        let attributes = patterns(
            &rule,
            "deny_attributes",
            &self.deny_attributes,
            Pattern::attribute,
        )?;
        let magics = ipython::expand_magic_groups(patterns(
            &rule,
            "deny_magics",
            &self.deny_magics,
            Pattern::magic,
        )?);
        if imports.is_empty()
            && calls.is_empty()
            && attributes.is_empty()
            && magics.is_empty()
            && !self.deny_dynamic_attributes
        {
            let message = "denies nothing (deny_imports, deny_calls, deny_attributes, \
                           deny_dynamic_attributes or deny_magics)";
            return Err(error(rule, "rule", message));
        }
        Ok(Rule {
            name: self.name,
            message: self.message,
            users: self.users,
            imports,
            calls,
            attributes,
            dynamic_attributes: self.deny_dynamic_attributes,
            magics,
        })
    }
}

impl Rule {
    fn applies_to(&self, user: &str) -> bool {
        self.users
            .as_ref()
            .is_none_or(|users| users.iter().any(|u| u == user))
    }
}

/// Whether a kernel spec's language is Python's (the only one checked).
fn is_python(language: &str) -> bool {
    let language = language.trim().to_ascii_lowercase();
    language.starts_with("python") || language.starts_with("ipython")
}

impl Policy {
    /// The policy of a TOML text (see the module's documentation for the format).
    pub fn from_toml(text: &str) -> Result<Policy, PolicyError> {
        let file: PolicyFile =
            toml::from_str(text).map_err(|e| PolicyError::Toml(e.to_string()))?;
        let mut rules = Vec::with_capacity(file.rule.len());
        for (index, rule) in file.rule.into_iter().enumerate() {
            let rule = rule.validate(index, &rules)?;
            rules.push(rule);
        }
        Ok(Policy { rules })
    }

    /// The policy of a file (at most [`MAX_POLICY_FILE_BYTES`]).
    pub fn load(path: &Path) -> Result<Policy, PolicyError> {
        let read_error = |source| PolicyError::Read {
            path: path.to_owned(),
            source,
        };
        let file = std::fs::File::open(path).map_err(read_error)?;
        let mut text = String::new();
        file.take(MAX_POLICY_FILE_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(read_error)?;
        if text.len() as u64 > MAX_POLICY_FILE_BYTES {
            return Err(PolicyError::TooLarge {
                path: path.to_owned(),
            });
        }
        Policy::from_toml(&text)
    }

    /// Whether the policy has no rule (every execution passes).
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// The rules' names, in the file's order.
    pub fn rule_names(&self) -> Vec<&str> {
        self.rules.iter().map(|rule| rule.name.as_str()).collect()
    }

    /// Checks `code` that `user` wants to run in a kernel whose spec's language is
    /// `language` ("python" is checked; every other language passes: the parser is Python's).
    /// Nothing is parsed unless a rule applies to `user`. The first finding a rule denies is
    /// the refusal (rules in the file's order).
    pub fn check(&self, user: &str, language: &str, code: &str) -> Result<(), Refusal> {
        if !is_python(language) {
            return Ok(());
        }
        let rules: Vec<&Rule> = self.rules.iter().filter(|r| r.applies_to(user)).collect();
        if rules.is_empty() {
            return Ok(());
        }
        if code.len() > MAX_CODE_BYTES {
            let what = format!("the code is larger than {} bytes", MAX_CODE_BYTES);
            return Err(Refusal::policy(what, 0));
        }
        check::check_cell(&rules, code)
    }
}
