//! Problems found in a recipe, each tied to the key that caused it and where that key came from.

use std::fmt;
use std::path::PathBuf;

/// A dotted key path into a recipe, e.g. `tables[1].features[0]`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyPath(pub Vec<Segment>);

/// One step of a [`KeyPath`].
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Segment {
    /// A table key.
    Key(String),
    /// An array index.
    Index(usize),
}

impl KeyPath {
    /// The empty path: the recipe's root table.
    pub fn root() -> Self {
        Self(Vec::new())
    }

    /// This path extended by a table key.
    pub fn key(&self, key: impl Into<String>) -> Self {
        let mut p = self.clone();
        p.0.push(Segment::Key(key.into()));
        p
    }

    /// This path extended by an array index.
    pub fn index(&self, index: usize) -> Self {
        let mut p = self.clone();
        p.0.push(Segment::Index(index));
        p
    }

    /// Parses `a.b[2].c` (also accepting `a.b.2.c`, the form environment overrides use).
    pub fn parse(text: &str) -> Option<Self> {
        let mut out = Vec::new();
        for part in text.split('.') {
            let (name, mut rest) = match part.find('[') {
                Some(i) => (&part[..i], &part[i..]),
                None => (part, ""),
            };
            if name.is_empty() && rest.is_empty() {
                return None;
            }
            if !name.is_empty() {
                match name.parse::<usize>() {
                    Ok(i) if !out.is_empty() => out.push(Segment::Index(i)),
                    _ => out.push(Segment::Key(name.to_string())),
                }
            }
            while !rest.is_empty() {
                let close = rest.find(']')?;
                let index = rest[1..close].parse::<usize>().ok()?;
                out.push(Segment::Index(index));
                rest = &rest[close + 1..];
                if !rest.is_empty() && !rest.starts_with('[') {
                    return None;
                }
            }
        }
        (!out.is_empty()).then_some(Self(out))
    }

    /// The parent path (the root's parent is the root).
    pub fn parent(&self) -> Self {
        let mut p = self.clone();
        p.0.pop();
        p
    }

    /// True for the root path.
    pub fn is_root(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("(recipe root)");
        }
        for (i, seg) in self.0.iter().enumerate() {
            match seg {
                Segment::Key(k) if i == 0 => write!(f, "{k}")?,
                Segment::Key(k) => write!(f, ".{k}")?,
                Segment::Index(n) => write!(f, "[{n}]")?,
            }
        }
        Ok(())
    }
}

/// Where a value of the recipe came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// A recipe file, at a 1-based line and column.
    File {
        /// The file, as the user named it (or as `extends` resolved it).
        path: PathBuf,
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
    },
    /// A `TRAINREC_*` environment variable.
    Env(String),
    /// A `--set key=value` command-line override.
    Set(String),
    /// Not written anywhere (a default, or a missing key).
    Unknown,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::File { path, line, column } => write!(f, "{}:{line}:{column}", path.display()),
            Origin::Env(var) => write!(f, "environment variable {var}"),
            Origin::Set(arg) => write!(f, "command-line override --set {arg}"),
            Origin::Unknown => f.write_str("(not set in any recipe file)"),
        }
    }
}

/// One problem with a recipe.
#[derive(Clone, Debug, PartialEq)]
pub struct Diagnostic {
    /// The key at fault.
    pub key: KeyPath,
    /// What is wrong.
    pub message: String,
    /// How to fix it (did-you-mean, the valid names, the allowed range).
    pub help: Option<String>,
    /// Where the key (or, for a missing key, its table) was written.
    pub origin: Origin,
}

impl Diagnostic {
    /// A diagnostic whose origin is filled in later by `LoadedRecipe::locate`.
    pub fn new(key: KeyPath, message: impl Into<String>) -> Self {
        Self { key, message: message.into(), help: None, origin: Origin::Unknown }
    }

    /// Adds a help line.
    pub fn with_help(mut self, help: impl Into<String>) -> Self {
        self.help = Some(help.into());
        self
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "error: {}", self.message)?;
        writeln!(f, "  --> {}", self.origin)?;
        write!(f, "   = key: {}", self.key)?;
        if let Some(help) = &self.help {
            write!(f, "\n   = help: {help}")?;
        }
        Ok(())
    }
}

/// All problems found in a recipe; never empty when returned as an error.
#[derive(Clone, Debug, PartialEq)]
pub struct Diagnostics(pub Vec<Diagnostic>);

impl fmt::Display for Diagnostics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for d in &self.0 {
            writeln!(f, "{d}\n")?;
        }
        let n = self.0.len();
        write!(f, "{n} problem{} found", if n == 1 { "" } else { "s" })
    }
}

impl std::error::Error for Diagnostics {}

impl Diagnostics {
    /// Sorted by where they were written (file, line, column; then environment and `--set`
    /// overrides), keeping the check order among equals.
    pub fn sorted(mut self) -> Self {
        self.0.sort_by_key(|d| origin_order(&d.origin));
        self
    }
}

/// The closest candidate to `word`, if any is close enough to be a likely typo.
pub fn did_you_mean<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    candidates
        .into_iter()
        .map(|c| (strsim::damerau_levenshtein(&word.to_lowercase(), &c.to_lowercase()), c))
        .filter(|(d, c)| *d <= (c.len().max(word.len()) / 3).max(1) || c.contains(word) && word.len() >= 3)
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

/// A help line: "did you mean `x`? valid <what>: a, b, c".
pub fn suggest(word: &str, what: &str, candidates: &[&str]) -> String {
    let list = candidates.iter().map(|c| format!("`{c}`")).collect::<Vec<_>>().join(", ");
    match did_you_mean(word, candidates.iter().copied()) {
        Some(best) => format!("did you mean `{best}`? valid {what}: {list}"),
        None => format!("valid {what}: {list}"),
    }
}

/// Sort key of a diagnostic's origin: files first (by path, line, column), then environment
/// variables, `--set` overrides and unknown origins.
fn origin_order(o: &Origin) -> (u8, String, usize, usize) {
    match o {
        Origin::File { path, line, column } => (0, path.display().to_string(), *line, *column),
        Origin::Env(v) => (1, v.clone(), 0, 0),
        Origin::Set(a) => (2, a.clone(), 0, 0),
        Origin::Unknown => (3, String::new(), 0, 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_paths_parse_and_print() {
        let p = KeyPath::parse("tables[1].features[0]").unwrap();
        assert_eq!(p, KeyPath::root().key("tables").index(1).key("features").index(0));
        assert_eq!(p.to_string(), "tables[1].features[0]");
        assert_eq!(KeyPath::parse("tables.1.rows").unwrap().to_string(), "tables[1].rows");
        assert_eq!(KeyPath::parse("train.steps").unwrap().to_string(), "train.steps");
        assert!(KeyPath::parse("").is_none());
        assert!(KeyPath::parse("a..b").is_none());
        assert!(KeyPath::parse("a[x]").is_none());
    }

    #[test]
    fn suggestions() {
        assert_eq!(did_you_mean("dimm", ["name", "dim", "rows"]), Some("dim"));
        assert_eq!(did_you_mean("zzzzzz", ["name", "dim", "rows"]), None);
        assert_eq!(suggest("summ", "values", &["sum", "mean"]), "did you mean `sum`? valid values: `sum`, `mean`");
    }
}
