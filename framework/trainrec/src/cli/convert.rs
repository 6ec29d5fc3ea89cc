//! `trainrec convert`: data between layouts.

use std::path::Path;

use super::args::CliError;

/// `trainrec convert criteo-binary`: a Criteo TSV file in TorchRec's binary layout.
pub(crate) fn criteo_binary(
    tsv: &Path,
    out_dir: &Path,
    prefix: &str,
    unlabeled: bool,
    skip_bad_rows: bool,
    workers: usize,
) -> Result<(), CliError> {
    let options = trainrec_data::criteo_binary::ConvertOptions {
        labeled: !unlabeled,
        on_bad_row: if skip_bad_rows { trainrec_data::BadRowPolicy::Skip } else { trainrec_data::BadRowPolicy::Fail },
        num_workers: workers,
    };
    let s = trainrec_data::criteo_binary::convert_tsv_with(tsv, out_dir, prefix, &options)
        .map_err(|e| CliError::Runtime(e.to_string()))?;
    println!(
        "wrote {} rows ({} skipped) to {}, {}, {}",
        s.rows,
        s.skipped,
        s.dense.display(),
        s.sparse.display(),
        s.labels.display()
    );
    Ok(())
}
