//! Starting a job's ranks: one rank in this process, one thread per rank (the thread
//! backend), or this process's rank under `mpirun` (the MPI backend); each builds its job,
//! resumes from a checkpoint when asked, and trains.

use std::sync::Arc;

use trainrec_comm::{ProcessGroup, ThreadGroup};
use trainrec_data::FeatureSchema;
use trainrec_recipe::LoadedRecipe;

use crate::error::EngineError;
use crate::job::Job;
use crate::registry::Registry;
use crate::run_dir::RunSummary;
use crate::runtime::{COLLECTIVE_TIMEOUT, configure_threads};

/// Trains the recipe on `topology.world_size` ranks of the in-process thread backend (one
/// thread per rank, each with its share of the data); returns rank 0's summary. The first
/// rank error that is not a consequence of another rank's failure is returned.
pub fn run_threads(
    loaded: &LoadedRecipe,
    features: &FeatureSchema,
    registry: &Registry,
) -> Result<RunSummary, EngineError> {
    run_threads_from(loaded, features, registry, None)
}

/// Builds rank `pg`'s job and runs it, from checkpoint directory `resume` when given.
fn build_and_run(
    loaded: &LoadedRecipe,
    features: &FeatureSchema,
    registry: &Registry,
    pg: Option<Arc<dyn ProcessGroup>>,
    resume: Option<&std::path::Path>,
) -> Result<RunSummary, EngineError> {
    let mut job = Job::build_rank(loaded, features, registry, pg)?;
    if let Some(dir) = resume {
        job.resume_from(crate::checkpoint::Checkpoint::open(dir)?);
    }
    job.run()
}

/// Trains one rank of the job (no process group), from checkpoint directory `resume` when
/// given.
pub fn run_local(
    loaded: &LoadedRecipe,
    features: &FeatureSchema,
    registry: &Registry,
    resume: Option<&std::path::Path>,
) -> Result<RunSummary, EngineError> {
    build_and_run(loaded, features, registry, None, resume)
}

/// [`run_threads`], every rank resuming from checkpoint directory `resume` when given.
pub fn run_threads_from(
    loaded: &LoadedRecipe,
    features: &FeatureSchema,
    registry: &Registry,
    resume: Option<&std::path::Path>,
) -> Result<RunSummary, EngineError> {
    let world = loaded.recipe.topology.world_size;
    let threads = configure_threads(loaded.recipe.run.threads);
    let per_rank = (threads / world).max(1) as i32;
    let results = ThreadGroup::run(world, COLLECTIVE_TIMEOUT, |pg| {
        tch::set_num_threads(per_rank);
        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
        build_and_run(loaded, features, registry, Some(pg), resume)
    });
    // The first rank's own error: a peer's "left the group" is only a consequence of it.
    let mut first_err: Option<EngineError> = None;
    let mut summary = None;
    for (rank, r) in results.into_iter().enumerate() {
        let e = match r {
            Ok(Ok(s)) => {
                if rank == 0 {
                    summary = Some(s);
                }
                continue;
            }
            Ok(Err(e)) => e,
            Err(panic) => EngineError::Internal(format!("rank {rank} panicked: {panic}")),
        };
        if first_err.as_ref().is_none_or(|f| is_peer_gone(f) && !is_peer_gone(&e)) {
            first_err = Some(e);
        }
    }
    match (first_err, summary) {
        (Some(e), _) => Err(e),
        (None, Some(s)) => Ok(s),
        (None, None) => Err(EngineError::Internal("rank 0 returned no summary".into())),
    }
}

/// The world size `mpirun` started this process in (Open MPI's `OMPI_COMM_WORLD_SIZE`, or the
/// PMI `PMI_SIZE` of other MPI launchers); `None` outside `mpirun`.
pub fn mpirun_world_size() -> Option<usize> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"].iter().find_map(|k| std::env::var(k).ok()?.parse().ok())
}

/// Trains this process's rank of a job started by `mpirun -n N` (the MPI backend): returns
/// the summary on rank 0 and `None` on the others. A recipe whose `topology.world_size` is not
/// `N` is refused with that key named.
#[cfg(feature = "mpi")]
pub fn run_mpi(
    loaded: &LoadedRecipe,
    features: &FeatureSchema,
    registry: &Registry,
    resume: Option<&std::path::Path>,
) -> Result<Option<RunSummary>, EngineError> {
    let pg = trainrec_comm::MpiGroup::init(COLLECTIVE_TIMEOUT)?;
    configure_threads(loaded.recipe.run.threads);
    let rank = pg.rank();
    let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
    let summary = build_and_run(loaded, features, registry, Some(pg), resume)?;
    Ok((rank == 0).then_some(summary))
}

fn is_peer_gone(e: &EngineError) -> bool {
    matches!(e, EngineError::Dist(trainrec_comm::DistError::PeerGone { .. }))
}
