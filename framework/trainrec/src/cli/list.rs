//! `trainrec list`: the registered plugins and the built-in metrics.

use trainrec_engine::Registry;

/// `trainrec list`: the registered plugins by kind, each with its config's first doc sentence.
pub fn list(registry: &Registry) -> String {
    let entries = registry.entries();
    let width = entries.iter().map(|e| e.name.len()).max().unwrap_or(0);
    let mut out = String::new();
    for (kind, title, how) in [
        (trainrec_plugin::PluginKind::Sampler, "samplers", "[data.sampler] kind"),
        (trainrec_plugin::PluginKind::Model, "models", "[model] kind"),
        (trainrec_plugin::PluginKind::Metric, "plugin metrics", "[[metrics]] kind = \"plugin\", name"),
    ] {
        let of_kind: Vec<_> = entries.iter().filter(|e| e.kind == kind).collect();
        out.push_str(&format!("{title} ({how}):\n"));
        if of_kind.is_empty() {
            out.push_str("  (none registered)\n");
        }
        for e in of_kind {
            out.push_str(&format!("  {:width$}  {}\n", e.name, e.summary));
        }
    }
    out.push_str("\nbuilt-in metrics ([[metrics]] kind):\n");
    let metrics = builtin_metrics();
    let width = metrics.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (kind, summary) in metrics {
        out.push_str(&format!("  {kind:width$}  {summary}\n"));
    }
    out
}

/// The built-in `[[metrics]]` kinds with the first sentence of each one's doc, read from the
/// recipe schema (so the list cannot drift from what recipes accept).
fn builtin_metrics() -> Vec<(String, String)> {
    let schema = trainrec_recipe::Recipe::json_schema();
    let variants = schema.pointer("/$defs/MetricSection/oneOf").and_then(|v| v.as_array()).cloned().unwrap_or_default();
    variants
        .iter()
        .filter_map(|v| {
            let kind = v.pointer("/properties/kind/const").and_then(|k| k.as_str())?;
            (kind != "plugin").then(|| (kind.to_owned(), trainrec_plugin::schema_summary(v)))
        })
        .collect()
}
