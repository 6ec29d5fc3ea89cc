//! The column-mapping keys the `parquet` and `csv` configs share: their checks, the schema they
//! produce and their resolution against a file's columns. Each config keeps the keys as fields
//! of its own (serde's `deny_unknown_fields` does not support a `#[serde(flatten)]` struct: an
//! unknown key's error would lose the expected keys and its place in the file).

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::{DataError, FeatureSchema, stream};

/// One label column or several (one per task of a multi-task job).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum LabelColumns {
    /// A single label column.
    One(String),
    /// Several label columns, in `Batch::labels` order.
    Many(Vec<String>),
}

impl LabelColumns {
    /// The column names.
    pub fn names(&self) -> Vec<String> {
        match self {
            LabelColumns::One(c) => vec![c.clone()],
            LabelColumns::Many(c) => c.clone(),
        }
    }
}

/// What a column is used for (decides the types a Parquet column may have).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// A dense feature or a label: one number per row.
    Numeric,
    /// A sparse feature or the group: ids.
    Ids,
}

/// The shared column-mapping keys of a config.
pub(crate) struct ColumnKeys<'a> {
    pub eval_paths: &'a [String],
    pub eval_fraction: Option<f64>,
    pub dense: &'a [String],
    pub dense_default: f32,
    pub sparse: &'a BTreeMap<String, String>,
    pub label: &'a LabelColumns,
    pub group: Option<&'a str>,
    pub weight: Option<&'a str>,
}

/// The [`ColumnKeys`] of a config with fields of those names.
macro_rules! column_keys {
    ($config:expr) => {
        $crate::columns::ColumnKeys {
            eval_paths: &$config.eval_paths,
            eval_fraction: $config.eval_fraction,
            dense: &$config.dense,
            dense_default: $config.dense_default,
            sparse: &$config.sparse,
            label: &$config.label,
            group: $config.group.as_deref(),
            weight: $config.weight.as_deref(),
        }
    };
}
pub(crate) use column_keys;

/// Where one file's mapped columns are: indexes of its columns (fields, leaves).
pub(crate) struct ColumnIndexes {
    pub dense: Vec<usize>,
    pub sparse: Vec<usize>,
    pub labels: Vec<usize>,
    pub group: Option<usize>,
    pub weight: Option<usize>,
}

impl ColumnKeys<'_> {
    /// The features the mapping produces.
    pub fn feature_schema(&self) -> FeatureSchema {
        FeatureSchema {
            num_dense: self.dense.len(),
            sparse: self.sparse.keys().cloned().collect(),
            labels: self.label.names(),
            grouping_key: self.group.map(str::to_owned),
        }
    }

    /// Checks the keys no file is needed for: the label column names and the hash-split
    /// fraction ([`stream::eval_fraction`]).
    pub fn check(&self) -> Result<(Vec<String>, Option<f64>), DataError> {
        let label_names = self.label.names();
        if label_names.is_empty() {
            return Err(DataError::config("label", "name at least one label column"));
        }
        let eval_fraction = stream::eval_fraction(self.eval_fraction, !self.eval_paths.is_empty(), "eval_paths")?;
        if self.weight.is_some_and(str::is_empty) {
            return Err(DataError::config("weight", "weight must name a column"));
        }
        if !self.dense_default.is_finite() {
            return Err(DataError::config("dense_default", "dense_default must be a finite number"));
        }
        Ok((label_names, eval_fraction))
    }

    /// Resolves the mapped columns with `column(name, role, key)`, `key` naming the config key
    /// of the column (`dense[0]`, `sparse.user`, `label`, ...), in key order.
    pub fn resolve(
        &self,
        column: impl Fn(&str, Role, String) -> Result<usize, DataError>,
    ) -> Result<ColumnIndexes, DataError> {
        let dense = self
            .dense
            .iter()
            .enumerate()
            .map(|(i, c)| column(c, Role::Numeric, format!("dense[{i}]")))
            .collect::<Result<_, _>>()?;
        let sparse =
            self.sparse.iter().map(|(f, c)| column(c, Role::Ids, format!("sparse.{f}"))).collect::<Result<_, _>>()?;
        let label_key = |i: usize| {
            if matches!(self.label, LabelColumns::One(_)) { "label".to_string() } else { format!("label[{i}]") }
        };
        let labels = self
            .label
            .names()
            .iter()
            .enumerate()
            .map(|(i, c)| column(c, Role::Numeric, label_key(i)))
            .collect::<Result<_, _>>()?;
        let group = self.group.map(|g| column(g, Role::Ids, "group".into())).transpose()?;
        let weight = self.weight.map(|w| column(w, Role::Numeric, "weight".into())).transpose()?;
        Ok(ColumnIndexes { dense, sparse, labels, group, weight })
    }
}
