//! The enumerator: every legal (sharding type, compute kernel) of every table, with its
//! shards estimated.
use rayon::prelude::*;

use crate::PlanError;
use crate::estimate::{Estimator, TableInputs, shard_layout};
use crate::types::defaults::UVM_CACHING_RATIO;
use crate::types::{ComputeDevice, ComputeKernel, CostModel, ShardingOption, ShardingType, TableSpec, Topology};

/// Sharding types the engines support on a device, in enumeration order.
pub fn supported_sharding_types(device: ComputeDevice, cost_model: CostModel) -> Vec<ShardingType> {
    use ShardingType::*;
    match (device, cost_model) {
        (ComputeDevice::Cuda, _) => ShardingType::ALL.to_vec(),
        // TorchRec has no row-wise on CPU (gloo lacks reduce-scatter); trainrec's MPI does.
        (ComputeDevice::Cpu, CostModel::Torchrec) => vec![DataParallel, TableWise, ColumnWise, TableColumnWise],
        (ComputeDevice::Cpu, CostModel::Trainrec) => ShardingType::ALL.to_vec(),
    }
}

/// Kernels a sharding type can use on a device, in enumeration order. The `trainrec` cost
/// model offers what trainrec's engines build; the `torchrec` one TorchRec's search space,
/// which on CUDA adds `fused_uvm` (see [`ComputeKernel::is_built`]).
pub fn supported_kernels(st: ShardingType, device: ComputeDevice, cost_model: CostModel) -> Vec<ComputeKernel> {
    use ComputeKernel::*;
    match (st, device, cost_model) {
        (ShardingType::DataParallel, _, _) => vec![Dense],
        // Cached on CPU: the cache in DDR, the table in a file on disk (`key_value`: a store
        // of the rows written).
        (_, ComputeDevice::Cpu, _) => vec![Fused, FusedUvmCaching, KeyValue],
        (_, ComputeDevice::Cuda, CostModel::Trainrec) => vec![Fused, FusedUvmCaching, KeyValue],
        (_, ComputeDevice::Cuda, CostModel::Torchrec) => vec![Fused, FusedUvm, FusedUvmCaching, KeyValue],
    }
}

fn names<T: std::fmt::Display>(xs: &[T]) -> String {
    xs.iter().map(|x| format!("\"{x}\"")).collect::<Vec<_>>().join(", ")
}

/// Checks a table's constraint values on their own (lengths, ranges).
fn check_constraints(index: usize, t: &TableSpec) -> Result<(), PlanError> {
    let c = &t.constraints;
    let bad =
        |key: &str, message: String| PlanError::Constraint { table: t.name.clone(), index, key: key.into(), message };
    let n = c.pooling_factors.as_ref().map(|p| p.len());
    if let Some(p) = &c.pooling_factors {
        if p.is_empty() || p.iter().any(|x| !x.is_finite() || *x < 0.0) {
            return Err(bad("pooling_factors", "give one finite, non-negative pooling factor per feature".into()));
        }
    }
    for (key, len) in [
        ("num_poolings", c.num_poolings.as_ref().map(|x| x.len())),
        ("batch_sizes", c.batch_sizes.as_ref().map(|x| x.len())),
    ] {
        if let Some(len) = len {
            let want = n.unwrap_or(1);
            if len != want {
                return Err(bad(
                    key,
                    format!("has {len} entries but `pooling_factors` describes {want} input(s); give one per input"),
                ));
            }
        }
    }
    if let Some(np) = &c.num_poolings {
        if np.iter().any(|x| !x.is_finite() || *x < 0.0) {
            return Err(bad("num_poolings", "entries must be finite and non-negative".into()));
        }
    }
    if c.min_partition == Some(0) {
        return Err(bad("min_partition", "must be at least 1".into()));
    }
    if let Some(lf) = c.cache.as_ref().and_then(|c| c.load_factor) {
        if !(lf > 0.0 && lf <= 1.0) {
            return Err(bad("cache.load_factor", format!("is {lf}; a load factor lies in (0, 1]")));
        }
    }
    if t.rows == 0 || t.dim == 0 {
        return Err(bad("rows", format!("table of {} × {} has no weights to place", t.rows, t.dim)));
    }
    Ok(())
}

/// The legal options of one table, estimated.
pub(crate) fn table_options(
    index: usize,
    table: &TableSpec,
    topo: &Topology,
    batch_size: u64,
    cost_model: CostModel,
) -> Result<Vec<ShardingOption>, PlanError> {
    check_constraints(index, table)?;
    let c = &table.constraints;
    let device = topo.compute_device;
    let supported = supported_sharding_types(device, cost_model);
    let types: Vec<ShardingType> = match &c.sharding_types {
        None => supported.iter().copied().filter(|&s| s != ShardingType::Grid).collect(),
        Some(allowed) => supported.iter().copied().filter(|s| allowed.contains(s)).collect(),
    };
    if types.is_empty() {
        return Err(PlanError::NoOptions {
            table: table.name.clone(),
            index,
            key: "sharding_types".into(),
            message: format!(
                "allows {} but a {} topology supports only {}",
                names(c.sharding_types.as_deref().unwrap_or(&[])),
                device.name(),
                names(&supported)
            ),
        });
    }
    let estimator = Estimator { topo, cost_model };
    let inputs = TableInputs::of(table, batch_size, cost_model);
    // The one place a cached kernel's load factor default is applied: options, the plan and
    // `plan.json` carry the value used.
    let clf = c.cache.as_ref().and_then(|c| c.load_factor);
    let mut out = Vec::new();
    let mut tried_kernels = Vec::new();
    for st in types.iter().copied() {
        let mut kernels: Vec<ComputeKernel> = supported_kernels(st, device, cost_model)
            .into_iter()
            .filter(|k| match &c.compute_kernels {
                Some(allowed) => allowed.contains(k),
                // On CPU a table goes to disk only when its constraints ask for it.
                None => {
                    *k != ComputeKernel::KeyValue
                        && !(device == ComputeDevice::Cpu && *k == ComputeKernel::FusedUvmCaching)
                }
            })
            .filter(|k| *k != ComputeKernel::KeyValue || topo.ssd_cap > 0)
            .collect();
        if kernels.contains(&ComputeKernel::Dense) && kernels.contains(&ComputeKernel::Fused) {
            kernels.retain(|k| *k != ComputeKernel::Dense);
        }
        tried_kernels.extend(supported_kernels(st, device, cost_model));
        let layout = shard_layout(table, st, topo);
        for kernel in kernels {
            let clf = kernel.is_cached().then(|| clf.unwrap_or(UVM_CACHING_RATIO));
            if let Some(shards) = estimator.shards(table, &inputs, st, kernel, clf, &layout) {
                out.push(ShardingOption {
                    table: index,
                    sharding_type: st,
                    compute_kernel: kernel,
                    cache_load_factor: clf,
                    shards,
                });
            }
        }
    }
    if out.is_empty() {
        tried_kernels.sort();
        tried_kernels.dedup();
        return Err(PlanError::NoOptions {
            table: table.name.clone(),
            index,
            key: "compute_kernels".into(),
            message: format!(
                "allows {} but with sharding types {} a {} topology offers only {}{}",
                names(c.compute_kernels.as_deref().unwrap_or(&[])),
                names(&types),
                device.name(),
                names(&tried_kernels),
                if c.compute_kernels.iter().flatten().any(|k| !k.is_built()) {
                    " (fused_uvm, FBGEMM's rows read in place from host memory, is not built by trainrec's engines: \
                     fused_uvm_caching keeps a cache in device memory in front of the rows in host memory)"
                } else {
                    ""
                }
            ),
        });
    }
    Ok(out)
}

/// The search space: each table's options (tables estimated in parallel). The error is the
/// first table's, in table order.
pub fn enumerate(
    tables: &[TableSpec],
    topo: &Topology,
    batch_size: u64,
    cost_model: CostModel,
) -> Result<Vec<Vec<ShardingOption>>, PlanError> {
    let all: Vec<_> =
        tables.par_iter().enumerate().map(|(i, t)| table_options(i, t, topo, batch_size, cost_model)).collect();
    all.into_iter().collect()
}

/// Every table's constraint problem (each table's first), without estimating anything: for
/// validation, which reports them all at once.
pub fn check_tables(tables: &[TableSpec], topo: &Topology, cost_model: CostModel) -> Vec<PlanError> {
    tables
        .iter()
        .enumerate()
        .filter_map(|(i, t)| {
            if let Err(e) = check_constraints(i, t) {
                return Some(e);
            }
            // One row is enough to see whether any option survives the filters.
            let probe = TableSpec { rows: 1, ..t.clone() };
            table_options(i, &probe, topo, 1, cost_model).err()
        })
        .collect()
}
