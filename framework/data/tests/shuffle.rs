//! Shuffling a file sampler's epoch on two ranks: each rank's shuffled stream holds exactly its
//! own share of the rows, and the two shares together hold every row of the file once.

use std::collections::BTreeMap;
use std::path::PathBuf;

use trainrec_data::{CsvConfig, CsvSampler, Sampler, SamplerContext, Shuffle, Split, shuffle_seed, shuffled};

const ROWS: u32 = 1001;

/// A CSV file of `ROWS` rows `id,label,cat,session` in a fresh directory.
fn csv_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("trainrec-shuffle-ranks-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut text = String::from("id,label,cat,session\n");
    for i in 0..ROWS {
        text.push_str(&format!("{i},{},{},{}\n", i % 2, i % 17, i / 5));
    }
    std::fs::write(dir.join("rows.csv"), text).unwrap();
    dir
}

fn sampler(dir: &std::path::Path, rank: usize) -> CsvSampler {
    let config: CsvConfig = serde_json::from_value(serde_json::json!({
        "path": "rows.csv",
        "eval_fraction": 0.0,
        "dense": ["id"],
        "sparse": { "cat": "cat" },
        "integer_ids": ["cat"],
        "label": "label",
        "group": "session",
    }))
    .unwrap();
    let ctx = SamplerContext {
        feature_rows: BTreeMap::from([("cat".to_string(), 100)]),
        base_dir: dir.to_path_buf(),
        seed: 5,
        rank,
        world_size: 2,
    };
    CsvSampler::build(config, &ctx).unwrap()
}

/// One row as read: id (the dense value), label, the `cat` bag, the group.
type Row = (u32, u32, Vec<i64>, i64);

/// The rows of one rank's epoch, shuffled as `shuffle` says.
fn rows(s: &CsvSampler, shuffle: &Shuffle, epoch: u64, rank: usize) -> Vec<Row> {
    let stream = s.batches(Split::Train, epoch, 32).unwrap();
    let mut out = Vec::new();
    for b in shuffled(stream, shuffle, 32, shuffle_seed(5, epoch, rank)) {
        let b = b.unwrap();
        assert!(b.batch_size <= 32);
        for i in 0..b.batch_size {
            let id = b.dense[i] as u32;
            assert_eq!(b.labels[i], (id % 2) as f32);
            out.push((id, b.labels[i].to_bits(), b.sparse.feature(0).bag(i).to_vec(), b.groups.as_ref().unwrap()[i]));
        }
    }
    out
}

fn sorted(mut rows: Vec<Row>) -> Vec<Row> {
    rows.sort();
    rows
}

#[test]
fn two_ranks_shuffled_read_every_row_once() {
    let dir = csv_dir();
    let ranks = [sampler(&dir, 0), sampler(&dir, 1)];
    for shuffle in [Shuffle::buffer(37), Shuffle::FULL] {
        for epoch in [0, 1] {
            let mut all = Vec::new();
            for (rank, s) in ranks.iter().enumerate() {
                let plain = rows(s, &Shuffle::NONE, epoch, rank);
                let got = rows(s, &shuffle, epoch, rank);
                assert_ne!(got, plain, "{shuffle}: rank {rank} was not shuffled");
                // Each row whole (label, ids, group) and once: the rank's own share.
                assert_eq!(sorted(got.clone()), sorted(plain), "{shuffle}: rank {rank}");
                all.extend(got.into_iter().map(|r| r.0));
            }
            all.sort_unstable();
            assert_eq!(all, (0..ROWS).collect::<Vec<_>>(), "{shuffle}, epoch {epoch}: every row once");
        }
        // Another epoch, another order; the same epoch, the same order.
        assert_ne!(rows(&ranks[0], &shuffle, 0, 0), rows(&ranks[0], &shuffle, 1, 0), "{shuffle}");
        assert_eq!(rows(&ranks[1], &shuffle, 1, 1), rows(&ranks[1], &shuffle, 1, 1), "{shuffle}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
