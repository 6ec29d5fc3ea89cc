//! A job's managed-collision tables (`[tables.mc]`): raw ids remapped to rows before the
//! embedding lookup, profiled on training batches, and the rows of slots that change hands
//! re-initialised (see [`trainrec_embedding::mc`]).

use std::collections::BTreeMap;

use trainrec_dist::{ProcessGroup, ProcessGroupExt};
use trainrec_embedding::mc::{EvictionPolicy, ManagedCollision, McConfig, McState, McStats};
use trainrec_recipe::{FeatureRef, McPolicy, Recipe};
use trainrec_sparse::KeyedJaggedTensor;

use crate::error::EngineError;

struct McTable {
    name: String,
    /// The input features it reads.
    keys: Vec<String>,
    module: ManagedCollision,
}

/// Every managed-collision table of a job.
pub(crate) struct McTables {
    tables: Vec<McTable>,
    seed: u64,
}

fn bad(table: &str, m: impl std::fmt::Display) -> EngineError {
    EngineError::Embedding(trainrec_embedding::EmbeddingError::Config(format!(
        "table \"{table}\": managed collisions: {m}"
    )))
}

impl McTables {
    /// The recipe's managed-collision tables (settings already validated).
    pub(crate) fn new(recipe: &Recipe) -> Result<Self, EngineError> {
        let mut tables = Vec::new();
        for t in &recipe.tables {
            let Some(mc) = &t.mc else { continue };
            let policy = match mc.eviction_policy {
                McPolicy::Lfu => EvictionPolicy::Lfu,
                McPolicy::Lru => EvictionPolicy::Lru { decay_exponent: mc.decay_exponent },
                McPolicy::DistanceLfu => EvictionPolicy::DistanceLfu { decay_exponent: mc.decay_exponent },
            };
            let config = McConfig {
                rows: t.rows,
                zch_size: mc.zch_size.unwrap_or(t.rows),
                input_hash_size: mc.input_hash_size,
                policy,
                eviction_interval: mc.eviction_interval,
            };
            let module = ManagedCollision::new(config).map_err(|m| bad(&t.name, m))?;
            let keys = t.features.iter().map(|f| FeatureRef::parse(f).input.to_string()).collect();
            tables.push(McTable { name: t.name.clone(), keys, module });
        }
        Ok(Self { tables, seed: recipe.run.seed })
    }

    /// Whether the job has none.
    pub(crate) fn is_empty(&self) -> bool {
        self.tables.is_empty()
    }

    /// The positions in `kjt` of each table's features, after checking their raw ids.
    fn resolve(&self, kjt: &KeyedJaggedTensor) -> Result<Vec<Vec<usize>>, EngineError> {
        self.tables
            .iter()
            .map(|t| {
                t.keys
                    .iter()
                    .map(|k| {
                        let i =
                            kjt.key_index(k).ok_or_else(|| bad(&t.name, format!("the batch has no feature '{k}'")))?;
                        t.module.check_ids(kjt.feature(i).values).map_err(|id| {
                            EngineError::Embedding(trainrec_embedding::EmbeddingError::RawIdOutOfRange {
                                table: t.name.clone(),
                                feature: k.clone(),
                                id,
                                input_hash_size: t.module.config().input_hash_size,
                            })
                        })?;
                        Ok(i)
                    })
                    .collect()
            })
            .collect()
    }

    /// A training batch: counts and remaps its raw ids in place (the batch must not be
    /// variable-batch); returns, per table, the rows to re-initialise with their key. Across
    /// ranks (`pg`) every rank counts the ids of the global batch, so the modules stay the same
    /// on every rank, and remaps its own.
    pub(crate) fn train(
        &mut self,
        kjt: &mut KeyedJaggedTensor,
        pg: Option<&dyn ProcessGroup>,
    ) -> Result<Vec<(String, Vec<u64>, u64)>, EngineError> {
        let at = self.resolve(kjt)?;
        let mut global: Vec<Vec<Vec<i64>>> = Vec::new();
        if let Some(pg) = pg {
            for keys in &at {
                global
                    .push(keys.iter().map(|&i| pg.all_gather_sized(kjt.feature(i).values)).collect::<Result<_, _>>()?);
            }
        }
        let mut per_key = kjt.values_per_key_mut();
        let mut out = Vec::new();
        for (ti, (t, keys)) in self.tables.iter_mut().zip(&at).enumerate() {
            let rows = match global.get_mut(ti) {
                Some(g) => {
                    let mut all: Vec<&mut [i64]> = g.iter_mut().map(Vec::as_mut_slice).collect();
                    let rows = t.module.train_step(&mut all);
                    for &i in keys {
                        t.module.remap(per_key[i]);
                    }
                    rows
                }
                None => {
                    // Each feature of a managed-collision table is its own (checked in the recipe).
                    let mut mine: Vec<&mut [i64]> = Vec::with_capacity(keys.len());
                    for (i, slice) in per_key.iter_mut().enumerate() {
                        if keys.contains(&i) {
                            mine.push(std::mem::take(slice));
                        }
                    }
                    t.module.train_step(&mut mine)
                }
            };
            if !rows.is_empty() {
                let round = t.module.stats().evictions;
                let key = self.seed
                    ^ (ti as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407)
                    ^ round.wrapping_mul(0x9FB2_1C65_1E98_DF25);
                tracing::debug!(table = %t.name, rows = rows.len(), "managed collisions: rows re-initialised");
                out.push((t.name.clone(), rows, key));
            }
        }
        Ok(out)
    }

    /// An evaluation batch: remaps its raw ids in place (no counting).
    pub(crate) fn eval(&self, kjt: &mut KeyedJaggedTensor) -> Result<(), EngineError> {
        let at = self.resolve(kjt)?;
        let mut per_key = kjt.values_per_key_mut();
        for (t, keys) in self.tables.iter().zip(&at) {
            for &i in keys {
                t.module.remap(per_key[i]);
            }
        }
        Ok(())
    }

    /// Each table's name and checkpointable state.
    pub(crate) fn states(&self) -> Vec<(String, McState)> {
        self.tables.iter().map(|t| (t.name.clone(), t.module.state())).collect()
    }

    /// Restores table `name`'s state.
    pub(crate) fn set_state(&mut self, name: &str, state: &McState) -> Result<(), EngineError> {
        let t = self
            .tables
            .iter_mut()
            .find(|t| t.name == name)
            .ok_or_else(|| bad(name, "the job has no managed-collision table of this name"))?;
        t.module.set_state(state).map_err(|m| bad(name, format!("checkpointed state: {m}")))
    }

    /// The names of the tables.
    pub(crate) fn names(&self) -> Vec<String> {
        self.tables.iter().map(|t| t.name.clone()).collect()
    }

    /// Each table's statistics.
    pub(crate) fn stats(&self) -> BTreeMap<String, McStats> {
        self.tables.iter().map(|t| (t.name.clone(), t.module.stats())).collect()
    }

    /// The statistics as metric values: `mc/<table>/collision_rate` (fraction of the ids so far
    /// that went to the fallback), `tracked_fraction` and `evictions` (at the last eviction).
    pub(crate) fn metric_values(&self) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for (name, s) in self.stats() {
            out.insert(format!("mc/{name}/collision_rate"), s.collision_rate());
            out.insert(format!("mc/{name}/tracked_fraction"), s.tracked_fraction());
            out.insert(format!("mc/{name}/evictions"), s.last_evictions as f64);
        }
        out
    }
}
