//! What the walk of a tree finds ([`Finding`]) and what it asks of the check it belongs to
//! ([`Checker`], which `check.rs`'s context is): apart, so that the check and the walk, which
//! call each other (code in code), depend on this file and not on each other.

use ruff_python_parser::Mode;

use super::{bound, ipython, Refusal};

/// The deepest tree walked (the bound's estimate is above the real depth).
pub(super) const MAX_TREE_DEPTH: u32 = bound::MAX_DEPTH + 10;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Lang {
    /// A cell, as IPython runs it.
    IPython,
    /// Python source, as `exec` runs it.
    Python,
}

#[derive(Clone, Copy)]
pub(super) enum MagicForm {
    Line,
    Cell,
    Shell,
    Automagic,
    Help,
    Api,
}

/// What the walk found, for the rules to judge.
pub(super) enum Finding<'f> {
    Import(&'f str),
    DynamicImport,
    Call(&'f str),
    Use(&'f str),
    Attribute(&'f str),
    DynamicAttribute,
    Magic(&'f str, MagicForm),
    DynamicMagic,
}

impl Finding<'_> {
    pub(super) fn describe(&self) -> String {
        match self {
            Finding::Import(module) => format!("import of {module}"),
            Finding::DynamicImport => "a dynamic import (its module name is not a literal)".into(),
            Finding::Call(path) => format!("call of {path}"),
            Finding::Use(path) => format!("use of {path}"),
            Finding::Attribute(name) => format!("attribute {name}"),
            Finding::DynamicAttribute => "an attribute whose name is not a literal \
                                          (getattr, setattr, delattr, hasattr)"
                .into(),
            Finding::Magic(name, form) => match form {
                MagicForm::Line => format!("magic %{name}"),
                MagicForm::Cell => format!("cell magic %%{name}"),
                MagicForm::Shell => "shell command (`!`, magic %system)".into(),
                MagicForm::Automagic => format!("magic %{name} (a line that starts with its name)"),
                MagicForm::Help => format!("help (magic %{name})"),
                MagicForm::Api => format!("magic %{name} (through get_ipython())"),
            },
            Finding::DynamicMagic => {
                "a magic whose name is not a literal (through get_ipython())".into()
            }
        }
    }
}

/// The line (1-based) of a byte offset in `text`.
pub(super) fn line_of(text: &str, offset: u32) -> u32 {
    let before = text.get(..offset as usize).unwrap_or(text);
    1 + ipython::newlines(before)
}

/// What the walk asks of its check: the rules' verdict, and checks of code in code.
pub(super) trait Checker {
    /// The tree depth, in the code that contains it, of the code being checked.
    fn depth(&self) -> u32;
    fn set_depth(&mut self, depth: u32);
    fn deny(&self, finding: Finding<'_>, line: u32) -> Result<(), Refusal>;
    /// Whether `code` parses (within the depth bound): a reading of it worth checking.
    fn parses(&mut self, code: &str, mode: Mode) -> Result<bool, Refusal>;
    /// Checks code in code, placed at `at` (see `check.rs`).
    fn nested(
        &mut self,
        code: &str,
        lang: Lang,
        nesting: u32,
        at: (u32, bool),
        via: &str,
    ) -> Result<(), Refusal>;
    /// The arguments of the line magic `name`.
    fn magic_args(
        &mut self,
        name: &str,
        args: &str,
        line: u32,
        nesting: u32,
    ) -> Result<(), Refusal>;
    /// The `{expr}` and `$name` IPython evaluates in `text`.
    fn expansions(&mut self, text: &str, line: u32, nesting: u32) -> Result<(), Refusal>;
    /// The cell magic `name` with its `args` line and `body`.
    fn cell_magic(
        &mut self,
        name: &str,
        args: &str,
        body: &str,
        line: u32,
        nesting: u32,
    ) -> Result<(), Refusal>;
}
