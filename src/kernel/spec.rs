//! Kernel specs: `<kernels-dir>/<name>/kernel.json` in Jupyter's format, read once at
//! start-up, validated, and shared by everyone who needs them (the local sandbox launches
//! their `argv`; the Jupyter API lists them; the session registry checks names against them).
//!
//! This is the only place that reads a `kernel.json`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

/// Other names of the shipped kernels, as E2B's SDK and its users send them (a spec of that
/// exact name, if a broker has one, goes first).
pub const ALIASES: &[(&str, &str)] = &[
    ("python", "python3"),
    ("ir", "r"),
    ("R", "r"),
    ("js", "javascript"),
    ("ts", "javascript"),
    ("typescript", "javascript"),
    ("deno", "javascript"),
    ("sh", "bash"),
    ("duckdb", "sql"),
];

/// The name among `names` that `name` is, or that it is an alias of.
pub fn resolve_name<'a>(
    name: &str,
    names: impl Iterator<Item = &'a str> + Clone,
) -> Option<&'a str> {
    names.clone().find(|n| *n == name).or_else(|| {
        let (_, to) = ALIASES.iter().find(|(alias, _)| *alias == name)?;
        names.clone().find(|n| n == to)
    })
}

/// Errors reading the kernel specs, with the path concerned.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("cannot read the kernel specs in {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the kernel spec {path} is invalid: {reason}")]
    Invalid { path: PathBuf, reason: String },
    #[error("no kernel specs (<name>/kernel.json) in {0}")]
    None(PathBuf),
}

/// One kernel spec.
#[derive(Debug, Clone)]
pub struct KernelSpec {
    pub name: String,
    pub argv: Vec<String>,
    pub env: HashMap<String, String>,
    pub display_name: String,
    pub language: String,
    pub interrupt_mode: Option<String>,
    /// The spec's directory (`{resource_dir}` in `argv`).
    pub resource_dir: PathBuf,
    /// Logo files in the spec's directory (`logo-*.png`), by file name.
    pub logos: Vec<String>,
    /// The `kernel.json` as read, for clients that want all of it.
    pub raw: Value,
}

#[derive(Deserialize)]
struct KernelJson {
    argv: Vec<String>,
    #[serde(default)]
    env: HashMap<String, String>,
    #[serde(default)]
    display_name: Option<String>,
    #[serde(default)]
    language: Option<String>,
    #[serde(default)]
    interrupt_mode: Option<String>,
}

/// Every kernel spec of a kernels directory, `python3` first, then by name.
#[derive(Debug, Clone)]
pub struct KernelSpecs {
    specs: Vec<KernelSpec>,
    dir: PathBuf,
}

impl KernelSpecs {
    /// Reads every `<dir>/<name>/kernel.json`. A spec that cannot be read or parsed, or has
    /// an empty `argv`, is an error (a broker must not start with a broken spec); so is a
    /// directory without any.
    pub fn load(dir: &Path) -> Result<Self, SpecError> {
        let io = |source| SpecError::Io {
            path: dir.to_path_buf(),
            source,
        };
        // Absolute: a spec's directory is shown to kernels (`{resource_dir}`), and sandboxes
        // start elsewhere than the broker's working directory.
        let dir = &std::path::absolute(dir).map_err(io)?;
        let mut specs = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(io)?.filter_map(Result::ok) {
            let file = entry.path().join("kernel.json");
            if !file.is_file() {
                continue;
            }
            let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            specs.push(Self::read_one(name, &entry.path(), &file)?);
        }
        if specs.is_empty() {
            return Err(SpecError::None(dir.to_path_buf()));
        }
        specs.sort_by(|a, b| (a.name != "python3", &a.name).cmp(&(b.name != "python3", &b.name)));
        Ok(Self {
            specs,
            dir: dir.to_path_buf(),
        })
    }

    fn read_one(name: String, spec_dir: &Path, file: &Path) -> Result<KernelSpec, SpecError> {
        let invalid = |reason: String| SpecError::Invalid {
            path: file.to_path_buf(),
            reason,
        };
        let text = std::fs::read(file).map_err(|e| invalid(e.to_string()))?;
        let raw: Value = serde_json::from_slice(&text).map_err(|e| invalid(e.to_string()))?;
        let parsed: KernelJson =
            serde_json::from_value(raw.clone()).map_err(|e| invalid(e.to_string()))?;
        if parsed.argv.is_empty() {
            return Err(invalid("its argv is empty".into()));
        }
        let mut logos: Vec<String> = std::fs::read_dir(spec_dir)
            .map(|rd| {
                rd.filter_map(Result::ok)
                    .filter_map(|e| e.file_name().into_string().ok())
                    .filter(|f| f.starts_with("logo-") && f.ends_with(".png"))
                    .collect()
            })
            .unwrap_or_default();
        logos.sort();
        Ok(KernelSpec {
            display_name: parsed.display_name.unwrap_or_else(|| name.clone()),
            language: parsed.language.unwrap_or_else(|| "python".into()),
            name,
            argv: parsed.argv,
            env: parsed.env,
            interrupt_mode: parsed.interrupt_mode,
            resource_dir: spec_dir.to_path_buf(),
            logos,
            raw,
        })
    }

    /// The one spec a backend that brings its own kernel offers (the Docker image's
    /// `python3`), for a broker without a kernels directory.
    pub fn builtin_python3(dir: &Path) -> Self {
        let argv: Vec<String> = [
            "python",
            "-m",
            "ipykernel_launcher",
            "-f",
            "{connection_file}",
        ]
        .into_iter()
        .map(String::from)
        .collect();
        let raw = serde_json::json!({
            "argv": argv, "display_name": "Python 3 (ipykernel)", "language": "python"
        });
        Self {
            specs: vec![KernelSpec {
                name: "python3".into(),
                argv,
                env: HashMap::new(),
                display_name: "Python 3 (ipykernel)".into(),
                language: "python".into(),
                interrupt_mode: None,
                resource_dir: dir.join("python3"),
                logos: Vec::new(),
                raw,
            }],
            dir: dir.to_path_buf(),
        }
    }

    /// These specs but those `keep` refuses, and the names of those left out.
    pub fn retained(&self, mut keep: impl FnMut(&KernelSpec) -> bool) -> (Self, Vec<String>) {
        let (kept, left): (Vec<KernelSpec>, Vec<KernelSpec>) =
            self.specs.iter().cloned().partition(|s| keep(s));
        (
            Self {
                specs: kept,
                dir: self.dir.clone(),
            },
            left.into_iter().map(|s| s.name).collect(),
        )
    }

    /// The directory the specs were read from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn get(&self, name: &str) -> Option<&KernelSpec> {
        self.specs.iter().find(|s| s.name == name)
    }

    /// The spec a name or one of its [`ALIASES`] names.
    pub fn resolve(&self, name: &str) -> Option<&KernelSpec> {
        resolve_name(name, self.specs.iter().map(|s| s.name.as_str())).and_then(|n| self.get(n))
    }

    /// The aliases that name `spec` here (none that a spec of its own answers to).
    pub fn aliases_of(&self, spec: &str) -> Vec<&'static str> {
        ALIASES
            .iter()
            .filter(|(alias, to)| *to == spec && self.get(alias).is_none())
            .map(|(alias, _)| *alias)
            .collect()
    }

    /// Each kernel's name, display name and aliases, as a model reads them (`r (R; also
    /// ir, R)`): MCP's `run_code` lists them.
    pub fn summary(&self) -> String {
        self.specs
            .iter()
            .map(|s| {
                let aliases = self.aliases_of(&s.name);
                if aliases.is_empty() {
                    format!("{} ({})", s.name, s.display_name)
                } else {
                    format!(
                        "{} ({}; also {})",
                        s.name,
                        s.display_name,
                        aliases.join(", ")
                    )
                }
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// All specs, the default (`python3` if present) first.
    pub fn iter(&self) -> impl Iterator<Item = &KernelSpec> {
        self.specs.iter()
    }

    /// The spec names, the default first.
    pub fn names(&self) -> Vec<String> {
        self.specs.iter().map(|s| s.name.clone()).collect()
    }

    /// Each spec's language, by name.
    pub fn languages(&self) -> std::collections::BTreeMap<String, String> {
        let each = self.specs.iter();
        each.map(|s| (s.name.clone(), s.language.clone())).collect()
    }

    /// The default spec's name.
    pub fn default_name(&self) -> &str {
        // `load` refuses an empty directory and `builtin_python3` has one spec.
        self.specs
            .first()
            .map(|s| s.name.as_str())
            .unwrap_or("python3")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, json: &str) {
        std::fs::create_dir_all(dir.join(name)).unwrap();
        std::fs::write(dir.join(name).join("kernel.json"), json).unwrap();
    }

    #[test]
    fn reads_specs_python3_first_with_logos() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            "a-kernel",
            r#"{"argv": ["x", "{connection_file}"]}"#,
        );
        write(
            dir.path(),
            "python3",
            r#"{"argv": ["python"], "display_name": "Py", "env": {"A": "1"}}"#,
        );
        std::fs::write(dir.path().join("python3/logo-64x64.png"), b"png").unwrap();
        std::fs::write(dir.path().join("python3/notes.txt"), b"").unwrap();
        std::fs::create_dir(dir.path().join("not-a-spec")).unwrap();
        let specs = KernelSpecs::load(dir.path()).unwrap();
        assert_eq!(specs.names(), vec!["python3", "a-kernel"]);
        assert_eq!(specs.default_name(), "python3");
        let py = specs.get("python3").unwrap();
        assert_eq!(py.display_name, "Py");
        assert_eq!(py.language, "python");
        assert_eq!(py.env["A"], "1");
        assert_eq!(py.logos, vec!["logo-64x64.png"]);
        assert_eq!(py.raw["display_name"], "Py");
        assert_eq!(specs.get("a-kernel").unwrap().display_name, "a-kernel");
        assert!(specs.get("nope").is_none());
    }

    #[test]
    fn the_shipped_specs_load_with_absolute_directories() {
        // Relative to the crate (the broker's default `--kernels-dir kernels`): a spec's
        // directory is shown to kernels, whose sandboxes start elsewhere.
        let specs = KernelSpecs::load(Path::new("kernels")).unwrap();
        assert_eq!(
            specs.names(),
            vec!["python3", "bash", "java", "javascript", "r", "sql"]
        );
        for spec in specs.iter() {
            assert!(spec.resource_dir.is_absolute(), "{:?}", spec.resource_dir);
        }
        assert!(specs.dir().is_absolute());
        assert_eq!(specs.get("javascript").unwrap().language, "typescript");
        assert_eq!(specs.get("r").unwrap().language, "R");
    }

    #[test]
    fn names_and_e2bs_aliases_resolve_to_the_specs() {
        let specs = KernelSpecs::load(Path::new("kernels")).unwrap();
        for (name, spec) in [
            ("python3", "python3"),
            ("python", "python3"),
            ("r", "r"),
            ("ir", "r"),
            ("js", "javascript"),
            ("ts", "javascript"),
            ("typescript", "javascript"),
            ("deno", "javascript"),
            ("javascript", "javascript"),
            ("bash", "bash"),
            ("java", "java"),
            ("sql", "sql"),
        ] {
            assert_eq!(
                specs.resolve(name).map(|s| s.name.as_str()),
                Some(spec),
                "{name}"
            );
        }
        assert!(specs.resolve("cobol").is_none());
        assert!(specs.resolve("").is_none());
        assert_eq!(specs.aliases_of("r"), vec!["ir", "R"]);
        let summary = specs.summary();
        assert!(
            summary.starts_with("python3 (Python 3 (ipykernel); also python), "),
            "{summary}"
        );
        assert!(summary.contains("r (R; also ir, R)"), "{summary}");
        // Without its spec, an alias names nothing.
        let (no_r, _) = specs.retained(|s| s.name != "r");
        assert!(no_r.resolve("ir").is_none());
    }

    #[test]
    fn specs_can_be_left_out_by_name() {
        let specs = KernelSpecs::load(Path::new("kernels")).unwrap();
        let (kept, left) = specs.retained(|s| s.name != "r" && s.name != "java");
        assert_eq!(left, vec!["java", "r"]);
        assert_eq!(kept.names(), vec!["python3", "bash", "javascript", "sql"]);
        assert_eq!(kept.dir(), specs.dir());
    }

    #[test]
    fn broken_or_missing_specs_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            KernelSpecs::load(dir.path()),
            Err(SpecError::None(_))
        ));
        write(dir.path(), "bad", "{not json");
        let err = KernelSpecs::load(dir.path()).unwrap_err().to_string();
        assert!(err.contains("bad/kernel.json is invalid"), "{err}");
        write(dir.path(), "bad", r#"{"argv": []}"#);
        let err = KernelSpecs::load(dir.path()).unwrap_err().to_string();
        assert!(err.contains("argv is empty"), "{err}");
        assert!(matches!(
            KernelSpecs::load(&dir.path().join("missing")),
            Err(SpecError::Io { .. })
        ));
    }
}
