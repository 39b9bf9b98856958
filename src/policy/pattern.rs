//! The patterns of a rule: dotted names (`os.system`, `subprocess.*`, `os.exec*`), attribute
//! names and magic names, validated when the policy is loaded.

/// Why a pattern is not valid (each variant carries the pattern as written).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum PatternError {
    #[error("{0:?} is not a dotted name (an empty part)")]
    EmptyPart(String),
    #[error("{0:?}: `*` stands alone or ends the last part (`os.*`, `os.exec*`)")]
    Star(String),
    #[error("{0:?}: {1:?} is not a Python identifier")]
    NotIdentifier(String, String),
    #[error("{0:?} alone would deny everything")]
    Everything(String),
    #[error("{0:?}: an attribute's or a magic's name has no dots")]
    Dots(String),
}

/// One part of a pattern: a whole name, or a prefix (`exec*`; `*` alone is the empty prefix).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Exact(String),
    Prefix(String),
}

impl Segment {
    fn matches(&self, part: &str) -> bool {
        match self {
            Segment::Exact(name) => part == name,
            Segment::Prefix(prefix) => part.starts_with(prefix.as_str()),
        }
    }
}

/// A validated pattern. It matches a dotted path whose first parts it matches, part by part:
/// `socket` matches `socket` and `socket.create_connection`, `subprocess.*` matches
/// `subprocess.run` (and `subprocess.run.x`) but not `subprocess` itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Pattern {
    segments: Vec<Segment>,
}

/// The names Python gives the builtins module; `builtins.eval` is `eval`.
pub(super) const BUILTINS: [&str; 3] = ["builtins", "__builtins__", "__builtin__"];

fn is_identifier(part: &str) -> bool {
    let mut chars = part.chars();
    matches!(chars.next(), Some(c) if c == '_' || c.is_ascii_alphabetic())
        && chars.all(|c| c == '_' || c.is_ascii_alphanumeric())
}

/// The last part: `name`, `name*` or `*`.
fn last_segment(part: &str, text: &str) -> Result<Segment, PatternError> {
    match part.strip_suffix('*') {
        Some(prefix) if prefix.is_empty() || is_identifier(prefix) => {
            Ok(Segment::Prefix(prefix.to_owned()))
        }
        Some(_) => Err(PatternError::Star(text.to_owned())),
        None if is_identifier(part) => Ok(Segment::Exact(part.to_owned())),
        None if part.contains('*') => Err(PatternError::Star(text.to_owned())),
        None => Err(PatternError::NotIdentifier(
            text.to_owned(),
            part.to_owned(),
        )),
    }
}

impl Pattern {
    /// A module or function: dotted identifiers, a `*` only in the last part.
    pub(super) fn dotted(text: &str) -> Result<Pattern, PatternError> {
        let parts: Vec<&str> = text.split('.').collect();
        if parts.iter().any(|part| part.is_empty()) {
            return Err(PatternError::EmptyPart(text.to_owned()));
        }
        // `builtins.eval` is written `eval` in the code this is matched with.
        let skip = usize::from(parts.len() > 1 && BUILTINS.contains(&parts[0]));
        let parts = &parts[skip..];
        let mut segments = Vec::with_capacity(parts.len());
        for (i, part) in parts.iter().enumerate() {
            if i + 1 == parts.len() {
                segments.push(last_segment(part, text)?);
            } else if is_identifier(part) {
                segments.push(Segment::Exact((*part).to_owned()));
            } else if part.contains('*') {
                return Err(PatternError::Star(text.to_owned()));
            } else {
                let part = (*part).to_owned();
                return Err(PatternError::NotIdentifier(text.to_owned(), part));
            }
        }
        if segments == [Segment::Prefix(String::new())] {
            return Err(PatternError::Everything(text.to_owned()));
        }
        Ok(Pattern { segments })
    }

    /// An attribute name: one identifier, possibly ending in `*` (not `*` alone).
    pub(super) fn attribute(text: &str) -> Result<Pattern, PatternError> {
        if text.contains('.') {
            return Err(PatternError::Dots(text.to_owned()));
        }
        let segment = last_segment(text, text)?;
        if segment == Segment::Prefix(String::new()) {
            return Err(PatternError::Everything(text.to_owned()));
        }
        Ok(Pattern {
            segments: vec![segment],
        })
    }

    /// A magic's name, with or without its `%`: `bash`, `%%bash`, `!` (the shell), `pip*`,
    /// or `*` (every magic).
    pub(super) fn magic(text: &str) -> Result<Pattern, PatternError> {
        let name = text.trim_start_matches('%');
        if name == "!" {
            return Ok(Pattern::exact("!"));
        }
        if name.contains('.') {
            return Err(PatternError::Dots(text.to_owned()));
        }
        Ok(Pattern {
            segments: vec![last_segment(name, text)?],
        })
    }

    pub(super) fn exact(name: &str) -> Pattern {
        Pattern {
            segments: vec![Segment::Exact(name.to_owned())],
        }
    }

    /// Whether the pattern matches `path` (dotted) or a path `path` starts with.
    pub(super) fn matches(&self, path: &str) -> bool {
        let mut parts = path.split('.');
        self.segments
            .iter()
            .all(|segment| parts.next().is_some_and(|part| segment.matches(part)))
    }

    /// The pattern of its first part alone (`os` of `os.system`).
    pub(super) fn first(&self) -> Pattern {
        Pattern {
            segments: self.segments[..1].to_vec(),
        }
    }

    /// Whether it names one thing (no `*`).
    pub(super) fn is_exact(&self) -> bool {
        self.segments.iter().all(|s| matches!(s, Segment::Exact(_)))
    }

    /// Whether it matches `name` itself, not only a path that begins with it.
    pub(super) fn matches_whole(&self, name: &str) -> bool {
        self.segments.len() == 1 && self.segments[0].matches(name)
    }
}
