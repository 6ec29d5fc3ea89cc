//! Dense model parts built with tch: the model factory trait, DLRM, and dense optimizers.
//!
//! Embedding tables are not tch parameters: a model receives the pooled embeddings as a leaf
//! tensor `[batch, sum(dims)]` and the engine feeds that tensor's gradient to the fused sparse
//! update.

pub mod dlrm;
pub mod optim;

pub use dlrm::{Dlrm, DlrmConfig, DlrmFactory};
pub use optim::DenseOptimizer;

use tch::{Tensor, nn};
use trainrec_recipe::{Diagnostic, KeyPath};

/// Errors building or running a dense model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The model's config is invalid (the diagnostics name the keys).
    #[error("invalid model config")]
    Config(Vec<Diagnostic>),
    /// libtorch reported an error.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}

/// What a model sees of the job: its inputs.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelInputs {
    /// Number of dense features.
    pub num_dense: usize,
    /// Pooled embedding outputs, in the order of the sparse tensor's columns: (name, dim).
    pub sparse: Vec<(String, usize)>,
    /// Where the sparse outputs' dims are set in the recipe, for error messages: one path per
    /// output, e.g. `tables[0].dim`.
    pub sparse_dim_keys: Vec<KeyPath>,
    /// Number of tasks: the model predicts one logit per task (the job's `[[tasks]]`).
    pub num_tasks: usize,
}

/// A dense model: dense features + pooled embeddings in, one logit per example and task out.
pub trait DenseModel: Send {
    /// Logits `[batch, num_tasks]` from dense features `[batch, num_dense]` and pooled
    /// embeddings `[batch, sum(dims)]`.
    fn forward(&self, dense: &Tensor, sparse: &Tensor, train: bool) -> Tensor;
}

/// Builds a dense model from its recipe section (`[model]`, `kind` removed).
pub trait ModelFactory: Send + Sync {
    /// The `kind` this factory registers under.
    fn kind(&self) -> &'static str;
    /// JSON schema of the config (drives validation and the reference page).
    fn config_schema(&self) -> serde_json::Value;
    /// Checks the config against the job's inputs; keys in the diagnostics are full recipe
    /// paths (e.g. `model.dense_arch`).
    fn check(&self, config: &serde_json::Value, inputs: &ModelInputs) -> Vec<Diagnostic>;
    /// Builds the model's parameters under `vs`.
    fn build(
        &self,
        vs: &nn::Path,
        config: &serde_json::Value,
        inputs: &ModelInputs,
    ) -> Result<Box<dyn DenseModel>, ModelError>;
}
