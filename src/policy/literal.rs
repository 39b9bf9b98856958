//! The literal values the checks read: strings (a module's or an attribute's name, code given
//! to `exec`) and a call's arguments.

use std::borrow::Cow;

use ruff_python_ast::{Expr, ExprCall, FStringPart, InterpolatedStringElement};

/// A string literal's value (implicitly concatenated, or an f-string without fields).
pub(super) fn literal_str(expr: &Expr) -> Option<Cow<'_, str>> {
    match expr {
        Expr::StringLiteral(s) => Some(Cow::Borrowed(s.value.to_str())),
        Expr::FString(f) => {
            let mut text = String::new();
            for part in f.value.iter() {
                match part {
                    FStringPart::Literal(s) => text.push_str(&s.value),
                    FStringPart::FString(f) => {
                        for element in f.elements.iter() {
                            match element {
                                InterpolatedStringElement::Literal(l) => text.push_str(&l.value),
                                InterpolatedStringElement::Interpolation(_) => return None,
                            }
                        }
                    }
                }
            }
            Some(Cow::Owned(text))
        }
        _ => None,
    }
}

/// A string or (UTF-8) bytes literal: the source given to `exec` or `compile`.
pub(super) fn literal_source(expr: &Expr) -> Option<Cow<'_, str>> {
    match expr {
        Expr::BytesLiteral(b) => String::from_utf8(b.value.bytes().collect())
            .ok()
            .map(Cow::Owned),
        _ => literal_str(expr),
    }
}

/// A call's argument by position (when no `*args` comes before it) or by keyword.
pub(super) fn argument<'e>(call: &'e ExprCall, position: usize, keyword: &str) -> Option<&'e Expr> {
    let args = &call.arguments.args;
    if args
        .iter()
        .take(position + 1)
        .any(|a| matches!(a, Expr::Starred(_)))
    {
        return None;
    }
    args.get(position).or_else(|| {
        let keywords = call.arguments.keywords.iter();
        keywords
            .filter(|k| k.arg.as_ref().is_some_and(|a| a.as_str() == keyword))
            .map(|k| &k.value)
            .next()
    })
}
