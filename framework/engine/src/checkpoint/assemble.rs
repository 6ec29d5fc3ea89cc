//! Assembling a job's block of a table from a checkpoint's saved blocks, whatever the layouts
//! (resharding), dense or sparse (a key-value table's rows written).

use std::ops::Range;

use trainrec_embedding::StatePart;
use trainrec_sharding::LocalShard;

use super::format::{Checkpoint, CheckpointError, ShardRecord, part_name};

/// A block of a table that a job holds, to assemble from a checkpoint
/// ([`Checkpoint::assemble_shard`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Block {
    /// The table.
    pub table: String,
    /// The table's rows and columns.
    pub table_shape: [usize; 2],
    /// The block's rows.
    pub rows: Range<u64>,
    /// The block's columns.
    pub cols: Range<usize>,
    /// A data-parallel replica.
    pub replicated: bool,
    /// The job keeps the block sparse (a key-value table: only the rows written).
    pub sparse: bool,
}

impl Block {
    /// The block a job's shard is (its data aside).
    pub fn of(s: &LocalShard) -> Self {
        Self {
            table: s.table.clone(),
            table_shape: s.table_shape,
            rows: s.rows.clone(),
            cols: s.cols.clone(),
            replicated: s.replicated,
            sparse: s.stored.is_some(),
        }
    }

    /// The whole table `table`, dense.
    pub fn whole(table: &str, table_shape: [usize; 2]) -> Self {
        Self {
            table: table.to_string(),
            table_shape,
            rows: 0..table_shape[0] as u64,
            cols: 0..table_shape[1],
            replicated: false,
            sparse: false,
        }
    }
}

impl Checkpoint {
    /// The rows a sparse block `s` holds (checked: ascending, inside the block).
    fn stored_rows(&self, s: &ShardRecord) -> Result<Option<std::sync::Arc<Vec<u64>>>, CheckpointError> {
        let Some(name) = &s.stored_rows else { return Ok(None) };
        if let Some(v) = self.stored.lock().unwrap_or_else(|p| p.into_inner()).get(name) {
            return Ok(Some(v.clone()));
        }
        let rows: Vec<u64> = self.i64(name)?.1.into_iter().map(|r| r as u64).collect();
        if rows.windows(2).any(|w| w[0] >= w[1]) || rows.iter().any(|r| !s.rows.contains(r)) {
            return Err(self.incompatible(format!(
                "tensor {name} does not list ascending rows of its block {:?}: the checkpoint is corrupted",
                s.rows
            )));
        }
        let rows = std::sync::Arc::new(rows);
        self.stored.lock().unwrap_or_else(|p| p.into_inner()).insert(name.clone(), rows.clone());
        Ok(Some(rows))
    }

    /// The initial weights of rows `rows` x columns `cols` of table `table` (of shape
    /// `shape`), as the job that saved the checkpoint built them: from its recipe's seed and
    /// the table's place in it.
    fn initial(
        &self,
        table: &str,
        shape: [usize; 2],
        rows: Range<u64>,
        cols: Range<usize>,
    ) -> Result<Vec<f32>, CheckpointError> {
        let got = self.init.get_or_init(|| {
            let v: toml::Value = toml::from_str(&self.manifest.recipe).map_err(|e| e.to_string())?;
            let seed =
                v.get("run").and_then(|r| r.get("seed")).and_then(toml::Value::as_integer).ok_or("no run.seed")?;
            let tables = v.get("tables").and_then(toml::Value::as_array).ok_or("no tables")?;
            let names = tables.iter().map(|t| t.get("name").and_then(toml::Value::as_str).unwrap_or("").to_string());
            Ok((seed as u64, names.collect()))
        });
        let (seed, names) = got
            .as_ref()
            .map_err(|e| self.incompatible(format!("its recipe does not give the tables' initial weights ({e})")))?;
        let ti = names
            .iter()
            .position(|n| n == table)
            .ok_or_else(|| self.incompatible(format!("its recipe has no table {table}")))?;
        Ok(trainrec_embedding::initial_weights(*seed, ti, shape[0] as u64, shape[1], rows, cols))
    }

    /// Block `want` of a table (a shard of the job loading the checkpoint), with the
    /// optimizer state laid out as `layout`, assembled from the saved blocks that overlap it:
    /// - weights and per-column state parts are copied element by element;
    /// - a per-row part (row-wise Adagrad's accumulator: the mean over the block's columns of
    ///   the squared gradients) is the column-weighted mean of the saved blocks' values, which
    ///   is exact when the new block is the saved one or a union of saved blocks, and the
    ///   saved block's value when the new block splits it;
    /// - the step count is the largest of the overlapping blocks';
    /// - a row a sparse saved block does not hold has its initial weights and zero state
    ///   there;
    /// - a sparse `want` holds the rows any overlapping saved block holds (every row of a
    ///   dense saved block), so a key-value table's checkpoint loads in proportion to the rows
    ///   written, whatever the table's size.
    ///
    /// Every element of the block must be covered, else the checkpoint does not fit.
    pub fn assemble_shard(&self, want: &Block, layout: &[StatePart]) -> Result<LocalShard, CheckpointError> {
        let (table, table_shape, rows, cols) = (&want.table, want.table_shape, want.rows.clone(), want.cols.clone());
        let n_cols = cols.len();
        let width = |c: usize| -> usize { layout.iter().map(|p| p.len(c)).sum() };
        let want_layout: Vec<String> = layout.iter().map(|p| part_name(*p).to_string()).collect();
        // The saved blocks that overlap, with the rows each holds.
        struct Src<'a> {
            rec: &'a ShardRecord,
            r: Range<u64>,
            c: Range<usize>,
            stored: Option<std::sync::Arc<Vec<u64>>>,
        }
        let mut srcs = Vec::new();
        for s in self.manifest.shards.iter().filter(|s| &s.table == table) {
            if s.table_shape != table_shape {
                return Err(self.incompatible(format!(
                    "table {table} is {:?} in the checkpoint and {table_shape:?} in the job",
                    s.table_shape
                )));
            }
            let r = rows.start.max(s.rows.start)..rows.end.min(s.rows.end);
            let c = cols.start.max(s.cols.start)..cols.end.min(s.cols.end);
            if r.is_empty() || c.is_empty() {
                continue;
            }
            srcs.push(Src { rec: s, r, c, stored: self.stored_rows(s)? });
        }
        // The rows the block holds: all of them, or (sparse) those any saved block holds.
        let held: Option<Vec<u64>> = want.sparse.then(|| {
            let mut v: Vec<u64> = Vec::new();
            for s in &srcs {
                match &s.stored {
                    Some(st) => {
                        let (a, b) = (st.partition_point(|&x| x < s.r.start), st.partition_point(|&x| x < s.r.end));
                        v.extend_from_slice(&st[a..b]);
                    }
                    None => v.extend(s.r.clone()),
                }
            }
            v.sort_unstable();
            v.dedup();
            v
        });
        let n_rows = held.as_ref().map_or((rows.end - rows.start) as usize, Vec::len);
        // A dense block over sparse saved blocks starts from the initial weights.
        let mut weights = if held.is_none() && srcs.iter().any(|s| s.stored.is_some()) {
            self.initial(table, table_shape, rows.clone(), cols.clone())?
        } else {
            vec![0f32; n_rows * n_cols]
        };
        let mut state = vec![0f32; n_rows * width(n_cols)];
        // Per row and per-row part: the column-weighted sum of values and the weight.
        let per_row_parts = layout.iter().filter(|p| **p == StatePart::PerRow).count();
        let mut row_sums = vec![0f64; n_rows * per_row_parts];
        let mut row_weights = vec![0usize; n_rows];
        // Coverage: element by element for a dense block, by area for a sparse one (saved
        // blocks do not overlap).
        let mut covered = if held.is_none() { vec![false; n_rows * n_cols] } else { Vec::new() };
        let mut area = 0u64;
        let mut step_count = 0u64;
        for src in &srcs {
            let s = src.rec;
            let (r0, r1, c0, c1) = (src.r.start, src.r.end, src.c.start, src.c.end);
            step_count = step_count.max(s.step_count);
            area += (r1 - r0) * (c1 - c0) as u64;
            let s_cols = s.cols.len();
            // The saved rows to read: positions `p` of the tensors.
            let (p, s_rows) = match &src.stored {
                Some(st) => (st.partition_point(|&x| x < r0)..st.partition_point(|&x| x < r1), st.len()),
                None => {
                    ((r0 - s.rows.start) as usize..(r1 - s.rows.start) as usize, (s.rows.end - s.rows.start) as usize)
                }
            };
            let (wshape, w) = self.f32_rows(&s.weights, p.clone())?;
            if wshape != [s_rows, s_cols] {
                return Err(self.incompatible(format!("tensor {} has shape {wshape:?}", s.weights)));
            }
            let saved_state = match (&s.optimizer_state, layout.is_empty()) {
                (_, true) => None,
                (None, false) => {
                    return Err(self.incompatible(format!(
                        "table {table} was saved without optimizer state; the job's optimizer keeps {want_layout:?}"
                    )));
                }
                (Some(name), false) => {
                    if s.state_layout != want_layout {
                        return Err(self.incompatible(format!(
                            "table {table}'s optimizer state is {:?} in the checkpoint and {want_layout:?} in the job: the sparse optimizer changed",
                            s.state_layout
                        )));
                    }
                    let (sshape, st) = self.f32_rows(name, p.clone())?;
                    if sshape != [s_rows, width(s_cols)] {
                        return Err(self.incompatible(format!("tensor {name} has shape {sshape:?}")));
                    }
                    Some(st)
                }
            };
            // The block's rows in this overlap: (row, its index in the block).
            let targets: Box<dyn Iterator<Item = (u64, usize)>> = match &held {
                Some(h) => {
                    let a = h.partition_point(|&x| x < r0);
                    let b = h.partition_point(|&x| x < r1);
                    Box::new((a..b).map(move |k| (h[k], k)))
                }
                None => Box::new((r0..r1).map(|r| (r, (r - rows.start) as usize))),
            };
            let held_here = src.stored.as_ref().map(|st| &st[p.clone()]);
            for (r, dst_r) in targets {
                // The row's index among the rows read, if this saved block holds it.
                let src_r = match held_here {
                    Some(h) => h.binary_search(&r).ok(),
                    None => Some((r - r0) as usize),
                };
                if held.is_none() {
                    for c in c0..c1 {
                        covered[dst_r * n_cols + c - cols.start] = true;
                    }
                }
                let Some(src_r) = src_r else {
                    // Not written there: initial weights (already so in a dense block), zero
                    // state.
                    if held.is_some() {
                        let init = self.initial(table, table_shape, r..r + 1, c0..c1)?;
                        weights[dst_r * n_cols + c0 - cols.start..][..c1 - c0].copy_from_slice(&init);
                    }
                    if saved_state.is_some() {
                        row_weights[dst_r] += c1 - c0;
                    }
                    continue;
                };
                for c in c0..c1 {
                    weights[dst_r * n_cols + c - cols.start] = w[src_r * s_cols + c - s.cols.start];
                }
                let Some(st) = &saved_state else { continue };
                let (mut src_at, mut dst_at) = (src_r * width(s_cols), dst_r * width(n_cols));
                let mut pr = 0;
                let overlap = c1 - c0;
                for part in layout {
                    match part {
                        StatePart::PerColumn => {
                            for c in c0..c1 {
                                state[dst_at + c - cols.start] = st[src_at + c - s.cols.start];
                            }
                        }
                        StatePart::PerRow => {
                            row_sums[dst_r * per_row_parts + pr] += st[src_at] as f64 * overlap as f64;
                            pr += 1;
                        }
                    }
                    src_at += part.len(s_cols);
                    dst_at += part.len(n_cols);
                }
                row_weights[dst_r] += overlap;
            }
        }
        let whole = (rows.end - rows.start) * n_cols as u64;
        let complete = match &held {
            None => covered.iter().all(|c| *c),
            Some(_) => area == whole,
        };
        if srcs.is_empty() || !complete {
            return Err(
                self.incompatible(format!("its blocks of table {table} do not cover rows {rows:?} columns {cols:?}"))
            );
        }
        if per_row_parts > 0 {
            for r in 0..n_rows {
                let mut at = r * width(n_cols);
                let mut pr = 0;
                for p in layout {
                    if *p == StatePart::PerRow {
                        state[at] = (row_sums[r * per_row_parts + pr] / row_weights[r].max(1) as f64) as f32;
                        pr += 1;
                    }
                    at += p.len(n_cols);
                }
            }
        }
        Ok(LocalShard {
            table: table.to_string(),
            table_shape,
            rows,
            cols,
            replicated: want.replicated,
            weights,
            optimizer_state: state,
            step_count,
            stored: held,
        })
    }
}
