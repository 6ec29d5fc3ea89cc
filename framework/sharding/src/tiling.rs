//! The tiling vocabulary: a table cut into blocks of rows x columns ([`ShardSpec`]), one per
//! rank that holds it; the sharding types are shapes of that tiling ([`TableSharding`]).

use std::ops::Range;

use trainrec_comm::DistError;
use trainrec_embedding::EmbeddingBagConfig;
use trainrec_planner::{ShardingType, TablePlan};

/// One block of a table on one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardSpec {
    /// The rank holding it.
    pub rank: usize,
    /// Its rows of the table.
    pub rows: Range<u64>,
    /// Its columns of the table.
    pub cols: Range<usize>,
}

/// How one table is split over the ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct TableSharding {
    /// The sharding type (data-parallel tables ignore `shards`: they live whole on every rank).
    pub sharding_type: ShardingType,
    /// The blocks, tiling `rows x dim`.
    pub shards: Vec<ShardSpec>,
}

impl TableSharding {
    /// The whole table on `rank`.
    pub fn table_wise(rows: u64, dim: usize, rank: usize) -> Self {
        Self { sharding_type: ShardingType::TableWise, shards: vec![ShardSpec { rank, rows: 0..rows, cols: 0..dim }] }
    }

    /// Even row blocks over `ranks` (the last ones smaller), TorchRec's row-wise block size
    /// `ceil(rows / n)`; table-row-wise when `ranks` is one host's ranks.
    pub fn row_wise(rows: u64, dim: usize, ranks: &[usize]) -> Self {
        let parts = ranks.len() as u64;
        let shards = ranks
            .iter()
            .enumerate()
            .filter_map(|(i, &rank)| {
                let rows = trainrec_types::even_block(rows, parts, i as u64);
                (!rows.is_empty()).then_some(ShardSpec { rank, rows, cols: 0..dim })
            })
            .collect();
        Self { sharding_type: ShardingType::RowWise, shards }
    }

    /// Column blocks of `block` columns (the last one smaller), one per entry of `ranks`.
    pub fn column_wise(rows: u64, dim: usize, block: usize, ranks: &[usize]) -> Self {
        let shards = ranks
            .iter()
            .enumerate()
            .filter_map(|(i, &rank)| {
                let start = (i * block).min(dim);
                let end = ((i + 1) * block).min(dim);
                (end > start).then_some(ShardSpec { rank, rows: 0..rows, cols: start..end })
            })
            .collect();
        Self { sharding_type: ShardingType::ColumnWise, shards }
    }

    /// A replica on every rank.
    pub fn data_parallel() -> Self {
        Self { sharding_type: ShardingType::DataParallel, shards: Vec::new() }
    }

    /// The same blocks under another sharding type's name (e.g. `TableRowWise` for
    /// [`Self::row_wise`] over one host's ranks).
    pub fn named(mut self, sharding_type: ShardingType) -> Self {
        self.sharding_type = sharding_type;
        self
    }

    /// A table's placement from the planner's plan.
    pub fn from_plan(plan: &TablePlan) -> Self {
        Self {
            sharding_type: plan.sharding_type,
            shards: plan
                .shards
                .iter()
                .map(|s| ShardSpec {
                    rank: s.rank,
                    rows: s.offset[0]..s.offset[0] + s.size[0],
                    cols: s.offset[1] as usize..(s.offset[1] + s.size[1]) as usize,
                })
                .collect(),
        }
    }

    /// Checks that the shards tile `rows x dim` on ranks below `world`.
    fn check(&self, table: &str, rows: u64, dim: usize, world: usize) -> Result<(), DistError> {
        let bad = |m: String| Err(DistError::Module(format!("table '{table}': {m}")));
        if self.sharding_type == ShardingType::DataParallel {
            return Ok(());
        }
        if self.shards.is_empty() {
            return bad("its sharding has no shards".into());
        }
        let mut area = 0u128;
        for (i, s) in self.shards.iter().enumerate() {
            if s.rank >= world {
                return bad(format!("shard {i} is on rank {} but the world has {world} ranks", s.rank));
            }
            if s.rows.is_empty() || s.cols.is_empty() || s.rows.end > rows || s.cols.end > dim {
                return bad(format!(
                    "shard {i} (rows {:?}, columns {:?}) is empty or outside the table's {rows} x {dim}",
                    s.rows, s.cols
                ));
            }
            for (j, o) in self.shards[..i].iter().enumerate() {
                let rows_meet = s.rows.start < o.rows.end && o.rows.start < s.rows.end;
                let cols_meet = s.cols.start < o.cols.end && o.cols.start < s.cols.end;
                if rows_meet && cols_meet {
                    return bad(format!("shards {j} and {i} overlap"));
                }
            }
            area += (s.rows.end - s.rows.start) as u128 * s.cols.len() as u128;
        }
        if area != rows as u128 * dim as u128 {
            return bad(format!("the shards cover {area} of the table's {} cells", rows as u128 * dim as u128));
        }
        Ok(())
    }
}

/// Checks the tables against their shardings and the world.
pub(crate) fn check_shardings(
    tables: &[EmbeddingBagConfig],
    shardings: &[TableSharding],
    world: usize,
) -> Result<(), DistError> {
    if tables.len() != shardings.len() {
        return Err(DistError::Module(format!("{} tables but {} shardings", tables.len(), shardings.len())));
    }
    for (t, s) in tables.iter().zip(shardings) {
        s.check(&t.name, t.rows, t.dim, world)?;
    }
    Ok(())
}
