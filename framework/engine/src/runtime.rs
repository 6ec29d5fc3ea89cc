//! The process around a job: thread pools, libtorch's seeded generator, and how long ranks
//! wait for each other.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::Duration;

/// The first stop signal received (0: none).
static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);
/// Whether [`install_stop_handlers`] ran (a library caller that did not install them pays no
/// per-step agreement across ranks).
static STOP_HANDLERS: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop_signal(signal: libc::c_int) {
    // Async-signal-safe: an atomic swap, and `_exit` on the second signal.
    if STOP_SIGNAL.swap(signal, Ordering::SeqCst) != 0 {
        // SAFETY: `_exit` may be called from a signal handler.
        unsafe { libc::_exit(128 + signal) };
    }
}

/// Makes SIGINT and SIGTERM stop a running job gracefully: the first finishes the current
/// step on every rank, saves a checkpoint and ends the run ([`crate::EngineError::Stopped`]);
/// a second exits at once with `128 + signal`.
pub fn install_stop_handlers() {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only touches an atomic and calls `_exit`.
        unsafe { libc::signal(signal, on_stop_signal as *const () as libc::sighandler_t) };
    }
    STOP_HANDLERS.store(true, Ordering::SeqCst);
}

/// The stop signal received, if any (only once [`install_stop_handlers`] ran).
pub fn stop_signal() -> Option<i32> {
    if !STOP_HANDLERS.load(Ordering::Relaxed) {
        return None;
    }
    match STOP_SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// Whether stop handlers are installed (then the ranks agree on a stop after every step).
pub(crate) fn stop_handlers_installed() -> bool {
    STOP_HANDLERS.load(Ordering::Relaxed)
}

/// How long a rank waits for the others in one collective before failing (thread backend).
pub const COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(300);

/// Sets libtorch's and the embedding kernels' thread counts.
pub fn configure_threads(threads: Option<usize>) -> usize {
    // `run.threads` out of range is a recipe error that validation reports; until then (this
    // runs before the recipe is checked), it must not reach libtorch, which aborts on it.
    let n = threads
        .filter(|n| (1..=trainrec_recipe::MAX_THREADS).contains(n))
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    tch::set_num_threads(n as i32);
    // libtorch accepts the inter-op pool size once per process, before any parallel work.
    static INTEROP: std::sync::Once = std::sync::Once::new();
    INTEROP.call_once(|| tch::set_num_interop_threads(1));
    // The global pool can be set once per process; later jobs in the same process reuse it.
    let _ = rayon::ThreadPoolBuilder::new().num_threads(n).build_global();
    n
}

/// Seeds libtorch's process-wide generator and runs `f` with no other job of this process
/// reseeding it meanwhile: a model built in one thread draws its initial weights from its own
/// seed even while jobs in other threads (ranks of a thread group, tests run in parallel)
/// reseed per step. Draws made later, during a step (dropout), are exact only when one job
/// runs in the process: the generator is shared.
pub fn with_torch_seed<T>(seed: i64, f: impl FnOnce() -> T) -> T {
    static TORCH_RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = TORCH_RNG.lock().unwrap_or_else(|p| p.into_inner());
    tch::manual_seed(seed);
    f()
}
