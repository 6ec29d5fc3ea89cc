//! `DistributedModelParallel` for training loops written in Rust (TorchRec's DMP): a model's
//! embedding modules sharded by a plan, its dense part data-parallel with bucketed gradient
//! all-reduce, and the named state of both, fused embedding parameters included.
//!
//! Recipes do not need it (`trainrec run` builds the same thing inside its job); it is for
//! programs that drive their own steps.

use std::collections::BTreeMap;
use std::sync::Arc;

use tch::nn;
use trainrec_comm::ProcessGroup;
use trainrec_sharding::{LocalShard, Module, ShardedModule, ShardingPlan, shard_modules};

use crate::data_parallel::{DEFAULT_BUCKET_MIB, DataParallel};
use crate::error::EngineError;

/// One named entry of a model's state: a dense parameter, or this rank's shard of an
/// embedding table's weights (TorchRec's `ShardedTensor` local shard).
#[derive(Clone, Debug, PartialEq)]
pub struct StateEntry {
    /// `dense.<variable>` or `<module>.<table>.weight`.
    pub name: String,
    /// The whole tensor's shape.
    pub shape: Vec<usize>,
    /// Where this rank's part starts in it (all zeros for a whole tensor).
    pub offset: Vec<usize>,
    /// This rank's part's shape.
    pub local_shape: Vec<usize>,
    /// Whether every rank holds the same part (dense parameters, data-parallel tables).
    pub replicated: bool,
    /// This rank's part, row-major fp32.
    pub data: Vec<f32>,
}

/// The state entries of a sharded table's local shards in module `module`.
pub fn shard_entries(module: &str, shards: &[LocalShard]) -> Vec<StateEntry> {
    shards
        .iter()
        .map(|s| StateEntry {
            name: format!("{module}.{}.weight", s.table),
            shape: s.table_shape.to_vec(),
            offset: vec![s.rows.start as usize, s.cols.start],
            local_shape: vec![(s.rows.end - s.rows.start) as usize, s.cols.len()],
            replicated: s.replicated,
            data: s.weights.clone(),
        })
        .collect()
}

/// The state entries of a var store's trainable variables, `dense.<name>`.
pub fn dense_entries(vs: &nn::VarStore) -> Vec<StateEntry> {
    let vars: BTreeMap<String, tch::Tensor> = vs.variables().into_iter().filter(|(_, t)| t.requires_grad()).collect();
    vars.into_iter()
        .map(|(name, t)| {
            let shape: Vec<usize> = t.size().iter().map(|&d| d as usize).collect();
            StateEntry {
                name: format!("dense.{name}"),
                offset: vec![0; shape.len()],
                local_shape: shape.clone(),
                shape,
                replicated: true,
                data: crate::tensors::with_f32_slice(&t, |s| s.to_vec()),
            }
        })
        .collect()
}

/// A model across the ranks of a group: its embedding modules sharded, its dense variables
/// data-parallel.
pub struct DistributedModelParallel<O> {
    modules: Vec<(String, ShardedModule<O>)>,
    dense: DataParallel,
}

impl<O> DistributedModelParallel<O> {
    /// Shards every embedding module of `modules` by `plan` (see [`shard_modules`]; the others
    /// are kept as they are) and makes `vs`'s trainable variables data-parallel: rank 0's
    /// values are copied to every rank, and gradients are summed in buckets of `bucket_mib`
    /// MiB (`None`: 25, as DDP). Collective.
    pub fn new(
        modules: Vec<(String, Module<O>)>,
        plan: &ShardingPlan,
        vs: &nn::VarStore,
        pg: Arc<dyn ProcessGroup>,
        bucket_mib: Option<f64>,
    ) -> Result<Self, EngineError> {
        let modules = shard_modules(modules, plan, pg.clone())?;
        let dense = DataParallel::new(pg, vs, bucket_mib.unwrap_or(DEFAULT_BUCKET_MIB))?;
        Ok(Self { modules, dense })
    }

    /// The modules, in order.
    pub fn modules(&self) -> &[(String, ShardedModule<O>)] {
        &self.modules
    }

    /// The module `name`.
    pub fn module(&self, name: &str) -> Option<&ShardedModule<O>> {
        self.modules.iter().find(|(n, _)| n == name).map(|(_, m)| m)
    }

    /// The module `name`, mutable (its backward updates its fused parameters).
    pub fn module_mut(&mut self, name: &str) -> Option<&mut ShardedModule<O>> {
        self.modules.iter_mut().find(|(n, _)| n == name).map(|(_, m)| m)
    }

    /// The data-parallel dense part.
    pub fn dense(&self) -> &DataParallel {
        &self.dense
    }

    /// After the backward: sums the dense gradients (and `loss`) across ranks; returns the
    /// summed loss. Collective.
    pub fn sync_gradients(&self, loss: f64) -> Result<f64, EngineError> {
        self.dense.all_reduce(loss)
    }

    /// The named state on this rank: the dense variables of `vs` (whole, replicated) and this
    /// rank's shards of every embedding table's weights, named `<module>.<table>.weight`.
    /// The fused optimizer's state of each shard is in the modules' `local_shards()`.
    pub fn named_state(&self, vs: &nn::VarStore) -> Vec<StateEntry> {
        let mut out = dense_entries(vs);
        for (name, m) in &self.modules {
            match m {
                ShardedModule::Bag(e) => out.extend(shard_entries(name, &e.local_shards())),
                ShardedModule::Sequence(e) => out.extend(shard_entries(name, &e.local_shards())),
                ShardedModule::Other(_) => {}
            }
        }
        out
    }
}
