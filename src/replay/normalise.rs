//! Output normalisation: what replay does not count as a difference.
//!
//! The rules, applied in this order to every compared text:
//! 1. UUIDs (`8-4-4-4-12` hex) become `<uuid>`.
//! 2. ISO 8601 date-times (`2024-05-01T12:03:04.123+00:00`, `2024-05-01 12:03:04`) become
//!    `<datetime>`; dates alone `<date>`; times of day (`12:03:04.5`) `<time>`.
//! 3. Hexadecimal numbers of 6 or more digits (`0x7f3a2c1b9e80`, memory addresses in
//!    reprs) become `0x<addr>`.
//! 4. Temporary paths (under `/tmp`, `/var/tmp`, `/dev/shm`, `/var/folders`) and tempfile
//!    names (`tmpk3j2_x9a`) become `<tmp>`.
//! 5. Durations (a number with `ns`, `µs`, `us`, `ms`, `s`, `sec`, `second(s)`, `min`,
//!    `minute(s)`: `1.23 s`, `123ms`) become `<duration>`.
//! 6. Integers of 12 or more digits (`id()` values, epoch times in ms, µs or ns) become
//!    `<number>`; numbers whose integer part has 10 digits between 1500000000 and
//!    2100000000 (epoch seconds, with or without a fraction) become `<timestamp>`.
//! 7. Images: `image/*` values are shown as `<N KB class>`, by decoded size: under 1 KB,
//!    1-10 KB, 10-100 KB, 100 KB-1 MB, over 1 MB.
//!
//! What is not normalised, and so shows as a difference: random numbers, small integers
//! that vary (process ids, ports), dates in other formats, and set or dict orders that
//! depend on hashing.
//!
//! Pure functions; their table of cases is in `super::tests`.

use std::sync::LazyLock;

use regex::Regex;

macro_rules! re {
    ($name:ident, $pattern:expr) => {
        // The patterns are constants, checked by the unit tests: compiling cannot fail.
        #[allow(clippy::unwrap_used)]
        static $name: LazyLock<Regex> = LazyLock::new(|| Regex::new($pattern).unwrap());
    };
}

re!(
    UUID,
    r"(?i)\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"
);
re!(
    DATETIME,
    r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?"
);
re!(DATE, r"\b\d{4}-\d{2}-\d{2}\b");
re!(TIME, r"\b\d{1,2}:\d{2}:\d{2}(?:\.\d+)?\b");
re!(HEX, r"\b0x[0-9a-fA-F]{6,}\b");
re!(
    TMP_PATH,
    r#"(?:/private)?(?:/tmp|/var/tmp|/dev/shm|/var/folders)/[^\s'"`)\]}>,;:]*"#
);
re!(TMP_NAME, r"\btmp[a-z0-9_]{6,}\b");
re!(
    DURATION,
    r"\b\d+(?:\.\d+)?\s?(?:ns|µs|us|ms|s|sec|secs|seconds?|min|mins|minutes?)\b"
);
re!(NUMBER, r"\d+(?:\.\d+)?");

/// Apply the normalisation rules (see the module documentation) to `text`.
pub fn normalise(text: &str) -> String {
    let t = UUID.replace_all(text, "<uuid>");
    let t = DATETIME.replace_all(&t, "<datetime>");
    let t = DATE.replace_all(&t, "<date>");
    let t = TIME.replace_all(&t, "<time>");
    let t = HEX.replace_all(&t, "0x<addr>");
    let t = TMP_PATH.replace_all(&t, "<tmp>");
    let t = TMP_NAME.replace_all(&t, "<tmp>");
    let t = DURATION.replace_all(&t, "<duration>");
    let t = NUMBER.replace_all(&t, |c: &regex::Captures<'_>| {
        let m = &c[0];
        let int = m.split('.').next().unwrap_or(m);
        if int.len() == 10 && ("1500000000".."2100000000").contains(&int) {
            "<timestamp>".to_string()
        } else if int.len() >= 12 && !m.contains('.') {
            "<number>".to_string()
        } else {
            m.to_string()
        }
    });
    t.into_owned()
}

/// The size class of a base64 image.
pub(super) fn size_class(b64: &str) -> &'static str {
    let bytes = b64.len() / 4 * 3;
    match bytes {
        0..1_000 => "<1 KB",
        1_000..10_000 => "1-10 KB",
        10_000..100_000 => "10-100 KB",
        100_000..1_000_000 => "100 KB-1 MB",
        _ => ">1 MB",
    }
}
