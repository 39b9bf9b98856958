//! One execution's environment variables (E2B's `envs`) for kernels without kernel-broker's
//! hooks (R, Deno, bash): a silent execution in the kernel's own language sets them before
//! the code and another puts the previous values (or their absence) back after its reply,
//! as E2B's code interpreter does. Python (the boot script's hooks) and SQL (its kernel
//! reads the same `metadata.kernel_broker.env`) apply them themselves; a Java kernel's
//! environment cannot change once the JVM runs (`System.getenv` is read-only), so a Java
//! execution with variables gets the broker's note that they were not applied.
//!
//! Names are identifiers (checked before: `environ::check_user_env`); every value, and every
//! name where the language quotes it, is a literal of that language: a JSON string for R and
//! JavaScript (both read JSON's escapes), single quotes for bash. Nothing of a value is ever
//! read as code.

use std::collections::BTreeMap;

/// The code that sets the variables, and the code that puts the previous ones back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvCode {
    pub set: String,
    pub restore: String,
}

/// The wrapper for a kernel of `language` (its spec's), if it has one.
pub fn for_language(language: &str, env: &BTreeMap<String, String>) -> Option<EnvCode> {
    if env.is_empty() {
        return None;
    }
    match language.to_ascii_lowercase().as_str() {
        "r" => Some(r(env)),
        "javascript" | "typescript" => Some(deno(env)),
        "bash" | "sh" => Some(bash(env)),
        _ => None,
    }
}

/// Whether a kernel of `language` applies an execution's variables itself (its
/// `execute_reply` says `"kernel_broker_env": "restored"`).
pub fn applied_by_kernel(language: &str) -> bool {
    matches!(language.to_ascii_lowercase().as_str(), "python" | "sql")
}

fn json(s: &str) -> String {
    serde_json::Value::String(s.to_string()).to_string()
}

fn r(env: &BTreeMap<String, String>) -> EnvCode {
    let names: Vec<String> = env.keys().map(|k| json(k)).collect();
    let values: Vec<String> = env.values().map(|v| json(v)).collect();
    EnvCode {
        set: format!(
            ".kernel_broker_env <- Sys.getenv(c({names}), unset = NA, names = TRUE)\n\
             invisible(do.call(Sys.setenv, as.list(setNames(c({values}), c({names})))))",
            names = names.join(", "),
            values = values.join(", "),
        ),
        restore: "local({\n\
             s <- .kernel_broker_env\n\
             for (n in names(s)) if (is.na(s[[n]])) Sys.unsetenv(n) else \
             do.call(Sys.setenv, as.list(setNames(s[[n]], n)))\n\
             })\n\
             rm(.kernel_broker_env)"
            .to_string(),
    }
}

fn deno(env: &BTreeMap<String, String>) -> EnvCode {
    let object = serde_json::to_string(env).unwrap_or_else(|_| "{}".into());
    EnvCode {
        set: format!(
            "{{ const e = {object};\n\
             globalThis.__kernel_broker_env = Object.fromEntries(Object.keys(e).map((k) => [k, Deno.env.get(k)]));\n\
             for (const [k, v] of Object.entries(e)) Deno.env.set(k, v); }}"
        ),
        restore: "{ const s = globalThis.__kernel_broker_env ?? {};\n\
             for (const [k, v] of Object.entries(s)) { if (v === undefined) Deno.env.delete(k); else Deno.env.set(k, v); }\n\
             delete globalThis.__kernel_broker_env; }"
            .to_string(),
    }
}

fn single_quoted(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

fn bash(env: &BTreeMap<String, String>) -> EnvCode {
    let names: Vec<&str> = env.keys().map(String::as_str).collect();
    let exports: Vec<String> = env
        .iter()
        .map(|(k, v)| format!("{k}={}", single_quoted(v)))
        .collect();
    EnvCode {
        set: format!(
            "__kernel_broker_env=\"$(declare -p {names} 2>/dev/null)\"; export {exports}",
            names = names.join(" "),
            exports = exports.join(" "),
        ),
        restore: format!(
            "unset {names}; eval \"$__kernel_broker_env\"; unset __kernel_broker_env",
            names = names.join(" "),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn each_language_gets_its_own_code_and_values_stay_literals() {
        let hostile = env(&[("A", "x'; rm -rf / #\"\\\n$(id)`id`"), ("B", "2")]);
        let r = for_language("R", &hostile).unwrap();
        assert!(
            r.set.contains(r#""x'; rm -rf / #\"\\\n$(id)`id`""#),
            "{}",
            r.set
        );
        assert!(r.set.contains(r#"c("A", "B")"#));
        let js = for_language("typescript", &hostile).unwrap();
        assert!(
            js.set
                .contains(r#"{"A":"x'; rm -rf / #\"\\\n$(id)`id`","B":"2"}"#),
            "{}",
            js.set
        );
        let sh = for_language("bash", &hostile).unwrap();
        assert!(
            sh.set.contains(r#"export A='x'\''; rm -rf / #"\"#),
            "{}",
            sh.set
        );
        assert!(sh.set.contains("declare -p A B"));
        assert_eq!(
            sh.restore,
            "unset A B; eval \"$__kernel_broker_env\"; unset __kernel_broker_env"
        );
    }

    #[test]
    fn kernels_with_hooks_or_without_a_way_get_no_code() {
        let one = env(&[("A", "1")]);
        assert!(for_language("python", &one).is_none());
        assert!(for_language("sql", &one).is_none());
        assert!(for_language("java", &one).is_none());
        assert!(for_language("R", &BTreeMap::new()).is_none());
        assert!(applied_by_kernel("python") && applied_by_kernel("sql"));
        assert!(!applied_by_kernel("java") && !applied_by_kernel("R"));
    }
}
