//! trainrec: train large recommendation models from a TOML recipe.
