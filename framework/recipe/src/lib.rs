//! The TOML recipe: schema, loading with extends and overrides, validation with file:line diagnostics.
