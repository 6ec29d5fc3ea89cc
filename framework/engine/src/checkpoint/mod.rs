//! Checkpoints: a directory `step-<N>` holding one safetensors file per rank and a JSON
//! manifest (`manifest.json`) that names every tensor, the file it is in and, for embedding
//! shards, the block of the table it holds.
//!
//! A save writes into a hidden `.step-<N>.partial` directory; rank 0 writes the manifest (with
//! each file's size and CRC-32C) last, then renames the directory. A directory without a
//! manifest is never taken for a checkpoint, and a file whose checksum differs is refused, so
//! a crash during a save leaves the previous checkpoint as the latest one.
//!
//! Shards are stored as they lie on their rank; loading assembles any block of a table from
//! the saved blocks that overlap it, so a checkpoint loads into another world size or plan
//! (see [`Checkpoint::assemble_shard`]).
//!
//! [`format`] is the format; `job` is what a [`crate::Job`] saves in it and how it resumes.

mod assemble;
mod format;
mod job;

pub use assemble::Block;
pub use format::{
    Checkpoint, CheckpointError, Contents, EVAL_KEYS, FORMAT, FileRecord, Header, MANIFEST, Manifest, RESUMABLE_KEYS,
    ShardRecord, TensorData, TensorRecord, VERSION, changed_keys, changed_keys_outside, latest, save, step_dir_name,
};
pub(crate) use format::{failpoint, failpoint_value};
