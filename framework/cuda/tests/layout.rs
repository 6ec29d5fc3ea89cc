//! The host side of the CUDA engine: a collection's layout as the kernels see it, and each
//! table's occurrences of a batch in the CPU engine's order. (The kernels themselves are
//! tested against the CPU engine in `emulated.rs`.)

use trainrec_cuda::check;
use trainrec_cuda::host::Layout;
use trainrec_embedding::{
    EmbeddingBagCollection, EmbeddingBagConfig, PoolingMode, SparseOptimizerConfig, WeightPrecision,
};
use trainrec_sparse::KeyedJaggedTensor;

#[test]
fn occurrences_are_sorted_by_row_in_the_cpu_engines_order() {
    // Table b (dim 40) serves fb then fc; the output's columns: fa 0..8, fb 8..48, fc 48..88.
    let sgd = SparseOptimizerConfig::Sgd { lr: 0.1 };
    let case = check::Case {
        optimizer: sgd,
        precision: WeightPrecision::Fp32,
        mean: true,
        weighted: false,
        stochastic: false,
    };
    let cpu = check::collection(&case);
    let layout = Layout::of(&cpu).unwrap();
    assert_eq!(layout.width, 8 + 40 + 40 + 70);
    // batch 2: fb = [[5, 2], [5]], fc = [[2], []]; weighted.
    let kjt = KeyedJaggedTensor::new(
        ["fa", "fb", "fc", "fd"].map(String::from).to_vec(),
        vec![1, 5, 2, 5, 2, 0],
        Some(vec![1.0, 0.5, 2.0, 4.0, 3.0, 1.0]),
        vec![1, 0, 2, 1, 1, 0, 0, 1],
        2,
    )
    .unwrap();
    let keys = layout.resolve(&kjt).unwrap();
    let occ = layout.occurrences(&kjt, &keys, 1);
    let w = layout.width as u32;
    assert_eq!(occ.rows, [2, 5]);
    assert_eq!(occ.seg, [0, 2, 4]);
    // Row 2: fb bag 0 (mean of 2: 0.5 * 2.0), then fc bag 0 (1 * 3.0); row 5: fb bag 0, fb bag 1.
    assert_eq!(occ.src, [8, 48, 8, w + 8]);
    assert_eq!(occ.scale, [1.0, 3.0, 0.25, 4.0]);
    // Table c (sum pooling) has fd's one id in bag 1.
    let occ = layout.occurrences(&kjt, &keys, 2);
    assert_eq!(
        (occ.rows.as_slice(), occ.src.as_slice(), occ.scale.as_slice()),
        (&[0i64][..], &[w + 88][..], &[1.0f32][..])
    );
}

#[test]
fn layout_refuses_what_the_kernels_do_not_cover() {
    let wide = vec![EmbeddingBagConfig::new("wide", 4, 1030, PoolingMode::Sum, &["f"])];
    let ebc = EmbeddingBagCollection::new(wide, SparseOptimizerConfig::Sgd { lr: 0.1 }, 0).unwrap();
    let e = Layout::of(&ebc).unwrap_err().to_string();
    assert!(e.contains("\"wide\"") && e.contains("1030") && e.contains("1024"), "{e}");
}
