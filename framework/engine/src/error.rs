//! Engine errors, each saying whose fault it is.

use std::path::PathBuf;

/// Why a job could not be built or run.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The recipe is invalid (every problem, located).
    #[error("{0}")]
    Recipe(#[from] trainrec_recipe::Diagnostics),
    /// The data could not be read.
    #[error("data: {0}")]
    Data(#[from] trainrec_data::DataError),
    /// The embedding collection rejected its input.
    #[error("embedding: {0}")]
    Embedding(trainrec_embedding::EmbeddingError),
    /// The dense model could not be built.
    #[error("model: {0}")]
    Model(#[from] trainrec_models::ModelError),
    /// A metric rejected its input.
    #[error("metrics: {0}")]
    Metric(#[from] trainrec_metrics::MetricError),
    /// A collective across ranks failed (a peer left, timed out or diverged).
    #[error("distributed: {0}")]
    Dist(#[from] trainrec_comm::DistError),
    /// The CUDA engine failed.
    #[error("cuda: {0}")]
    Cuda(#[from] trainrec_cuda::CudaError),
    /// libtorch reported an error.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    /// A file of the run directory could not be written.
    #[error("cannot write {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The run was stopped by a signal after `step`, its checkpoint saved in `dir`.
    #[error(
        "stopped by {} after step {step}; the checkpoint is saved: resume with `trainrec run --resume {}`",
        signal_name(*signal),
        run_dir.display()
    )]
    Stopped {
        /// The signal (SIGINT 2, SIGTERM 15).
        signal: i32,
        /// The last step trained.
        step: u64,
        /// The run directory.
        run_dir: PathBuf,
    },
    /// Another process holds the run directory (its advisory lock, `RUN_DIR/.lock`).
    #[error(
        "run directory {} is in use by {holder}; wait for that run to end, or give this one another run.output_dir",
        dir.display()
    )]
    Locked {
        /// The run directory.
        dir: PathBuf,
        /// Who holds it: process id, host, start time and command, as the holder wrote them.
        holder: String,
    },
    /// A checkpoint could not be written or read.
    #[error("checkpoint: {0}")]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    /// The recipe's `[pipeline]` cannot run this job as asked.
    #[error("pipeline: {0}")]
    Pipeline(String),
    /// A split produced no batches.
    #[error("the sampler's {0} split produced no batches; check its size settings")]
    EmptySplit(&'static str),
    /// The recipe's model or tables cannot take the asked form (the message says which and
    /// what to do instead).
    #[error("{0}")]
    Unsupported(String),
    /// A broken internal invariant: a trainrec bug.
    #[error("internal error (please report): {0}")]
    Internal(String),
}

/// An engine's error by whose fault it is: a backend's own error (a collective that failed, a
/// GPU) as that backend's, a batch that cannot be laid out as the data's, others as the
/// embedding collection's.
impl From<trainrec_embedding::EmbeddingError> for EngineError {
    fn from(e: trainrec_embedding::EmbeddingError) -> Self {
        use trainrec_embedding::EmbeddingError as E;
        match e {
            E::Backend(b) => {
                if let Some(d) = b.downcast_ref::<trainrec_comm::DistError>() {
                    Self::Dist(d.clone())
                } else if let Some(c) = b.downcast_ref::<trainrec_cuda::CudaError>() {
                    Self::Cuda(c.clone())
                } else {
                    Self::Embedding(E::Backend(b))
                }
            }
            E::Input(s) => s.into(),
            other => Self::Embedding(other),
        }
    }
}

/// A batch's sparse features that cannot be laid out (a variable-batch KJT whose inverse
/// indices do not fit) are the data's fault, as the old engine reported them.
impl From<trainrec_sparse::SparseError> for EngineError {
    fn from(e: trainrec_sparse::SparseError) -> Self {
        Self::Data(e.into())
    }
}

/// A stop signal's name.
fn signal_name(signal: i32) -> String {
    match signal {
        libc::SIGINT => "SIGINT (Ctrl-C)".into(),
        libc::SIGTERM => "SIGTERM".into(),
        s => format!("signal {s}"),
    }
}
