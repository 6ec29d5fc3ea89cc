//! Table-batched embedding storage, pooled lookups and fused sparse optimizers.
