//! The run directory and what a run shows while it trains: `resolved.toml` and `plan.json`
//! written whole, the metric files (`metrics.jsonl`, `metrics.csv`, TensorBoard events),
//! where the training loop stands ([`Progress`], saved with every checkpoint), the progress
//! bar and the summary printed at the end.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use trainrec_metrics::sinks::{CsvSink, TensorBoardSink};

use crate::error::EngineError;

/// An OS advisory lock (`flock`) on a run directory's `.lock` file, held while a command writes
/// into the directory and released when dropped, or by the OS when the process ends however
/// it ends (so a killed run's lock never blocks the next one).
#[derive(Debug)]
pub struct RunDirLock {
    _file: File,
}

/// The refusal naming who holds run directory `dir`'s lock, as the holder wrote it into the
/// lock file.
fn held(dir: &Path, file: &mut File) -> EngineError {
    use std::io::Read;
    let mut holder = String::new();
    let _ = file.read_to_string(&mut holder);
    let holder = holder.trim();
    let holder = if holder.is_empty() { "another process".to_string() } else { holder.to_string() };
    EngineError::Locked { dir: dir.to_path_buf(), holder }
}

/// Locks run directory `dir` (made when missing) for `command`, or says who holds it: the
/// holder's process id, host, start time and command, which it wrote into the lock file.
pub fn lock_run_dir(dir: &Path, command: &str) -> Result<RunDirLock, EngineError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| EngineError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let path = dir.join(".lock");
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io(&path))?;
    match file.try_lock() {
        Ok(()) => {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_string())
                .or_else(|_| std::env::var("HOSTNAME"))
                .unwrap_or_else(|_| "an unknown host".into());
            let since = chrono::Utc::now().format("%Y-%m-%d %H:%M:%S UTC");
            let holder = format!("pid {} on {host} since {since} ({command})\n", std::process::id());
            file.set_len(0).map_err(io(&path))?;
            file.write_all(holder.as_bytes()).map_err(io(&path))?;
            file.flush().map_err(io(&path))?;
            Ok(RunDirLock { _file: file })
        }
        Err(std::fs::TryLockError::WouldBlock) => Err(held(dir, &mut file)),
        Err(std::fs::TryLockError::Error(e)) => Err(io(&path)(e)),
    }
}

/// Locks run directory `dir` for reading (`trainrec eval`, `export`, `predict`): a shared
/// `flock`, so readers run side by side but not while a run or a `--resume` writes there (its
/// holder is named, as [`lock_run_dir`] names it).
pub fn lock_run_dir_shared(dir: &Path) -> Result<RunDirLock, EngineError> {
    let path = dir.join(".lock");
    let io = |source| EngineError::Io { path: path.clone(), source };
    let mut file =
        std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(io)?;
    match file.try_lock_shared() {
        Ok(()) => Ok(RunDirLock { _file: file }),
        Err(std::fs::TryLockError::WouldBlock) => Err(held(dir, &mut file)),
        Err(std::fs::TryLockError::Error(e)) => Err(io(e)),
    }
}

/// What a finished run reports.
#[derive(Clone, Debug)]
pub struct RunSummary {
    /// Training steps taken.
    pub steps: u64,
    /// Training examples seen.
    pub samples: u64,
    /// Wall time of the training loop (evaluation included), seconds.
    pub train_seconds: f64,
    /// The last evaluation's metrics, by name.
    pub eval: BTreeMap<String, f64>,
    /// Mean train loss over the first `log_every` steps and over the last `log_every` steps.
    pub train_loss: (f64, f64),
    /// The run directory.
    pub output_dir: PathBuf,
}

/// Where the training loop stands: saved with every checkpoint and restored on resume. Floats
/// are kept as their bits (JSON has no NaN, and the values must come back exactly).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct Progress {
    /// Steps taken.
    pub step: u64,
    /// Examples seen (every rank's).
    pub samples: u64,
    /// The epoch in progress.
    pub epoch: u64,
    /// Batches this rank read in that epoch.
    pub in_epoch: u64,
    /// Ranks that read them.
    pub world_size: usize,
    /// The loss window: sum (bits) and steps.
    pub window_sum: u64,
    /// Steps in the loss window.
    pub window_count: u64,
    /// The first reported mean loss (bits).
    pub first_loss: Option<u64>,
    /// The last reported mean loss (bits).
    pub last_loss: u64,
    /// The last evaluation's values (bits).
    pub last_eval: Option<BTreeMap<String, u64>>,
}

impl Progress {
    pub(crate) fn window(&self) -> (f64, u64) {
        (f64::from_bits(self.window_sum), self.window_count)
    }
    pub(crate) fn set_window(&mut self, (sum, n): (f64, u64)) {
        (self.window_sum, self.window_count) = (sum.to_bits(), n);
    }
    pub(crate) fn last_eval(&self) -> Option<BTreeMap<String, f64>> {
        self.last_eval.as_ref().map(|m| m.iter().map(|(k, &v)| (k.clone(), f64::from_bits(v))).collect())
    }
    pub(crate) fn set_last_eval(&mut self, m: &BTreeMap<String, f64>) {
        self.last_eval = Some(m.iter().map(|(k, v)| (k.clone(), v.to_bits())).collect());
    }
    /// Counts a step that trained `examples` (every rank's) with loss `loss`.
    pub(crate) fn advance(&mut self, examples: usize, loss: f64) {
        self.step += 1;
        self.in_epoch += 1;
        self.samples += examples as u64;
        let (sum, n) = self.window();
        self.set_window((sum + loss, n + 1));
    }
    /// The mean loss of the window, which closes (it becomes the last reported loss, and the
    /// first when none was); `None` when the window is empty.
    pub(crate) fn close_window(&mut self) -> Option<f64> {
        let (sum, n) = self.window();
        if n == 0 {
            return None;
        }
        let mean = sum / n as f64;
        self.first_loss.get_or_insert(mean.to_bits());
        self.last_loss = mean.to_bits();
        self.set_window((0.0, 0));
        Some(mean)
    }
}

/// Writes `bytes` to `path` through a temporary file and a rename, so a reader never sees a
/// partial file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), EngineError> {
    write_atomic_with(path, |w| w.write_all(bytes).map_err(|e| EngineError::Io { path: path.to_path_buf(), source: e }))
}

/// [`write_atomic`] of what `write` writes, piece by piece (a file larger than memory): into
/// `<path>.tmp`, flushed to the disk, then renamed over `path`. On any error the temporary file
/// is removed and `path` is left as it was.
pub fn write_atomic_with(
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> Result<(), EngineError>,
) -> Result<(), EngineError> {
    let tmp = path.with_extension("tmp");
    let io = |e| EngineError::Io { path: path.to_path_buf(), source: e };
    let written = (|| -> Result<(), EngineError> {
        let mut out = BufWriter::with_capacity(1 << 20, File::create(&tmp).map_err(io)?);
        write(&mut out)?;
        let file = out.into_inner().map_err(|e| io(e.into_error()))?;
        file.sync_all().map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// `metrics.jsonl`: one JSON object per line, each line written whole and flushed, so the file
/// is valid JSONL at every moment (also when a run stops on an error).
/// The run directory's metric files: `metrics.jsonl`, `metrics.csv` and a TensorBoard event
/// file (`tensorboard --logdir runs/`).
pub(crate) struct MetricsLog {
    path: PathBuf,
    out: BufWriter<File>,
    csv: CsvSink,
    tb: TensorBoardSink,
    dir: PathBuf,
}

impl MetricsLog {
    /// Creates the files, or with `append` (a resumed run) appends to them.
    pub(crate) fn open(path: &Path, append: bool) -> Result<Self, EngineError> {
        let io = |p: &Path| {
            let p = p.to_path_buf();
            move |e| EngineError::Io { path: p, source: e }
        };
        let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        let file =
            if append { std::fs::OpenOptions::new().create(true).append(true).open(path) } else { File::create(path) }
                .map_err(io(path))?;
        let csv_path = dir.join("metrics.csv");
        let csv =
            if append { CsvSink::append(&csv_path) } else { CsvSink::create(&csv_path) }.map_err(io(&csv_path))?;
        let tb = TensorBoardSink::create(&dir).map_err(io(&dir))?;
        Ok(Self { path: path.to_path_buf(), out: BufWriter::new(file), csv, tb, dir })
    }

    pub(crate) fn write(&mut self, step: u64, split: &str, metrics: &BTreeMap<String, f64>) -> Result<(), EngineError> {
        let mut line = serde_json::json!({ "step": step, "split": split, "metrics": metrics }).to_string();
        line.push('\n');
        self.out
            .write_all(line.as_bytes())
            .and_then(|_| self.out.flush())
            .map_err(|e| EngineError::Io { path: self.path.clone(), source: e })?;
        let pairs = || metrics.iter().map(|(k, v)| (k.as_str(), *v));
        self.csv
            .write(step, split, pairs())
            .map_err(|e| EngineError::Io { path: self.dir.join("metrics.csv"), source: e })?;
        self.tb.write(step, split, pairs()).map_err(|e| EngineError::Io { path: self.dir.clone(), source: e })
    }

    pub(crate) fn finish(mut self) -> Result<(), EngineError> {
        self.out.flush().map_err(|e| EngineError::Io { path: self.path.clone(), source: e })
    }
}

/// Keeps the lines of a run's `metrics.jsonl` and `metrics.csv` up to `step` (the ones a
/// resumed run would write again), each file rewritten through a rename.
pub(crate) fn truncate_metrics(dir: &Path, step: u64) -> Result<(), EngineError> {
    let keep = |path: &Path, keep_line: &dyn Fn(&str) -> bool| -> Result<(), EngineError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(EngineError::Io { path: path.to_path_buf(), source: e }),
        };
        let kept: String = text.lines().filter(|l| keep_line(l)).flat_map(|l| [l, "\n"]).collect();
        write_atomic(path, kept.as_bytes())
    };
    keep(&dir.join("metrics.jsonl"), &|l| {
        serde_json::from_str::<serde_json::Value>(l)
            .ok()
            .and_then(|v| v.get("step").and_then(serde_json::Value::as_u64))
            .is_some_and(|s| s <= step)
    })?;
    keep(&dir.join("metrics.csv"), &|l| {
        l.starts_with("step,") || l.split(',').next().and_then(|s| s.parse::<u64>().ok()).is_some_and(|s| s <= step)
    })
}

/// The console table printed at the end of a run.
pub fn summary_table(s: &RunSummary) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "trained {} steps ({} samples) in {:.1} s · {:.0} samples/s · train loss {:.4} -> {:.4}\n",
        s.steps,
        s.samples,
        s.train_seconds,
        s.samples as f64 / s.train_seconds.max(1e-9),
        s.train_loss.0,
        s.train_loss.1
    ));
    out.push_str(&trainrec_metrics::render_table("eval", &s.eval));
    out.push_str(&format!("\nrun directory: {}", s.output_dir.display()));
    out
}

pub(crate) fn human(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1}k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

/// A spinner on stderr counting examples (`what`: what is being done), drawn only on a
/// terminal.
pub fn spinner(what: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new_spinner().with_style(
        ProgressStyle::with_template("{elapsed_precise} {spinner} {pos} examples · {per_sec} · {msg}")
            .expect("valid template"),
    );
    bar.set_message(what.to_string());
    bar.set_draw_target(indicatif::ProgressDrawTarget::stderr_with_hz(4));
    bar
}

pub(crate) fn progress_bar(steps: Option<u64>, enabled: bool) -> ProgressBar {
    if !enabled || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = match steps {
        Some(n) => ProgressBar::new(n).with_style(
            ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} steps · {msg}")
                .expect("valid template")
                .progress_chars("=> "),
        ),
        None => ProgressBar::new_spinner().with_style(
            ProgressStyle::with_template("{elapsed_precise} {spinner} {pos} steps · {msg}").expect("valid template"),
        ),
    };
    bar.set_draw_target(indicatif::ProgressDrawTarget::stderr_with_hz(4));
    bar
}

/// The run directory as a training run holds it: the lock (rank 0), `resolved.toml`,
/// `plan.json`, the metric files and the progress bar. Ranks other than 0 hold none of them
/// and write nothing.
pub(crate) struct RunDir {
    dir: PathBuf,
    lead: bool,
    _lock: Option<RunDirLock>,
    log: Option<MetricsLog>,
    bar: ProgressBar,
}

impl RunDir {
    /// Locks `dir` for a training run on rank 0 (`lead`). Collective across ranks (`sync`):
    /// every rank learns of a refusal, since the others would wait in the first collective
    /// otherwise.
    pub(crate) fn lock(
        dir: PathBuf,
        lead: bool,
        sync: Option<&crate::data_parallel::DataParallel>,
    ) -> Result<Self, EngineError> {
        let lock = if lead { Some(lock_run_dir(&dir, "trainrec run")) } else { None };
        let refused = lock.as_ref().is_some_and(|l| l.is_err());
        if let Some(sync) = sync
            && !sync.all_have(!refused)?
            && !refused
        {
            return Err(EngineError::Internal("rank 0 could not lock the run directory".into()));
        }
        let lock = lock.transpose()?;
        Ok(Self { dir, lead, _lock: lock, log: None, bar: ProgressBar::hidden() })
    }

    /// Writes `resolved.toml` and `plan.json` whole and opens the metric files: a run resumed
    /// after step `resumed_at` keeps their lines up to it and appends. Shows the progress bar
    /// (`steps` long, when known, at `step`) when `show`.
    pub(crate) fn open(
        &mut self,
        resolved_toml: &str,
        plan: &trainrec_planner::Plan,
        resumed_at: Option<u64>,
        steps: Option<u64>,
        show: bool,
    ) -> Result<(), EngineError> {
        if !self.lead {
            return Ok(());
        }
        let dir = &self.dir;
        std::fs::create_dir_all(dir).map_err(|e| EngineError::Io { path: dir.clone(), source: e })?;
        write_atomic(&dir.join("resolved.toml"), resolved_toml.as_bytes())?;
        let plan_path = dir.join("plan.json");
        trainrec_planner::save_plan(plan, &plan_path).map_err(|e| EngineError::Io { path: plan_path, source: e })?;
        if let Some(step) = resumed_at {
            truncate_metrics(dir, step)?;
        }
        self.log = Some(MetricsLog::open(&dir.join("metrics.jsonl"), resumed_at.is_some())?);
        self.bar = progress_bar(steps, show);
        if let Some(step) = resumed_at.filter(|&s| s > 0) {
            self.bar.set_position(step);
        }
        Ok(())
    }

    /// The directory.
    pub(crate) fn path(&self) -> &Path {
        &self.dir
    }

    /// Whether this rank writes the directory (rank 0).
    pub(crate) fn lead(&self) -> bool {
        self.lead
    }

    /// The progress bar (hidden off a terminal, on other ranks, or with `train.progress = false`).
    pub(crate) fn bar(&self) -> &ProgressBar {
        &self.bar
    }

    /// Writes a line to the metric files (rank 0; the others have none).
    pub(crate) fn write(&mut self, step: u64, split: &str, metrics: &BTreeMap<String, f64>) -> Result<(), EngineError> {
        match &mut self.log {
            Some(log) => log.write(step, split, metrics),
            None => Ok(()),
        }
    }

    /// Clears the progress bar and flushes the metric files; the lock goes with `self`.
    pub(crate) fn finish(self) -> Result<(), EngineError> {
        self.bar.finish_and_clear();
        match self.log {
            Some(log) => log.finish(),
            None => Ok(()),
        }
    }
}
