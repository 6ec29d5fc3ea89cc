//! Loading a recipe: the `extends` chain, `TRAINREC_*` environment overrides and `--set`
//! overrides merged with figment, then structural and typed validation. Every problem is
//! reported with the key path and the file and line (or override) it came from.

use std::path::{Path, PathBuf};

use figment::Figment;
use figment::providers::{Env, Format, Toml};
use figment::value::Value as FValue;
use serde_json::Value;

use crate::schema::Recipe;
use crate::walk;
use trainrec_types::{Diagnostic, Diagnostics, KeyPath, Origin, Segment};

/// Prefix of environment overrides: `TRAINREC_TRAIN__STEPS=100` sets `train.steps`.
/// Only names with a `__` separator are read, so tool settings such as `TRAINREC_LOG` are not
/// mistaken for recipe keys.
pub const ENV_PREFIX: &str = "TRAINREC_";

/// How to load a recipe.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// `--set key.path=value` overrides, applied last, in order. Values are TOML values;
    /// anything that does not parse as one is taken as a string.
    pub overrides: Vec<String>,
    /// Read `TRAINREC_*` environment overrides.
    pub env: bool,
}

/// A recipe file read and parsed, kept for locating keys.
struct SourceFile {
    path: PathBuf,
    text: String,
    doc: toml_edit::Document<String>,
}

/// Where each value of the merged recipe came from.
pub struct Sources {
    files: Vec<SourceFile>,
    figment: Figment,
    merged: Option<FValue>,
    sets: Vec<(KeyPath, String)>,
}

/// A recipe that passed structural and typed validation.
pub struct LoadedRecipe {
    /// The typed recipe.
    pub recipe: Recipe,
    /// The merged recipe as a JSON value (before serde defaults are applied).
    pub value: Value,
    /// The top-level recipe file.
    pub path: PathBuf,
    /// Directory of the top-level recipe file: relative data paths resolve against it.
    pub base_dir: PathBuf,
    /// Where values came from.
    pub sources: Sources,
    /// Structural problems that did not prevent typing the recipe (unknown keys, bad optional
    /// values, which were dropped): a recipe is valid only when this is empty.
    pub problems: Vec<Diagnostic>,
}

impl LoadedRecipe {
    /// Fills in the origin of each diagnostic.
    pub fn locate(&self, diagnostics: Vec<Diagnostic>) -> Diagnostics {
        self.sources.locate_all(diagnostics)
    }

    /// Files of the `extends` chain, base first, the top-level file last.
    pub fn files(&self) -> Vec<&Path> {
        self.sources.files.iter().map(|f| f.path.as_path()).collect()
    }

    /// The resolved recipe as TOML: every key, defaults included, overrides applied.
    pub fn resolved_toml(&self) -> Result<String, toml::ser::Error> {
        toml::to_string_pretty(&self.recipe)
    }
}

fn file_diag(path: &Path, text: Option<&str>, offset: usize, message: String) -> Diagnostic {
    let (line, column) = text.map(|t| line_col(t, offset)).unwrap_or((1, 1));
    Diagnostic {
        key: KeyPath::root(),
        message,
        help: None,
        origin: Origin::File { path: path.to_path_buf(), line, column },
    }
}

/// The key path a duplicate-key error at `offset` points at, and whether it is a key or a
/// table: a table header on that line, or the dotted key before its `=` under the last table
/// header above it (`[[x]]` headers counted into an index).
fn duplicate_key(text: &str, offset: usize) -> Option<(KeyPath, &'static str)> {
    let offset = offset.min(text.len());
    let start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let line = text[start..].lines().next().unwrap_or("").trim();
    let header = |l: &str| -> Option<(Vec<String>, bool)> {
        let l = l.split('#').next().unwrap_or("").trim();
        let (inner, array) = if let Some(x) = l.strip_prefix("[[").and_then(|x| x.strip_suffix("]]")) {
            (x, true)
        } else {
            (l.strip_prefix('[')?.strip_suffix(']')?, false)
        };
        Some((dotted(inner), array))
    };
    if let Some((parts, _)) = header(line) {
        return Some((KeyPath(parts.into_iter().map(Segment::Key).collect()), "table"));
    }
    let (key, _) = line.split_once('=')?;
    // The enclosing table: the last header above, with arrays of tables indexed by how many
    // of their headers came before.
    let mut path = KeyPath::root();
    let above: Vec<&str> = text[..start].lines().collect();
    if let Some((i, (parts, array))) = above.iter().enumerate().rev().find_map(|(i, l)| Some((i, header(l.trim())?))) {
        for p in &parts {
            path = path.key(p);
        }
        if array {
            let count = above[..=i].iter().filter(|l| header(l.trim()).is_some_and(|(q, a)| a && q == parts)).count();
            path = path.index(count - 1);
        }
    }
    for p in dotted(key) {
        path = path.key(&p);
    }
    Some((path, "key"))
}

/// The parts of a dotted TOML key, unquoted.
fn dotted(key: &str) -> Vec<String> {
    key.split('.').map(|p| p.trim().trim_matches('"').trim_matches('\'').to_string()).collect()
}

/// 1-based line and column of a byte offset.
pub fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let column = before.rfind('\n').map_or(offset, |nl| offset - nl - 1) + 1;
    (line, column)
}

/// Reads `path` and every file it extends, base first.
fn read_chain(path: &Path) -> Result<Vec<SourceFile>, Diagnostics> {
    let mut chain: Vec<SourceFile> = Vec::new();
    let mut next = Some((path.to_path_buf(), None::<(PathBuf, usize)>));
    while let Some((file, extended_from)) = next.take() {
        let text = match std::fs::read_to_string(&file) {
            Ok(t) => t,
            Err(e) => {
                let d = match &extended_from {
                    Some((parent, offset)) => {
                        let parent_text = chain.iter().find(|f| &f.path == parent).map(|f| f.text.as_str());
                        let mut d = file_diag(
                            parent,
                            parent_text,
                            *offset,
                            format!("cannot read base recipe {}: {e}", file.display()),
                        );
                        d.key = KeyPath::root().key("extends");
                        d.with_help("`extends` is resolved relative to the file that contains it")
                    }
                    None => file_diag(&file, None, 0, format!("cannot read recipe {}: {e}", file.display())),
                };
                return Err(Diagnostics(vec![d]));
            }
        };
        let doc = match toml_edit::Document::parse(text.clone()) {
            Ok(doc) => doc,
            Err(e) => {
                let offset = e.span().map_or(0, |s| s.start);
                let mut d = file_diag(&file, Some(&text), offset, format!("invalid TOML: {}", e.message()));
                // A duplicate names no key: say which key or table is written twice.
                if e.message().trim_end().ends_with("duplicate key") {
                    if let Some((key, what)) = duplicate_key(&text, offset) {
                        d.message = format!("invalid TOML: {what} `{key}` is written twice");
                        d.help =
                            Some("keep one of them (a later line does not override an earlier one in TOML)".into());
                        d.key = key;
                    }
                }
                return Err(Diagnostics(vec![d]));
            }
        };
        if let Some(item) = doc.as_table().get("extends") {
            let offset = item.span().map_or(0, |s| s.start);
            let Some(base) = item.as_str() else {
                let mut d = file_diag(
                    &file,
                    Some(&text),
                    offset,
                    "`extends` must be a string (a path to a base recipe)".into(),
                );
                d.key = KeyPath::root().key("extends");
                return Err(Diagnostics(vec![d]));
            };
            let base = file.parent().unwrap_or(Path::new(".")).join(base);
            let canonical = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
            if canonical(&base) == canonical(&file) || chain.iter().any(|f| canonical(&f.path) == canonical(&base)) {
                let mut d = file_diag(
                    &file,
                    Some(&text),
                    offset,
                    format!("`extends` cycle: {} is already in the chain", base.display()),
                );
                d.key = KeyPath::root().key("extends");
                return Err(Diagnostics(vec![d]));
            }
            next = Some((base, Some((file.clone(), offset))));
        }
        chain.push(SourceFile { path: file, text, doc });
    }
    chain.reverse();
    Ok(chain)
}

/// Converts a figment value into JSON (dropping tags).
fn to_json(value: &FValue) -> Value {
    use figment::value::Num;
    match value {
        FValue::String(_, s) => Value::String(s.clone()),
        FValue::Char(_, c) => Value::String(c.to_string()),
        FValue::Bool(_, b) => Value::Bool(*b),
        FValue::Num(_, n) => match *n {
            Num::F32(x) => serde_json::Number::from_f64(x as f64).map_or(Value::Null, Value::Number),
            Num::F64(x) => serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number),
            other => match other.to_u128() {
                Some(u) if u <= u64::MAX as u128 => Value::from(u as u64),
                _ => other.to_i128().and_then(|i| i64::try_from(i).ok()).map_or(Value::Null, Value::from),
            },
        },
        FValue::Empty(..) => Value::Null,
        FValue::Dict(_, d) => Value::Object(d.iter().map(|(k, v)| (k.clone(), to_json(v))).collect()),
        FValue::Array(_, a) => Value::Array(a.iter().map(to_json).collect()),
    }
}

/// Parses an override value as TOML (`100`, `1e-3`, `"x"`, `[1, 2]`, `{ kind = "sgd" }`),
/// falling back to a plain string.
fn parse_override_value(text: &str) -> Value {
    let doc = format!("v = {text}");
    match toml::from_str::<toml::Table>(&doc) {
        Ok(mut t) => serde_json::to_value(t.remove("v")).unwrap_or(Value::String(text.into())),
        Err(_) => Value::String(text.to_string()),
    }
}

fn apply_override(root: &mut Value, path: &KeyPath, new: Value) -> Result<(), String> {
    let mut cur = root;
    let (last, init) = path.0.split_last().ok_or("empty key")?;
    for (i, seg) in init.iter().enumerate() {
        let shown = KeyPath(path.0[..=i].to_vec());
        cur = match seg {
            Segment::Key(k) => {
                let map =
                    cur.as_object_mut().ok_or_else(|| format!("`{}` is not a table", KeyPath(path.0[..i].to_vec())))?;
                map.entry(k.clone()).or_insert_with(|| Value::Object(Default::default()))
            }
            Segment::Index(n) => {
                let arr =
                    cur.as_array_mut().ok_or_else(|| format!("`{}` is not an array", KeyPath(path.0[..i].to_vec())))?;
                let len = arr.len();
                arr.get_mut(*n).ok_or_else(|| format!("index out of range: `{shown}` (the array has {len} entries)"))?
            }
        };
    }
    match last {
        Segment::Key(k) => {
            let map = cur.as_object_mut().ok_or_else(|| format!("`{}` is not a table", path.parent()))?;
            map.insert(k.clone(), new);
        }
        Segment::Index(n) => {
            let arr = cur.as_array_mut().ok_or_else(|| format!("`{}` is not an array", path.parent()))?;
            let len = arr.len();
            *arr.get_mut(*n).ok_or_else(|| format!("index out of range: `{path}` (the array has {len} entries)"))? =
                new;
        }
    }
    Ok(())
}

/// Loads, merges and structurally validates a recipe. Fails when the recipe cannot be typed;
/// otherwise the remaining structural problems are in [`LoadedRecipe::problems`] (see
/// [`load_valid`] for a loader that fails on any problem).
pub fn load(path: &Path, options: &LoadOptions) -> Result<LoadedRecipe, Diagnostics> {
    let files = read_chain(path)?;
    let mut figment = Figment::new();
    for f in &files {
        figment = figment.merge(Toml::file_exact(&f.path));
    }
    let mut sources = Sources { files, figment: figment.clone(), merged: None, sets: Vec::new() };
    let mut diags = Vec::new();
    if options.env {
        for (name, _) in std::env::vars() {
            if let Some(rest) = name.strip_prefix(ENV_PREFIX) {
                if rest.contains("__") && rest.split("__").any(|s| s.parse::<usize>().is_ok()) {
                    let d = Diagnostic::new(KeyPath::root(), format!("environment override {name} indexes an array"));
                    diags.push(Diagnostic { origin: Origin::Env(name.clone()), ..d }.with_help(
                        "environment overrides can set table keys only; use --set tables[0].rows=... for array entries",
                    ));
                }
            }
        }
        let env = Env::prefixed(ENV_PREFIX)
            .filter(|k| k.as_str().contains("__") && !k.as_str().split("__").any(|s| s.parse::<usize>().is_ok()))
            .split("__");
        figment = figment.merge(env);
        sources.figment = figment.clone();
    }
    let merged = match figment.find_value("") {
        Ok(v) => v,
        Err(e) => {
            let message = e.to_string();
            let d = Diagnostic::new(KeyPath(e.path.iter().map(|p| Segment::Key(p.clone())).collect()), message);
            diags.push(d);
            return Err(sources.locate_all(diags));
        }
    };
    let mut value = to_json(&merged);
    sources.merged = Some(merged);
    if let Some(map) = value.as_object_mut() {
        map.remove("extends");
    }
    for arg in &options.overrides {
        let parsed = arg.split_once('=').and_then(|(k, v)| KeyPath::parse(k.trim()).map(|k| (k, v.trim())));
        let Some((key, raw)) = parsed else {
            diags.push(
                Diagnostic {
                    origin: Origin::Set(arg.clone()),
                    ..Diagnostic::new(KeyPath::root(), format!("malformed override `{arg}`"))
                }
                .with_help("write --set key.path=value, e.g. --set train.steps=100 or --set tables[0].rows=5000"),
            );
            continue;
        };
        match apply_override(&mut value, &key, parse_override_value(raw)) {
            Ok(()) => sources.sets.push((key, arg.clone())),
            Err(e) => diags.push(Diagnostic { origin: Origin::Set(arg.clone()), ..Diagnostic::new(key, e) }),
        }
    }
    let schema = Recipe::json_schema();
    walk::check(&schema, &mut value, &KeyPath::root(), &mut diags);
    let recipe = match serde_path_to_error::deserialize::<_, Recipe>(&value) {
        Ok(r) => Some(r),
        Err(e) => {
            if diags.is_empty() {
                let key = KeyPath::parse(&e.path().to_string()).unwrap_or_default();
                diags.push(Diagnostic::new(key, e.inner().to_string()));
            }
            None
        }
    };
    match recipe {
        Some(recipe) => {
            let base_dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
            Ok(LoadedRecipe { recipe, value, path: path.to_path_buf(), base_dir, sources, problems: diags })
        }
        _ => Err(sources.locate_all(diags)),
    }
}

/// Like [`load`], but any structural problem is an error.
pub fn load_valid(path: &Path, options: &LoadOptions) -> Result<LoadedRecipe, Diagnostics> {
    let mut loaded = load(path, options)?;
    let problems = std::mem::take(&mut loaded.problems);
    if problems.is_empty() { Ok(loaded) } else { Err(loaded.locate(problems)) }
}

impl Sources {
    fn locate_all(&self, diagnostics: Vec<Diagnostic>) -> Diagnostics {
        Diagnostics(
            diagnostics
                .into_iter()
                .map(|mut d| {
                    if d.origin == Origin::Unknown {
                        d.origin = self.locate(&d.key);
                    }
                    d
                })
                .collect::<Vec<_>>(),
        )
        .sorted()
    }

    /// Where the value at `path` (or, when it is missing, its nearest written parent) came from.
    pub fn locate(&self, path: &KeyPath) -> Origin {
        if let Some((_, arg)) = self.sets.iter().rev().find(|(p, _)| path.0.starts_with(&p.0)) {
            return Origin::Set(arg.clone());
        }
        let Some(merged) = &self.merged else { return Origin::Unknown };
        // The deepest value along the path that exists in the merged figment.
        let mut cur = merged;
        let mut depth = 0;
        for seg in &path.0 {
            let next = match (seg, cur) {
                (Segment::Key(k), FValue::Dict(_, d)) => d.get(k),
                (Segment::Index(i), FValue::Array(_, a)) => a.get(*i),
                _ => None,
            };
            match next {
                Some(v) => {
                    cur = v;
                    depth += 1;
                }
                None => break,
            }
        }
        let found = KeyPath(path.0[..depth].to_vec());
        let metadata = self.figment.get_metadata(cur.tag());
        match metadata.and_then(|m| m.source.as_ref()) {
            Some(figment::Source::File(file)) => self.file_origin(file, &found),
            _ if metadata.is_some_and(|m| m.name.contains("environment")) && depth > 0 => {
                let var = found
                    .0
                    .iter()
                    .map(|s| match s {
                        Segment::Key(k) => k.to_uppercase(),
                        Segment::Index(i) => i.to_string(),
                    })
                    .collect::<Vec<_>>()
                    .join("__");
                Origin::Env(format!("{ENV_PREFIX}{var}"))
            }
            // The root table has no single source: point at the top-level file.
            _ => match self.files.last() {
                Some(f) => Origin::File { path: f.path.clone(), line: 1, column: 1 },
                None => Origin::Unknown,
            },
        }
    }

    fn file_origin(&self, file: &Path, path: &KeyPath) -> Origin {
        let Some(src) = self.files.iter().find(|f| f.path == file) else {
            return Origin::File { path: file.to_path_buf(), line: 1, column: 1 };
        };
        let offset = span_of(&src.doc, path).unwrap_or(0);
        let (line, column) = line_col(&src.text, offset);
        Origin::File { path: src.path.clone(), line, column }
    }
}

/// Byte offset of the deepest part of `path` written in `doc`.
fn span_of(doc: &toml_edit::Document<String>, path: &KeyPath) -> Option<usize> {
    enum Node<'a> {
        Item(&'a toml_edit::Item),
        Value(&'a toml_edit::Value),
        Table(&'a toml_edit::Table),
    }
    let mut node = Node::Table(doc.as_table());
    let mut best = None;
    for seg in &path.0 {
        let next = match (seg, &node) {
            (Segment::Key(k), Node::Table(t)) => {
                if let Some(key) = t.key(k) {
                    best = key.span().map(|s| s.start).or(best);
                }
                t.get(k).map(Node::Item)
            }
            (Segment::Key(k), Node::Item(toml_edit::Item::Table(t))) => {
                if let Some(key) = t.key(k) {
                    best = key.span().map(|s| s.start).or(best);
                }
                t.get(k).map(Node::Item)
            }
            (Segment::Key(k), Node::Item(toml_edit::Item::Value(toml_edit::Value::InlineTable(t))))
            | (Segment::Key(k), Node::Value(toml_edit::Value::InlineTable(t))) => {
                if let Some(key) = t.key(k) {
                    best = key.span().map(|s| s.start).or(best);
                }
                t.get(k).map(Node::Value)
            }
            (Segment::Index(i), Node::Item(toml_edit::Item::ArrayOfTables(a))) => {
                let t = a.get(*i);
                if let Some(t) = t {
                    best = t.span().map(|s| s.start).or(best);
                }
                t.map(Node::Table)
            }
            (Segment::Index(i), Node::Item(toml_edit::Item::Value(toml_edit::Value::Array(a))))
            | (Segment::Index(i), Node::Value(toml_edit::Value::Array(a))) => {
                let v = a.get(*i);
                if let Some(v) = v {
                    best = v.span().map(|s| s.start).or(best);
                }
                v.map(Node::Value)
            }
            _ => None,
        };
        match next {
            Some(n) => node = n,
            None => break,
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_and_column() {
        let t = "a = 1\nbb = 2\n";
        assert_eq!(line_col(t, 0), (1, 1));
        assert_eq!(line_col(t, 6), (2, 1));
        assert_eq!(line_col(t, 9), (2, 4));
    }

    #[test]
    fn override_values_parse_as_toml() {
        assert_eq!(parse_override_value("100"), Value::from(100));
        assert_eq!(parse_override_value("1e-3"), Value::from(1e-3));
        assert_eq!(parse_override_value("zipf"), Value::from("zipf"));
        assert_eq!(parse_override_value("\"x y\""), Value::from("x y"));
        assert_eq!(parse_override_value("[1, 2]"), serde_json::json!([1, 2]));
    }

    #[test]
    fn overrides_reach_into_arrays() {
        let mut v = serde_json::json!({"tables": [{"rows": 1}], "train": {}});
        apply_override(&mut v, &KeyPath::parse("tables[0].rows").unwrap(), Value::from(5)).unwrap();
        apply_override(&mut v, &KeyPath::parse("train.steps").unwrap(), Value::from(7)).unwrap();
        assert_eq!(v, serde_json::json!({"tables": [{"rows": 5}], "train": {"steps": 7}}));
        let err = apply_override(&mut v, &KeyPath::parse("tables[3].rows").unwrap(), Value::from(5)).unwrap_err();
        assert!(err.contains("out of range"), "{err}");
    }
}
