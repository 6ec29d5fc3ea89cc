//! trainrec's benchmarks, apart from the product: each times one part of trainrec on the
//! workload of the TorchRec / FBGEMM script it is compared with, side by side in one run (the
//! scripts in `scripts/`), and prints one JSON line. The `trainrec` command runs them as
//! `trainrec bench <which>` ([`cli::BenchCommand`]).
//!
//! | workload | module | compared with |
//! | --- | --- | --- |
//! | W1: pooled embedding train step | [`embedding`] (CPU), [`cuda`] (GPU) | FBGEMM's CPU TBE |
//! | W2: DLRM train step and inference | [`dlrm`], [`pipeline`] (across ranks) | TorchRec's DMP |
//! | W3: sharding planner | [`planner`] | TorchRec's planner |
//! | W4: NE + AUC | [`metrics`] | torchrec.metrics |
//! | readers | [`data`] | — |
//! | sharded step | [`sharding`] | the raw all-to-all of the same bytes |

pub mod cli;
pub mod cuda;
pub mod data;
pub mod dlrm;
pub mod embedding;
pub mod metrics;
pub mod pipeline;
pub mod planner;
pub mod sharding;
pub mod stats;

pub use cli::{BenchCommand, device_check_command, run};
