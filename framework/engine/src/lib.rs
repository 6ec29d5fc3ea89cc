//! Builds a training job from a recipe and runs it.
