//! A bound on the syntax tree's depth, estimated from the tokens before parsing.
//!
//! The parser grows its own stack, but the tree it returns is dropped, and walked, by
//! recursion: `a+a+…+a` (one left-nested node per `+`), `not not … x`, `f()()()…` or 5,000
//! parentheses would overflow a thread's stack. So the code is lexed first (Ruff's lexer, no
//! recursion) and its depth estimated from above: each bracket opens a level; within a level,
//! each operator or keyword token may add one node around what precedes it, and a comma (a
//! sibling), a newline or `;` (a new statement) or an assignment's `=` start over; a closed
//! bracket adds its deepest part to the level it is in, and each indentation two levels (a
//! statement and its body). The estimate is never below the real depth: every node of a path
//! from the root owns a token of the segment it is in (an operator, a keyword, a bracket).
//! Long flat data (`[1, 2, …]`, many short statements) stays shallow; one expression of
//! more than [`MAX_DEPTH`] operators is refused, which no hand-written code comes near.

use ruff_python_ast::token::TokenKind;
use ruff_python_parser::{lexer, Mode};

/// The deepest estimated tree checked, code in code included (an `exec` 400 deep may run
/// code 100 deep). Walking 500 levels takes about 1 MiB of stack in a debug build, 250 KiB
/// in a release build.
pub(super) const MAX_DEPTH: u32 = 500;

#[derive(Default)]
struct Level {
    /// The estimate of the current segment (since the last comma).
    current: u32,
    /// The deepest segment of the level so far.
    deepest: u32,
    /// `lambda`s whose `:` has not come yet: their parameters' commas are not siblings.
    lambdas: u32,
}

/// Whether the estimate stays within `room` (when not, the lexer does not say where).
pub(super) fn within(source: &str, mode: Mode, room: u32) -> bool {
    let mut lexer = lexer::lex(source, mode);
    let mut levels = vec![Level::default()];
    // The sum of the levels' `current`.
    let mut total: u32 = 0;
    let mut indents: u32 = 0;
    loop {
        let kind = lexer.next_token();
        let outermost = levels.len() == 1;
        let level = levels.last_mut().expect("level 0 is never popped");
        match kind {
            TokenKind::EndOfFile => return true,
            TokenKind::Indent => indents += 1,
            TokenKind::Dedent => indents = indents.saturating_sub(1),
            TokenKind::Name
            | TokenKind::Int
            | TokenKind::Float
            | TokenKind::Complex
            | TokenKind::String
            | TokenKind::FStringMiddle
            | TokenKind::TStringMiddle
            | TokenKind::Comment
            | TokenKind::NonLogicalNewline
            | TokenKind::Case
            | TokenKind::Lazy
            | TokenKind::Match
            | TokenKind::Type => {}
            TokenKind::Newline | TokenKind::Semi => {
                // Only ever at level 0 in valid code; anywhere, a new statement.
                total -= level.current;
                level.current = 0;
                level.lambdas = 0;
            }
            TokenKind::Comma if level.lambdas == 0 => {
                level.deepest = level.deepest.max(level.current);
                total -= level.current;
                level.current = 0;
            }
            TokenKind::Equal if outermost => {
                total -= level.current;
                level.current = 0;
            }
            TokenKind::Lpar
            | TokenKind::Lsqb
            | TokenKind::Lbrace
            | TokenKind::FStringStart
            | TokenKind::TStringStart => {
                level.current += 1;
                total += 1;
                levels.push(Level::default());
            }
            TokenKind::Rpar
            | TokenKind::Rsqb
            | TokenKind::Rbrace
            | TokenKind::FStringEnd
            | TokenKind::TStringEnd => {
                if levels.len() > 1 {
                    let inner = levels.pop().expect("more than one level");
                    total -= inner.current;
                    let deepest = inner.deepest.max(inner.current);
                    let outer = levels.last_mut().expect("level 0 is never popped");
                    outer.current += deepest;
                    total += deepest;
                }
            }
            TokenKind::Lambda => {
                level.lambdas += 1;
                level.current += 1;
                total += 1;
            }
            TokenKind::Colon => {
                level.lambdas = level.lambdas.saturating_sub(1);
                level.current += 1;
                total += 1;
            }
            _ => {
                level.current += 1;
                total += 1;
            }
        }
        let depth = total + levels.len() as u32 + 2 * indents;
        if depth > room {
            return false;
        }
    }
}
