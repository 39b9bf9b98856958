//! The check of one piece of code: IPython's cell steps, the depth bound, the parse, then a
//! walk of the tree that reports each finding (an import, a call, an attribute, a magic …)
//! to the rules. Code in code (a literal given to `exec`, a `%time` line, a cell magic's
//! body) is checked the same way, at most [`MAX_NESTING`] deep.

use ruff_python_ast::visitor::Visitor;
use ruff_python_parser::{parse, Mode, ParseOptions};

use super::finding::{line_of, Checker, Finding, Lang, MagicForm};
use super::ipython::{self, Cell};
use super::resolve::{Bindings, Resolver, Roots};
use super::walk::Walker;
use super::{bound, Refusal, Rule, MAX_CODE_BYTES};

/// How deep code may be in code (`exec("exec('…')")`).
const MAX_NESTING: u32 = 4;
/// The most code parsed for one check, code in code included.
const PARSE_BUDGET: usize = 4 * MAX_CODE_BYTES;
impl Rule {
    fn denies(&self, finding: &Finding<'_>) -> bool {
        let any =
            |patterns: &[super::Pattern], path: &str| patterns.iter().any(|p| p.matches(path));
        match *finding {
            Finding::Import(module) => any(&self.imports, module),
            Finding::DynamicImport => !self.imports.is_empty(),
            // `socket.create_connection` is a use of the module `socket`.
            Finding::Call(path) | Finding::Use(path) => {
                any(&self.calls, path) || (path.contains('.') && any(&self.imports, path))
            }
            Finding::Attribute(name) => self.attributes.iter().any(|p| p.matches_whole(name)),
            Finding::DynamicAttribute => self.dynamic_attributes,
            // Any name may start a line; only a known magic's, or one named exactly, is one.
            Finding::Magic(name, MagicForm::Automagic) => {
                let known = ipython::is_line_magic(name);
                self.magics
                    .iter()
                    .any(|p| p.matches_whole(name) && (known || p.is_exact()))
            }
            Finding::Magic(name, _) => self.magics.iter().any(|p| p.matches_whole(name)),
            Finding::DynamicMagic => !self.magics.is_empty(),
        }
    }
}

pub(super) fn check_cell(rules: &[&Rule], code: &str) -> Result<(), Refusal> {
    let roots = Roots::new(rules);
    let mut ctx = Ctx {
        rules,
        roots: &roots,
        budget: PARSE_BUDGET,
        depth: 0,
    };
    ctx.code(code, Lang::IPython, 0)
}

pub(super) struct Ctx<'r, 'p> {
    rules: &'r [&'p Rule],
    /// The paths worth resolving under these rules.
    roots: &'r Roots,
    /// Bytes that may still be parsed.
    budget: usize,
    /// The tree depth, in the code that contains it, of the code being checked.
    depth: u32,
}

impl Ctx<'_, '_> {
    /// Takes `bytes` from what may still be parsed.
    fn spend(&mut self, bytes: usize) -> Result<(), Refusal> {
        let Some(left) = self.budget.checked_sub(bytes) else {
            let what = "more code to check than 4 MiB (with the code in its strings and magics)";
            return Err(Refusal::policy(what.into(), 0));
        };
        self.budget = left;
        Ok(())
    }

    /// Checks code; a refusal's line is one of `code`'s.
    pub(super) fn code(&mut self, code: &str, lang: Lang, nesting: u32) -> Result<(), Refusal> {
        if nesting > MAX_NESTING {
            let what = format!("code run by code is nested more than {MAX_NESTING} deep");
            return Err(Refusal::policy(what, 0));
        }
        self.spend(code.len())?;
        let (text, mode) = match lang {
            Lang::Python => (std::borrow::Cow::Borrowed(code), Mode::Module),
            Lang::IPython => match ipython::prepare(code) {
                Cell::Magic {
                    name,
                    line,
                    body,
                    line_no,
                } => {
                    return self.cell_magic(&name, &line, &body, line_no, nesting);
                }
                Cell::Code {
                    text,
                    automagic,
                    autocall,
                } => {
                    if let Some((call, line)) = autocall {
                        if self.parses(&call, Mode::Module)? {
                            let via = "the call %autocall would make of the line";
                            self.nested(&call, Lang::Python, nesting, (line, false), via)?;
                        }
                    }
                    if let Some(magic) = automagic {
                        let form = MagicForm::Automagic;
                        self.deny(Finding::Magic(&magic.name, form), magic.line_no)?;
                        self.magic_args(&magic.name, &magic.rest, magic.line_no, nesting)?;
                        if magic.known && !self.parses(&text, Mode::Ipython)? {
                            return Ok(()); // `ls -la`, `pip install x`: only the magic
                        }
                    }
                    (text, Mode::Ipython)
                }
            },
        };
        let base = self.depth;
        if !bound::within(&text, mode, bound::MAX_DEPTH.saturating_sub(base)) {
            let what = format!(
                "the code nests too deeply to check (more than {} operators or brackets \
                 in one expression)",
                bound::MAX_DEPTH
            );
            return Err(Refusal::policy(what, 0));
        }
        let parsed = parse(&text, ParseOptions::from(mode)).map_err(|e| {
            let what = format!("the code could not be parsed: {}", e.error);
            Refusal::policy(what, line_of(&text, u32::from(e.location.start())))
        })?;
        let Some(module) = parsed.syntax().as_module() else {
            return Err(Refusal::policy("the code is not a module".into(), 0));
        };
        let bindings = Bindings::collect(&module.body);
        let resolver = Resolver::new(&bindings, self.roots);
        self.depth = base;
        let mut walker = Walker::new(self, &text, resolver, nesting);
        walker.visit_body(&module.body);
        let result = walker.finish();
        self.depth = base;
        result
    }
}

impl Checker for Ctx<'_, '_> {
    fn depth(&self) -> u32 {
        self.depth
    }

    fn set_depth(&mut self, depth: u32) {
        self.depth = depth;
    }

    fn deny(&self, finding: Finding<'_>, line: u32) -> Result<(), Refusal> {
        match self.rules.iter().find(|rule| rule.denies(&finding)) {
            None => Ok(()),
            Some(rule) => Err(Refusal {
                rule: rule.name.clone(),
                message: rule.message.clone(),
                what: finding.describe(),
                line,
            }),
        }
    }

    /// Whether `code` parses (within the depth bound): a reading of it worth checking.
    fn parses(&mut self, code: &str, mode: Mode) -> Result<bool, Refusal> {
        self.spend(code.len())?;
        let room = bound::MAX_DEPTH.saturating_sub(self.depth);
        Ok(bound::within(code, mode, room) && parse(code, ParseOptions::from(mode)).is_ok())
    }

    /// Checks code in code: a refusal is placed at `line` (of the outer code), or, with
    /// `offset`, at its own line counted from `line` (a cell magic's body).
    fn nested(
        &mut self,
        code: &str,
        lang: Lang,
        nesting: u32,
        at: (u32, bool),
        via: &str,
    ) -> Result<(), Refusal> {
        let (line, offset) = at;
        self.code(code, lang, nesting + 1).map_err(|mut refusal| {
            refusal.line = if offset && refusal.line > 0 {
                line + refusal.line
            } else {
                line
            };
            refusal.what = format!("{}, in {via}", refusal.what);
            refusal
        })
    }

    /// The arguments of the line magic `name`: the modules it imports, the code it runs.
    fn magic_args(
        &mut self,
        name: &str,
        args: &str,
        line: u32,
        nesting: u32,
    ) -> Result<(), Refusal> {
        self.expansions(args, line, nesting)?;
        for module in ipython::magic_imports(name, args) {
            self.deny(Finding::Import(module), line)?;
        }
        if name == "alias_magic" {
            // `%alias_magic b bash` makes `%%b` run `%%bash`.
            for magic in args.split_whitespace().filter(|w| !w.starts_with('-')) {
                self.deny(
                    Finding::Magic(magic.trim_start_matches('%'), MagicForm::Line),
                    line,
                )?;
            }
        }
        if name == "config" {
            // `%config X.y = expr` runs `exec("cfg." + line)`.
            let code = format!("cfg.{}", args.trim());
            if self.parses(&code, Mode::Module)? {
                self.nested(&code, Lang::Python, nesting, (line, false), "%config")?;
            }
        }
        if ipython::EVAL_MAGICS.contains(&name) {
            for code in ipython::code_suffixes(args) {
                if self.parses(code, Mode::Module)? {
                    self.nested(
                        code,
                        Lang::Python,
                        nesting,
                        (line, false),
                        &format!("%{name}"),
                    )?;
                }
            }
        }
        if !ipython::CODE_MAGICS.contains(&name) {
            return Ok(());
        }
        let suffixes = ipython::code_suffixes(args);
        let mut parsed = false;
        for code in &suffixes {
            if self.parses(code, Mode::Ipython)? {
                parsed = true;
                self.nested(
                    code,
                    Lang::IPython,
                    nesting,
                    (line, false),
                    &format!("%{name}"),
                )?;
            }
        }
        if !parsed && !suffixes.is_empty() {
            let what = format!("the code given to %{name} could not be parsed");
            return Err(Refusal::policy(what, line));
        }
        Ok(())
    }

    /// The `{expr}` and `$name` IPython evaluates in a magic's arguments or a shell command.
    fn expansions(&mut self, text: &str, line: u32, nesting: u32) -> Result<(), Refusal> {
        for expr in ipython::expansions(text) {
            if self.parses(expr, Mode::Module)? {
                let via = "an expansion IPython evaluates ({…} or $name)";
                self.nested(expr, Lang::Python, nesting, (line, false), via)?;
            }
        }
        Ok(())
    }

    fn cell_magic(
        &mut self,
        name: &str,
        args: &str,
        body: &str,
        line: u32,
        nesting: u32,
    ) -> Result<(), Refusal> {
        self.deny(Finding::Magic(name, MagicForm::Cell), line)?;
        self.magic_args(name, args, line, nesting)?;
        let via = format!("the body of %%{name}");
        if ipython::CODE_MAGICS.contains(&name) {
            self.nested(body, Lang::IPython, nesting, (line, true), &via)?;
        }
        let interpreter = match name {
            "script" => args
                .split_whitespace()
                .next()
                .unwrap_or("")
                .rsplit('/')
                .next()
                .unwrap_or(""),
            _ => name,
        };
        if interpreter.starts_with("python") || interpreter.starts_with("pypy") {
            self.nested(body, Lang::Python, nesting, (line, true), &via)?;
        }
        Ok(())
    }
}
