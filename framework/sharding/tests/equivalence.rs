//! Every sharding type on 2 and 3 ranks of the thread backend equals the unsharded collection
//! (the checks of `trainrec_sharding::conformance`, which the MPI backend runs under `mpirun`).

use std::sync::Arc;
use std::time::Duration;

use trainrec_comm::{ProcessGroup, ThreadGroup};
use trainrec_embedding::SparseOptimizerConfig;
use trainrec_sharding::conformance::{Case, cases, host_cases, run_case, standard_sizes, tables};
use trainrec_sharding::{ShardedEbc, TableSharding};
use trainrec_sparse::KeyedJaggedTensor;

fn run_all(world: usize, all: Vec<Case>) {
    let results = ThreadGroup::run(world, Duration::from_secs(30), |pg| {
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        all.iter().try_for_each(|c| run_case(pg.clone(), c))
    });
    for (r, res) in results.into_iter().enumerate() {
        res.unwrap_or_else(|e| panic!("rank {r} panicked: {e}")).unwrap_or_else(|e| panic!("{e}"));
    }
}

#[test]
fn every_sharding_type_on_two_ranks_equals_unsharded() {
    run_all(2, [cases(&[5, 3], false), cases(&[4, 4], true)].concat());
}

#[test]
fn every_sharding_type_on_three_ranks_equals_unsharded() {
    run_all(3, [cases(&standard_sizes(3, 0), false), cases(&[2, 6, 1], true)].concat());
}

#[test]
fn table_row_wise_and_grid_over_hosts_equal_unsharded() {
    // Two hosts of two ranks, and two hosts of three: partial sums added on their host first.
    run_all(4, [host_cases(&standard_sizes(4, 0), false, 2), host_cases(&[3, 1, 4, 2], true, 2)].concat());
    run_all(6, host_cases(&standard_sizes(6, 1), false, 3));
}

#[test]
fn a_rank_with_an_empty_batch_still_takes_part() {
    let mut all = cases(&[6, 0], false);
    all.retain(|c| {
        let n = c.name.trim_start_matches("ec ");
        n.starts_with("row_wise") || n.starts_with("table_wise") || n.starts_with("data_parallel")
    });
    assert_eq!(all.len(), 18);
    run_all(2, all);
}

#[test]
fn bad_shardings_and_bad_ids_are_named() {
    let t = tables();
    let results = ThreadGroup::run(2, Duration::from_secs(10), |pg| {
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        let rowwise = SparseOptimizerConfig::Sgd { lr: 0.1 };
        let mut s: Vec<TableSharding> = t.iter().map(|c| TableSharding::table_wise(c.rows, c.dim, 0)).collect();
        s[1].shards[0].rows = 0..30;
        let err = ShardedEbc::new(tables(), s, rowwise.clone(), 1, pg.clone()).err().unwrap().to_string();
        assert!(err.contains("table 't1': the shards cover 180 of the table's 222 cells"), "{err}");
        let mut s: Vec<TableSharding> = t.iter().map(|c| TableSharding::table_wise(c.rows, c.dim, 0)).collect();
        s[2].shards[0].rank = 5;
        let err = ShardedEbc::new(tables(), s, rowwise.clone(), 1, pg.clone()).err().unwrap().to_string();
        assert!(err.contains("table 't2': shard 0 is on rank 5 but the world has 2 ranks"), "{err}");
        let s: Vec<TableSharding> = t.iter().map(|c| TableSharding::row_wise(c.rows, c.dim, &[0, 1])).collect();
        let ebc = ShardedEbc::new(tables(), s, rowwise, 1, pg).unwrap();
        let keys = ["a", "b", "c", "d"].iter().map(|s| s.to_string()).collect();
        let k = KeyedJaggedTensor::new(keys, vec![3, 50], None, vec![1, 0, 0, 1], 1).unwrap();
        ebc.forward(&k).err().unwrap().to_string()
    });
    for r in results {
        let err = r.unwrap();
        assert!(err.contains("feature 'd': id 50 is outside table 't2' (20 rows)"), "{err}");
    }
}
