//! The shared words' spellings, pinned: recipes, `plan.json` (and the hash of a plan's inputs,
//! which pinned plans check), checkpoints and `metrics.jsonl` read and write them, so moving a
//! type between crates must not change a byte of them.

use serde::Serialize;
use trainrec::embedding::{
    BoundsCheckMode, CachePolicy, PoolingMode, SparseOptimizerConfig, WeightDecayMode, WeightPrecision,
};
use trainrec::planner::{ComputeDevice, ComputeKernel, ShardingType};
use trainrec::recipe::{DenseOptimizerConfig, McEvictionPolicy, PipelineKind, Shuffle, ShuffleKind};

fn json<T: Serialize>(v: T) -> String {
    serde_json::to_string(&v).expect("serializes")
}

fn spellings<T: Serialize + Copy>(all: &[T]) -> Vec<String> {
    all.iter().map(|&v| json(v)).collect()
}

#[test]
fn unit_words_keep_their_spellings() {
    assert_eq!(
        spellings(&[PoolingMode::Sum, PoolingMode::Mean, PoolingMode::None]),
        ["\"sum\"", "\"mean\"", "\"none\""]
    );
    assert_eq!(
        spellings(&[WeightPrecision::Fp32, WeightPrecision::Fp16, WeightPrecision::Bf16]),
        ["\"fp32\"", "\"fp16\"", "\"bf16\""]
    );
    assert_eq!(
        spellings(&[BoundsCheckMode::Fatal, BoundsCheckMode::Warning, BoundsCheckMode::Ignore]),
        ["\"fatal\"", "\"warning\"", "\"ignore\""]
    );
    assert_eq!(
        spellings(&[WeightDecayMode::None, WeightDecayMode::L2, WeightDecayMode::Decoupled]),
        ["\"none\"", "\"l2\"", "\"decoupled\""]
    );
    assert_eq!(spellings(&[CachePolicy::Lru, CachePolicy::Lfu]), ["\"lru\"", "\"lfu\""]);
    assert_eq!(
        spellings(&ShardingType::ALL),
        [
            "\"data_parallel\"",
            "\"table_wise\"",
            "\"column_wise\"",
            "\"table_column_wise\"",
            "\"row_wise\"",
            "\"table_row_wise\"",
            "\"grid\""
        ]
    );
    assert_eq!(
        spellings(&ComputeKernel::ALL),
        ["\"dense\"", "\"fused\"", "\"fused_uvm\"", "\"fused_uvm_caching\"", "\"key_value\""]
    );
    assert_eq!(spellings(&[ComputeDevice::Cpu, ComputeDevice::Cuda]), ["\"cpu\"", "\"cuda\""]);
    assert_eq!(
        spellings(&[McEvictionPolicy::Lfu, McEvictionPolicy::Lru, McEvictionPolicy::DistanceLfu]),
        ["\"lfu\"", "\"lru\"", "\"distance_lfu\""]
    );
    assert_eq!(
        spellings(&[PipelineKind::Base, PipelineKind::SparseDist, PipelineKind::PrefetchSparseDist]),
        ["\"base\"", "\"sparse_dist\"", "\"prefetch_sparse_dist\""]
    );
    assert_eq!(
        spellings(&[trainrec::metrics::Split::Train, trainrec::metrics::Split::Eval]),
        ["\"train\"", "\"eval\""]
    );
    assert_eq!(
        spellings(&[ShuffleKind::None, ShuffleKind::Buffer, ShuffleKind::Full]),
        ["\"none\"", "\"buffer\"", "\"full\""]
    );
    assert_eq!(json(Shuffle::buffer(4096)), r#"{"kind":"buffer","rows":4096}"#);
    assert_eq!(json(Shuffle::FULL), r#"{"kind":"full"}"#);
    // The defaults recipes get when a key is left out.
    assert_eq!(trainrec::recipe::defaults::pooling(), PoolingMode::Sum);
    assert_eq!(WeightPrecision::default(), WeightPrecision::Fp32);
    assert_eq!(BoundsCheckMode::default(), BoundsCheckMode::Fatal);
    assert_eq!(CachePolicy::default(), CachePolicy::Lru);
    assert_eq!(McEvictionPolicy::default(), McEvictionPolicy::Lfu);
    assert_eq!(ShuffleKind::default(), ShuffleKind::None);
}

#[test]
fn optimizer_configs_keep_their_tags_fields_and_field_order() {
    use SparseOptimizerConfig as S;
    let sparse = [
        S::Sgd { lr: 0.5 },
        S::Adagrad { lr: 0.5, eps: 0.25 },
        S::RowwiseAdagrad { lr: 0.5, eps: 0.25, weight_decay: 0.125, weight_decay_mode: WeightDecayMode::L2 },
        S::Adam { lr: 0.5, eps: 0.25, beta1: 0.75, beta2: 0.875, weight_decay: 0.125 },
        S::PartialRowwiseAdam { lr: 0.5, eps: 0.25, beta1: 0.75, beta2: 0.875, weight_decay: 0.125 },
        S::Lamb { lr: 0.5, eps: 0.25, beta1: 0.75, beta2: 0.875, weight_decay: 0.125 },
    ];
    let want = [
        r#"{"kind":"sgd","lr":0.5}"#,
        r#"{"kind":"adagrad","lr":0.5,"eps":0.25}"#,
        r#"{"kind":"rowwise_adagrad","lr":0.5,"eps":0.25,"weight_decay":0.125,"weight_decay_mode":"l2"}"#,
        r#"{"kind":"adam","lr":0.5,"eps":0.25,"beta1":0.75,"beta2":0.875,"weight_decay":0.125}"#,
        r#"{"kind":"partial_rowwise_adam","lr":0.5,"eps":0.25,"beta1":0.75,"beta2":0.875,"weight_decay":0.125}"#,
        r#"{"kind":"lamb","lr":0.5,"eps":0.25,"beta1":0.75,"beta2":0.875,"weight_decay":0.125}"#,
    ];
    for (c, w) in sparse.iter().zip(want) {
        assert_eq!(json(c), w);
    }
    // Left-out fields take their defaults.
    let adam: SparseOptimizerConfig = serde_json::from_str(r#"{"kind":"adam","lr":0.5}"#).unwrap();
    assert_eq!(json(&adam), r#"{"kind":"adam","lr":0.5,"eps":1e-8,"beta1":0.9,"beta2":0.999,"weight_decay":0.0}"#);

    use DenseOptimizerConfig as D;
    let dense = [
        D::Sgd { lr: 0.5, momentum: 0.25, weight_decay: 0.125 },
        D::Adagrad { lr: 0.5, weight_decay: 0.125 },
        D::Adam { lr: 0.5, beta1: 0.75, beta2: 0.875, weight_decay: 0.125 },
    ];
    let want = [
        r#"{"kind":"sgd","lr":0.5,"momentum":0.25,"weight_decay":0.125}"#,
        r#"{"kind":"adagrad","lr":0.5,"weight_decay":0.125}"#,
        r#"{"kind":"adam","lr":0.5,"beta1":0.75,"beta2":0.875,"weight_decay":0.125}"#,
    ];
    for (c, w) in dense.iter().zip(want) {
        assert_eq!(json(c), w);
    }
    let adam: DenseOptimizerConfig = serde_json::from_str(r#"{"kind":"adam","lr":0.5}"#).unwrap();
    assert_eq!(json(&adam), r#"{"kind":"adam","lr":0.5,"beta1":0.9,"beta2":0.999,"weight_decay":0.0}"#);
}
