//! The walk's IPython findings: the escape commands of Ruff's IPython mode (`%magic`,
//! `!cmd`, `obj?`, `/f a`) and the calls of IPython's shell (`get_ipython().system(…)`).

use ruff_python_ast::{ExprCall, IpyEscapeKind};

use super::finding::{Finding, Lang, MagicForm};
use super::ipython;
use super::literal::{argument, literal_str};
use super::walk::Walker;
use super::Refusal;

impl<'a> Walker<'a, '_> {
    pub(super) fn escape(&mut self, kind: IpyEscapeKind, value: &str, offset: u32) {
        match kind {
            IpyEscapeKind::Shell | IpyEscapeKind::ShCap => {
                if !self.deny(Finding::Magic("system", MagicForm::Shell), offset) {
                    let (line, nesting) = (self.line(offset), self.nesting);
                    self.result = self.ctx().expansions(value, line, nesting);
                }
            }
            IpyEscapeKind::Help | IpyEscapeKind::Help2 => {
                let name = match kind {
                    IpyEscapeKind::Help2 => "pinfo2",
                    _ if value.contains('*') => "psearch",
                    _ => "pinfo",
                };
                if self.deny(Finding::Magic(name, MagicForm::Help), offset) {
                    return;
                }
                // Help looks up `obj.attr.attr` with getattr.
                for attribute in value.split('.').skip(1) {
                    let attribute = attribute.split('[').next().unwrap_or("");
                    if self.deny(Finding::Attribute(attribute.trim()), offset) {
                        return;
                    }
                }
            }
            IpyEscapeKind::Magic | IpyEscapeKind::Magic2 => {
                let (name, args) = ipython::split_magic(value);
                if !self.deny(Finding::Magic(name, MagicForm::Line), offset) {
                    let (line, nesting) = (self.line(offset), self.nesting);
                    self.result = self.ctx().magic_args(name, args, line, nesting);
                }
            }
            IpyEscapeKind::Paren | IpyEscapeKind::Quote | IpyEscapeKind::Quote2 => {
                if let Some(code) = ipython::escape_call(kind, value) {
                    self.nested(
                        &code,
                        Lang::Python,
                        offset,
                        "an IPython call line (/f, ,f, ;f)",
                    );
                }
            }
        }
    }

    /// A call of a method of IPython's shell (`get_ipython().system("…")`).
    pub(super) fn shell_call(&mut self, method: &str, call: &'a ExprCall, offset: u32) {
        let literal = |position, keyword| argument(call, position, keyword).and_then(literal_str);
        match method {
            "system" | "system_raw" | "system_piped" | "getoutput" => {
                let denied = self.deny(Finding::Magic("system", MagicForm::Api), offset);
                if let (false, Some(command)) = (denied, literal(0, "cmd")) {
                    let (line, nesting) = (self.line(offset), self.nesting);
                    self.result = self.ctx().expansions(&command, line, nesting);
                }
            }
            "run_line_magic" | "run_cell_magic" | "find_line_magic" | "find_cell_magic"
            | "find_magic" => {
                let Some(name) = literal(0, "magic_name") else {
                    self.deny(Finding::DynamicMagic, offset);
                    return;
                };
                let name = name.trim_start_matches('%');
                if self.deny(Finding::Magic(name, MagicForm::Api), offset) {
                    return;
                }
                let line = self.line(offset);
                let args = literal(1, "line");
                let args = args.as_deref().unwrap_or("");
                self.result = match (method, literal(2, "cell")) {
                    ("run_line_magic", _) => {
                        let nesting = self.nesting;
                        self.ctx().magic_args(name, args, line, nesting)
                    }
                    ("run_cell_magic", Some(body)) => {
                        let nesting = self.nesting;
                        self.ctx()
                            .cell_magic(name, args, &body, line, nesting)
                            .map_err(|r| Refusal { line, ..r })
                    }
                    _ => Ok(()),
                };
            }
            "magic" => match literal(0, "arg_s") {
                Some(text) => {
                    let (name, args) = ipython::split_magic(&text);
                    if !self.deny(Finding::Magic(name, MagicForm::Api), offset) {
                        let (line, nesting) = (self.line(offset), self.nesting);
                        self.result = self.ctx().magic_args(name, args, line, nesting);
                    }
                }
                None => {
                    self.deny(Finding::DynamicMagic, offset);
                }
            },
            "run_cell" | "run_cell_async" => {
                if let Some(code) = literal(0, "raw_cell") {
                    self.nested(&code, Lang::IPython, offset, "code run by run_cell");
                }
            }
            "ex" | "ev" => {
                if let Some(code) = literal(0, "cmd").or_else(|| literal(0, "expr")) {
                    self.nested(
                        &code,
                        Lang::Python,
                        offset,
                        &format!("code run by {method}"),
                    );
                }
            }
            _ => {}
        }
    }
}
