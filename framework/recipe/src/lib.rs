//! The TOML recipe: a typed schema with a doc comment on every key, loading with `extends`,
//! `TRAINREC_*` environment and `--set` overrides (merged by figment), and validation that
//! reports every problem with its key path and the file and line it came from.
//!
//! Three visible steps: [`load`] (raw files → merged value → structurally checked, typed
//! [`Recipe`]), [`check_semantics`] (cross-section rules), then the engine builds runtime
//! objects from the typed recipe.

pub mod load;
pub mod plan;
pub mod reference;
pub mod schema;
pub mod validate;
pub mod walk;

pub use load::{ENV_PREFIX, LoadOptions, LoadedRecipe, load, load_valid};
pub use schema::*;
pub use trainrec_types::FeatureRef;
pub use trainrec_types::{Diagnostic, Diagnostics, KeyPath, Origin, Segment, did_you_mean, suggest};
pub use validate::{check_plugin_section, check_semantics};
