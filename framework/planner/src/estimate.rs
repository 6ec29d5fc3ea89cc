//! Shard sizes and the storage and perf estimators.
//!
//! The formulas are TorchRec 1.9's default estimators (`EmbeddingStorageEstimator`,
//! `EmbeddingPerfEstimator` with its default hardware config), re-derived here; the book's
//! planner chapter writes them out, and `tests/planner.rs` checks every option of TorchRec's
//! own search space for fixed cases against them.
use crate::types::defaults::*;
use crate::types::{
    ComputeDevice, ComputeKernel, CostModel, Perf, Shard, ShardingType, Storage, TableSpec, Topology, bytes_per_ms,
};

/// The per-table inputs every estimate uses.
#[derive(Clone, Debug)]
pub(crate) struct TableInputs {
    /// Pooling factor of each input (feature).
    pub input_lengths: Vec<f64>,
    /// Poolings per example of each input.
    pub num_poolings: Vec<f64>,
    /// Batch size of each input.
    pub batch_sizes: Vec<f64>,
}

impl TableInputs {
    pub(crate) fn of(table: &TableSpec, batch_size: u64, cost_model: CostModel) -> Self {
        let c = &table.constraints;
        let input_lengths = match &c.pooling_factors {
            Some(p) => p.clone(),
            // TorchRec: one input of pooling factor 1 per table, whatever its features.
            None if cost_model == CostModel::Torchrec => vec![1.0],
            None => vec![1.0; table.features.len().max(1)],
        };
        let n = input_lengths.len();
        let num_poolings = c.num_poolings.clone().unwrap_or_else(|| vec![1.0; n]);
        let batch_sizes = match &c.batch_sizes {
            Some(b) => b.iter().map(|&x| x as f64).collect(),
            None => vec![batch_size as f64; n],
        };
        Self { input_lengths, num_poolings, batch_sizes }
    }

    /// Σ pooling × poolings × batch: ids per step over the inputs.
    pub(crate) fn batch_inputs(&self) -> f64 {
        let mut s = 0.0;
        for i in 0..self.input_lengths.len() {
            s += self.input_lengths[i] * self.num_poolings[i] * self.batch_sizes[i];
        }
        s
    }

    /// Pooled outputs per step (sequence tables: one per id).
    pub(crate) fn batch_outputs(&self, pooled: bool) -> f64 {
        if !pooled {
            return self.batch_inputs();
        }
        let mut s = 0.0;
        for i in 0..self.input_lengths.len() {
            s += self.input_lengths[i].min(1.0) * self.num_poolings[i] * self.batch_sizes[i];
        }
        s
    }
}

/// Row-wise blocks: `ceil(rows / n)` rows each, the last ones shorter or empty.
fn rw_sizes(rows: u64, n: usize, cols: u64) -> Vec<([u64; 2], [u64; 2])> {
    let n = n.max(1) as u64;
    (0..n)
        .map(|rank| {
            let b = trainrec_types::even_block(rows, n, rank);
            ([b.end - b.start, cols], [b.start, 0])
        })
        .collect()
}

/// The column block of column-wise sharding: the smallest multiple of 4 at least
/// `min_partition` (default 128) that divides `dim`, else `dim`.
pub(crate) fn cw_block(dim: u64, min_partition: Option<u64>) -> u64 {
    let lower = min_partition.unwrap_or(MIN_CW_DIM);
    let mut block = dim;
    for i in lower.max(1)..dim {
        if dim.is_multiple_of(i) && i.is_multiple_of(4) {
            block = i;
            break;
        }
    }
    let block = block.min(dim);
    if !dim.is_multiple_of(block) { dim } else { block }
}

/// Shard sizes and offsets of a sharding type (TorchRec's `calculate_shard_sizes_and_offsets`).
pub(crate) fn shard_layout(table: &TableSpec, st: ShardingType, topo: &Topology) -> Vec<([u64; 2], [u64; 2])> {
    let (rows, cols) = (table.rows, table.dim);
    match st {
        ShardingType::DataParallel => vec![([rows, cols], [0, 0]); topo.world_size],
        ShardingType::TableWise => vec![([rows, cols], [0, 0])],
        ShardingType::RowWise => rw_sizes(rows, topo.world_size, cols),
        ShardingType::TableRowWise => rw_sizes(rows, topo.local_world_size, cols),
        ShardingType::ColumnWise | ShardingType::TableColumnWise => {
            let block = cw_block(cols, table.constraints.min_partition);
            (0..cols / block).map(|i| ([rows, block], [0, i * block])).collect()
        }
        ShardingType::Grid => {
            let block = cw_block(cols, table.constraints.min_partition);
            let row_blocks = rw_sizes(rows, topo.local_world_size, block);
            let mut out = Vec::new();
            for node in 0..cols / block {
                for (size, offset) in &row_blocks {
                    out.push(([size[0], block], [offset[0], block * node]));
                }
            }
            out
        }
    }
}

/// Everything fixed for one (table, sharding type, kernel) while its shards are estimated.
pub(crate) struct Estimator<'a> {
    pub topo: &'a Topology,
    pub cost_model: CostModel,
}

struct Ctx {
    st: ShardingType,
    world: f64,
    local: f64,
    group: f64,
    table_dtype: f64,
    comm_dtype: f64,
    device_bw: f64,
    weighted: bool,
    pooled: bool,
    batch_inputs: f64,
    batch_outputs: f64,
}

/// Collective kinds, for bandwidth lookup.
#[derive(Clone, Copy, PartialEq)]
enum Collective {
    AllToAll,
    ReduceScatter,
    AllGather,
    AllReduce,
}

impl Estimator<'_> {
    /// Bytes per ms of a collective over `world` ranks with `local` ranks per host
    /// (TorchRec's `BasicCommsBandwidths.get_bw`).
    fn comms_bw(&self, world: usize, local: usize, c: Collective) -> f64 {
        if c == Collective::AllReduce {
            return bytes_per_ms(self.topo.inter_host_bw) * local as f64;
        }
        if world <= local { bytes_per_ms(self.topo.intra_host_bw) } else { bytes_per_ms(self.topo.inter_host_bw) }
    }

    /// The memory bandwidth a kernel reads rows at (TorchRec's `kernel_bw_lookup`).
    pub(crate) fn device_bw(&self, kernel: ComputeKernel, clf: Option<f64>, prefetch: bool) -> Option<f64> {
        let t = self.topo;
        let hbm = bytes_per_ms(t.hbm_mem_bw);
        let ddr = bytes_per_ms(t.ddr_mem_bw);
        let h2d = bytes_per_ms(t.hbm_to_ddr_mem_bw);
        let ratio = cache_ratio(clf);
        match (t.compute_device, kernel) {
            (ComputeDevice::Cpu, ComputeKernel::Dense) => Some(0.5 * ddr),
            (ComputeDevice::Cpu, ComputeKernel::Fused) => Some(ddr),
            // Prefetched: every lookup hits the cache. Otherwise misses read from disk.
            (ComputeDevice::Cpu, ComputeKernel::FusedUvmCaching | ComputeKernel::KeyValue) if prefetch => Some(ddr),
            (ComputeDevice::Cpu, ComputeKernel::FusedUvmCaching | ComputeKernel::KeyValue) => {
                Some(ratio * ddr + (1.0 - ratio) * bytes_per_ms(t.ssd_mem_bw))
            }
            (ComputeDevice::Cpu, _) => None,
            (ComputeDevice::Cuda, ComputeKernel::Dense) => Some(0.5 * hbm),
            (ComputeDevice::Cuda, ComputeKernel::Fused) => Some(hbm),
            (ComputeDevice::Cuda, ComputeKernel::FusedUvm) => Some(h2d / 10.0),
            (ComputeDevice::Cuda, ComputeKernel::FusedUvmCaching) if prefetch => Some(hbm),
            (ComputeDevice::Cuda, ComputeKernel::FusedUvmCaching) => Some((ratio * hbm + (1.0 - ratio) * h2d) / 10.0),
            (ComputeDevice::Cuda, ComputeKernel::KeyValue) => Some(bytes_per_ms(t.ssd_mem_bw)),
        }
    }

    /// Estimates every shard of one option: perf and storage.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn shards(
        &self,
        table: &TableSpec,
        inputs: &TableInputs,
        st: ShardingType,
        kernel: ComputeKernel,
        clf: Option<f64>,
        layout: &[([u64; 2], [u64; 2])],
    ) -> Option<Vec<Shard>> {
        let t = self.topo;
        let prefetch = table.constraints.cache.as_ref().and_then(|c| c.prefetch_pipeline).unwrap_or(false);
        let device_bw = self.device_bw(kernel, clf, prefetch)?;
        let ctx = Ctx {
            st,
            world: t.world_size as f64,
            local: t.local_world_size as f64,
            group: t.local_world_size as f64,
            table_dtype: table.element_size(),
            // trainrec's engines send fp32 pooled outputs whatever the table's precision.
            comm_dtype: match self.cost_model {
                CostModel::Trainrec => 4.0,
                CostModel::Torchrec => table.element_size(),
            },
            device_bw,
            weighted: table.constraints.is_weighted,
            pooled: table.pooled,
            batch_inputs: inputs.batch_inputs(),
            batch_outputs: inputs.batch_outputs(table.pooled),
        };
        let storages = self.storage(table, inputs, st, kernel, clf, layout);
        Some(
            layout
                .iter()
                .zip(storages)
                .map(|((size, offset), storage)| Shard {
                    size: *size,
                    offset: *offset,
                    perf: self.perf(&ctx, kernel, clf, size),
                    storage,
                })
                .collect(),
        )
    }

    fn perf(&self, c: &Ctx, kernel: ComputeKernel, clf: Option<f64>, size: &[u64; 2]) -> Perf {
        let t = self.topo;
        let (hash, dim) = (size[0] as f64, size[1] as f64);
        let st = c.st;
        // Divisor of the ids a shard sees: RW splits them over the world, TWRW over a host.
        let divisor = match st {
            ShardingType::RowWise => c.world,
            ShardingType::TableRowWise | ShardingType::Grid => c.group,
            _ => 1.0,
        };
        let weighted = if c.weighted { 2.0 } else { 1.0 };
        let (input_read, lookup, fwd_write, bwd_write) = match st {
            ShardingType::DataParallel => {
                let input = (c.batch_inputs * BIGINT_DTYPE).ceil() * weighted;
                let write = c.batch_outputs * dim * c.table_dtype;
                (input, c.batch_inputs * dim * c.table_dtype, write, write)
            }
            ShardingType::TableWise | ShardingType::ColumnWise | ShardingType::TableColumnWise => {
                let input = (c.batch_inputs * c.world * BIGINT_DTYPE).ceil() * weighted;
                let lookup = c.batch_inputs * c.world * dim.max(32.0) * c.table_dtype;
                let write = c.batch_outputs * c.world * dim * c.comm_dtype;
                (input, lookup, write, write)
            }
            _ => {
                let ids = c.batch_inputs / divisor;
                let input = (ids * c.world * BIGINT_DTYPE).ceil() * weighted;
                let lookup = ids * c.world * dim * c.table_dtype;
                let outputs = if c.pooled { c.batch_outputs } else { c.batch_outputs / divisor };
                let write = outputs * c.world * dim * c.comm_dtype;
                (input, lookup, write, write)
            }
        };
        let penalty = match st {
            ShardingType::TableWise | ShardingType::ColumnWise | ShardingType::TableColumnWise => {
                block_penalty(size[1])
            }
            _ => 1.0,
        };
        let fwd_compute = (input_read + lookup + fwd_write) * penalty / c.device_bw;
        let mut bwd_compute = fwd_compute * BWD_COMPUTE_MULTIPLIER;
        let mut grad_weights = 0.0;
        if c.weighted {
            bwd_compute *= WEIGHTED_FEATURE_BWD_COMPUTE_MULTIPLIER;
            grad_weights = fwd_compute * WEIGHTED_KERNEL_MULTIPLIER;
        }
        let bwd_compute = bwd_compute + grad_weights;
        let (w, l) = (t.world_size, t.local_world_size);
        let a2a = self.comms_bw(w, l, Collective::AllToAll);
        let batched_copy = |bytes: f64| bytes * BATCHED_COPY_PERF_FACTOR / c.device_bw;
        let (fwd_comms, bwd_comms) = match st {
            ShardingType::DataParallel => {
                let table_bytes = hash * dim * c.table_dtype;
                let nodes = (c.world / c.local).min(2.0);
                let bw = self.comms_bw(w, l, Collective::AllReduce);
                let mut all_reduce = table_bytes * (2.0 * nodes - 1.0) / nodes / bw;
                if c.world > 2.0 * c.local {
                    all_reduce *= 2.0;
                }
                (0.0, all_reduce + table_bytes * DP_ELEMENTWISE_KERNELS_PERF_FACTOR / c.device_bw)
            }
            ShardingType::TableWise | ShardingType::ColumnWise | ShardingType::TableColumnWise => {
                (fwd_write / a2a, bwd_write / a2a)
            }
            ShardingType::RowWise => (
                fwd_write / self.comms_bw(w, l, Collective::ReduceScatter),
                bwd_write / self.comms_bw(w, l, Collective::AllGather) + batched_copy(bwd_write),
            ),
            ShardingType::TableRowWise | ShardingType::Grid => {
                let g = l;
                let groups = (w / g).max(1);
                let inter = if groups > 1 {
                    c.batch_outputs * groups as f64 * dim * c.comm_dtype
                        / self.comms_bw(groups, 1, Collective::AllToAll)
                } else {
                    0.0
                };
                let intra_local = g.min(l);
                (
                    fwd_write / self.comms_bw(g, intra_local, Collective::ReduceScatter) + inter,
                    inter + bwd_write / self.comms_bw(g, intra_local, Collective::AllGather) + batched_copy(bwd_write),
                )
            }
        };
        let input_dist_comms =
            if st == ShardingType::DataParallel { 0.0 } else { (c.batch_inputs * c.world * BIGINT_DTYPE).ceil() / a2a };
        let prefetch_compute = self.prefetch(c, kernel, clf, divisor, dim);
        Perf { fwd_compute, fwd_comms, bwd_compute, bwd_comms, prefetch_compute, input_dist_comms }
    }

    /// Time to load missed rows into a cache. TorchRec counts this only with cache statistics
    /// (none here), so it is 0 under its cost model; trainrec's assumes uniform access: a
    /// share `1 - load_factor` of the step's ids miss and cross the host link (on CPU a
    /// `key_value` table's cache misses the same way as a `fused_uvm_caching` one's).
    fn prefetch(&self, c: &Ctx, kernel: ComputeKernel, clf: Option<f64>, divisor: f64, dim: f64) -> f64 {
        let cpu_store = self.topo.compute_device == ComputeDevice::Cpu && kernel == ComputeKernel::KeyValue;
        if self.cost_model == CostModel::Torchrec || !(kernel == ComputeKernel::FusedUvmCaching || cpu_store) {
            return 0.0;
        }
        let miss = 1.0 - cache_ratio(clf);
        let ids = (c.world * c.batch_inputs).ceil() / divisor;
        ids * miss * dim * c.table_dtype / bytes_per_ms(self.topo.hbm_to_ddr_mem_bw)
    }

    /// Per-shard storage (TorchRec's `calculate_shard_storages`, no pipeline).
    fn storage(
        &self,
        table: &TableSpec,
        inputs: &TableInputs,
        st: ShardingType,
        kernel: ComputeKernel,
        clf: Option<f64>,
        layout: &[([u64; 2], [u64; 2])],
    ) -> Vec<Storage> {
        let t = self.topo;
        let world = t.world_size as f64;
        // trainrec's engines pool into fp32 whatever the table's precision; TorchRec's
        // estimate sizes outputs by the table's element.
        let out_dtype = match self.cost_model {
            CostModel::Trainrec => 4.0,
            CostModel::Torchrec => table.element_size(),
        };
        let bi = inputs.batch_inputs();
        let pooled_outputs = inputs.batch_outputs(true);
        let io: Vec<(u64, u64)> = layout
            .iter()
            .map(|(size, _)| {
                let empty = size[0] == 0 || size[1] == 0;
                let (ids, outputs, cols) = match st {
                    ShardingType::DataParallel => {
                        let o = if table.pooled { pooled_outputs } else { bi };
                        return ((bi * BIGINT_DTYPE).ceil() as u64, (o * table.dim as f64 * out_dtype).ceil() as u64);
                    }
                    ShardingType::TableWise => (bi, if table.pooled { pooled_outputs } else { bi }, table.dim),
                    ShardingType::ColumnWise | ShardingType::TableColumnWise => {
                        (bi, if table.pooled { pooled_outputs } else { bi }, size[1])
                    }
                    ShardingType::RowWise | ShardingType::TableRowWise | ShardingType::Grid => {
                        if empty {
                            return (0, 0);
                        }
                        let d = if st == ShardingType::RowWise { world } else { t.local_world_size as f64 };
                        let ids = bi / d;
                        (ids, if table.pooled { pooled_outputs } else { ids }, size[1])
                    }
                };
                ((ids * world * BIGINT_DTYPE).ceil() as u64, (outputs * world * cols as f64 * out_dtype).ceil() as u64)
            })
            .collect();
        let bytes = table.rows * table.dim * table.precision.bytes() as u64;
        let on_ddr = matches!(kernel, ComputeKernel::FusedUvm | ComputeKernel::FusedUvmCaching)
            || t.compute_device == ComputeDevice::Cpu;
        let (mut hbm_total, ddr_total) = if on_ddr { (0, bytes) } else { (bytes, 0) };
        let cached = kernel.is_cached();
        let ratio = cache_ratio(clf);
        if cached {
            hbm_total = (ddr_total as f64 * ratio).round_ties_even() as u64;
        }
        let shape = (table.rows * table.dim) as f64;
        let opt = table.optimizer.multiplier(table.dim);
        let specific = |total: u64, size: &[u64; 2], with_cache: bool| -> u64 {
            let tensor = if st == ShardingType::DataParallel {
                total
            } else {
                (total as f64 * (size[0] * size[1]) as f64 / shape).ceil() as u64
            };
            let optimizer = (tensor as f64 * opt).ceil() as u64;
            let aux = if with_cache { (size[0] as f64 * (4.0 + ratio * 16.0)).ceil() as u64 } else { 0 };
            tensor + optimizer + aux
        };
        layout
            .iter()
            .zip(io)
            .map(|((size, _), (input, output))| {
                let (mut hbm, mut ddr, ssd) = if kernel == ComputeKernel::KeyValue
                    && t.compute_device == ComputeDevice::Cuda
                    && self.cost_model == CostModel::Torchrec
                {
                    // TorchRec: rows (with optimizer state and cache metadata) on SSD; no
                    // L1 cache set.
                    (0, 0, specific(bytes, size, true))
                } else if kernel == ComputeKernel::KeyValue && t.compute_device == ComputeDevice::Cuda {
                    // trainrec's CUDA engine keeps the cache's slots (rows and their state)
                    // in GPU memory, its index on the host, the rows written on disk.
                    (
                        specific((bytes as f64 * ratio).round_ties_even() as u64, size, false),
                        0,
                        specific(bytes, size, true),
                    )
                } else if cached && t.compute_device == ComputeDevice::Cpu {
                    // The cache (rows, their state, its index) in DDR; the table on disk.
                    (0, specific(hbm_total, size, true), specific(bytes, size, false))
                } else {
                    (specific(hbm_total, size, cached), specific(ddr_total, size, false), 0)
                };
                match t.compute_device {
                    ComputeDevice::Cuda => hbm += input + output,
                    ComputeDevice::Cpu => {
                        hbm = 0;
                        ddr += input + output;
                    }
                }
                Storage { hbm, ddr, ssd }
            })
            .collect()
    }
}

/// FBGEMM kernel block under-use penalty of narrow shards.
fn block_penalty(dim: u64) -> f64 {
    if dim < FULL_BLOCK_EMB_DIM { if dim >= 64 { HALF_BLOCK_PENALTY } else { QUARTER_BLOCK_PENALTY } } else { 1.0 }
}

/// The share of a table's rows its cache holds. Enumeration resolves every cached option's
/// load factor (the default included), so `None` only comes with kernels without a cache,
/// where nothing reads the ratio: all rows count as resident.
pub(crate) fn cache_ratio(clf: Option<f64>) -> f64 {
    clf.unwrap_or(1.0)
}
