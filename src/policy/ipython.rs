//! IPython's syntax, as IPython 8's `TransformerManager` reads a cell before Python sees it.
//!
//! The approach: the cell-level steps, which look at whole lines, are done here exactly as
//! IPython does them (its line splitting included, `str.splitlines`): leading blank lines
//! dropped, the first line's indentation removed from every line, `>>> `/`... ` and
//! `In [1]: `/`...: ` prompts stripped, and a first line `%%name` making the rest of the cell
//! the body of a cell magic, not Python. Skipping these steps would let the two readings of a
//! cell differ (`... (__import__)("socket")` is an Ellipsis called to IPython's parser's eyes
//! until the prompt is stripped). The token-level steps are left to Ruff's parser in its
//! IPython mode, whose lexer makes a token of `%magic`, `!cmd`, `x = !cmd`, `x = %magic`,
//! `obj?`/`??obj` and the `/f a`, `,f a`, `;f a` calls only at the start of a logical line
//! (after `=` for the assignments), as IPython's tokenizer-based transforms do: a `%` or `!`
//! inside a string, in brackets or after a line continuation is not a magic. Then, like
//! IPython's prefilter, a cell of one line that starts with a magic's name is that magic
//! (automagic: `system ("ls")` runs `%system`), whether or not it is also Python.

use std::borrow::Cow;
use std::sync::LazyLock;

use regex::Regex;
use ruff_python_ast::IpyEscapeKind;

use super::pattern::Pattern;

/// Magics that run a program outside the kernel (the shell, an interpreter, a package
/// manager through the shell, IPython's shell aliases and what defines more of them): a rule
/// that denies one of them denies them all, since any of them can run the others' commands.
const SHELL_MAGICS: &str =
    "system sx ! sc alias rehashx bash sh script perl ruby python python2 python3 pypy \
    pip conda mamba micromamba uv cat cp ldir lf lk ll ls lx mkdir mv rm rmdir clear \
    less man more edit ed";

/// IPython's and ipykernel's line magics: a one-line cell that starts with one of them and is
/// not Python is that magic (automagic), not a syntax error.
const LINE_MAGICS: &str =
    "alias alias_magic autoawait autocall automagic autosave bookmark cat cd clear colors \
    conda config connect_info cp debug dhist dirs doctest_mode ed edit env gui hist \
    history killbgscripts ldir less lf lk ll load load_ext loadpy logoff logon logstart \
    logstate logstop ls lsmagic lx macro magic mamba man matplotlib micromamba mkdir \
    more mv notebook page pastebin pdb pdef pdoc pfile pinfo pinfo2 pip popd pprint \
    precision prun psearch psource pushd pwd pycat pylab qtconsole quickref recall \
    rehashx reload_ext rep rerun reset reset_selective rm rmdir run save sc set_env sx \
    system tb time timeit unalias unload_ext uv who who_ls whos xdel xmode";

/// Whether IPython or ipykernel has a line magic `name`.
pub(super) fn is_line_magic(name: &str) -> bool {
    LINE_MAGICS.split_whitespace().any(|magic| magic == name)
}

/// Magics whose argument (and, as cell magics, body) is Python code IPython runs.
pub(super) const CODE_MAGICS: &[&str] = &["time", "timeit", "prun", "debug", "capture"];
/// Magics that may `eval` their argument (when it is not a file or a history range).
pub(super) const EVAL_MAGICS: &[&str] = &["load", "loadpy", "recall", "rep", "macro"];

/// `patterns` with, when one of them names a shell magic, every shell magic.
pub(super) fn expand_magic_groups(mut patterns: Vec<Pattern>) -> Vec<Pattern> {
    let mut shell = SHELL_MAGICS.split_whitespace();
    if shell.any(|name| patterns.iter().any(|p| p.matches_whole(name))) {
        patterns.extend(SHELL_MAGICS.split_whitespace().map(Pattern::exact));
    }
    patterns
}

/// Python's `str.isspace` for one character.
fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\x1c'..='\x1f').contains(&c)
}

/// Python's `str.splitlines(keepends=True)`.
fn split_lines(text: &str) -> Vec<&str> {
    let mut lines = Vec::new();
    let mut start = 0;
    let mut chars = text.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        let end = match c {
            '\r' if chars.peek().is_some_and(|&(_, next)| next == '\n') => {
                chars.next();
                i + 2
            }
            '\n' | '\r' | '\x0b' | '\x0c' | '\x1c' | '\x1d' | '\x1e' | '\u{85}' | '\u{2028}'
            | '\u{2029}' => i + c.len_utf8(),
            _ => continue,
        };
        lines.push(&text[start..end]);
        start = end;
    }
    if start < text.len() {
        lines.push(&text[start..]);
    }
    lines
}

/// The line breaks Python's tokenizer (and Ruff's) counts in `text`.
pub(super) fn newlines(text: &str) -> u32 {
    let bytes = text.as_bytes();
    let mut count = 0;
    for (i, &b) in bytes.iter().enumerate() {
        if b == b'\n' || (b == b'\r' && bytes.get(i + 1) != Some(&b'\n')) {
            count += 1;
        }
    }
    count
}

static CLASSIC_INITIAL: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"^>>>( |$)").unwrap());
static CLASSIC: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"^(>>>|\.\.\.)( |$)").unwrap());
static IPYTHON_PROMPT: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^(((\[nav\]|\[ins\])? )?In \[\d+\]: |\s*\.{3,}: ?)").unwrap());
static CELL_MAGIC_HELP: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"^%%\w+\?").unwrap());

/// A line without its end (Python's `$` also matches before a final `\n`).
fn body(line: &str) -> &str {
    line.strip_suffix('\n').unwrap_or(line)
}

/// IPython's `PromptStripper`: strips `prompt` from every line when the first line has
/// `initial`, or the second `prompt`.
fn strip_prompts(lines: &mut [Cow<'_, str>], initial: &Regex, prompt: &Regex) {
    let applies = lines.first().is_some_and(|l| initial.is_match(body(l)))
        || lines.get(1).is_some_and(|l| prompt.is_match(body(l)));
    if applies {
        for line in lines.iter_mut() {
            if let Some(found) = prompt.find(body(line)) {
                *line = Cow::Owned(line[found.end()..].to_owned());
            }
        }
    }
}

/// A cell as IPython reads it, before its tokens.
pub(super) enum Cell<'a> {
    /// Python (with IPython's escapes), and, for a cell of one line, the magic that line would
    /// be if its first word is one (automagic), and the call it would be with `%autocall` on
    /// (`f x` is `f(x)`).
    Code {
        text: Cow<'a, str>,
        automagic: Option<Automagic>,
        autocall: Option<(String, u32)>,
    },
    /// `%%name line` then the body.
    Magic {
        name: String,
        line: String,
        body: String,
        line_no: u32,
    },
}

/// `name rest`, a one-line cell IPython may run as the magic `%name rest`.
pub(super) struct Automagic {
    pub name: String,
    pub rest: String,
    pub line_no: u32,
    /// Whether IPython has a line magic of that name (not Python then, if it does not parse).
    pub known: bool,
}

/// IPython's cleanup and cell-magic steps (see the module's documentation). Line numbers are
/// kept: dropped leading lines leave their line breaks.
pub(super) fn prepare(code: &str) -> Cell<'_> {
    let lines = split_lines(code);
    let Some(first) = lines.iter().position(|l| !l.chars().all(py_space)) else {
        return Cell::Code {
            text: Cow::Borrowed(code),
            automagic: None,
            autocall: None,
        };
    };
    let line_no = 1 + lines[..first].iter().map(|l| newlines(l)).sum::<u32>();
    let mut rest: Vec<Cow<'_, str>> = lines[first..].iter().map(|l| Cow::Borrowed(*l)).collect();
    let indent = rest[0].len() - rest[0].trim_start_matches([' ', '\t']).len();
    if indent > 0 {
        let prefix = rest[0][..indent].to_owned();
        for line in rest.iter_mut() {
            if let Some(stripped) = line.strip_prefix(prefix.as_str()) {
                *line = Cow::Owned(stripped.to_owned());
            }
        }
    }
    strip_prompts(&mut rest, &CLASSIC_INITIAL, &CLASSIC);
    strip_prompts(&mut rest, &IPYTHON_PROMPT, &IPYTHON_PROMPT);
    let head = &rest[0];
    if head.starts_with("%%") && !CELL_MAGIC_HELP.is_match(head) {
        let head = head[2..].trim_end_matches(py_space);
        let (name, line) = head.split_once(' ').unwrap_or((head, ""));
        let body: String = rest[1..].concat();
        return Cell::Magic {
            name: name.to_owned(),
            line: line.to_owned(),
            body,
            line_no,
        };
    }
    let single = rest.len() == 1;
    let automagic = if single {
        automagic(head, line_no)
    } else {
        None
    };
    let autocall = if single {
        autocall(head).map(|call| (call, line_no))
    } else {
        None
    };
    let changed = first > 0 || rest.iter().any(|l| matches!(l, Cow::Owned(_)));
    let text = if changed {
        let breaks = "\n".repeat(line_no as usize - 1);
        Cow::Owned(breaks + &rest.concat())
    } else {
        Cow::Borrowed(code)
    };
    Cell::Code {
        text,
        automagic,
        autocall,
    }
}

/// IPython's `split_user_input` and its automagic checker, for one line.
fn automagic(line: &str, line_no: u32) -> Option<Automagic> {
    let line = line.trim_matches(py_space);
    if line.starts_with([',', ';', '/', '%', '!', '?']) || line.ends_with('?') {
        return None; // an escape or help: IPython's transforms have made it a call already
    }
    let end = line
        .find(|c: char| !(c == '_' || c == '.' || c == '*' || c.is_alphanumeric()))
        .unwrap_or(line.len());
    let (name, rest) = line.split_at(end);
    let rest = rest.trim_start_matches(py_space).trim_end_matches(py_space);
    if name.is_empty() || name.contains(['.', '*']) || rest.starts_with(['=', ',']) {
        return None;
    }
    let known = is_line_magic(name);
    Some(Automagic {
        name: name.to_owned(),
        rest: rest.to_owned(),
        line_no,
        known,
    })
}

/// IPython's autocall (off by default, `%autocall` turns it on): `f x` runs `f(x)` when the
/// line does not go on like Python (its prefilter's `PythonOpsChecker`, `AutocallChecker`).
fn autocall(line: &str) -> Option<String> {
    let line = line.trim_matches(py_space);
    let end = line
        .find(|c: char| !(c == '_' || c == '.' || c.is_alphanumeric()))
        .unwrap_or(line.len());
    let (name, rest) = line.split_at(end);
    let rest = rest.trim_start_matches(py_space);
    let python = rest.starts_with(|c| "!=()<>,+*/%^&|-".contains(c))
        || ["is ", "not ", "in ", "and ", "or "]
            .iter()
            .any(|w| rest.starts_with(w));
    let string_prefix = ["b", "f", "r", "u", "br", "rb", "fr", "rf"]
        .contains(&name.to_ascii_lowercase().as_str())
        && line[name.len()..].starts_with(['\'', '"']);
    if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) || rest.is_empty() {
        return None;
    }
    if python || string_prefix {
        return None;
    }
    Some(match rest.strip_suffix(';') {
        Some(args) => format!("{name}({args});"),
        None => format!("{name}({rest})"),
    })
}

/// The Python expressions IPython's `var_expand` evaluates in a magic's arguments or a shell
/// command: each `{expr}` (`{{` is a brace), and each `$name.attr`.
pub(super) fn expansions(text: &str) -> Vec<&str> {
    let mut found = Vec::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() && found.len() < 64 {
        match bytes[i] {
            b'{' if bytes.get(i + 1) == Some(&b'{') => i += 2,
            b'{' => {
                let mut depth = 0;
                let start = i + 1;
                while i < bytes.len() {
                    match bytes[i] {
                        b'{' => depth += 1,
                        b'}' if depth == 1 => break,
                        b'}' => depth -= 1,
                        _ => {}
                    }
                    i += 1;
                }
                found.push(&text[start..i.min(text.len())]);
                i += 1;
            }
            b'$' => {
                let start = i + 1 + usize::from(bytes.get(i + 1) == Some(&b'$'));
                let end = text[start..]
                    .find(|c: char| !(c == '_' || c == '.' || c.is_alphanumeric()))
                    .map_or(text.len(), |n| start + n);
                if end > start {
                    found.push(&text[start..end]);
                }
                i = end.max(i + 1);
            }
            _ => i += 1,
        }
    }
    found
}

/// A magic's name as written in `%name args` (ruff's value of the escape), and its arguments.
pub(super) fn split_magic(value: &str) -> (&str, &str) {
    let value = value.trim_start_matches(py_space);
    let (name, args) = value.split_once(py_space).unwrap_or((value, ""));
    (name.trim_start_matches('%').trim_end_matches('?'), args)
}

/// The Python line IPython makes of `/f a b` (`f(a, b)`), `,f a b` (`f("a", "b")`) and
/// `;f a b` (`f("a b")`).
pub(super) fn escape_call(kind: IpyEscapeKind, value: &str) -> Option<String> {
    let (name, args) = value.split_once(' ').unwrap_or((value, ""));
    let words = || {
        args.split(py_space)
            .filter(|w| !w.is_empty())
            .collect::<Vec<_>>()
    };
    match kind {
        IpyEscapeKind::Paren => Some(format!("{name}({})", words().join(", "))),
        IpyEscapeKind::Quote => Some(format!("{name}(\"{}\")", words().join("\", \""))),
        IpyEscapeKind::Quote2 => Some(format!("{name}(\"{args}\")")),
        _ => None,
    }
}

/// Where the code of a code magic's line may begin: after each of its first words (its
/// options are not known here, so each reading is checked).
pub(super) fn code_suffixes(args: &str) -> Vec<&str> {
    let mut suffixes = Vec::new();
    let mut rest = args.trim_start_matches(py_space);
    while !rest.is_empty() && suffixes.len() < 8 {
        suffixes.push(rest);
        let word_end = rest.find(py_space).unwrap_or(rest.len());
        rest = rest[word_end..].trim_start_matches(py_space);
    }
    suffixes
}

/// The modules a magic's arguments import: `%load_ext m`, `%reload_ext m`, `%aimport m, n`,
/// `%run -m m`, `%matplotlib module://m`.
pub(super) fn magic_imports<'v>(name: &str, args: &'v str) -> Vec<&'v str> {
    let words = args
        .split(|c: char| py_space(c) || c == ',')
        .filter(|w| !w.is_empty());
    let dotted = |w: &&str| Pattern::dotted(w).is_ok() && !w.contains('*');
    match name {
        "load_ext" | "reload_ext" => words.filter(dotted).collect(),
        "aimport" => words
            .map(|w| w.trim_start_matches('-'))
            .filter(dotted)
            .collect(),
        "run" => words
            .skip_while(|w| *w != "-m")
            .nth(1)
            .into_iter()
            .collect(),
        "matplotlib" | "pylab" => words.filter_map(|w| w.strip_prefix("module://")).collect(),
        _ => Vec::new(),
    }
}
