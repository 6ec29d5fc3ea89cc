//! A job's checkpoints: what [`Job`] saves (see [`super::format`] for the format) and how
//! it resumes from them.
//!
//! Tensor names in the checkpoint:
//! - `sparse.<table>.rows<a>-<b>.cols<c>-<d>.weight` / `.optimizer_state`: every rank's blocks
//!   of every table (data-parallel replicas once);
//! - `dense.<variable>`: the dense model's variables (VarStore names);
//! - `dense_opt.<name>`: the dense optimizer's state;
//! - `mc.<table>.<ids|counts|last_access|window_ids|window_counts|window_last|meta>`: managed
//!   collisions (`mc.<table>.part<i>.*` per partition of a table split in more than one;
//!   `meta`: step, lookups, fallbacks, last evictions, last admissions, evictions and the
//!   partition's first row), saved by the rank that runs the partition;
//! - `metrics.train.<task>.<metric>.<array>`: the training metrics' windows and sums.
//!
//! The rest (the loop's position, the running loss, statistics) is JSON in the manifest's
//! `state`.

use std::collections::BTreeMap;
use trainrec_embedding::EmbeddingBagCollection;
use trainrec_embedding::dynamic::NOT_ADMITTED;

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};
use trainrec_embedding::StatePart;
use trainrec_embedding::mc::{McState, McStats};
use trainrec_metrics::{MetricState, MetricSuite};

use super::format::{Checkpoint, CheckpointError, Contents, Header, TensorData};
use crate::error::EngineError;
use crate::job::Job;
use crate::job_metrics::TrainMetrics;
use crate::run_dir::Progress;

/// Managed-collision counters of one table (its arrays are tensors).
#[derive(Clone, Debug, Serialize, Deserialize)]
struct McRecord {
    table: String,
    /// Its partitions (each part's state and statistics are tensors).
    partitions: usize,
}

/// The checkpoint name prefix of part `part` of `partitions` of managed-collision table
/// `table`: `mc.<table>` for one part, `mc.<table>.part<i>` for more.
fn mc_prefix(table: &str, part: usize, partitions: usize) -> String {
    if partitions == 1 { format!("mc.{table}") } else { format!("mc.{table}.part{part}") }
}

/// The manifest's `state`.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct JobState {
    progress: Progress,
    mc: Vec<McRecord>,
    /// Per task, per metric: the names of its state arrays (`None`: a metric without
    /// checkpointable state, so the training metrics restart at resume).
    train_metrics: Option<Vec<Vec<Vec<String>>>>,
    /// The names of the throughput metric's state arrays.
    throughput: Vec<String>,
}

fn tensor_data(name: &str, t: &Tensor) -> Result<TensorData, EngineError> {
    let shape: Vec<usize> = t.size().iter().map(|&d| d as usize).collect();
    let flat = t.detach().to_device(tch::Device::Cpu).contiguous().view([-1]);
    let bad = |e: tch::TchError| EngineError::Internal(format!("checkpoint tensor {name}: {e}"));
    Ok(match t.kind() {
        Kind::Float => TensorData::f32(shape, &Vec::<f32>::try_from(&flat).map_err(bad)?),
        Kind::Double => TensorData::f64(shape, &Vec::<f64>::try_from(&flat).map_err(bad)?),
        Kind::Int64 => TensorData::i64(shape, &Vec::<i64>::try_from(&flat).map_err(bad)?),
        k => return Err(EngineError::Internal(format!("checkpoint tensor {name}: {k:?} is not saved"))),
    })
}

/// Tensor `name` of the checkpoint as a CPU tensor of its saved type.
fn read_tensor(ck: &Checkpoint, name: &str) -> Result<Tensor, EngineError> {
    let dtype = ck.manifest.tensors.get(name).map(|t| t.dtype.clone()).unwrap_or_default();
    let (shape, t) = match dtype.as_str() {
        "F64" => {
            let (shape, v) = ck.f64(name)?;
            (shape, Tensor::from_slice(&v))
        }
        "I64" => {
            let (shape, v) = ck.i64(name)?;
            (shape, Tensor::from_slice(&v))
        }
        _ => {
            let (shape, v) = ck.f32(name)?;
            (shape, Tensor::from_slice(&v))
        }
    };
    let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    Ok(t.reshape(dims.as_slice()))
}

fn incompatible(ck: &Checkpoint, message: String) -> EngineError {
    CheckpointError::Incompatible { dir: ck.dir().to_path_buf(), message }.into()
}

impl Job {
    /// Loads a checkpoint's model (tables, dense model, optimizers, managed collisions) into
    /// this freshly built job, for evaluation or inference; [`Job::resume_from`] resumes
    /// training instead.
    pub fn load_checkpoint(&mut self, ck: &Checkpoint) -> Result<(), EngineError> {
        self.restore(ck, &mut TrainMetrics::none()?).map(|_| ())
    }

    /// Replaces a one-rank job's tables by inference tables quantized to `precision` (int8
    /// row-wise or fp16): [`Job::evaluate`] then reads them; training is refused.
    pub fn quantize(&mut self, precision: trainrec_embedding::quant::QuantPrecision) -> Result<(), EngineError> {
        let Some(ebc) = self.sparse.engine().and_then(|e| e.as_any().downcast_ref::<EmbeddingBagCollection>()) else {
            return Err(EngineError::Internal("quantized inference runs on one rank (topology.world_size = 1)".into()));
        };
        let q = trainrec_embedding::quant::QuantizedEbc::from_ebc(ebc, precision)?;
        tracing::info!(?precision, bytes = q.bytes(), "tables quantized");
        self.sparse.pooled = crate::sparse_arch::Pooled::Lookup(Box::new(q));
        Ok(())
    }

    /// The sparse optimizer's state layout of table `name`.
    fn state_layout(&self, name: &str) -> Vec<StatePart> {
        let table = self.recipe.tables.iter().find(|t| t.name == name);
        table.and_then(|t| t.optimizer.as_ref()).unwrap_or(&self.recipe.optimizer.sparse).state_layout().to_vec()
    }

    /// Saves a checkpoint of the job after `progress.step` into `<output_dir>/checkpoints`
    /// (every rank calls it), with the training metrics `metrics`.
    pub(crate) fn save_checkpoint(
        &self,
        progress: &Progress,
        metrics: &TrainMetrics,
    ) -> Result<std::path::PathBuf, EngineError> {
        let _span = tracing::info_span!("checkpoint", step = progress.step).entered();
        let pg = self.sync.as_ref().map(|s| s.pg.as_ref());
        let lead = pg.is_none_or(|g| g.rank() == 0);
        let mut contents = Contents { tensors: Vec::new(), shards: Vec::new() };
        let mut shards = self.sparse.local_shards();
        self.mc.dynamic.live_rows_only(&mut shards);
        contents.add_shards(shards, |t| self.state_layout(t), lead);
        // Managed collisions: every part once, saved by the rank that runs it (the lead for
        // replicated tables).
        let mc_states = self.mc.states(lead);
        for (table, partitions, parts) in &mc_states {
            for ps in parts {
                let (p, s) = (mc_prefix(table, ps.part, *partitions), &ps.state);
                contents.tensors.push((format!("{p}.ids"), TensorData::i64(vec![s.ids.len()], &s.ids)));
                contents.tensors.push((format!("{p}.counts"), TensorData::u64s(&s.counts)));
                contents.tensors.push((format!("{p}.last_access"), TensorData::u64s(&s.last_access)));
                let ids: Vec<i64> = s.window.iter().map(|w| w.0).collect();
                let counts: Vec<u64> = s.window.iter().map(|w| w.1).collect();
                let last: Vec<u64> = s.window.iter().map(|w| w.2).collect();
                contents.tensors.push((format!("{p}.window_ids"), TensorData::i64(vec![ids.len()], &ids)));
                contents.tensors.push((format!("{p}.window_counts"), TensorData::u64s(&counts)));
                contents.tensors.push((format!("{p}.window_last"), TensorData::u64s(&last)));
                let st = &s.stats;
                let meta = [
                    s.step,
                    st.lookups,
                    st.fallbacks,
                    st.last_evictions,
                    st.last_admissions,
                    st.evictions,
                    ps.first_row,
                ];
                contents.tensors.push((format!("{p}.meta"), TensorData::u64s(&meta)));
            }
        }
        // Dynamic tables: each map saved once, by its owner (or the lead when every rank runs
        // it).
        for (table, part, parts, s) in self.mc.dynamic.states(lead) {
            let p = dynamic_prefix(&table, part, parts);
            // The live rows alone, with their ids, counts and last steps.
            let rows: Vec<u64> = s.rows.iter().map(|&r| u64::from(r)).collect();
            contents.tensors.push((format!("{p}.rows"), TensorData::u64s(&rows)));
            contents.tensors.push((format!("{p}.ids"), TensorData::i64(vec![s.ids.len()], &s.ids)));
            contents.tensors.push((format!("{p}.counts"), TensorData::u64s(&s.counts)));
            contents.tensors.push((format!("{p}.last"), TensorData::u64s(&s.last)));
            // Two 32-bit counters to a value.
            let sketch: Vec<u64> = s
                .sketch
                .chunks(2)
                .map(|c| u64::from(c[0]) | (u64::from(c.get(1).copied().unwrap_or(0)) << 32))
                .collect();
            contents.tensors.push((format!("{p}.sketch"), TensorData::u64s(&sketch)));
            let st = &s.stats;
            let meta = [s.step, st.admitted, st.rejected, st.expired, st.evicted, st.lookups, s.sketch_added];
            contents.tensors.push((format!("{p}.meta"), TensorData::u64s(&meta)));
        }
        let header = if lead {
            let vars: BTreeMap<String, Tensor> = self.vs.variables().into_iter().collect();
            for (name, t) in &vars {
                contents.tensors.push((format!("dense.{name}"), tensor_data(name, t)?));
            }
            for (name, t) in self.dense_opt.state() {
                contents.tensors.push((format!("dense_opt.{name}"), tensor_data(&name, &t)?));
            }
            let mc: Vec<McRecord> = mc_states
                .iter()
                .map(|(table, partitions, _)| McRecord { table: table.clone(), partitions: *partitions })
                .collect();
            let states = metrics
                .suites
                .as_deref()
                .map(|suites| suites.iter().map(MetricSuite::state).collect::<Option<Vec<_>>>());
            let train_metrics = match states {
                Some(Some(per_task)) => {
                    let mut names = Vec::new();
                    for (task, states) in per_task.iter().enumerate() {
                        let mut per_metric = Vec::new();
                        for (m, state) in states.iter().enumerate() {
                            let mut arrays = Vec::new();
                            for (a, (name, values)) in state.arrays.iter().enumerate() {
                                let key = format!("metrics.train.{task}.{m}.{a}");
                                contents.tensors.push((key, TensorData::f64(vec![values.len()], values)));
                                arrays.push(name.clone());
                            }
                            per_metric.push(arrays);
                        }
                        names.push(per_metric);
                    }
                    Some(names)
                }
                Some(None) => {
                    tracing::warn!(
                        "a training metric has no checkpointable state: on resume the training metrics restart"
                    );
                    None
                }
                None => None,
            };
            let mut throughput_arrays = Vec::new();
            for (a, (name, values)) in metrics.throughput.state().arrays.iter().enumerate() {
                contents.tensors.push((format!("metrics.throughput.{a}"), TensorData::f64(vec![values.len()], values)));
                throughput_arrays.push(name.clone());
            }
            let state = JobState { progress: progress.clone(), mc, train_metrics, throughput: throughput_arrays };
            Some(Header {
                step: progress.step,
                recipe: self.resolved_toml.clone(),
                base_dir: std::path::absolute(&self.base_dir).unwrap_or_else(|_| self.base_dir.clone()),
                plan: serde_json::to_value(&self.plan).map_err(|e| EngineError::Internal(format!("plan: {e}")))?,
                state: serde_json::to_value(&state).expect("the job state serializes"),
            })
        } else {
            None
        };
        let root = self.recipe.output_dir().join("checkpoints");
        let keep = self.recipe.train.keep_checkpoints as usize;
        Ok(super::format::save(&root, header, contents, pg, progress.step, keep)?)
    }

    /// Restores everything a checkpoint holds into this freshly built job (the same model;
    /// any world size and plan) and returns the loop's position; `metrics` get the training
    /// metrics' state.
    pub(crate) fn restore(&mut self, ck: &Checkpoint, metrics: &mut TrainMetrics) -> Result<Progress, EngineError> {
        let _span = tracing::info_span!("restore", step = ck.manifest.step).entered();
        let state: JobState = serde_json::from_value(ck.manifest.state.clone())
            .map_err(|e| incompatible(ck, format!("its job state does not parse: {e}")))?;

        // Embedding shards: each of this job's blocks assembled from the saved ones.
        let mut shards = Vec::new();
        for s in self.sparse.local_shards() {
            let layout = self.state_layout(&s.table);
            shards.push(ck.assemble_shard(&super::Block::of(&s), &layout)?);
        }
        self.sparse.load_local_shards(shards)?;

        // Dense variables, then the dense optimizer.
        let vars = self.vs.variables();
        let saved = ck.manifest.tensors.keys().filter(|k| k.starts_with("dense.")).count();
        if saved != vars.len() {
            return Err(incompatible(
                ck,
                format!("it has {saved} dense variables, the model {}: the model changed", vars.len()),
            ));
        }
        tch::no_grad(|| -> Result<(), EngineError> {
            for (name, mut var) in vars {
                let key = format!("dense.{name}");
                if !ck.has(&key) {
                    return Err(incompatible(ck, format!("it has no dense variable {name}: the model changed")));
                }
                let t = read_tensor(ck, &key)?;
                if t.size() != var.size() {
                    return Err(incompatible(
                        ck,
                        format!("dense variable {name} is {:?} there and {:?} in the model", t.size(), var.size()),
                    ));
                }
                var.copy_(&t.to_kind(var.kind()));
            }
            Ok(())
        })?;
        let mut opt = Vec::new();
        for key in ck.manifest.tensors.keys().filter(|k| k.starts_with("dense_opt.")) {
            opt.push((key["dense_opt.".len()..].to_string(), read_tensor(ck, key)?));
        }
        self.dense_opt.load_state(&opt).map_err(|e| incompatible(ck, format!("dense optimizer state: {e}")))?;

        // Managed collisions.
        let mut names = self.mc.names();
        names.sort();
        let mut saved: Vec<String> = state.mc.iter().map(|m| m.table.clone()).collect();
        saved.sort();
        if names != saved {
            return Err(incompatible(ck, format!("managed-collision tables {saved:?} there, {names:?} in the job")));
        }
        for m in &state.mc {
            self.mc.set_partitions(&m.table, m.partitions)?;
            for part in 0..m.partitions {
                let s = read_mc_part(ck, &mc_prefix(&m.table, part, m.partitions), &m.table)?;
                self.mc.set_state(&m.table, part, &s)?;
            }
        }
        self.mc.attach(&mut self.sparse, &self.recipe, &self.plan)?;

        // Dynamic tables: every map (each rank runs its own, or all of them).
        let maps: Vec<(String, usize, usize, usize)> = self
            .mc
            .dynamic
            .tables
            .iter()
            .flat_map(|t| {
                t.parts.iter().enumerate().map(move |(pi, p)| {
                    let c = p.table.config();
                    (t.name.clone(), pi, t.parts.len(), c.sketch_width * c.sketch_depth)
                })
            })
            .collect();
        for (name, part, parts, counters) in maps {
            let p = dynamic_prefix(&name, part, parts);
            if !ck.manifest.tensors.contains_key(&format!("{p}.ids")) {
                return Err(incompatible(
                    ck,
                    format!("it holds no state of dynamic table {name} (partition {part} of {parts})"),
                ));
            }
            let u64s = |what: &str| ck.u64s(&format!("{p}.{what}"));
            let meta = u64s("meta")?;
            let [step, admitted, rejected, expired, evicted, lookups, sketch_added] = meta[..] else {
                return Err(incompatible(
                    ck,
                    format!("dynamic table {name}: its meta has {} values, not 7", meta.len()),
                ));
            };
            let mut sketch: Vec<u32> = u64s("sketch")?.into_iter().flat_map(|c| [c as u32, (c >> 32) as u32]).collect();
            sketch.truncate(counters);
            let (mut ids, mut counts, mut last) = (ck.i64(&format!("{p}.ids"))?.1, u64s("counts")?, u64s("last")?);
            let rows: Vec<u32> = if ck.has(&format!("{p}.rows")) {
                u64s("rows")?.into_iter().map(|r| r as u32).collect()
            } else {
                // A checkpoint of every row (free ones -1), as trainrec saved them before.
                let live: Vec<usize> = (0..ids.len()).filter(|&r| ids[r] != NOT_ADMITTED).collect();
                ids = live.iter().map(|&r| ids[r]).collect();
                counts = live.iter().filter_map(|&r| counts.get(r).copied()).collect();
                last = live.iter().filter_map(|&r| last.get(r).copied()).collect();
                live.iter().map(|&r| r as u32).collect()
            };
            let state = trainrec_embedding::dynamic::DynamicState {
                step,
                rows,
                ids,
                counts,
                last,
                sketch,
                sketch_added,
                stats: trainrec_embedding::dynamic::DynamicStats {
                    live: 0,
                    admitted,
                    rejected,
                    expired,
                    evicted,
                    lookups,
                },
            };
            self.mc.dynamic.load(&name, part, state).map_err(|e| incompatible(ck, e.to_string()))?;
        }

        // Training metrics.
        match (metrics.suites.as_deref_mut(), &state.train_metrics) {
            (Some(suites), Some(names)) => {
                if names.len() != suites.len() {
                    return Err(incompatible(
                        ck,
                        format!("{} tasks' training metrics there, {} in the job", names.len(), suites.len()),
                    ));
                }
                for (task, (suite, metrics)) in suites.iter_mut().zip(names).enumerate() {
                    let mut states = Vec::new();
                    for (m, arrays) in metrics.iter().enumerate() {
                        let mut st = MetricState::default();
                        for (a, name) in arrays.iter().enumerate() {
                            st.arrays.push((name.clone(), ck.f64(&format!("metrics.train.{task}.{m}.{a}"))?.1));
                        }
                        states.push(st);
                    }
                    suite.load_state(&states).map_err(|e| incompatible(ck, format!("training metrics: {e}")))?;
                }
            }
            (Some(_), None) => {
                tracing::warn!("the checkpoint has no training-metric state: the training metrics restart")
            }
            _ => {}
        }

        let mut st = MetricState::default();
        for (a, name) in state.throughput.iter().enumerate() {
            st.arrays.push((name.clone(), ck.f64(&format!("metrics.throughput.{a}"))?.1));
        }
        metrics.throughput.load_state(&st).map_err(|e| incompatible(ck, format!("throughput: {e}")))?;

        let mut progress = state.progress;
        let world = self.sync.as_ref().map_or(1, |s| s.pg.world_size());
        if progress.world_size != world && progress.world_size > 0 {
            let skip = self.sampler.resume_offset(progress.in_epoch, progress.world_size, world);
            tracing::warn!(
                saved = progress.world_size,
                now = world,
                read = progress.in_epoch,
                skip,
                "resuming on another world size: each rank skips {skip} batches of the epoch"
            );
            progress.in_epoch = skip;
        }
        progress.world_size = world;
        tracing::info!(step = progress.step, dir = %ck.dir().display(), "resumed from checkpoint");
        Ok(progress)
    }
}

/// The state of one managed-collision part (tensors `<prefix>.*`) of table `table`.
fn read_mc_part(ck: &Checkpoint, p: &str, table: &str) -> Result<McState, EngineError> {
    let window_ids = ck.i64(&format!("{p}.window_ids"))?.1;
    let window_counts = ck.u64s(&format!("{p}.window_counts"))?;
    let window_last = ck.u64s(&format!("{p}.window_last"))?;
    if window_ids.len() != window_counts.len() || window_ids.len() != window_last.len() {
        return Err(incompatible(ck, format!("table {table}: managed-collision window arrays differ in length")));
    }
    let meta = ck.u64s(&format!("{p}.meta"))?;
    let &[step, lookups, fallbacks, last_evictions, last_admissions, evictions, _first_row] = meta.as_slice() else {
        return Err(incompatible(ck, format!("table {table}: {p}.meta holds {} values, not 7", meta.len())));
    };
    Ok(McState {
        ids: ck.i64(&format!("{p}.ids"))?.1,
        counts: ck.u64s(&format!("{p}.counts"))?,
        last_access: ck.u64s(&format!("{p}.last_access"))?,
        step,
        window: window_ids.into_iter().zip(window_counts).zip(window_last).map(|((a, b), c)| (a, b, c)).collect(),
        stats: McStats { lookups, fallbacks, last_evictions, last_admissions, evictions, ..Default::default() },
    })
}

/// The tensor names' prefix of map `part` (of `parts`) of dynamic table `table`:
/// `dynamic.<table>` for a table of one map, else `dynamic.<table>.part<i>`.
pub(crate) fn dynamic_prefix(table: &str, part: usize, parts: usize) -> String {
    if parts == 1 { format!("dynamic.{table}") } else { format!("dynamic.{table}.part{part}") }
}
