//! Structural validation of a recipe value against a JSON schema generated from the typed
//! structs: finds every unknown key, missing key, wrong type and bad enum value in one pass
//! (serde alone stops at the first).

use serde_json::{Map, Value};

use trainrec_types::{Diagnostic, KeyPath, suggest};

/// Checks `value` against `schema` (a schemars root schema with `$defs`), pushing one
/// diagnostic per problem. Unknown keys are removed from `value`, so that a value whose only
/// problems were unknown keys can still be deserialized for the semantic checks.
pub fn check(root: &Value, value: &mut Value, path: &KeyPath, out: &mut Vec<Diagnostic>) {
    Walker { root }.walk(root, value, path, out);
}

struct Walker<'a> {
    root: &'a Value,
}

/// A short human name of a JSON value's type, in TOML words.
pub fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "nothing",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_f64() => "a float",
        Value::Number(_) => "an integer",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "a table",
    }
}

fn show(value: &Value) -> String {
    let s = value.to_string();
    if s.len() > 40 { format!("{}...", &s[..37]) } else { s }
}

/// The first line of a schema's description.
pub fn summary(schema: &Value) -> Option<&str> {
    schema.get("description").and_then(Value::as_str).and_then(|d| d.lines().next())
}

impl<'a> Walker<'a> {
    fn resolve(&self, mut schema: &'a Value) -> &'a Value {
        for _ in 0..32 {
            let Some(r) = schema.get("$ref").and_then(Value::as_str) else { break };
            let Some(name) = r.strip_prefix("#/$defs/") else { break };
            match self.root.get("$defs").and_then(|d| d.get(name)) {
                Some(s) => schema = s,
                None => break,
            }
        }
        schema
    }

    fn walk(&self, schema: &'a Value, value: &mut Value, path: &KeyPath, out: &mut Vec<Diagnostic>) {
        let schema = self.resolve(schema);
        if schema.as_bool() == Some(true) {
            return;
        }
        // Option<T> and unions: a TOML value is never null, so pick the non-null branch.
        if let Some(branches) = schema.get("anyOf").or_else(|| schema.get("oneOf")).and_then(Value::as_array) {
            self.walk_union(branches, value, path, out);
            return;
        }
        if let Some(allowed) = schema.get("enum").and_then(Value::as_array) {
            if !allowed.contains(value) {
                let names: Vec<&str> = allowed.iter().filter_map(Value::as_str).collect();
                out.push(self.bad_value(value, &names, path));
            }
            return;
        }
        if let Some(expected) = schema.get("const") {
            if expected != value {
                out.push(Diagnostic::new(path.clone(), format!("expected {expected}, found {}", show(value))));
            }
            return;
        }
        if !self.type_matches(schema, value) {
            let want = self.type_words(schema);
            out.push(Diagnostic::new(
                path.clone(),
                format!("wrong type: expected {want}, found {} ({})", type_name(value), show(value)),
            ));
            return;
        }
        match value {
            Value::Object(map) => self.walk_object(schema, map, path, out),
            Value::Array(items) => {
                if let Some(item_schema) = schema.get("items") {
                    for (i, item) in items.iter_mut().enumerate() {
                        self.walk(item_schema, item, &path.index(i), out);
                    }
                }
            }
            Value::Number(n) => {
                if let Some(min) = schema.get("minimum").and_then(Value::as_f64) {
                    if n.as_f64().is_some_and(|x| x < min) {
                        out.push(
                            Diagnostic::new(path.clone(), format!("value {n} is below the minimum {min}"))
                                .with_help(format!("use a value >= {min}")),
                        );
                    }
                }
            }
            _ => {}
        }
    }

    fn bad_value(&self, value: &Value, names: &[&str], path: &KeyPath) -> Diagnostic {
        match value.as_str() {
            Some(s) => {
                Diagnostic::new(path.clone(), format!("unknown value \"{s}\"")).with_help(suggest(s, "values", names))
            }
            None => Diagnostic::new(path.clone(), format!("wrong type: expected a string, found {}", type_name(value)))
                .with_help(suggest("", "values", names)),
        }
    }

    fn walk_union(&self, branches: &'a [Value], value: &mut Value, path: &KeyPath, out: &mut Vec<Diagnostic>) {
        let branches: Vec<&Value> = branches
            .iter()
            .map(|b| self.resolve(b))
            .filter(|b| b.get("type").and_then(Value::as_str) != Some("null"))
            .collect();
        if branches.len() == 1 {
            self.walk(branches[0], value, path, out);
            return;
        }
        // A string enum whose variants carry docs: every branch is a `const`.
        let consts: Vec<&str> = branches.iter().filter_map(|b| b.get("const").and_then(Value::as_str)).collect();
        if consts.len() == branches.len() {
            if !value.as_str().is_some_and(|s| consts.contains(&s)) {
                out.push(self.bad_value(value, &consts, path));
            }
            return;
        }
        // An internally tagged enum: the branch whose tag property matches.
        if let Some(tag) = tag_key(&branches) {
            let names: Vec<&str> = branches
                .iter()
                .filter_map(|b| b.pointer(&format!("/properties/{tag}/const")).and_then(Value::as_str))
                .collect();
            let Some(map) = value.as_object() else {
                out.push(Diagnostic::new(
                    path.clone(),
                    format!("wrong type: expected a table with `{tag}`, found {} ({})", type_name(value), show(value)),
                ));
                return;
            };
            match map.get(tag) {
                None => out.push(
                    Diagnostic::new(path.clone(), format!("missing required key `{tag}`"))
                        .with_help(suggest("", "kinds", &names)),
                ),
                Some(Value::String(kind)) => match branches.iter().position(|b| {
                    b.pointer(&format!("/properties/{tag}/const")).and_then(Value::as_str) == Some(kind.as_str())
                }) {
                    Some(i) => self.walk(branches[i], value, path, out),
                    None => {
                        let kind = kind.clone();
                        out.push(
                            Diagnostic::new(path.key(tag), format!("unknown {tag} \"{kind}\""))
                                .with_help(suggest(&kind, "kinds", &names)),
                        )
                    }
                },
                Some(other) => out.push(Diagnostic::new(
                    path.key(tag),
                    format!("wrong type: expected a string, found {}", type_name(other)),
                )),
            }
            return;
        }
        // Anything else: accept the first branch that produces no problem.
        let mut best: Option<Vec<Diagnostic>> = None;
        for b in &branches {
            let mut trial = Vec::new();
            let mut copy = value.clone();
            self.walk(b, &mut copy, path, &mut trial);
            if trial.is_empty() {
                *value = copy;
                return;
            }
            if best.as_ref().is_none_or(|x| trial.len() < x.len()) {
                best = Some(trial);
            }
        }
        out.extend(best.unwrap_or_default());
    }

    fn walk_object(&self, schema: &'a Value, map: &mut Map<String, Value>, path: &KeyPath, out: &mut Vec<Diagnostic>) {
        let empty = Map::new();
        let props = schema.get("properties").and_then(Value::as_object).unwrap_or(&empty);
        let additional = schema.get("additionalProperties");
        let closed = additional.and_then(Value::as_bool) == Some(false)
            || schema.get("unevaluatedProperties").and_then(Value::as_bool) == Some(false);
        let required: Vec<&str> = schema
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        {
            for &key in &required {
                if !map.contains_key(key) {
                    let mut d = Diagnostic::new(path.clone(), format!("missing required key `{key}`"));
                    if let Some(s) = props.get(key).and_then(|p| summary(p).or_else(|| summary(self.resolve(p)))) {
                        d = d.with_help(format!("add `{key}`: {s}"));
                    }
                    out.push(d);
                }
            }
        }
        let names: Vec<&str> = props.keys().map(String::as_str).collect();
        let keys: Vec<String> = map.keys().cloned().collect();
        for key in keys {
            let child = path.key(&key);
            if let Some(prop) = props.get(&key) {
                let before = out.len();
                self.walk(prop, map.get_mut(&key).expect("key listed"), &child, out);
                // A bad optional key is reported, then dropped so its default applies and the
                // cross-section checks can still run over the rest of the recipe.
                if out.len() > before && !required.contains(&key.as_str()) {
                    map.remove(&key);
                }
            } else if closed {
                out.push(Diagnostic::new(child, format!("unknown key `{key}`")).with_help(suggest(
                    &key,
                    "keys here",
                    &names,
                )));
                map.remove(&key);
            } else if let Some(extra) = additional.filter(|a| a.is_object()) {
                self.walk(extra, map.get_mut(&key).expect("key listed"), &child, out);
            }
        }
    }

    fn types(&self, schema: &Value) -> Vec<String> {
        match schema.get("type") {
            Some(Value::String(t)) => vec![t.clone()],
            Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).map(str::to_string).collect(),
            _ => Vec::new(),
        }
    }

    fn type_matches(&self, schema: &Value, value: &Value) -> bool {
        let types = self.types(schema);
        types.is_empty()
            || types.iter().any(|t| match t.as_str() {
                "object" => value.is_object(),
                "array" => value.is_array(),
                "string" => value.is_string(),
                "boolean" => value.is_boolean(),
                "integer" => value.is_i64() || value.is_u64(),
                "number" => value.is_number(),
                "null" => value.is_null(),
                _ => true,
            })
    }

    fn type_words(&self, schema: &Value) -> String {
        let words: Vec<&str> = self
            .types(schema)
            .iter()
            .filter(|t| *t != "null")
            .map(|t| match t.as_str() {
                "object" => "a table",
                "array" => "an array",
                "string" => "a string",
                "boolean" => "a boolean (true or false)",
                "integer" if schema.get("minimum").and_then(Value::as_f64) == Some(0.0) => "a non-negative integer",
                "integer" => "an integer",
                "number" => "a number",
                _ => "a value",
            })
            .collect();
        words.join(" or ")
    }
}

/// The property every branch pins with a `const` (serde's internal tag), if there is one.
fn tag_key<'a>(branches: &[&'a Value]) -> Option<&'a str> {
    let first = branches.first()?.get("properties")?.as_object()?;
    first
        .iter()
        .filter(|(_, p)| p.get("const").is_some())
        .map(|(k, _)| k.as_str())
        .find(|k| branches.iter().all(|b| b.pointer(&format!("/properties/{k}/const")).is_some()))
}
