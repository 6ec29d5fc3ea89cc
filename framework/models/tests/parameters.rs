//! Every built-in model counts its parameters without building them (`ModelFactory::parameters`,
//! what validation and the planner measure), and the count is what `build` creates.

use serde_json::json;
use tch::nn;
use trainrec_models::{DeepFmFactory, DlrmDcnFactory, DlrmFactory, ModelFactory, ModelInputs, TwoTowerFactory};
use trainrec_types::KeyPath;

fn inputs(num_dense: usize, dims: &[usize], num_tasks: usize) -> ModelInputs {
    ModelInputs {
        num_dense,
        sparse: dims.iter().enumerate().map(|(i, &d)| (format!("f{i}"), d)).collect(),
        sparse_dim_keys: (0..dims.len()).map(|i| KeyPath::root().key("tables").index(i).key("dim")).collect(),
        num_tasks,
        sequences: Vec::new(),
    }
}

/// Parameters `factory` builds for `config`, counted in the built store.
fn built(factory: &dyn ModelFactory, config: &serde_json::Value, inputs: &ModelInputs) -> u128 {
    let vs = nn::VarStore::new(tch::Device::Cpu);
    factory.build(&vs.root(), config, inputs).unwrap_or_else(|e| panic!("{config}: {e}"));
    vs.trainable_variables().iter().map(|t| t.numel() as u128).sum()
}

#[test]
fn counted_parameters_are_the_built_ones() {
    let cases: Vec<(Box<dyn ModelFactory>, serde_json::Value, ModelInputs)> = vec![
        (
            Box::new(DlrmFactory::default()),
            json!({"dense_arch": [16, 8], "over_arch": [32, 1]}),
            inputs(13, &[8; 5], 1),
        ),
        (Box::new(DlrmFactory::default()), json!({"dense_arch": [4], "over_arch": [7, 5, 2]}), inputs(3, &[4; 2], 2)),
        (
            Box::new(DlrmDcnFactory::default()),
            json!({"dense_arch": [16, 8], "over_arch": [32, 1], "dcn_num_layers": 3, "dcn_low_rank_dim": 4}),
            inputs(13, &[8; 4], 1),
        ),
        (
            Box::new(DeepFmFactory::default()),
            json!({"hidden_layer_size": 20, "deep_fm_dimension": 6}),
            inputs(5, &[8; 3], 2),
        ),
        (
            Box::new(TwoTowerFactory::default()),
            json!({"query_features": ["f0"], "candidate_features": ["f1", "f2"], "query_tower": [12, 8], "candidate_tower": [10, 8]}),
            inputs(0, &[4, 6, 2], 1),
        ),
    ];
    for (factory, config, inputs) in &cases {
        assert!(factory.check(config, inputs).is_empty(), "{config}: {:?}", factory.check(config, inputs));
        let counted = factory.parameters(config, inputs).unwrap_or_else(|| panic!("{} counts", factory.kind()));
        assert_eq!(counted, built(factory.as_ref(), config, inputs), "{}: {config}", factory.kind());
    }
}

#[test]
fn a_model_no_machine_holds_is_counted_not_built() {
    let inputs = inputs(1 << 32, &[16; 8], 1);
    let config = json!({"dense_arch": [512, 256, 16], "over_arch": [512, 256, 1]});
    let n = DlrmFactory::default().parameters(&config, &inputs).unwrap();
    // The first layer alone: 2^32 x 512 weights and 512 biases.
    assert!(n > (1u128 << 32) * 512, "{n}");
}
