//! Replay's pure transforms as tables (`check(input, expect)`): normalisation, the
//! rendered form of a cell's output, comparison, and outputs read like executions.

use serde_json::{json, Value};

use super::*;
use crate::session::Execution;

/// Normalises each input and compares with its expected text; every mismatch is listed.
fn check(cases: &[(&str, &str)]) {
    let wrong: Vec<String> = cases
        .iter()
        .filter(|(input, expect)| normalise(input) != *expect)
        .map(|(input, expect)| {
            format!(
                "normalise({input:?})\n   got {:?}\n  want {expect:?}",
                normalise(input)
            )
        })
        .collect();
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn normalisation_rules() {
    let cases = [
        // Addresses (rule 3).
        (
            "<object object at 0x7f3a2c1b9e80>",
            "<object object at 0x<addr>>",
        ),
        ("<Foo at 0x7FFF2C1B9E80>", "<Foo at 0x<addr>>"),
        ("0x10 stays", "0x10 stays"),
        ("0x12345 stays, 0x123456 not", "0x12345 stays, 0x<addr> not"),
        // Large integers and epoch times (rule 6).
        ("140234567890123\n", "<number>\n"),
        ("0.8444218515250481", "0.8444218515250481"),
        ("42", "42"),
        ("t=1718000000.123", "t=<timestamp>"),
        ("1718000000", "<timestamp>"),
        ("1499999999 and 2100000000", "1499999999 and 2100000000"),
        ("ms=1718000000123", "ms=<number>"),
        ("12345678901", "12345678901"),
        ("123456789012.5", "123456789012.5"),
        ("3 items in 2 sets", "3 items in 2 sets"),
        // Durations (rule 5).
        (
            "took 1.23 s and 123 ms, 5µs, 3 minutes",
            "took <duration> and <duration>, <duration>, <duration>",
        ),
        ("Wall time: 12.5ms", "Wall time: <duration>"),
        (
            "1 second, 2 secs, 10 us, 5ns, 1 min",
            "<duration>, <duration>, <duration>, <duration>, <duration>",
        ),
        ("3 steps", "3 steps"),
        // UUIDs (rule 1).
        ("id 3f2b8c1e-9a4d-4e6f-8b2a-1c3d5e7f9a0b", "id <uuid>"),
        ("ID 3F2B8C1E-9A4D-4E6F-8B2A-1C3D5E7F9A0B.", "ID <uuid>."),
        // Dates and times (rule 2).
        ("at 2024-05-01T12:03:04.123456+00:00.", "at <datetime>."),
        ("2024-05-01 12:03:04", "<datetime>"),
        ("2024-05-01T12:03Z", "<datetime>"),
        ("on 2024-05-01", "on <date>"),
        ("at 12:03:04.5", "at <time>"),
        ("01/05/2024 stays", "01/05/2024 stays"),
        // Temporary files (rule 4).
        ("wrote /tmp/tmpab3k_9xz/out.csv", "wrote <tmp>"),
        ("file tmpab3k_9xz.txt", "file <tmp>.txt"),
        ("'/var/tmp/x.log'", "'<tmp>'"),
        ("(/dev/shm/seg)", "(<tmp>)"),
        ("/private/var/folders/ab/T/x.txt: ok", "<tmp>: ok"),
        ("/home/alice/data.csv", "/home/alice/data.csv"),
        // Rules apply in order: a date inside a temporary path goes first, and the path
        // then ends at its `>` (the same on both sides, so it still compares equal).
        ("/tmp/run-2024-05-01/x", "<tmp>>/x"),
    ];
    check(&cases);
}

/// Renders `observed` and compares with `expect`.
fn check_render(observed: Observed, expect: &str) {
    assert_eq!(render(&observed), expect, "render({observed:?})");
}

#[test]
fn rendered_outputs() {
    let png = |n: usize| Value::String("A".repeat(n));
    let cases = [
        (Observed::default(), ""),
        (
            Observed {
                stdout: "at 0x7f3a2c1b9e80".into(),
                stderr: "warn".into(),
                ..Default::default()
            },
            "--- stdout\nat 0x<addr>\n--- stderr\nwarn\n",
        ),
        (
            Observed {
                results: vec![
                    (
                        false,
                        json!({"text/plain": ["a", "b\n"], "image/png": png(40), "image/svg+xml": "<svg/>", "text/html": "<b>"}),
                    ),
                    (true, json!({"text/plain": 7})),
                ],
                ..Default::default()
            },
            "--- display\nimage/png: <1 KB\nimage/svg+xml: present\ntext/html: present\ntext/plain:\nab\n--- result\ntext/plain:\n7\n",
        ),
        (
            Observed {
                results: vec![(false, json!({"image/jpeg": png(2_000_000)}))],
                error: Some(("E".into(), "at 12:03:04".into())),
                ..Default::default()
            },
            "--- display\nimage/jpeg: >1 MB\n--- error\nE: at <time>\n",
        ),
    ];
    for (observed, expect) in cases {
        check_render(observed, expect);
    }
}

#[test]
fn image_size_classes() {
    let cases = [
        (0, "<1 KB"),
        (1_332, "<1 KB"),
        (1_336, "1-10 KB"),
        (13_336, "10-100 KB"),
        (133_336, "100 KB-1 MB"),
        (1_333_336, ">1 MB"),
    ];
    for (len, expect) in cases {
        assert_eq!(normalise::size_class(&"A".repeat(len)), expect, "{len}");
    }
}

#[test]
fn executions_are_observed_as_they_were_answered() {
    let x: Execution = serde_json::from_value(json!({
        "status": "error", "execution_count": 3, "stdout": "o", "stderr": "e",
        "results": [{"data": {"text/plain": "1"}, "metadata": {}, "is_main_result": true}],
        "error": {"ename": "E", "evalue": "v", "traceback": ["tb"]},
        "truncated": false, "duration_ms": 1.0,
    }))
    .unwrap();
    assert_eq!(
        Observed::of_execution(&x),
        Observed {
            stdout: "o".into(),
            stderr: "e".into(),
            results: vec![(true, json!({"text/plain": "1"}))],
            error: Some(("E".into(), "v".into())),
        }
    );
}

fn exec(stdout: &str, results: Vec<(bool, Value)>, error: Option<(&str, &str)>) -> Observed {
    Observed {
        stdout: stdout.into(),
        stderr: String::new(),
        results,
        error: error.map(|(a, b)| (a.into(), b.into())),
    }
}

#[test]
fn comparisons() {
    let png = |n: usize| Value::String("A".repeat(n));
    let same = [
        (exec("a\n", vec![], None), exec("a\n", vec![], None)),
        (
            exec(
                "",
                vec![(true, json!({"text/plain": "140234567890123"}))],
                None,
            ),
            exec(
                "",
                vec![(true, json!({"text/plain": "139876543210987"}))],
                None,
            ),
        ),
        (
            exec(
                "",
                vec![(
                    false,
                    json!({"image/png": png(40_000), "text/plain": "<Figure size 640x480 with 1 Axes>"}),
                )],
                None,
            ),
            exec(
                "",
                vec![(
                    false,
                    json!({"image/png": png(44_000), "text/plain": "<Figure size 640x480 with 1 Axes>"}),
                )],
                None,
            ),
        ),
        (
            exec("", vec![], Some(("KeyError", "'x'"))),
            exec("", vec![], Some(("KeyError", "'x'"))),
        ),
    ];
    for (a, b) in same {
        assert_eq!(compare(&a, &b), (true, String::new()));
    }
    let different = [
        (
            exec(
                "",
                vec![(true, json!({"text/plain": "0.8444218515250481"}))],
                None,
            ),
            exec(
                "",
                vec![(true, json!({"text/plain": "0.7579544029403025"}))],
                None,
            ),
            "-0.8444218515250481",
        ),
        (exec("a\n", vec![], None), exec("b\n", vec![], None), "+b"),
        (
            exec("", vec![(false, json!({"image/png": png(400)}))], None),
            exec("", vec![(false, json!({"image/png": png(40_000)}))], None),
            "+image/png: 10-100 KB",
        ),
        (
            exec("", vec![], None),
            exec("", vec![], Some(("NameError", "name 'x' is not defined"))),
            "+NameError",
        ),
    ];
    for (a, b, needle) in different {
        let (same, diff) = compare(&a, &b);
        assert!(!same);
        assert!(
            diff.contains("--- recorded") && diff.contains("+++ replayed"),
            "{diff}"
        );
        assert!(diff.contains(needle), "{needle} not in\n{diff}");
    }
}

#[test]
fn outputs_are_observed_like_executions() {
    let outputs = vec![
        json!({"output_type": "stream", "name": "stdout", "text": "abcdef"}),
        json!({"output_type": "stream", "name": "stderr", "text": "w"}),
        json!({"output_type": "execute_result", "data": {"text/plain": "1"}, "metadata": {}, "execution_count": 1}),
        json!({"output_type": "error", "ename": "E", "evalue": "v", "traceback": []}),
    ];
    let o = Observed::of_outputs(&outputs, 3);
    assert_eq!(o.stdout, "abc");
    assert_eq!(o.stderr, "w");
    assert_eq!(o.results, vec![(true, json!({"text/plain": "1"}))]);
    assert_eq!(o.error, Some(("E".into(), "v".into())));
}
