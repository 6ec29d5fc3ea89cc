//! Blocks of rows: TorchRec's even split of `0..n` into `parts` blocks, which the planner's
//! row-wise estimates, the row-wise tiling and the managed-collision partitions share.

use std::ops::Range;

/// Block `i` of `0..n` cut into `parts` blocks of `ceil(n / parts)` (at least 1): the last
/// blocks smaller, maybe empty (TorchRec's row-wise block sizes).
pub fn even_block(n: u64, parts: u64, i: u64) -> Range<u64> {
    let b = n.div_ceil(parts.max(1)).max(1);
    (i * b).min(n)..((i + 1) * b).min(n)
}

#[cfg(test)]
mod tests {
    use super::even_block;

    #[test]
    fn blocks_are_ceil_sized_and_tile_the_range() {
        assert_eq!((0..3).map(|i| even_block(10, 3, i)).collect::<Vec<_>>(), [0..4, 4..8, 8..10]);
        // More parts than rows: one row each, then empty blocks.
        assert_eq!((0..4).map(|i| even_block(2, 4, i)).collect::<Vec<_>>(), [0..1, 1..2, 2..2, 2..2]);
        assert_eq!(even_block(0, 2, 0), 0..0);
    }
}
