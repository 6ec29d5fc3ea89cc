//! Semantic checks across sections, run after the recipe is structurally sound.

use std::collections::HashMap;

use serde_json::Value;

use crate::schema::{MetricSection, PluginSection, Recipe};
use crate::walk;
use trainrec_types::{Diagnostic, FeatureRef, KeyPath, PoolingMode, suggest};

/// Checks a plugin section: `kind` must name one of `kinds`, and the rest must match that
/// kind's config schema (given by `schema_of`).
pub fn check_plugin_section(
    path: &KeyPath,
    section: &PluginSection,
    kinds: &[&str],
    schema_of: impl Fn(&str) -> Option<Value>,
) -> Vec<Diagnostic> {
    let mut out = Vec::new();
    let what = path.to_string();
    match section.0.get("kind") {
        None => out.push(
            Diagnostic::new(path.clone(), format!("missing required key `kind` in [{what}]"))
                .with_help(suggest("", "kinds", kinds)),
        ),
        Some(Value::String(kind)) => match schema_of(kind) {
            Some(schema) => {
                let mut config = section.config();
                walk::check(&schema, &mut config, path, &mut out);
            }
            None => out.push(
                Diagnostic::new(path.key("kind"), format!("unknown {what} kind \"{kind}\""))
                    .with_help(suggest(kind, "kinds", kinds)),
            ),
        },
        Some(other) => out.push(Diagnostic::new(
            path.key("kind"),
            format!("wrong type: expected a string, found {}", walk::type_name(other)),
        )),
    }
    out
}

fn positive_f64(out: &mut Vec<Diagnostic>, path: KeyPath, x: f64) {
    if !(x.is_finite() && x > 0.0) {
        out.push(Diagnostic::new(path, format!("must be a positive finite number, found {x}")));
    }
}

/// Cross-section checks of a typed recipe. `sparse_features` are the sparse features the
/// sampler produces, when the sampler is known.
pub fn check_semantics(recipe: &Recipe, sparse_features: Option<&[String]>) -> Vec<Diagnostic> {
    let mut out = Vec::new();
    let root = KeyPath::root();

    let run = root.key("run");
    if recipe.run.name.trim().is_empty() || recipe.run.name.contains(['/', '\\']) {
        out.push(
            Diagnostic::new(run.key("name"), format!("invalid run name \"{}\"", recipe.run.name))
                .with_help("use a non-empty name without path separators (set run.output_dir for a path)"),
        );
    }
    match recipe.run.threads {
        Some(0) => out.push(
            Diagnostic::new(run.key("threads"), "threads must be at least 1")
                .with_help("leave it out to use all cores"),
        ),
        Some(n) if n > crate::MAX_THREADS => out.push(
            Diagnostic::new(run.key("threads"), format!("threads = {n}: at most {} threads", crate::MAX_THREADS))
                .with_help("leave it out to use all cores"),
        ),
        _ => {}
    }

    let optimizer = root.key("optimizer");
    out.extend(trainrec_types::check_schedule(&recipe.optimizer.dense_schedule, &optimizer.key("dense_schedule")));
    out.extend(trainrec_types::check_schedule(&recipe.optimizer.sparse_schedule, &optimizer.key("sparse_schedule")));
    if let Some(c) = &recipe.optimizer.dense_clipping {
        out.extend(c.check(&optimizer.key("dense_clipping")));
    }

    let data = root.key("data");
    if recipe.data.batch_size == 0 {
        out.push(Diagnostic::new(data.key("batch_size"), "batch_size must be greater than 0"));
    }
    if recipe.data.eval_batch_size == Some(0) {
        out.push(Diagnostic::new(data.key("eval_batch_size"), "eval_batch_size must be greater than 0"));
    }
    if let Some(s) = &recipe.data.shuffle {
        out.extend(s.check(&data.key("shuffle")));
    }

    if let Some(m) = recipe.embedding.max_gradient {
        positive_f64(&mut out, root.key("embedding").key("max_gradient"), m);
    }
    let tables = root.key("tables");
    if recipe.tables.is_empty() {
        out.push(
            Diagnostic::new(tables.clone(), "a recipe needs at least one embedding table")
                .with_help("add a [[tables]] entry"),
        );
    }
    let mut table_names: HashMap<&str, usize> = HashMap::new();
    let mut used_by: HashMap<&str, Vec<(usize, usize)>> = HashMap::new();
    let mut outputs: HashMap<&str, (usize, usize)> = HashMap::new();
    for (t, table) in recipe.tables.iter().enumerate() {
        let tp = tables.index(t);
        if let Some(first) = table_names.insert(&table.name, t) {
            out.push(
                Diagnostic::new(tp.key("name"), format!("duplicate table name \"{}\"", table.name))
                    .with_help(format!("tables[{first}] already uses this name; table names must be unique")),
            );
        }
        if table.rows == 0 {
            out.push(Diagnostic::new(tp.key("rows"), format!("table \"{}\" must have at least one row", table.name)));
        }
        if table.dim == 0 {
            out.push(Diagnostic::new(tp.key("dim"), format!("table \"{}\" must have a positive dim", table.name)));
        }
        if table.features.is_empty() {
            out.push(
                Diagnostic::new(tp.key("features"), format!("table \"{}\" has no features", table.name))
                    .with_help("list the sparse features looked up in this table"),
            );
        }
        if let Some(m) = table.max_gradient {
            positive_f64(&mut out, tp.key("max_gradient"), m);
        }
        if let Some(opt) = &table.optimizer {
            let before = out.len();
            positive_f64(&mut out, tp.key("optimizer").key("lr"), opt.lr() as f64);
            if out.len() == before {
                if let Err(message) = opt.validate() {
                    out.push(Diagnostic::new(tp.key("optimizer"), message));
                }
            }
        }
        for (f, feature) in table.features.iter().enumerate() {
            let fp = tp.key("features").index(f);
            let r = FeatureRef::parse(feature);
            if let Some(suffix) = r.table {
                if suffix != table.name {
                    out.push(
                        Diagnostic::new(
                            fp.clone(),
                            format!(
                                "feature \"{feature}\" names table \"{suffix}\" but is listed in table \"{}\"",
                                table.name
                            ),
                        )
                        .with_help(format!("write \"{}@{}\"", r.input, table.name)),
                    );
                }
            }
            if let Some(first) = outputs.insert(feature, (t, f)).filter(|first| first.0 == t) {
                out.push(
                    Diagnostic::new(fp.clone(), format!("feature \"{feature}\" is listed twice"))
                        .with_help(format!("first listed at tables[{}].features[{}]", first.0, first.1)),
                );
            }
            used_by.entry(r.input).or_default().push((t, f));
            if let Some(known) = sparse_features {
                if !known.iter().any(|k| k == r.input) {
                    let names: Vec<&str> = known.iter().map(String::as_str).collect();
                    out.push(
                        Diagnostic::new(
                            fp,
                            format!("unknown feature \"{}\": the sampler does not produce it", r.input),
                        )
                        .with_help(suggest(r.input, "features", &names)),
                    );
                }
            }
        }
    }
    // Dynamic tables and managed collisions: settings in range, and the table's features its
    // own (they carry raw ids of a larger id space, which no other table could read).
    for (t, table) in recipe.tables.iter().enumerate() {
        if let Some(d) = &table.dynamic {
            check_dynamic(&mut out, &tables, t, table, d);
            out.extend(own_features(&tables.index(t), table, &used_by, "dynamic"));
        }
    }
    for (t, table) in recipe.tables.iter().enumerate().filter(|(_, t)| t.pooling == PoolingMode::None) {
        check_sequence_table(&mut out, recipe, &tables.index(t), table);
    }
    for (t, table) in recipe.tables.iter().enumerate() {
        if let Some(pw) = &table.position_weighted {
            check_position_weighted(&mut out, recipe, &tables.index(t), table, pw);
        }
    }
    for (t, table) in recipe.tables.iter().enumerate() {
        if let Some(mc) = &table.mc {
            check_mc(&mut out, &tables, t, table, mc);
            out.extend(own_features(&tables.index(t), table, &used_by, "managed-collision"));
        }
    }
    let mut shared: Vec<_> = used_by.into_iter().filter(|(_, uses)| uses.len() > 1).collect();
    shared.sort();
    for (input, uses) in shared {
        for &(t, f) in &uses {
            if FeatureRef::parse(&recipe.tables[t].features[f]).table.is_none() {
                let others: Vec<String> =
                    uses.iter().map(|&(t, _)| format!("\"{input}@{}\"", recipe.tables[t].name)).collect();
                out.push(
                    Diagnostic::new(
                        tables.index(t).key("features").index(f),
                        format!("feature \"{input}\" feeds {} tables and needs a per-table name", uses.len()),
                    )
                    .with_help(format!("write {} so each pooled output has its own name", others.join(" and "))),
                );
            }
        }
    }

    if let Some(mib) = recipe.topology.gradient_bucket_mib {
        positive_f64(&mut out, root.key("topology").key("gradient_bucket_mib"), mib);
    }

    let opt = root.key("optimizer");
    let before = out.len();
    positive_f64(&mut out, opt.key("sparse").key("lr"), recipe.optimizer.sparse.lr() as f64);
    // The optimizer's own rules (eps, weight decay), found here rather than when the job is built.
    if out.len() == before {
        if let Err(message) = recipe.optimizer.sparse.validate() {
            out.push(Diagnostic::new(opt.key("sparse"), message));
        }
    }
    positive_f64(&mut out, opt.key("dense").key("lr"), recipe.optimizer.dense.lr());

    check_train_metrics_tasks(&mut out, recipe);
    out
}

/// `[train]`'s schedule, the `[[metrics]]` list and the `[[tasks]]`.
fn check_train_metrics_tasks(out: &mut Vec<Diagnostic>, recipe: &Recipe) {
    let root = KeyPath::root();
    let train = root.key("train");
    match (recipe.train.steps, recipe.train.epochs) {
        (None, None) => out.push(
            Diagnostic::new(train.clone(), "set how long to train")
                .with_help("add `steps = N` or `epochs = N` to [train]"),
        ),
        (Some(_), Some(_)) => out.push(
            Diagnostic::new(train.key("epochs"), "`steps` and `epochs` are both set")
                .with_help("keep exactly one of them"),
        ),
        (Some(0), _) => out.push(Diagnostic::new(train.key("steps"), "steps must be greater than 0")),
        (_, Some(0)) => out.push(Diagnostic::new(train.key("epochs"), "epochs must be greater than 0")),
        _ => {}
    }
    for (key, v) in [
        ("eval_every", recipe.train.eval_every),
        ("eval_batches", recipe.train.eval_batches),
        ("log_every", Some(recipe.train.log_every)),
        ("metrics_every", recipe.train.metrics_every),
        ("metrics_window", Some(recipe.train.metrics_window)),
        ("checkpoint_every", recipe.train.checkpoint_every),
        ("keep_checkpoints", Some(recipe.train.keep_checkpoints)),
    ] {
        if v == Some(0) {
            out.push(Diagnostic::new(train.key(key), format!("{key} must be greater than 0")));
        }
    }
    for (i, m) in recipe.metrics.iter().enumerate() {
        if let Some(first) = recipe.metrics[..i].iter().position(|x| match (x, m) {
            (MetricSection::Plugin { name: a, .. }, MetricSection::Plugin { name: b, .. }) => a == b,
            _ => std::mem::discriminant(x) == std::mem::discriminant(m),
        }) {
            out.push(
                Diagnostic::new(root.key("metrics").index(i).key("kind"), "this metric is listed twice")
                    .with_help(format!("metrics[{first}] is the same kind; keep one")),
            );
        }
    }
    for (i, m) in recipe.metrics.iter().enumerate() {
        let at = root.key("metrics").index(i);
        match m {
            MetricSection::Ndcg { k: Some(0), .. } => {
                out.push(
                    Diagnostic::new(at.key("k"), "k must be at least 1").with_help("leave k unset to count every rank"),
                );
            }
            MetricSection::RecallSession { top_threshold: 0, .. } => {
                out.push(Diagnostic::new(at.key("top_threshold"), "top_threshold must be at least 1"));
            }
            MetricSection::RecallAtK { k } | MetricSection::FullRanking { k } => {
                if k.is_empty() {
                    out.push(
                        Diagnostic::new(at.key("k"), "k needs at least one cut-off").with_help("e.g. k = [10, 50]"),
                    );
                }
                for (j, &kk) in k.iter().enumerate() {
                    if kk == 0 {
                        out.push(Diagnostic::new(at.key("k").index(j), "a cut-off must be at least 1"));
                    }
                }
            }
            _ => {}
        }
    }
    for (i, t) in recipe.tasks.iter().enumerate() {
        if let Some(first) = recipe.tasks[..i].iter().position(|x| x.name == t.name) {
            out.push(
                Diagnostic::new(root.key("tasks").index(i).key("name"), format!("task {:?} is listed twice", t.name))
                    .with_help(format!("tasks[{first}] has the same name; task names must be unique")),
            );
        }
        if !(t.loss_weight.is_finite() && t.loss_weight >= 0.0) {
            out.push(Diagnostic::new(
                root.key("tasks").index(i).key("loss_weight"),
                format!("loss_weight must be a finite number >= 0, found {}", t.loss_weight),
            ));
        }
    }
    if recipe.metrics.is_empty() {
        out.push(
            Diagnostic::new(root.key("metrics"), "no metrics")
                .with_help("add a [[metrics]] entry such as kind = \"auc\""),
        );
    }
}

/// A dynamic table's settings (`tables[t].dynamic`): in range, sum pooling, not managed
/// collisions too.
fn check_dynamic(
    out: &mut Vec<Diagnostic>,
    tables: &KeyPath,
    t: usize,
    table: &crate::TableSection,
    d: &crate::DynamicSection,
) {
    let dp = tables.index(t).key("dynamic");
    if table.mc.is_some() {
        out.push(
            Diagnostic::new(dp.clone(), "a table is either dynamic or managed-collision, not both")
                .with_help("drop tables[].mc: a dynamic table gives every admitted id its own row"),
        );
    }
    if table.pooling != trainrec_types::PoolingMode::Sum {
        out.push(
            Diagnostic::new(tables.index(t).key("pooling"), "a dynamic table pools by sum")
                .with_help("an id without a row adds nothing to its bag; a mean would count it"),
        );
    }
    if table.rows > u64::from(u32::MAX) {
        out.push(Diagnostic::new(
            tables.index(t).key("rows"),
            format!("a dynamic table holds at most {} rows (its capacity)", u32::MAX),
        ));
    }
    if d.admit_after == 0 {
        out.push(Diagnostic::new(dp.key("admit_after"), "admit_after must be at least 1"));
    }
    if !(d.admit_probability > 0.0 && d.admit_probability <= 1.0) {
        out.push(Diagnostic::new(
            dp.key("admit_probability"),
            format!("admit_probability = {} must be in (0, 1]", d.admit_probability),
        ));
    }
    if d.ttl_steps == Some(0) {
        out.push(
            Diagnostic::new(dp.key("ttl_steps"), "ttl_steps must be at least 1")
                .with_help("leave it out to keep rows until a new id needs their room"),
        );
    }
    if d.sketch_width == 0 || d.sketch_depth == 0 || d.sketch_width.saturating_mul(d.sketch_depth) > 1 << 30 {
        let key = if d.sketch_width == 0 { "sketch_width" } else { "sketch_depth" };
        out.push(Diagnostic::new(
            dp.key(key),
            format!(
                "the admission sketch needs 1..=2^30 counters in all (width {} x depth {})",
                d.sketch_width, d.sketch_depth
            ),
        ));
    }
    if d.id_space == 0 || d.id_space > 1 << 63 {
        out.push(Diagnostic::new(dp.key("id_space"), "id_space must be in 1..=2^63"));
    }
    let parts = u64::from(d.partitions);
    if parts == 0 || (parts - 1) * table.rows.div_ceil(parts.max(1)) >= table.rows {
        out.push(
            Diagnostic::new(
                dp.key("partitions"),
                format!(
                    "partitions = {} must be 1 or more, each with rows of its own: {} rows in blocks of {} leave \
                     the last one without any",
                    d.partitions,
                    table.rows,
                    table.rows.div_ceil(parts.max(1))
                ),
            )
            .with_help("use fewer partitions, or more rows"),
        );
    }
}

/// A sequence table (`pooling = "none"`, at `at`): what its path runs today, CPU ranks, every
/// row in memory, no id maps, no gradient clipping.
fn check_sequence_table(out: &mut Vec<Diagnostic>, recipe: &Recipe, at: &KeyPath, table: &crate::TableSection) {
    let help = "sequence tables (pooling = \"none\") train on CPU ranks, with every row in memory";
    if recipe.topology.compute_device == trainrec_types::ComputeDevice::Cuda {
        out.push(
            Diagnostic::new(
                at.key("pooling"),
                "a sequence table has no CUDA path yet (topology.compute_device = \"cuda\")",
            )
            .with_help(help),
        );
    }
    if table.mc.is_some() {
        out.push(
            Diagnostic::new(at.key("mc"), "a sequence table takes no managed collisions yet")
                .with_help("drop tables[].mc, or pool the table (pooling = \"sum\" or \"mean\")"),
        );
    }
    let c = &table.constraints;
    let cached = c.compute_kernels.as_ref().is_some_and(|k| k.iter().all(|k| k.cache_backing().is_some()));
    if c.cache.is_some() || cached {
        out.push(
            Diagnostic::new(at.key("constraints"), "a sequence table keeps every row in memory: it has no cache")
                .with_help(help),
        );
    }
    if table.max_gradient.is_some() {
        out.push(
            Diagnostic::new(at.key("max_gradient"), "gradient clipping applies to pooled outputs only")
                .with_help("drop tables[].max_gradient from the sequence table"),
        );
    }
}

/// The longest `tables[].position_weighted.max_length`: weights per feature, a dense parameter
/// each rank holds whole.
pub const MAX_POSITION_WEIGHTS: usize = 1 << 20;

/// A position-weighted table (`tables[t].position_weighted`, at `at`): a summed table whose
/// rows the job's embedding collection looks up id by id (CPU ranks, every row in memory, no
/// id maps, no gradient clipping), with a sane number of weights.
fn check_position_weighted(
    out: &mut Vec<Diagnostic>,
    recipe: &Recipe,
    at: &KeyPath,
    table: &crate::TableSection,
    pw: &crate::PositionWeightedSection,
) {
    let key = at.key("position_weighted");
    if pw.max_length == 0 || pw.max_length > MAX_POSITION_WEIGHTS {
        out.push(Diagnostic::new(
            key.key("max_length"),
            format!("max_length = {} must be in 1..={MAX_POSITION_WEIGHTS}", pw.max_length),
        ));
    }
    if table.pooling != PoolingMode::Sum {
        out.push(
            Diagnostic::new(
                key.clone(),
                format!("position weights need sum pooling; the table pools by {:?}", table.pooling),
            )
            .with_help("set pooling = \"sum\" (TorchRec's feature-processed bags sum the weighted rows)"),
        );
    }
    let help = "position-weighted tables train on CPU ranks, with every row in memory";
    if recipe.topology.compute_device == trainrec_types::ComputeDevice::Cuda {
        out.push(
            Diagnostic::new(key.clone(), "position weights have no CUDA path yet (topology.compute_device = \"cuda\")")
                .with_help(help),
        );
    }
    let c = &table.constraints;
    let cached = c.compute_kernels.as_ref().is_some_and(|k| k.iter().all(|k| k.cache_backing().is_some()));
    if c.cache.is_some() || cached {
        out.push(
            Diagnostic::new(
                at.key("constraints"),
                "a position-weighted table keeps every row in memory: it has no cache",
            )
            .with_help(help),
        );
    }
    for (name, set) in [("mc", table.mc.is_some()), ("dynamic", table.dynamic.is_some())] {
        if set {
            out.push(
                Diagnostic::new(at.key(name), format!("a position-weighted table takes no tables[].{name} yet"))
                    .with_help("drop one of the two"),
            );
        }
    }
    if table.max_gradient.is_some() {
        out.push(
            Diagnostic::new(at.key("max_gradient"), "gradient clipping applies to the pooled engine's tables only")
                .with_help("drop tables[].max_gradient from the position-weighted table"),
        );
    }
}

/// A managed-collision table's settings (`tables[t].mc`), in range.
fn check_mc(
    out: &mut Vec<Diagnostic>,
    tables: &KeyPath,
    t: usize,
    table: &crate::TableSection,
    mc: &crate::ManagedCollisionSection,
) {
    let mp = tables.index(t).key("mc");
    let zch = mc.zch_size.unwrap_or(table.rows);
    if zch == 0 || zch > table.rows {
        out.push(
            Diagnostic::new(
                mp.key("zch_size"),
                format!("zch_size = {zch} must be in 1..={} (the table's rows)", table.rows),
            )
            .with_help("leave it out to track rows - 1 ids and keep the last row for the others"),
        );
    } else if zch == table.rows && table.rows < 2 {
        out.push(Diagnostic::new(tables.index(t).key("rows"), "a managed-collision table needs at least 2 rows"));
    }
    if mc.input_hash_size == 0 {
        out.push(Diagnostic::new(mp.key("input_hash_size"), "input_hash_size must be at least 1"));
    }
    if mc.eviction_interval == 0 {
        out.push(Diagnostic::new(mp.key("eviction_interval"), "eviction_interval must be at least 1"));
    }
    positive_f64(out, mp.key("decay_exponent"), mc.decay_exponent);
    if let Some(n) = mc.partitions {
        let config = trainrec_types::McConfig {
            rows: table.rows,
            zch_size: zch.clamp(1, table.rows),
            input_hash_size: mc.input_hash_size.max(1),
            policy: trainrec_types::McEvictionPolicy::Lfu,
            decay_exponent: 1.0,
            eviction_interval: 1,
        };
        if let Err(m) = config.partitions(n) {
            out.push(
                Diagnostic::new(mp.key("partitions"), m).with_help(
                    "each partition needs raw ids and rows of its own (two rows when it keeps a reserved row)",
                ),
            );
        }
    }
}

/// Features of table `table` (at recipe key `at`) that another table reads too, for a table of
/// `kind` that reads raw ids (managed-collision, dynamic).
fn own_features(
    at: &KeyPath,
    table: &crate::TableSection,
    used_by: &HashMap<&str, Vec<(usize, usize)>>,
    kind: &str,
) -> Vec<Diagnostic> {
    let mut out = Vec::new();
    for (f, feature) in table.features.iter().enumerate() {
        let input = FeatureRef::parse(feature).input;
        let users = used_by.get(input).map_or(0, Vec::len);
        if users > 1 {
            out.push(
                Diagnostic::new(
                    at.key("features").index(f),
                    format!("feature \"{input}\" feeds a {kind} table and {} other table(s)", users - 1),
                )
                .with_help(format!("a {kind} table reads raw ids; give it features no other table reads")),
            );
        }
    }
    out
}
