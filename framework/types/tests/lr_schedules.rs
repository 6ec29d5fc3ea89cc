//! Learning-rate schedules against TorchRec's `WarmupOptimizer`: the per-step rates of
//! `fixtures/lr_schedules.json` (written by `scripts/anchors/lr_schedule_fixture.py` with
//! TorchRec 1.9.2) are `lr × lr_multiplier(stages, step)`, bit for bit.

use trainrec_types::{WarmupStage, check_schedule, diagnostic::KeyPath, lr_multiplier};

#[test]
fn rates_equal_torchrecs_warmup_optimizer() {
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/lr_schedules.json")).unwrap();
    let fixture: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 5);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let lr = case["lr"].as_f64().unwrap();
        let stages: Vec<WarmupStage> = serde_json::from_value(case["stages"].clone()).unwrap();
        assert!(check_schedule(&stages, &KeyPath::root()).is_empty(), "{name}");
        for (step, want) in case["lrs"].as_array().unwrap().iter().enumerate() {
            let want = want.as_f64().unwrap();
            let got = lr * lr_multiplier(&stages, step as u64);
            assert_eq!(got.to_bits(), want.to_bits(), "{name}, step {step}: {got} against TorchRec's {want}");
        }
    }
}
