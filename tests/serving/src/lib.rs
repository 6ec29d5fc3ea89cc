//! Nothing here: the crate is its test (`tests/loader.rs`), which reads trainrec's TorchScript
//! files through libtorch alone.
