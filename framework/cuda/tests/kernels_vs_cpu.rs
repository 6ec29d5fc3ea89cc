//! The CUDA kernels, compiled as host C++ by `trainrec-cuda-emu`, against the CPU engine:
//! forward, backward and every fused optimizer over fp32 / fp16 / bf16 weights give the same
//! bits as `EmbeddingBagCollection` for several steps.

use std::ffi::c_void;

use rand::SeedableRng;
use rand::rngs::StdRng;
use trainrec_cuda::check;
use trainrec_cuda::host::{Layout, StepArgs, StoredWeights, from_stored, grid, to_stored};
use trainrec_cuda_emu::Precision;
use trainrec_embedding::{
    EmbeddingBagCollection, EmbeddingBagConfig, PoolingMode, SparseOptimizerConfig, WeightPrecision,
};
use trainrec_sparse::KeyedJaggedTensor;

fn emu_precision(p: WeightPrecision) -> Precision {
    match p {
        WeightPrecision::Fp32 => Precision::F32,
        WeightPrecision::Fp16 => Precision::F16,
        WeightPrecision::Bf16 => Precision::Bf16,
    }
}

fn stored_ptr(w: &mut StoredWeights) -> *mut c_void {
    match w {
        StoredWeights::F32(v) => v.as_mut_ptr().cast(),
        StoredWeights::Bits(v) => v.as_mut_ptr().cast(),
    }
}

/// The emulated GPU collection: the layout and each table's stored weights and state.
struct Emu {
    layout: Layout,
    weights: Vec<StoredWeights>,
    state: Vec<Vec<f32>>,
    iter: Vec<u64>,
    grid_cap: usize,
}

impl Emu {
    fn of(ebc: &EmbeddingBagCollection, grid_cap: usize) -> Self {
        let layout = Layout::of(ebc).unwrap();
        let weights =
            layout.tables.iter().map(|t| to_stored(t.precision, &ebc.table_weights(&t.name).unwrap())).collect();
        let state = layout.tables.iter().map(|t| ebc.optimizer_state(&t.name).unwrap_or_default()).collect();
        let iter = layout.tables.iter().map(|t| ebc.step_count(&t.name).unwrap()).collect();
        Self { layout, weights, state, iter, grid_cap }
    }

    fn grid(&self, n: usize) -> u32 {
        grid(n).min(self.grid_cap as u32)
    }

    fn forward(&mut self, kjt: &KeyedJaggedTensor) -> Vec<f32> {
        let keys = self.layout.resolve(kjt).unwrap();
        let b = kjt.stride();
        let width = self.layout.width;
        let mut out = vec![f32::NAN; b * width];
        let offsets: Vec<i64> = kjt.offsets().iter().map(|&o| o as i64).collect();
        for (o, &k) in self.layout.outputs.iter().zip(&keys) {
            let t = &self.layout.tables[o.table];
            let g = self.grid(b);
            // SAFETY: the table holds rows * dim weights; offsets index the KJT's values and
            // weights; out holds b rows of width floats.
            unsafe {
                trainrec_cuda_emu::pool(
                    g,
                    emu_precision(t.precision),
                    stored_ptr(&mut self.weights[o.table]),
                    t.rows as i64,
                    t.dim as i32,
                    kjt.values(),
                    &offsets[k * b..k * b + b + 1],
                    kjt.weights(),
                    t.pooling == PoolingMode::Mean,
                    &mut out,
                    width as i64,
                    o.column as i64,
                )
            };
        }
        out
    }

    fn backward(&mut self, kjt: &KeyedJaggedTensor, grad: &[f32]) {
        let keys = self.layout.resolve(kjt).unwrap();
        for t in 0..self.layout.tables.len() {
            let occ = self.layout.occurrences(kjt, &keys, t);
            self.iter[t] += 1;
            let spec = &self.layout.tables[t];
            let args = StepArgs::new(spec, self.iter[t]);
            let mut dummy = vec![0f32; 1];
            let state = if self.state[t].is_empty() { dummy.as_mut_ptr() } else { self.state[t].as_mut_ptr() };
            let g = self.grid(occ.rows.len());
            // SAFETY: unique rows inside the table, state of spr floats per row, every
            // occurrence's gradient inside `grad`, args a StepArgs.
            unsafe {
                trainrec_cuda_emu::update(
                    g,
                    emu_precision(spec.precision),
                    stored_ptr(&mut self.weights[t]),
                    state,
                    spec.dim as i32,
                    spec.state_per_row as i32,
                    &occ.rows,
                    &occ.seg,
                    &occ.src,
                    &occ.scale,
                    grad,
                    (&args as *const StepArgs).cast(),
                )
            };
        }
    }
}

fn sgd_case(precision: WeightPrecision, mean: bool) -> check::Case {
    check::Case {
        optimizer: SparseOptimizerConfig::Sgd { lr: 0.1 },
        precision,
        mean,
        weighted: false,
        stochastic: false,
    }
}

/// Equal bit for bit (NaN patterns included); the first difference otherwise.
fn assert_same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a.to_bits() != b.to_bits()) {
        panic!(
            "{what}: element {i} is {} ({:#010x}), the CPU engine's {} ({:#010x})",
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

#[test]
fn kernels_train_bit_for_bit_like_the_cpu_collection() {
    let mut checked = 0;
    for (i, case) in check::cases().iter().enumerate() {
        // The GPU check's seeds (trainrec device-check).
        let mut rng = StdRng::seed_from_u64(11 + i as u64);
        let mut cpu = check::collection(case);
        // A small grid: warps loop over several bags / rows.
        let mut emu = Emu::of(&cpu, 2);
        for step in 0..check::STEPS {
            let kjt = check::batch(&mut rng, case.weighted, step);
            let mut out = vec![0f32; kjt.stride() * cpu.width()];
            cpu.forward_into(&kjt, &mut out).unwrap();
            let got = emu.forward(&kjt);
            assert_same_bits(&got, &out, &format!("{case}: forward of step {step}"));
            let grad = check::gradient(&mut rng, &kjt, cpu.width());
            cpu.backward_and_update(&kjt, &grad).unwrap();
            emu.backward(&kjt, &grad);
            for (t, spec) in emu.layout.tables.iter().enumerate() {
                let want = cpu.table_weights(&spec.name).unwrap();
                let got = from_stored(spec.precision, &emu.weights[t]);
                assert_same_bits(&got, &want, &format!("{case}: table {} after step {step}", spec.name));
                let want = cpu.optimizer_state(&spec.name).unwrap_or_default();
                assert_same_bits(&emu.state[t], &want, &format!("{case}: state of {} after step {step}", spec.name));
                assert_eq!(emu.iter[t], cpu.step_count(&spec.name).unwrap());
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 8 * 3 * check::STEPS * 3);
}

#[test]
fn gather_copies_rows_and_reads_row_zero_for_bad_ids() {
    for precision in [WeightPrecision::Fp32, WeightPrecision::Fp16, WeightPrecision::Bf16] {
        let cpu = check::collection(&sgd_case(precision, false));
        let w = cpu.table_weights("c").unwrap();
        let mut stored = to_stored(precision, &w);
        let ids = [3i64, 16, 3, -1, 17, 0, 5];
        let mut out = vec![f32::NAN; ids.len() * 70];
        // SAFETY: table c holds 17 x 70 weights; out holds ids.len() rows of 70.
        unsafe {
            trainrec_cuda_emu::gather(2, emu_precision(precision), stored_ptr(&mut stored), 17, 70, &ids, &mut out)
        };
        for (i, &id) in ids.iter().enumerate() {
            let r = if (0..17).contains(&id) { id as usize } else { 0 };
            assert_same_bits(&out[i * 70..][..70], &w[r * 70..][..70], &format!("{precision:?}: id {id}"));
        }
    }
}

#[test]
fn occurrences_are_sorted_by_row_in_the_cpu_engines_order() {
    // Table b (dim 40) serves fb then fc; the output's columns: fa 0..8, fb 8..48, fc 48..88.
    let cpu = check::collection(&sgd_case(WeightPrecision::Fp32, true));
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
