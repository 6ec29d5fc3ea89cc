//! `criteo_binary` against TorchRec: the fixtures in `tests/fixtures/criteo_binary/` were written
//! by TorchRec's own `BinaryCriteoUtils.tsv_to_npys` (`tests/fixtures/gen_criteo_binary.py`) from
//! synthetic TSV files. The converter must reproduce them byte for byte, and the sampler must
//! agree with `criteo_tsv` on the same lines.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use trainrec_data::criteo_binary::{ConvertOptions, convert_tsv, convert_tsv_with, dense_transform};
use trainrec_data::{
    BadRowPolicy, Batch, CriteoBinaryConfig, CriteoBinarySampler, CriteoTsvConfig, CriteoTsvSampler, Sampler,
    SamplerContext, Split,
};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/criteo_binary")
}

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("trainrec-binparity-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn ctx(dir: &Path, rows: u64) -> SamplerContext {
    SamplerContext {
        feature_rows: (1..=26).map(|i| (format!("C{i}"), rows)).collect(),
        base_dir: dir.to_path_buf(),
        seed: 11,
        rank: 0,
        world_size: 1,
    }
}

fn binary_config() -> CriteoBinaryConfig {
    CriteoBinaryConfig {
        dir: fixtures().to_string_lossy().into_owned(),
        train: vec!["train".into()],
        eval: vec![],
        eval_fraction: None,
        frequency_threshold: 0,
        on_bad_row: BadRowPolicy::Fail,
        num_workers: 1,
    }
}

/// The fixture TSV's lines as integers, parsed here independently: (label, dense, sparse).
fn raw_lines(name: &str) -> Vec<(i64, Vec<i64>, Vec<u64>)> {
    let text = std::fs::read_to_string(fixtures().join(name)).unwrap();
    text.lines()
        .map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            assert_eq!(f.len(), 40);
            let int = |s: &str| if s.is_empty() { 0 } else { s.parse::<i64>().unwrap() };
            let hex = |s: &str| if s.is_empty() { 0 } else { u64::from_str_radix(s, 16).unwrap() };
            (int(f[0]), f[1..14].iter().map(|s| int(s)).collect(), f[14..].iter().map(|s| hex(s)).collect())
        })
        .collect()
}

fn all_batches(s: &dyn Sampler, split: Split, bs: usize) -> Vec<Batch> {
    s.batches(split, 0, bs).unwrap().map(Result::unwrap).collect()
}

#[test]
fn converter_matches_torchrec() {
    let out = temp("convert");
    let summary = convert_tsv(&fixtures().join("train.tsv"), &out, "train").unwrap();
    assert_eq!(summary.rows, 40);
    let lines = raw_lines("train.tsv");
    let min = lines.iter().flat_map(|l| l.1.iter().copied()).min().unwrap();
    assert_eq!(summary.dense_min, min);
    for kind in ["sparse", "labels"] {
        let ours = std::fs::read(out.join(format!("train_{kind}.npy"))).unwrap();
        let theirs = std::fs::read(fixtures().join(format!("train_{kind}.npy"))).unwrap();
        assert_eq!(ours.len(), theirs.len(), "{kind}: file sizes");
        if let Some(at) = ours.iter().zip(&theirs).position(|(a, b)| a != b) {
            panic!("train_{kind}.npy differs from TorchRec's at byte {at}");
        }
    }
    assert_dense_within_one_ulp(&out.join("train_dense.npy"), &fixtures().join("train_dense.npy"));
    // No temporary file is left behind.
    let names: Vec<String> =
        std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(names.len(), 3, "{names:?}");

    let out = temp("convert-test");
    let opts = ConvertOptions { labeled: false, num_workers: 2, ..ConvertOptions::default() };
    let summary = convert_tsv_with(&fixtures().join("test.tsv"), &out, "test", &opts).unwrap();
    assert_eq!(summary.rows, 10);
    for kind in ["sparse", "labels"] {
        let ours = std::fs::read(out.join(format!("test_{kind}.npy"))).unwrap();
        let theirs = std::fs::read(fixtures().join(format!("test_{kind}.npy"))).unwrap();
        assert!(ours == theirs, "test_{kind}.npy differs from TorchRec's");
    }
    assert_dense_within_one_ulp(&out.join("test_dense.npy"), &fixtures().join("test_dense.npy"));
}

/// The dense files have identical headers and values at most one unit in the last place apart:
/// NumPy's vectorized float32 `log` (AVX2 / AVX-512) is not always correctly rounded, ours is.
fn assert_dense_within_one_ulp(ours: &Path, theirs: &Path) {
    let (a, b) = (std::fs::read(ours).unwrap(), std::fs::read(theirs).unwrap());
    assert_eq!(a.len(), b.len());
    assert_eq!(a[..128], b[..128], "identical .npy headers");
    let mut off_by_one = 0;
    for (i, (x, y)) in a[128..].chunks_exact(4).zip(b[128..].chunks_exact(4)).enumerate() {
        let (x, y) = (i32::from_le_bytes(x.try_into().unwrap()), i32::from_le_bytes(y.try_into().unwrap()));
        assert!(
            (x - y).abs() <= 1,
            "value {i}: {} vs TorchRec's {}",
            f32::from_bits(x as u32),
            f32::from_bits(y as u32)
        );
        off_by_one += (x != y) as usize;
    }
    eprintln!("{}: {off_by_one} of {} values one ulp from TorchRec's", ours.display(), (a.len() - 128) / 4);
}

#[test]
fn converter_errors_name_the_line_and_leave_nothing() {
    let dir = temp("convert-bad");
    let good = std::fs::read_to_string(fixtures().join("train.tsv")).unwrap();
    let mut lines: Vec<&str> = good.lines().collect();
    lines.insert(7, "1\t2\t3");
    std::fs::write(dir.join("bad.tsv"), lines.join("\n")).unwrap();
    let out = dir.join("out");
    let err = convert_tsv(&dir.join("bad.tsv"), &out, "day_0").unwrap_err().to_string();
    assert!(err.ends_with("bad.tsv:8: expected 40 tab-separated columns, found 3"), "{err}");
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0, "no partial or temporary file is left");
    let opts = ConvertOptions { on_bad_row: BadRowPolicy::Skip, ..ConvertOptions::default() };
    let s = convert_tsv_with(&dir.join("bad.tsv"), &out, "day_0", &opts).unwrap();
    assert_eq!((s.rows, s.skipped), (40, 1));
    // The labelled converter keeps TorchRec's rules: an empty label is 0, any integer is kept.
    let mut f: Vec<String> = vec!["".into()];
    f.extend((0..13).map(|i| i.to_string()));
    f.extend((0..26).map(|_| "ff".to_string()));
    std::fs::write(dir.join("one.tsv"), f.join("\t") + "\n").unwrap();
    convert_tsv(&dir.join("one.tsv"), &out, "one").unwrap();
    let labels = std::fs::read(out.join("one_labels.npy")).unwrap();
    assert_eq!(&labels[128..], &0i32.to_le_bytes());
    std::fs::write(dir.join("empty.tsv"), "").unwrap();
    assert!(convert_tsv(&dir.join("empty.tsv"), &out, "e").unwrap_err().to_string().contains("no rows"));
}

#[test]
fn sampler_agrees_with_criteo_tsv_on_the_same_lines() {
    let lines = raw_lines("train.tsv");
    let min = lines.iter().flat_map(|l| l.1.iter().copied()).min().unwrap();
    let rows = 1000u64;
    let bin = CriteoBinarySampler::build(
        CriteoBinaryConfig { eval_fraction: Some(0.25), ..binary_config() },
        &ctx(Path::new("/"), rows),
    )
    .unwrap();
    let tsv_cfg = CriteoTsvConfig {
        path: fixtures().join("train.tsv").to_string_lossy().into_owned(),
        eval_fraction: 0.25,
        on_bad_row: BadRowPolicy::Fail,
        max_rows: None,
        num_workers: 1,
    };
    let tsv = CriteoTsvSampler::build(tsv_cfg, &ctx(Path::new("/"), rows)).unwrap();
    let mut seen = 0;
    for split in [Split::Train, Split::Eval] {
        // The lines of this split, in order (both samplers hold out by the same hash).
        let mut order = (0..lines.len())
            .filter(|&i| trainrec_data::stream::is_eval_row(11, i as u64 + 1, 0.25) == (split == Split::Eval));
        let (b, t) = (all_batches(&bin, split, 8), all_batches(&tsv, split, 8));
        assert_eq!(b.len(), t.len());
        for (b, t) in b.iter().zip(&t) {
            assert_eq!(b.batch_size, t.batch_size);
            assert_eq!(b.labels, t.labels);
            assert_eq!(b.sparse, t.sparse, "the same ids in the same tables");
            for r in 0..b.batch_size {
                let (label, dense, sparse) = &lines[order.next().unwrap()];
                assert_eq!(b.labels[r], *label as f32);
                assert_eq!(b.sparse.feature(25).values[r] as u64, sparse[25] % rows);
                // Dense: the same integers under each sampler's transform.
                for (j, &x) in dense.iter().enumerate() {
                    // The fixture's dense values are NumPy's (within one ulp of the exact log).
                    let (got, exact) = (b.dense[r * 13 + j], (((x - min + 2) as f32) as f64).ln() as f32);
                    assert!((got.to_bits() as i32 - exact.to_bits() as i32).abs() <= 1, "{got} vs ln = {exact}");
                    assert_eq!(exact, dense_transform(x as i32, min as i32));
                    assert_eq!(t.dense[r * 13 + j], (x.max(0) as f64).ln_1p() as f32, "criteo_tsv transform");
                }
            }
            seen += b.batch_size;
        }
        assert!(order.next().is_none());
    }
    assert_eq!(seen, 40);
}

#[test]
fn frequency_threshold_maps_rare_training_values_to_zero() {
    let lines = raw_lines("train.tsv");
    let rows = 1 << 40;
    // Counted here from the TSV text, over all (training) rows.
    let mut counts: Vec<HashMap<u64, u64>> = vec![HashMap::new(); 26];
    for l in &lines {
        for (j, &v) in l.2.iter().enumerate() {
            *counts[j].entry(v).or_default() += 1;
        }
    }
    let cfg =
        CriteoBinaryConfig { eval_fraction: Some(0.0), frequency_threshold: 3, num_workers: 2, ..binary_config() };
    let s = CriteoBinarySampler::build(cfg, &ctx(Path::new("/"), rows)).unwrap();
    let batches = all_batches(&s, Split::Train, 16);
    let mut r = 0;
    let mut kept = 0;
    for b in &batches {
        for i in 0..b.batch_size {
            for (j, count) in counts.iter().enumerate() {
                let v = lines[r].2[j];
                let want = if count[&v] >= 3 { v } else { 0 };
                kept += (want != 0) as usize;
                assert_eq!(b.sparse.feature(j).values[i] as u64, want, "row {r} C{}", j + 1);
            }
            r += 1;
        }
    }
    assert_eq!(r, 40);
    assert!(kept > 100 && kept < 40 * 26, "the threshold keeps the frequent values only ({kept})");
}

#[test]
fn ranks_eval_files_and_bad_labels() {
    // Ranks: row index modulo world_size.
    let mut labels_by_rank = Vec::new();
    for rank in 0..3 {
        let c = SamplerContext { rank, world_size: 3, ..ctx(Path::new("/"), 100) };
        let s =
            CriteoBinarySampler::build(CriteoBinaryConfig { eval_fraction: Some(0.0), ..binary_config() }, &c).unwrap();
        let got: Vec<f32> = all_batches(&s, Split::Train, 5).iter().flat_map(|b| b.labels.clone()).collect();
        labels_by_rank.push(got);
    }
    let want: Vec<f32> = raw_lines("train.tsv").iter().map(|l| l.0 as f32).collect();
    for (rank, got) in labels_by_rank.iter().enumerate() {
        let expect: Vec<f32> = want.iter().enumerate().filter(|(i, _)| i % 3 == rank).map(|(_, &l)| l).collect();
        assert_eq!(got, &expect, "rank {rank}");
    }
    // Separate eval files: TorchRec's unlabelled conversion has label -1, a bad row.
    let cfg = CriteoBinaryConfig { eval: vec!["test".into()], ..binary_config() };
    let s = CriteoBinarySampler::build(cfg.clone(), &ctx(Path::new("/"), 100)).unwrap();
    assert_eq!(all_batches(&s, Split::Train, 64)[0].batch_size, 40, "all of train is training data");
    let err = s.batches(Split::Eval, 0, 4).unwrap().find_map(Result::err).unwrap().to_string();
    assert!(err.ends_with("test_labels.npy: row 0: label must be 0 or 1, found -1"), "{err}");
    let skip = CriteoBinarySampler::build(
        CriteoBinaryConfig { on_bad_row: BadRowPolicy::Skip, ..cfg },
        &ctx(Path::new("/"), 100),
    )
    .unwrap();
    assert_eq!(skip.batches(Split::Eval, 0, 4).unwrap().count(), 0);
    // Config errors name their key.
    let both = CriteoBinaryConfig { eval: vec!["test".into()], eval_fraction: Some(0.1), ..binary_config() };
    let e = CriteoBinarySampler::build(both, &ctx(Path::new("/"), 100)).unwrap_err();
    assert!(matches!(&e, trainrec_data::DataError::Config { key, .. } if key == "eval_fraction"), "{e}");
    let missing = CriteoBinaryConfig { train: vec!["train".into(), "day_9".into()], ..binary_config() };
    let e = CriteoBinarySampler::build(missing, &ctx(Path::new("/"), 100)).unwrap_err();
    assert!(matches!(&e, trainrec_data::DataError::Config { key, .. } if key == "train[1]"), "{e}");
    assert!(e.to_string().contains("day_9_dense.npy does not exist"), "{e}");
}
