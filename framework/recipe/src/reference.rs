//! The recipe reference, rendered from the JSON schema of the typed structs (and of each
//! plugin's config), so the book cannot drift from the code.

use serde_json::Value;

struct Renderer<'a> {
    root: &'a Value,
    out: String,
}

impl<'a> Renderer<'a> {
    fn resolve(&self, mut s: &'a Value) -> &'a Value {
        while let Some(name) = s.get("$ref").and_then(Value::as_str).and_then(|r| r.strip_prefix("#/$defs/")) {
            match self.root.get("$defs").and_then(|d| d.get(name)) {
                Some(next) => s = next,
                None => break,
            }
        }
        s
    }

    /// Non-null branches of a union, resolved.
    fn branches(&self, s: &'a Value) -> Vec<&'a Value> {
        s.get("anyOf")
            .or_else(|| s.get("oneOf"))
            .and_then(Value::as_array)
            .map(|b| {
                b.iter()
                    .map(|x| self.resolve(x))
                    .filter(|x| x.get("type").and_then(Value::as_str) != Some("null"))
                    .collect()
            })
            .unwrap_or_default()
    }

    fn tag_of(&self, branches: &[&'a Value]) -> Option<String> {
        let first = branches.first()?.get("properties")?.as_object()?;
        first
            .iter()
            .find(|(k, p)| {
                p.get("const").is_some()
                    && branches.iter().all(|b| b.pointer(&format!("/properties/{k}/const")).is_some())
            })
            .map(|(k, _)| k.clone())
    }

    fn type_words(&self, s: &'a Value) -> String {
        let s = self.resolve(s);
        let branches = self.branches(s);
        if branches.len() == 1 {
            return self.type_words(branches[0]);
        }
        if !branches.is_empty() {
            if branches.iter().all(|b| b.get("const").is_some()) {
                return branches.iter().map(|b| format!("`{}`", b["const"])).collect::<Vec<_>>().join(" \\| ");
            }
            if let Some(tag) = self.tag_of(&branches) {
                return format!("table, by `{tag}`");
            }
        }
        if let Some(e) = s.get("enum").and_then(Value::as_array) {
            return e.iter().map(|v| format!("`{v}`")).collect::<Vec<_>>().join(" \\| ");
        }
        let types: Vec<String> = match s.get("type") {
            Some(Value::String(t)) => vec![t.clone()],
            Some(Value::Array(ts)) => {
                ts.iter().filter_map(Value::as_str).filter(|t| *t != "null").map(String::from).collect()
            }
            _ => vec![],
        };
        let words: Vec<String> = types
            .iter()
            .map(|t| match t.as_str() {
                "array" => match s.get("items") {
                    Some(items) if self.is_table(items) => "array of tables".to_string(),
                    Some(items) => format!("array of {}", self.type_words(items)),
                    None => "array".to_string(),
                },
                "object" => "table".to_string(),
                "integer" if s.get("minimum").and_then(Value::as_f64) == Some(0.0) => {
                    "non-negative integer".to_string()
                }
                "number" => "float".to_string(),
                other => other.to_string(),
            })
            .collect();
        if words.is_empty() { "any".to_string() } else { words.join(" or ") }
    }

    fn is_table(&self, s: &'a Value) -> bool {
        let s = self.resolve(s);
        let b = self.branches(s);
        if b.len() == 1 {
            return self.is_table(b[0]);
        }
        s.get("properties").is_some() || (!b.is_empty() && self.tag_of(&b).is_some())
    }

    fn doc(s: &Value) -> String {
        s.get("description")
            .and_then(Value::as_str)
            .unwrap_or("")
            .replace("\n\n", "<br>")
            .replace('\n', " ")
            .replace('|', "\\|")
    }

    fn section(&mut self, title: &str, s: &'a Value, skip: Option<&str>) {
        let s = self.resolve(s);
        let branches = self.branches(s);
        if branches.len() == 1 {
            return self.section(title, branches[0], skip);
        }
        if let Some(tag) = self.tag_of(&branches) {
            for b in branches {
                let kind = b.pointer(&format!("/properties/{tag}/const")).cloned().unwrap_or(Value::Null);
                self.section(&format!("{title} ({tag} = {kind})"), b, Some(&tag));
            }
            return;
        }
        let Some(props) = s.get("properties").and_then(Value::as_object) else { return };
        let required: Vec<&str> = s
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let heading = if title.is_empty() { "(top level)" } else { title };
        self.out.push_str(&format!("\n### `{heading}`\n\n"));
        let doc = Self::doc(s);
        if !doc.is_empty() {
            self.out.push_str(&format!("{doc}\n\n"));
        }
        if props.keys().all(|k| Some(k.as_str()) == skip) {
            self.out.push_str("No other keys.\n");
            return;
        }
        self.out.push_str("| key | type | default | description |\n| --- | --- | --- | --- |\n");
        let mut nested = Vec::new();
        for (key, p) in props {
            if Some(key.as_str()) == skip {
                continue;
            }
            let default = match p.get("default") {
                _ if required.contains(&key.as_str()) => "required".to_string(),
                Some(Value::Null) | None => "—".to_string(),
                Some(d) => format!("`{}`", short_floats(d)),
            };
            let mut doc = Self::doc(p);
            if doc.is_empty() {
                doc = Self::doc(self.resolve(p));
            }
            self.out.push_str(&format!("| `{key}` | {} | {default} | {doc} |\n", self.type_words(p)));
            let target = self.resolve(p);
            let items = target.get("items").map(|i| self.resolve(i));
            match items {
                Some(items) if self.is_table(items) => nested.push((join(title, &format!("{key}[]")), items)),
                _ if self.is_table(target) => nested.push((join(title, key), target)),
                _ => {}
            }
        }
        for (t, s) in nested {
            self.section(&t, s, None);
        }
    }
}

/// Markdown tables for every key of `schema`, nested tables after their parent. `title` is the
/// dotted name of the root (e.g. `data.sampler (kind = "synthetic")`); `skip` leaves out one
/// root key (a plugin's `kind`, documented by its title).
pub fn render(title: &str, schema: &Value, skip: Option<&str>) -> String {
    let mut r = Renderer { root: schema, out: String::new() };
    r.section(title, schema, skip);
    r.out
}

fn join(title: &str, key: &str) -> String {
    if title.is_empty() { key.to_string() } else { format!("{title}.{key}") }
}

/// `value` as JSON, with floats that came from `f32` defaults written in their shortest
/// `f32` form (`0.9`, not `0.8999999761581421`).
fn short_floats(value: &Value) -> String {
    match value {
        Value::Number(n) if n.is_f64() => {
            let x = n.as_f64().unwrap_or_default();
            let f = x as f32;
            if f64::from(f) == x && f.is_finite() {
                let (plain, sci) = (format!("{f:?}"), format!("{f:e}"));
                if sci.len() < plain.len() { sci } else { plain }
            } else {
                n.to_string()
            }
        }
        Value::Array(items) => format!("[{}]", items.iter().map(short_floats).collect::<Vec<_>>().join(",")),
        Value::Object(map) => format!(
            "{{{}}}",
            map.iter()
                .map(|(k, v)| format!("{}:{}", Value::String(k.clone()), short_floats(v)))
                .collect::<Vec<_>>()
                .join(",")
        ),
        other => other.to_string(),
    }
}
