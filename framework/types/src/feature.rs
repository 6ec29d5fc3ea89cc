//! How a table names the input features it reads.

/// A sparse feature name as written in a table: `C1`, or `C1@t_big` when the feature feeds
/// several tables.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FeatureRef<'a> {
    /// The input feature (the sampler's key).
    pub input: &'a str,
    /// The table named after `@`, if any.
    pub table: Option<&'a str>,
}

impl<'a> FeatureRef<'a> {
    /// Splits `feature@table`.
    pub fn parse(text: &'a str) -> Self {
        match text.split_once('@') {
            Some((input, table)) => Self { input, table: Some(table) },
            None => Self { input: text, table: None },
        }
    }
}
