//! The engine conformance kit (`trainrec_embedding::conformance`) on the sharded collection as
//! an engine: one rank holding every shard, its tables table-wise, row-wise, data-parallel and
//! (for element-wise optimizers, whose state does not depend on a row's other columns)
//! column-wise; its stage (the input dist), forward, backward, checkpoint blocks and resets
//! against the CPU collection: bit for bit with sum pooling, within 1e-5 with mean pooling. The sharding kit (`trainrec_sharding::conformance`) covers
//! the collectives over several ranks.

use std::sync::Arc;
use std::time::Duration;

use trainrec_comm::{ProcessGroup, ThreadGroup};
use trainrec_embedding::{EmbeddingBagCollection, EmbeddingEngine, SparseOptimizerConfig, conformance};
use trainrec_sharding::{ShardingPlan, TableSharding, shard_ebc};

/// The layouts a case runs under.
fn plans(case: &conformance::Case) -> Vec<(&'static str, ShardingPlan)> {
    let shape = |name: &str| {
        let t = conformance::tables(case).into_iter().find(|t| t.name == name).expect("a kit table");
        (t.rows, t.dim)
    };
    let ((ra, da), (rb, db), (rc, dc)) = (shape("a"), shape("b"), shape("c"));
    let mut out = vec![
        (
            "table-wise",
            ShardingPlan::new()
                .with("a", TableSharding::table_wise(ra, da, 0))
                .with("b", TableSharding::table_wise(rb, db, 0))
                .with("c", TableSharding::table_wise(rc, dc, 0)),
        ),
        (
            "row-wise a, data-parallel c",
            ShardingPlan::new()
                .with("a", TableSharding::row_wise(ra, da, &[0]))
                .with("b", TableSharding::table_wise(rb, db, 0))
                .with("c", TableSharding::data_parallel()),
        ),
    ];
    let elementwise = matches!(
        case.optimizer,
        SparseOptimizerConfig::Sgd { .. } | SparseOptimizerConfig::Adagrad { .. } | SparseOptimizerConfig::Adam { .. }
    );
    if elementwise {
        out.push((
            "column-wise b",
            ShardingPlan::new()
                .with("a", TableSharding::table_wise(ra, da, 0))
                .with("b", TableSharding::column_wise(rb, db, 8, &[0, 0, 0]))
                .with("c", TableSharding::table_wise(rc, dc, 0)),
        ));
    }
    out
}

#[test]
fn the_sharded_collection_passes_the_engine_conformance_kit() {
    let results = ThreadGroup::run(1, Duration::from_secs(300), |pg| {
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        let mut ran = 0;
        for case in conformance::cases() {
            for (layout, plan) in plans(&case) {
                let mut make = |cpu: &EmbeddingBagCollection| {
                    shard_ebc(cpu, &plan, pg.clone())
                        .map(|s| Box::new(s) as Box<dyn EmbeddingEngine>)
                        .map_err(|e| e.to_string())
                };
                // Mean pooling is a sum scaled by 1 / ids afterwards (TorchRec's way under
                // sharding), so the last bit can differ from the CPU collection's mean; sums
                // are bit for bit.
                let tol = if case.mean { 1e-5 } else { 0.0 };
                conformance::check_engine(&case, &mut make, tol).map_err(|e| format!("{layout}: {e}"))?;
                ran += 1;
            }
        }
        Ok::<usize, String>(ran)
    });
    let ran = results.into_iter().next().expect("one rank").unwrap_or_else(Err).unwrap_or_else(|e| panic!("{e}"));
    // 6 cases x 2 layouts, and column-wise for the 3 element-wise optimizers.
    assert_eq!(ran, 15);
}
