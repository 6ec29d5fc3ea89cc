//! The planner's view of a recipe: tables with their constraints, the topology, the planner
//! settings; and planner errors as diagnostics at the recipe key at fault.
use trainrec_planner::{ComputeDevice, OptimizerState, PlanError, PlanInput, PlannerConfig, TableSpec, Topology};
use trainrec_types::SparseOptimizerConfig;

use crate::schema::Recipe;
use trainrec_types::{Diagnostic, KeyPath};

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Optimizer state per weight of a fused optimizer, as the storage estimator counts it.
pub fn optimizer_state(o: &SparseOptimizerConfig) -> OptimizerState {
    match o {
        SparseOptimizerConfig::Sgd { .. } => OptimizerState::None,
        SparseOptimizerConfig::RowwiseAdagrad { .. } => OptimizerState::RowWise,
        SparseOptimizerConfig::Adagrad { .. } => OptimizerState::PerWeight,
        SparseOptimizerConfig::PartialRowwiseAdam { .. } => OptimizerState::PerWeightPlusRow,
        _ => OptimizerState::TwoPerWeight,
    }
}

/// The planner inputs of a recipe; `dense_bytes` is the dense model's reservation when
/// `planner.dense_estimate_mib` is not set.
pub fn plan_input(recipe: &Recipe, dense_bytes: u64) -> PlanInput {
    let t = &recipe.topology;
    let mut topology = Topology::new(t.world_size, t.compute_device);
    topology.local_world_size = t.local_world_size.unwrap_or(t.world_size);
    let gib = |x: f64| (x * GIB) as u64;
    if let Some(h) = t.hbm_gib {
        topology.hbm_cap = gib(h);
    } else if t.compute_device == ComputeDevice::Cpu {
        topology.hbm_cap = 0;
    }
    let set = |slot: &mut f64, v: Option<f64>| {
        if let Some(v) = v {
            *slot = v;
        }
    };
    if let Some(d) = t.ddr_gib {
        topology.ddr_cap = gib(d);
    }
    if let Some(s) = t.ssd_gib {
        topology.ssd_cap = gib(s);
    }
    set(&mut topology.hbm_mem_bw, t.hbm_bandwidth);
    set(&mut topology.ddr_mem_bw, t.ddr_bandwidth);
    set(&mut topology.ssd_mem_bw, t.ssd_bandwidth);
    set(&mut topology.hbm_to_ddr_mem_bw, t.hbm_to_ddr_bandwidth);
    set(&mut topology.intra_host_bw, t.intra_host_bandwidth);
    set(&mut topology.inter_host_bw, t.inter_host_bandwidth);
    let tables = recipe
        .tables
        .iter()
        .map(|tab| TableSpec {
            name: tab.name.clone(),
            rows: tab.rows,
            dim: tab.dim as u64,
            features: tab.features.clone(),
            precision: tab.precision,
            pooled: true,
            optimizer: optimizer_state(tab.optimizer.as_ref().unwrap_or(&recipe.optimizer.sparse)),
            constraints: tab.constraints.clone(),
        })
        .collect();
    let p = &recipe.planner;
    let config = PlannerConfig {
        proposer: p.proposer,
        early_stop_threshold: p.early_stop_threshold,
        partitioner: p.partitioner,
        reserved_percentage: p.reserved_percentage,
        dense_bytes: p.dense_estimate_mib.map(|m| (m * 1024.0 * 1024.0) as u64).unwrap_or(dense_bytes),
        cost_model: p.cost_model,
        batch_size: recipe.data.batch_size as u64,
        refine: p.refine,
    };
    PlanInput { tables, topology, config }
}

fn path_of(base: KeyPath, dotted: &str) -> KeyPath {
    dotted.split('.').fold(base, |k, part| k.key(part))
}

/// A planner error as a diagnostic at the recipe key it is about.
pub fn plan_diagnostic(e: &PlanError) -> Diagnostic {
    let root = KeyPath::root();
    match e {
        PlanError::Constraint { table, index, key, message } => Diagnostic::new(
            path_of(root.key("tables").index(*index).key("constraints"), key),
            format!("table {table}: `{key}` {message}"),
        ),
        PlanError::NoOptions { table, index, key, message } => Diagnostic::new(
            path_of(root.key("tables").index(*index).key("constraints"), key),
            format!("table {table}: no way left to shard it: `{key}` {message}"),
        )
        .with_help("allow a sharding type and kernel the device supports, or change topology.compute_device"),
        PlanError::Topology { key, message } => {
            let path = if let Some(k) = key.strip_prefix("planner.") {
                path_of(root.key("planner"), k)
            } else if key == "batch_size" {
                root.key("data").key("batch_size")
            } else {
                path_of(root.key("topology"), key)
            };
            Diagnostic::new(path, format!("`{key}` {message}"))
        }
        PlanError::Unbuilt { index, .. } => {
            Diagnostic::new(root.key("tables").index(*index).key("constraints").key("compute_kernels"), e.to_string())
                .with_help(
                    "allow only kernels trainrec builds here (compute_kernels = [\"fused\", \"fused_uvm_caching\"]; fused_uvm_caching keeps a cache in device memory in front of the rows in host memory), or plan with planner.cost_model = \"trainrec\"",
                )
        }
        PlanError::Reservation { message } | PlanError::NoFit { message } => {
            Diagnostic::new(root.key("topology"), message.clone())
        }
        PlanError::PlanFile { .. } => Diagnostic::new(root.key("planner").key("plan_file"), e.to_string()),
    }
}
