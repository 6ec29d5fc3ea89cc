//! Dense model parts built with tch: the model factory trait, DLRM, DLRM-DCN, DeepFM, the
//! two-tower model, DIN and SASRec (sequence features), and dense optimizers.
//!
//! Embedding tables are not tch parameters: a model receives the pooled embeddings as a leaf
//! tensor `[batch, sum(dims)]` (and a sequence feature's unpooled rows as a jagged leaf, see
//! [`sequence`]) and the engine feeds those tensors' gradient to the fused sparse update.

pub mod autocast;
pub mod deepfm;
pub mod din;
pub mod dlrm;
pub mod dlrm_dcn;
mod mlp;
pub mod optim;
pub mod sasrec;
pub mod script;
pub mod sequence;
pub mod two_tower;

pub use autocast::Autocast;
pub use deepfm::{DeepFm, DeepFmConfig, DeepFmFactory};
pub use din::{Din, DinConfig};
pub use dlrm::{Dlrm, DlrmConfig, DlrmFactory};
pub use dlrm_dcn::{DlrmDcn, DlrmDcnConfig, DlrmDcnFactory};
pub use optim::{DenseOptimizer, OptimStateError};
pub use sasrec::{SasRec, SasRecConfig};
pub use sequence::{Catalogue, CatalogueRequest, CatalogueRows, JaggedEmbeddings, JaggedError, ModelInput};
pub use two_tower::{TwoTower, TwoTowerConfig, TwoTowerFactory};

use tch::{Tensor, nn};
use trainrec_types::{Diagnostic, KeyPath};

/// Errors building or running a dense model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The model's config is invalid (the diagnostics name the keys).
    #[error("invalid model config")]
    Config(Vec<Diagnostic>),
    /// libtorch reported an error.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    /// The model cannot be written as TorchScript (it does not implement
    /// [`DenseModel::torchscript`]).
    #[error("this model has no TorchScript form (its DenseModel does not implement `torchscript`)")]
    NotScriptable,
    /// A model's input is inconsistent (jagged lengths that do not match their rows).
    #[error("model input: {0}")]
    Input(#[from] sequence::JaggedError),
    /// Writing the TorchScript file failed.
    #[error("TorchScript export: {0}")]
    Script(#[from] script::ScriptError),
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
    /// Sequence features (read by tables with `pooling = "none"`): (name, dim), in the order
    /// of [`ModelInput::sequences`]. Only a model that declares
    /// [`TypedModel::READS_SEQUENCES`] gets any.
    pub sequences: Vec<(String, usize)>,
}

/// A dense model: dense features + pooled embeddings in, one logit per example and task out.
pub trait DenseModel: Send {
    /// Logits `[batch, num_tasks]` from dense features `[batch, num_dense]` and pooled
    /// embeddings `[batch, sum(dims)]`.
    fn forward(&self, dense: &Tensor, sparse: &Tensor, train: bool) -> Tensor;

    /// Logits `[batch, num_tasks]` from everything the batch holds for the model: dense
    /// features, pooled embeddings and its sequence features' jagged embeddings. The engine
    /// calls this one. The default reads the dense features and pooled embeddings alone
    /// ([`DenseModel::forward`]); a model of sequences overrides it.
    fn forward_input(&self, input: &ModelInput<'_>, train: bool) -> Tensor {
        self.forward(input.dense, input.pooled, train)
    }

    /// Whether the model takes its pooled embeddings in the precision its matrix products run
    /// in (bf16 under `train.dense_precision = "bf16"`) instead of fp32. Only for a model whose
    /// every use of them is a matrix product, which autocast would cast to bf16 anyway (DLRM's
    /// interaction): the logits are the same, and with the engine making the cast outside
    /// autograd their gradient arrives in bf16 without autograd's strided copy back to fp32.
    /// Default: false (fp32, what TorchRec's embedding modules hand a model).
    fn pooled_in_compute_precision(&self) -> bool {
        false
    }

    /// The model's own training objective for a batch, a scalar to minimise (for example the
    /// two-tower model's in-batch softmax). `None`, the default, trains [`DenseModel::forward`]'s
    /// logits with binary cross entropy against the labels.
    fn loss(&mut self, _input: &LossInput<'_>) -> Option<Tensor> {
        None
    }

    /// The model as a retrieval model (query and candidate embedded apart), when it is one;
    /// retrieval metrics (`recall_at_k`) need it.
    fn retrieval(&self) -> Option<&dyn Retrieval> {
        None
    }

    /// The model as a next-item model (users scored against every row of an item table), when
    /// it is one; the full-ranking metrics (`full_ranking`: HR@K, NDCG@K) need it.
    fn next_item(&self) -> Option<&dyn NextItem> {
        None
    }

    /// Rows of an item table the model reads in every training step besides the batch's own
    /// ids (a full or sampled softmax over the catalogue): they arrive as
    /// [`ModelInput::catalogue`] and [`LossInput::catalogue`], and their gradient joins the
    /// table's fused update. Default: none.
    fn catalogue(&self) -> Option<CatalogueRequest> {
        None
    }

    /// Writes the model into a TorchScript serving file (`trainrec export --format
    /// torchscript`): the method
    /// `def dense_forward(self, dense: Tensor, sparse: Tensor) -> Tensor` computing the same
    /// logits as [`DenseModel::forward`] in eval mode, and for a [`Retrieval`] model also
    /// `def query_tower(self, dense: Tensor, sparse: Tensor) -> Tensor` and
    /// `def candidate_tower(self, sparse: Tensor) -> Tensor`. `vars` are the model's variables
    /// by their VarStore names (trained values); add the ones the source reads with
    /// [`script::ScriptModule::var`]. The default: [`ModelError::NotScriptable`].
    fn torchscript(&self, _vars: &script::Vars, _module: &mut script::ScriptModule) -> Result<(), ModelError> {
        Err(ModelError::NotScriptable)
    }
}

/// What [`DenseModel::loss`] sees of a training batch.
pub struct LossInput<'a> {
    /// Dense features `[batch, num_dense]`.
    pub dense: &'a Tensor,
    /// Pooled embeddings `[batch, sum(dims)]` (the leaf the embedding gradient is read from).
    pub sparse: &'a Tensor,
    /// Labels `[batch, num_tasks]`.
    pub labels: &'a Tensor,
    /// The batch's ids, for objectives that need them (sampling-bias correction, masking
    /// repeated candidates).
    pub ids: &'a trainrec_sparse::KeyedJaggedTensor,
    /// Sample weights `[batch]` when the data has them: an objective weighs each example's
    /// loss by its weight (a weighted mean).
    pub weights: Option<&'a Tensor>,
    /// The batch's sequence features (leaves that receive their gradient).
    pub sequences: &'a [(String, JaggedEmbeddings)],
    /// The catalogue rows the model asked for ([`DenseModel::catalogue`]).
    pub catalogue: Option<&'a Catalogue>,
}

/// A model that embeds queries and candidates separately, so candidates can be ranked for a
/// query by a dot product.
pub trait Retrieval {
    /// The pooled outputs (names of [`ModelInputs::sparse`]) that make up a candidate.
    fn candidate_features(&self) -> &[String];
    /// Query embeddings `[batch, d]` from a batch's dense features and pooled embeddings.
    fn query_embeddings(&self, dense: &Tensor, sparse: &Tensor) -> Tensor;
    /// Candidate embeddings `[n, d]` from pooled embeddings `[n, sum(dims)]` (only the
    /// candidate features' columns are read).
    fn candidate_embeddings(&self, sparse: &Tensor) -> Tensor;
}

impl<'a> LossInput<'a> {
    /// A batch without sequence features or catalogue rows.
    pub fn pooled(
        dense: &'a Tensor,
        sparse: &'a Tensor,
        labels: &'a Tensor,
        ids: &'a trainrec_sparse::KeyedJaggedTensor,
        weights: Option<&'a Tensor>,
    ) -> Self {
        Self { dense, sparse, labels, ids, weights, sequences: &[], catalogue: None }
    }
}

/// A model that predicts a user's next item among every row of an item table (SASRec): the
/// `full_ranking` metric scores each eval example's user against every row and ranks the
/// example's target item among them.
pub trait NextItem {
    /// The sequence feature whose table holds the items (its every row is a candidate).
    fn item_feature(&self) -> &str;
    /// The sequence feature holding each example's next item (one id), the one ranked.
    fn target_feature(&self) -> &str;
    /// User embeddings `[batch, d]` (eval mode) from a batch's input.
    fn user_embeddings(&self, input: &ModelInput<'_>) -> Tensor;
    /// Item embeddings `[n, d]` from item table rows `[n, dim]`; the default takes the rows as
    /// they are (input and output embeddings tied).
    fn item_embeddings(&self, rows: &Tensor) -> Tensor {
        rows.shallow_clone()
    }
}

/// A model with a typed config: implement this (and [`DenseModel`]) and register it with
/// `Registry::model::<M>()`; [`TypedModelFactory`] derives the schema, parses the `[model]`
/// table into [`TypedModel::Config`] (errors name the full key, e.g. `model.tower[2]`), and
/// calls [`TypedModel::check`] before [`TypedModel::build`]. The built-in models are typed
/// models too.
pub trait TypedModel: DenseModel + Sized + 'static {
    /// The model's typed config (`deny_unknown_fields`, a doc comment on every field; the
    /// struct's own doc comment is the model's one-line description in `trainrec list`).
    type Config: serde::de::DeserializeOwned + schemars::JsonSchema;
    /// The `kind` it registers under.
    const KIND: &'static str;
    /// Whether the model reads sequence features ([`ModelInput::sequences`], from tables with
    /// `pooling = "none"`) in [`DenseModel::forward_input`]. A recipe with sequence tables and
    /// a model that does not is refused at validation. Default: false.
    const READS_SEQUENCES: bool = false;
    /// Problems of a parsed config against the job's inputs, with full recipe keys
    /// (`model.<key>`, `tables[i].dim`). The default finds none.
    fn check(_config: &Self::Config, _inputs: &ModelInputs) -> Vec<Diagnostic> {
        Vec::new()
    }
    /// Builds the parameters under `vs`; `config` has passed [`TypedModel::check`].
    fn build(vs: &nn::Path, config: &Self::Config, inputs: &ModelInputs) -> Result<Self, ModelError>;
    /// The number of (fp32) parameters [`TypedModel::build`] creates, counted without building
    /// them (validation and the planner measure the model this way, so a model too large for
    /// any machine is reported instead of allocated). `None`: not known without building (the
    /// default; the model is then built on a scratch store to count).
    fn parameters(_config: &Self::Config, _inputs: &ModelInputs) -> Option<u128> {
        None
    }
}

/// The [`ModelFactory`] of a [`TypedModel`].
pub struct TypedModelFactory<M>(std::marker::PhantomData<fn() -> M>);

impl<M> Default for TypedModelFactory<M> {
    fn default() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<M: TypedModel> TypedModelFactory<M> {
    fn parse(config: &serde_json::Value) -> Result<M::Config, Diagnostic> {
        serde_path_to_error::deserialize(config).map_err(|e| {
            let mut key = KeyPath::root().key("model");
            if let Some(sub) = KeyPath::parse(&e.path().to_string()) {
                key.0.extend(sub.0);
            }
            Diagnostic::new(key, e.inner().to_string())
        })
    }
}

impl<M: TypedModel> ModelFactory for TypedModelFactory<M> {
    fn kind(&self) -> &'static str {
        M::KIND
    }
    fn reads_sequences(&self) -> bool {
        M::READS_SEQUENCES
    }
    fn config_schema(&self) -> serde_json::Value {
        serde_json::to_value(schemars::schema_for!(M::Config)).expect("schema serializes")
    }
    fn check(&self, config: &serde_json::Value, inputs: &ModelInputs) -> Vec<Diagnostic> {
        match Self::parse(config) {
            Ok(c) => M::check(&c, inputs),
            Err(d) => vec![d],
        }
    }
    fn build(
        &self,
        vs: &nn::Path,
        config: &serde_json::Value,
        inputs: &ModelInputs,
    ) -> Result<Box<dyn DenseModel>, ModelError> {
        let config = Self::parse(config).map_err(|d| ModelError::Config(vec![d]))?;
        let problems = M::check(&config, inputs);
        if !problems.is_empty() {
            return Err(ModelError::Config(problems));
        }
        Ok(Box::new(M::build(vs, &config, inputs)?))
    }
    fn parameters(&self, config: &serde_json::Value, inputs: &ModelInputs) -> Option<u128> {
        let config = Self::parse(config).ok()?;
        M::check(&config, inputs).is_empty().then(|| M::parameters(&config, inputs)).flatten()
    }
}

/// Builds a dense model from its recipe section (`[model]`, `kind` removed).
pub trait ModelFactory: Send + Sync {
    /// The `kind` this factory registers under.
    fn kind(&self) -> &'static str;
    /// Whether its models read sequence features (see [`TypedModel::READS_SEQUENCES`]).
    fn reads_sequences(&self) -> bool {
        false
    }
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
    /// The number of fp32 parameters [`ModelFactory::build`] creates, counted without building
    /// them; `None` when it is not known without building (see [`TypedModel::parameters`]).
    fn parameters(&self, _config: &serde_json::Value, _inputs: &ModelInputs) -> Option<u128> {
        None
    }
}

/// Seeds libtorch's global generator for a test and holds it until the guard drops: tests run
/// in parallel threads, and two drawing from the one generator at once would each see
/// different values from run to run.
#[cfg(test)]
pub(crate) fn seeded(seed: i64) -> std::sync::MutexGuard<'static, ()> {
    static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let guard = RNG.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    tch::manual_seed(seed);
    guard
}
