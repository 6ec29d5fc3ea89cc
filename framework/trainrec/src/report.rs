//! `trainrec report RUN_DIR`: PNG plots of every metric of a run over its steps.
//!
//! Reads the run's `metrics.jsonl` (one [`MetricReport`] per line) and draws one chart per
//! metric name into `RUN_DIR/plots/<metric>.png`, a line per split that reports it (`train` in
//! blue, `eval` in orange). Text is drawn with the embedded DejaVu Sans font, so no system
//! font is needed. Each file is written under a temporary name and renamed into place, so a
//! failure leaves no partial PNG; a malformed line is reported as `file:line` before anything
//! is drawn.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Once;

use plotters::prelude::*;
use plotters::style::FontStyle;
use trainrec_metrics::{MetricReport, Split};

/// What went wrong while rendering a report.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// The run directory or its `metrics.jsonl` cannot be read.
    #[error("cannot read {path}: {source} (expected a run directory written by `trainrec run`)")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A line of `metrics.jsonl` is not a metric report.
    #[error("{path}:{line}: not a metric report: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What the parser said.
        message: String,
    },
    /// `metrics.jsonl` holds no finite value to plot.
    #[error("{path} has no metric values to plot")]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// Drawing or writing a PNG failed.
    #[error("cannot write {path}: {message}")]
    Write {
        /// The PNG.
        path: PathBuf,
        /// Why.
        message: String,
    },
}

/// One metric's points per split, by step.
type Series = BTreeMap<Split, Vec<(u64, f64)>>;

/// Reads `metrics.jsonl` of `run_dir` into series by metric name (NaN values skipped).
pub fn read_series(run_dir: &Path) -> Result<BTreeMap<String, Series>, ReportError> {
    let path = run_dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path).map_err(|source| ReportError::Read { path: path.clone(), source })?;
    let mut out: BTreeMap<String, Series> = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let r: MetricReport = serde_json::from_str(line).map_err(|e| ReportError::Parse {
            path: path.clone(),
            line: i + 1,
            message: e.to_string(),
        })?;
        for (name, v) in r.metrics {
            if v.is_finite() {
                out.entry(name).or_default().entry(r.split).or_default().push((r.step, v));
            }
        }
    }
    if out.is_empty() {
        return Err(ReportError::Empty { path });
    }
    Ok(out)
}

/// Renders every metric of `run_dir` into `run_dir/plots/`; returns the PNGs written.
pub fn render(run_dir: &Path) -> Result<Vec<PathBuf>, ReportError> {
    let series = read_series(run_dir)?;
    let dir = run_dir.join("plots");
    std::fs::create_dir_all(&dir).map_err(|e| ReportError::Write { path: dir.clone(), message: e.to_string() })?;
    register_font();
    let mut written = Vec::new();
    for (name, s) in &series {
        let path = dir.join(format!("{}.png", file_stem(name)));
        let tmp = dir.join(format!(".{}.partial.png", file_stem(name)));
        let drawn = draw(&tmp, name, s).and_then(|()| std::fs::rename(&tmp, &path).map_err(|e| e.to_string()));
        if let Err(message) = drawn {
            let _ = std::fs::remove_file(&tmp);
            return Err(ReportError::Write { path, message });
        }
        written.push(path);
    }
    Ok(written)
}

/// A file name for a metric (`ne-click|window_ne` → `ne-click_window_ne`).
fn file_stem(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
}

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The embedded font is a valid TrueType file; a failure would show as missing text.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular());
    });
}

/// Train and eval line colours.
fn colour(split: Split) -> RGBColor {
    match split {
        Split::Train => RGBColor(31, 119, 180),
        Split::Eval => RGBColor(255, 127, 14),
    }
}

fn draw(path: &Path, name: &str, series: &Series) -> Result<(), String> {
    let points = series.values().flatten();
    let (mut x0, mut x1, mut y0, mut y1) = (u64::MAX, 0u64, f64::INFINITY, f64::NEG_INFINITY);
    for &(x, y) in points {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    // Give single points and flat lines some room.
    let pad = if y1 > y0 { (y1 - y0) * 0.05 } else { y0.abs().max(1.0) * 0.05 };
    let (y0, y1) = (y0 - pad, y1 + pad);
    let x1 = x1.max(x0 + 1);
    let root = BitMapBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let mut chart = ChartBuilder::on(&root)
        .caption(name, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(name)
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| e.to_string())?;
    for (&split, pts) in series {
        let c = colour(split);
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(split.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, c.filled()))).map_err(|e| e.to_string())?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_dir(name: &str, jsonl: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("trainrec-report-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("metrics.jsonl"), jsonl).unwrap();
        dir
    }

    #[test]
    fn series_by_metric_and_split() {
        let dir = run_dir(
            "series",
            "{\"step\":1,\"split\":\"train\",\"metrics\":{\"loss\":0.7}}\n\
             {\"step\":2,\"split\":\"train\",\"metrics\":{\"loss\":0.6,\"x\":null}}\n\
             {\"step\":2,\"split\":\"eval\",\"metrics\":{\"auc\":0.8,\"loss\":0.65}}\n",
        );
        let s = read_series(&dir).unwrap();
        assert_eq!(s.keys().collect::<Vec<_>>(), ["auc", "loss"]);
        assert_eq!(s["loss"][&Split::Train], vec![(1, 0.7), (2, 0.6)]);
        assert_eq!(s["loss"][&Split::Eval], vec![(2, 0.65)]);
        assert_eq!(s["auc"].len(), 1);
    }

    #[test]
    fn bad_inputs_name_file_and_line() {
        let missing = std::env::temp_dir().join("trainrec-report-no-such-run");
        let e = render(&missing).unwrap_err().to_string();
        assert!(e.contains("no-such-run/metrics.jsonl") && e.contains("run directory"), "{e}");
        let dir = run_dir("bad", "{\"step\":1,\"split\":\"train\",\"metrics\":{\"loss\":0.7}}\n{\"step\":\"x\"}\n");
        let e = render(&dir).unwrap_err().to_string();
        assert!(e.contains("metrics.jsonl:2:"), "{e}");
        assert!(!dir.join("plots").exists(), "nothing is drawn before every line parses");
        let empty = run_dir("empty", "{\"step\":1,\"split\":\"eval\",\"metrics\":{\"ne\":null}}\n");
        assert!(matches!(render(&empty), Err(ReportError::Empty { .. })));
    }

    #[test]
    fn renders_one_png_per_metric_with_both_splits_drawn() {
        let mut jsonl = String::new();
        for step in (10..=100).step_by(10) {
            let loss = 0.7 - step as f64 * 0.002;
            jsonl.push_str(&format!("{{\"step\":{step},\"split\":\"train\",\"metrics\":{{\"loss\":{loss}}}}}\n"));
            if step % 50 == 0 {
                let l = loss + 0.01;
                jsonl.push_str(&format!(
                    "{{\"step\":{step},\"split\":\"eval\",\"metrics\":{{\"loss\":{l},\"ne|x\":0.9}}}}\n"
                ));
            }
        }
        let dir = run_dir("render", &jsonl);
        let files = render(&dir).unwrap();
        let names: Vec<_> = files.iter().map(|f| f.file_name().unwrap().to_string_lossy().into_owned()).collect();
        assert_eq!(names, ["loss.png", "ne_x.png"]);
        let img = image::open(&files[0]).unwrap().to_rgb8();
        assert_eq!(img.dimensions(), (800, 500));
        let count = |c: RGBColor| img.pixels().filter(|p| p.0 == [c.0, c.1, c.2]).count();
        // Both lines are drawn (and their legend swatches), and dark text/axes exist.
        assert!(count(colour(Split::Train)) > 500, "train pixels: {}", count(colour(Split::Train)));
        assert!(count(colour(Split::Eval)) > 100, "eval pixels: {}", count(colour(Split::Eval)));
        assert!(img.pixels().filter(|p| p.0.iter().all(|&v| v < 60)).count() > 500, "no text or axes");
        // No temporary file is left behind.
        let left: Vec<_> = std::fs::read_dir(dir.join("plots")).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left.len(), 2, "{left:?}");
    }

    #[test]
    fn file_names_are_safe() {
        assert_eq!(file_stem("ne-click|window_ne"), "ne-click_window_ne");
        assert_eq!(file_stem("../etc"), "___etc");
    }
}
