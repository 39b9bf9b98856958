//! The policy's configuration, its users and languages, and its bounds. (Its Python rules:
//! `tests_python.rs`; IPython's syntax: `tests_ipython.rs`.)

use super::*;

pub(super) const EXAMPLE: &str = r#"
[[rule]]
name = "no-network"
message = "network access is not allowed here"
users = ["alice", "bob"]
deny_imports = ["socket", "ssl", "http.client", "requests"]

[[rule]]
name = "no-shell"
deny_calls = ["os.system", "os.exec*", "subprocess.*", "eval"]
deny_attributes = ["__subclasses__", "__globals__"]
deny_magics = ["system", "bash", "sh", "script"]
"#;

pub(super) fn policy(text: &str) -> Policy {
    Policy::from_toml(text).unwrap_or_else(|e| panic!("{e}"))
}

/// The start of `code`, for a message.
fn short(code: &str) -> String {
    code.chars().take(200).collect()
}

#[track_caller]
pub(super) fn refused(policy: &Policy, code: &str) -> Refusal {
    match policy.check("alice", "python", code) {
        Ok(()) => panic!("not refused: {:?}", short(code)),
        Err(refusal) => refusal,
    }
}

#[track_caller]
pub(super) fn allowed(policy: &Policy, code: &str) {
    if let Err(refusal) = policy.check("alice", "python", code) {
        let what: String = refusal.what.chars().take(300).collect();
        panic!(
            "refused: {:?}: {} (line {})",
            short(code),
            what,
            refusal.line
        );
    }
}

/// `code` is refused by `rule` for `what` (a part of the description).
#[track_caller]
pub(super) fn refused_by(policy: &Policy, code: &str, rule: &str, what: &str) -> Refusal {
    let refusal = refused(policy, code);
    let said = format!("{:?}: {}", short(code), short(&refusal.to_string()));
    assert_eq!(refusal.rule, rule, "{said}");
    assert!(refusal.what.contains(what), "{said}");
    refusal
}

fn config_error(text: &str) -> String {
    match Policy::from_toml(text) {
        Ok(_) => panic!("accepted: {text}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn the_example_loads() {
    let p = policy(EXAMPLE);
    assert!(!p.is_empty());
    assert_eq!(p.rule_names(), ["no-network", "no-shell"]);
    assert!(policy("").is_empty());
    let dynamic = policy("[[rule]]\nname = \"a\"\ndeny_dynamic_attributes = true\n");
    assert_eq!(dynamic.rule_names(), ["a"]);
}

#[test]
fn configuration_errors_name_the_rule_and_field() {
    let rule = |body: &str| format!("[[rule]]\nname = \"r\"\n{body}\n");
    let cases = [
        ("other = 1\n".to_owned(), "other"),
        (rule("deny_everything = true"), "deny_everything"),
        ("[[rule]]\ndeny_imports = [\"x\"]\n".to_owned(), "name"),
        (
            "[[rule]]\nname = \"a b\"\ndeny_imports = [\"x\"]\n".to_owned(),
            "rule #1: name",
        ),
        (
            rule("deny_imports = [\"x\"]") + &rule("deny_imports = [\"y\"]"),
            "rule \"r\": name",
        ),
        (
            "[[rule]]\nname = \"policy\"\ndeny_imports = [\"x\"]\n".to_owned(),
            "name",
        ),
        (rule(""), "rule \"r\": rule: denies nothing"),
        (rule("deny_dynamic_attributes = false"), "denies nothing"),
        (
            rule("users = []\ndeny_imports = [\"x\"]"),
            "rule \"r\": users",
        ),
        (
            rule("deny_calls = [\"os..system\"]"),
            "rule \"r\": deny_calls: \"os..system\"",
        ),
        (rule("deny_calls = [\"os.*.x\"]"), "deny_calls: \"os.*.x\""),
        (
            rule("deny_calls = [\"os.ex*ec\"]"),
            "deny_calls: \"os.ex*ec\"",
        ),
        (rule("deny_imports = [\"*\"]"), "deny_imports: \"*\" alone"),
        (rule("deny_imports = [\"1os\"]"), "deny_imports: \"1os\""),
        (rule("deny_imports = [\"\"]"), "deny_imports"),
        (
            rule("deny_attributes = [\"a.b\"]"),
            "deny_attributes: \"a.b\"",
        ),
        (rule("deny_attributes = [\"*\"]"), "deny_attributes"),
        (rule("deny_magics = [\"my.magic\"]"), "deny_magics"),
        (rule("deny_imports = \"socket\""), "deny_imports"),
    ];
    for (text, expected) in cases {
        let error = config_error(&text);
        assert!(error.contains(expected), "{text:?}: {error}");
    }
    // Valid patterns.
    policy(&rule(
        "deny_calls = [\"os.exec*\", \"subprocess.*\", \"builtins.eval\", \"x*\"]",
    ));
    policy(&rule("deny_magics = [\"%%bash\", \"!\", \"*\", \"pip*\"]"));
}

#[test]
fn load_reads_a_file_of_at_most_a_mebibyte() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy.toml");
    std::fs::write(&path, EXAMPLE).unwrap();
    assert_eq!(Policy::load(&path).unwrap().rule_names().len(), 2);
    let big = format!(
        "{EXAMPLE}\n#{}\n",
        "x".repeat(MAX_POLICY_FILE_BYTES as usize)
    );
    std::fs::write(&path, big).unwrap();
    assert!(matches!(
        Policy::load(&path),
        Err(PolicyError::TooLarge { .. })
    ));
    let missing = Policy::load(&dir.path().join("missing.toml"));
    assert!(matches!(missing, Err(PolicyError::Read { .. })));
}

#[test]
fn a_refusal_says_rule_what_line_and_message() {
    let p = policy(EXAMPLE);
    let refusal = refused(&p, "import os\nx = 1\nimport socket\n");
    assert_eq!(
        refusal.to_string(),
        "refused by the policy rule \"no-network\": import of socket (line 3): \
         network access is not allowed here"
    );
    assert_eq!(
        (refusal.line, refusal.what.as_str()),
        (3, "import of socket")
    );
    let refusal = refused(&p, "x = (\n");
    assert_eq!(refusal.rule, POLICY_RULE);
    assert!(refusal
        .to_string()
        .starts_with("refused by the policy: the code could not be parsed"));
    let json = serde_json::to_value(&refusal).unwrap();
    assert_eq!(json["rule"], "policy");
}

#[test]
fn rules_apply_to_their_users_only() {
    let p = policy(EXAMPLE);
    // "no-network" is alice's and bob's; "no-shell" is everyone's.
    assert!(p.check("carol", "python", "import socket").is_ok());
    assert!(p.check("bob", "python", "import socket").is_err());
    assert_eq!(
        p.check("carol", "python", "import os\nos.system('x')")
            .unwrap_err()
            .rule,
        "no-shell"
    );
    // No rule for the user: nothing is parsed, so even invalid code passes.
    let only_bob =
        policy("[[rule]]\nname = \"b\"\nusers = [\"bob\"]\ndeny_imports = [\"socket\"]\n");
    assert!(only_bob
        .check("alice", "python", "this is (not python")
        .is_ok());
    assert!(only_bob
        .check("bob", "python", "this is (not python")
        .is_err());
    assert!(Policy::default()
        .check("bob", "python", "import socket")
        .is_ok());
}

#[test]
fn other_languages_pass() {
    let p = policy(EXAMPLE);
    assert!(p.check("alice", "R", "library(socket)").is_ok());
    assert!(p.check("alice", "julia", "import socket").is_ok());
    assert!(p.check("alice", "Python", "import socket").is_err());
    assert!(p.check("alice", "python3", "import socket").is_err());
}

#[test]
fn code_over_a_mebibyte_is_refused() {
    let p = policy(EXAMPLE);
    let big = format!("x = 1\n{}", "#".repeat(MAX_CODE_BYTES));
    let refusal = refused_by(&p, &big, POLICY_RULE, "larger than");
    assert_eq!(refusal.line, 0);
    let just = format!("x = 1\n#{}", "#".repeat(MAX_CODE_BYTES - 8));
    allowed(&p, &just);
}

#[test]
fn invalid_syntax_is_refused_with_its_line() {
    let p = policy(EXAMPLE);
    let refusal = refused_by(
        &p,
        "x = 1\nif x\n    pass\n",
        POLICY_RULE,
        "could not be parsed",
    );
    assert_eq!(refusal.line, 2);
    refused_by(&p, "print 'python 2'", POLICY_RULE, "could not be parsed");
    refused_by(&p, "exec('x = (')", POLICY_RULE, "could not be parsed");
}

#[test]
fn deep_nesting_is_refused_without_overflowing() {
    let p = policy(EXAMPLE);
    let deep = [
        format!("{}x{}", "(".repeat(5_000), ")".repeat(5_000)),
        format!("{}x", "not ".repeat(100_000)),
        format!("{}x", "-".repeat(500_000)),
        format!("x = {}", ["a"; 300_000].join("+")),
        format!("x = {}", ["a"; 300_000].join("**")),
        format!("x = a{}", ".b".repeat(300_000)),
        format!("x = f{}", "()".repeat(300_000)),
        format!("x = a{}", "[0]".repeat(200_000)),
        format!("x = {}1", "lambda: ".repeat(100_000)),
        format!("x = {}1", "lambda a, b: ".repeat(50_000)),
        format!("x = {}0", "1 if c else ".repeat(100_000)),
        format!("x = {}{}", "[".repeat(100_000), "]".repeat(100_000)),
        format!("x = {}", "f'{".repeat(2_000) + &"}'".repeat(2_000)),
        (0..1_400)
            .map(|i| format!("{}if x:\n", " ".repeat(i)))
            .collect::<String>()
            + &" ".repeat(1_400)
            + "pass\n",
        format!("exec('{}')", "-".repeat(100_000)),
    ];
    for code in &deep {
        let refusal = refused(&p, code);
        assert_eq!(refusal.rule, POLICY_RULE, "{refusal}");
    }
    // Just under the bound, the tree is walked and dropped on a test thread's stack.
    for code in [
        format!("x = {}", ["a"; 450].join("+")),
        format!("x = {}x{}", "(".repeat(220), ")".repeat(220)),
        format!("x = {}1", "not ".repeat(450)),
        format!("x = a{}", ".b".repeat(450)),
    ] {
        allowed(&p, &code);
    }
    // Code in code counts from where it is: 400 deep, `exec` has no room for 200 more.
    let exec = |inner: usize| format!("x = exec('{}1'){}", "-".repeat(inner), "+a".repeat(400));
    allowed(&p, &exec(50));
    let refusal = refused_by(&p, &exec(200), POLICY_RULE, "nests too deeply");
    assert!(refusal.what.ends_with("in code run by exec"), "{refusal}");
    // Code in code is parsed within a budget (4 MiB): each `%time` line is read 8 ways.
    let lines = format!("%time x = [{}]\n", "1, ".repeat(66_000)).repeat(5);
    refused_by(&p, &lines, POLICY_RULE, "more code to check than 4 MiB");
    // Long flat data is not deep.
    let data = format!("x = [{}]\n", vec!["-1"; 100_000].join(", "));
    allowed(&p, &data);
    let lines = "x = 1\n".repeat(50_000);
    allowed(&p, &lines);
}

pub(super) fn typical_cell(lines: usize) -> String {
    let chunk = r#"import os
import json
import numpy as np
import pandas as pd
from pathlib import Path

DATA = Path(os.environ.get("DATA", "/data"))

def load(name: str) -> pd.DataFrame:
    """Loads one table."""
    with open(DATA / f"{name}.json") as f:
        rows = json.load(f)
    return pd.DataFrame(rows)

df = load("sales")
df["total"] = df["price"] * df["quantity"]
summary = df.groupby("region").agg({"total": "sum", "quantity": "mean"})
for region, row in summary.iterrows():
    if row["total"] > 1_000:
        print(f"{region}: {row['total']:.2f}")
values = np.array([x ** 2 for x in range(10) if x % 2 == 0])
print(values.mean(), values.std())
"#;
    let mut cell = String::new();
    while cell.lines().count() < lines {
        cell.push_str(chunk);
    }
    cell.lines().take(lines).collect::<Vec<_>>().join("\n")
}

fn time_checks(policy: &Policy, code: &str, runs: u32) -> std::time::Duration {
    allowed(policy, code);
    let start = std::time::Instant::now();
    for _ in 0..runs {
        policy.check("alice", "python", code).unwrap();
    }
    start.elapsed() / runs
}

#[test]
fn a_typical_cell_is_checked_in_well_under_a_millisecond() {
    let p = policy(EXAMPLE);
    let each = time_checks(&p, &typical_cell(50), 20);
    println!("check of a 50-line cell: {each:?}");
    // Generous: an unoptimized build on a busy machine (an optimized one takes far less).
    assert!(each < std::time::Duration::from_millis(20), "{each:?}");
}

#[test]
#[ignore = "a benchmark: cargo test --release --lib policy -- --ignored --nocapture"]
fn benchmark_a_200_line_cell() {
    let p = policy(EXAMPLE);
    let each = time_checks(&p, &typical_cell(200), 1_000);
    println!("check of a 200-line cell: {each:?}");
}
