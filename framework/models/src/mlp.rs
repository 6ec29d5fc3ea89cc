//! Building blocks the models share: the MLP and the config checks every model needs.

use tch::nn;
use trainrec_types::{Diagnostic, KeyPath};

use crate::ModelInputs;

/// PyTorch's `nn.Linear` initialisation for a layer of `fan_in` inputs: weights and bias
/// uniform in `±1 / sqrt(fan_in)` (`kaiming_uniform_(a = sqrt(5))` and its bias rule), as every
/// TorchRec model's layers start. tch's `nn::linear` default draws the weights `√6` times wider
/// (Kaiming-uniform with ReLU's gain).
pub(crate) fn torch_linear(fan_in: i64) -> nn::LinearConfig {
    let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
    nn::LinearConfig { ws_init: nn::Init::Uniform { lo: -bound, up: bound }, ..Default::default() }
}

/// An MLP of `nn::linear` layers named `layer{i}` under `vs` (PyTorch's initialisation,
/// [`torch_linear`]), with a ReLU after every layer but the last, and after the last too when
/// `relu_last` is set (TorchRec's `MLP` with `activation="relu"` is `relu_last = true`; its
/// `OverArch` is `relu_last = false`).
pub(crate) fn mlp(vs: &nn::Path, input: usize, sizes: &[usize], relu_last: bool) -> nn::Sequential {
    let mut seq = nn::seq();
    let mut prev = input as i64;
    for (i, &size) in sizes.iter().enumerate() {
        seq = seq.add(nn::linear(vs / format!("layer{i}"), prev, size as i64, torch_linear(prev)));
        if relu_last || i + 1 < sizes.len() {
            seq = seq.add_fn(|x| x.relu());
        }
        prev = size as i64;
    }
    seq
}

/// Parameters of [`mlp`]`(_, input, sizes, _)`: each layer's weights and bias.
pub(crate) fn mlp_parameters(input: usize, sizes: &[usize]) -> u128 {
    let mut prev = input as u128;
    let mut total = 0u128;
    for &size in sizes {
        total += prev * size as u128 + size as u128;
        prev = size as u128;
    }
    total
}

/// The `[model]` table's path.
pub(crate) fn model_key() -> KeyPath {
    KeyPath::root().key("model")
}

/// Checks that `model.<key>` lists at least `min_layers` layer sizes, all positive; `help` goes
/// with a too-short list.
pub(crate) fn check_layer_sizes(
    key: &str,
    sizes: &[usize],
    min_layers: usize,
    help: Option<String>,
    out: &mut Vec<Diagnostic>,
) {
    let model = model_key();
    if sizes.len() < min_layers {
        let message = match min_layers {
            1 => format!("{key} needs at least one layer"),
            n => format!("{key} needs at least {n} layers, found {}", sizes.len()),
        };
        let d = Diagnostic::new(model.key(key), message);
        out.push(match help {
            Some(help) => d.with_help(help),
            None => d,
        });
    }
    for (i, &s) in sizes.iter().enumerate() {
        if s == 0 {
            out.push(Diagnostic::new(model.key(key).index(i), "layer sizes must be positive"));
        }
    }
}

/// Checks that a single size `model.<key>` is positive.
pub(crate) fn check_positive(key: &str, value: usize, what: &str, out: &mut Vec<Diagnostic>) {
    if value == 0 {
        out.push(
            Diagnostic::new(model_key().key(key), format!("{key} ({what}) must be positive, found 0"))
                .with_help(format!("set model.{key} to 1 or more")),
        );
    }
}

/// Checks that the last size of `model.<key>` is the number of tasks (one logit per task).
pub(crate) fn check_last_is_num_tasks(key: &str, sizes: &[usize], tasks: usize, out: &mut Vec<Diagnostic>) {
    if let Some(&last) = sizes.last()
        && last != tasks
    {
        let i = sizes.len() - 1;
        let what = if tasks == 1 { "1 (one logit)".to_owned() } else { format!("{tasks} (one logit per task)") };
        out.push(
            Diagnostic::new(
                model_key().key(key).index(i),
                format!("the last {key} layer must have size {what}, found {last}"),
            )
            .with_help(format!("end {key} with {tasks}")),
        );
    }
}

/// Checks that every pooled embedding has dim `dim`, the last `dense_arch` size; `model` names
/// the model in the message.
pub(crate) fn check_dims_match_dense_arch(model: &str, dim: usize, inputs: &ModelInputs, out: &mut Vec<Diagnostic>) {
    for ((name, d), key) in inputs.sparse.iter().zip(&inputs.sparse_dim_keys) {
        if *d != dim {
            out.push(
                Diagnostic::new(
                    key.clone(),
                    format!(
                        "{model} needs every embedding dim to equal the last dense_arch size ({dim}); feature \"{name}\" has dim {d}"
                    ),
                )
                .with_help(format!("set this table's dim to {dim}, or end model.dense_arch with {d}")),
            );
        }
    }
}

/// Checks that the job has at least one pooled embedding (TorchRec's models assert this).
pub(crate) fn check_has_sparse(model: &str, inputs: &ModelInputs, out: &mut Vec<Diagnostic>) {
    if inputs.sparse.is_empty() {
        out.push(
            Diagnostic::new(
                KeyPath::root().key("tables"),
                format!("{model} needs at least one embedding table; the job has no sparse features"),
            )
            .with_help("add a [[tables]] entry with at least one feature"),
        );
    }
}

/// Checks that the job has at least one dense feature.
pub(crate) fn check_has_dense(model: &str, inputs: &ModelInputs, out: &mut Vec<Diagnostic>) {
    if inputs.num_dense == 0 {
        out.push(Diagnostic::new(
            model_key(),
            format!("{model} needs at least one dense feature; the sampler produces none"),
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every layer starts as PyTorch's `nn.Linear` does: weights and bias uniform in
    /// `±1/sqrt(fan_in)`, so their standard deviation is `1/sqrt(3 fan_in)` (tch's default
    /// weights would be `√6` times wider and fail both checks).
    #[test]
    fn layers_start_as_pytorch_linear_layers() {
        let _rng = crate::seeded(7);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let _ = mlp(&vs.root(), 400, &[300, 1], false);
        let vars = vs.variables();
        for (name, fan_in, numel) in
            [("layer0.weight", 400.0, 120_000), ("layer1.weight", 300.0, 300), ("layer0.bias", 400.0, 300)]
        {
            let v = &vars[name];
            assert_eq!(v.numel(), numel, "{name}");
            let values: Vec<f32> = Vec::try_from(v.flatten(0, -1)).unwrap();
            let bound = 1.0 / f64::sqrt(fan_in);
            let max = values.iter().map(|x| f64::from(x.abs())).fold(0.0, f64::max);
            assert!(max <= bound && max > 0.9 * bound, "{name}: max |w| {max} against bound {bound}");
            if numel >= 10_000 {
                let n = values.len() as f64;
                let mean = values.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
                let var = values.iter().map(|&x| (f64::from(x) - mean).powi(2)).sum::<f64>() / n;
                let want = bound / 3f64.sqrt();
                assert!((var.sqrt() / want - 1.0).abs() < 0.02, "{name}: std {} against {want}", var.sqrt());
            }
        }
    }
}
