//! Sharding modules that already exist: TorchRec's `shard` and `shard_modules`.
//!
//! [`shard_ebc`] and [`shard_ec`] turn one rank's copy of an unsharded collection into that
//! rank's part of the sharded one, keeping its trained state: weights, fused optimizer state
//! and step counts. Every rank passes its own copy (equal on every rank, e.g. built with one
//! seed) and the same [`ShardingPlan`]; nothing is communicated. [`shard_modules`] does it for
//! every embedding module of a model's named modules and hands the other modules back as
//! they were.

use std::collections::BTreeMap;
use std::sync::Arc;

use trainrec_embedding::{EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection};
use trainrec_planner::Plan;

use crate::local::LocalTables;
use crate::{ShardedEbc, ShardedEc, TableSharding};
use trainrec_comm::{DistError, ProcessGroup};

/// Where each table goes, by table name (TorchRec's per-parameter sharding plan).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ShardingPlan {
    tables: BTreeMap<String, TableSharding>,
}

impl ShardingPlan {
    /// An empty plan.
    pub fn new() -> Self {
        Self::default()
    }

    /// The planner's placement of every table.
    pub fn from_plan(plan: &Plan) -> Self {
        Self { tables: plan.tables.iter().map(|t| (t.name.clone(), TableSharding::from_plan(t))).collect() }
    }

    /// `table` placed by `sharding`.
    pub fn with(mut self, table: impl Into<String>, sharding: TableSharding) -> Self {
        self.tables.insert(table.into(), sharding);
        self
    }

    /// The placement of `table`.
    pub fn get(&self, table: &str) -> Option<&TableSharding> {
        self.tables.get(table)
    }

    /// The placement of each of `tables`.
    pub fn shardings_for(&self, tables: &[EmbeddingBagConfig]) -> Result<Vec<TableSharding>, DistError> {
        tables
            .iter()
            .map(|t| {
                self.get(&t.name).cloned().ok_or_else(|| {
                    DistError::Module(format!(
                        "the sharding plan does not place table '{}' (it places: {})",
                        t.name,
                        self.tables.keys().cloned().collect::<Vec<_>>().join(", ")
                    ))
                })
            })
            .collect()
    }
}

/// This rank's part of `ebc` sharded by `plan` over `pg`, with its weights, optimizer state
/// and step counts.
pub fn shard_ebc(
    ebc: &EmbeddingBagCollection,
    plan: &ShardingPlan,
    pg: Arc<dyn ProcessGroup>,
) -> Result<ShardedEbc, DistError> {
    let tables: Vec<EmbeddingBagConfig> = ebc.table_configs().cloned().collect();
    let shardings = plan.shardings_for(&tables)?;
    let mut sharded = ShardedEbc::new(tables.clone(), shardings, ebc.optimizer().clone(), 0, pg)?;
    copy_tables(
        &tables,
        |n| (ebc.table_weights(n), ebc.optimizer_state(n), ebc.step_count(n)),
        |name, w, s, n| sharded.load_table(name, w, s, n),
    )?;
    Ok(sharded)
}

/// This rank's part of `ec` sharded by `plan` over `pg`, with its state (as [`shard_ebc`]).
pub fn shard_ec(
    ec: &EmbeddingCollection,
    plan: &ShardingPlan,
    pg: Arc<dyn ProcessGroup>,
) -> Result<ShardedEc, DistError> {
    let tables: Vec<EmbeddingBagConfig> = ec.table_configs().cloned().collect();
    let shardings = plan.shardings_for(&tables)?;
    let mut sharded = ShardedEc::new(tables.clone(), shardings, ec.optimizer().clone(), 0, pg)?;
    copy_tables(
        &tables,
        |n| (ec.weights(n), ec.state(n), ec.steps(n)),
        |name, w, s, n| sharded.load_table(name, w, s, n),
    )?;
    Ok(sharded)
}

/// Hands each table's weights, optimizer state and step count (`src` of its name) to `load`.
#[allow(clippy::type_complexity)]
fn copy_tables(
    tables: &[EmbeddingBagConfig],
    src: impl Fn(&str) -> (Option<Vec<f32>>, Option<Vec<f32>>, Option<u64>),
    mut load: impl FnMut(&str, &[f32], Option<&[f32]>, Option<u64>) -> Result<(), DistError>,
) -> Result<(), DistError> {
    for t in tables {
        let (weights, state, steps) = src(&t.name);
        load(&t.name, &weights.unwrap_or_default(), state.as_deref(), steps)?;
    }
    Ok(())
}

/// One named module of a model: an embedding collection, or anything else (`O`: the dense
/// modules).
pub enum Module<O> {
    /// Pooled embeddings.
    Bag(EmbeddingBagCollection),
    /// Sequence embeddings.
    Sequence(EmbeddingCollection),
    /// Not an embedding module: left as it is.
    Other(O),
}

/// A module after [`shard_modules`].
pub enum ShardedModule<O> {
    /// A sharded bag collection.
    Bag(Box<ShardedEbc>),
    /// A sharded sequence collection.
    Sequence(Box<ShardedEc>),
    /// The module as it was.
    Other(O),
}

/// Shards every embedding module of `modules` by `plan` (each table by its name, so table
/// names must be unique across modules) and returns every module in order, the others
/// untouched.
pub fn shard_modules<O>(
    modules: Vec<(String, Module<O>)>,
    plan: &ShardingPlan,
    pg: Arc<dyn ProcessGroup>,
) -> Result<Vec<(String, ShardedModule<O>)>, DistError> {
    let mut owner: BTreeMap<String, String> = BTreeMap::new();
    for (name, m) in &modules {
        let tables: Vec<String> = match m {
            Module::Bag(e) => e.table_configs().map(|t| t.name.clone()).collect(),
            Module::Sequence(e) => e.table_configs().map(|t| t.name.clone()).collect(),
            Module::Other(_) => Vec::new(),
        };
        for t in tables {
            if let Some(first) = owner.insert(t.clone(), name.clone()) {
                return Err(DistError::Module(format!(
                    "modules '{first}' and '{name}' both have a table '{t}': the plan places tables by name"
                )));
            }
        }
    }
    let named = |name: &str, e: DistError| DistError::Module(format!("module '{name}': {e}"));
    modules
        .into_iter()
        .map(|(name, m)| {
            let sharded = match m {
                Module::Bag(e) => {
                    ShardedModule::Bag(Box::new(shard_ebc(&e, plan, pg.clone()).map_err(|e| named(&name, e))?))
                }
                Module::Sequence(e) => {
                    ShardedModule::Sequence(Box::new(shard_ec(&e, plan, pg.clone()).map_err(|e| named(&name, e))?))
                }
                Module::Other(o) => ShardedModule::Other(o),
            };
            Ok((name, sharded))
        })
        .collect()
}
