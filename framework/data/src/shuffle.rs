//! Shuffling of a training epoch (`data.shuffle`), for any sampler: [`shuffled`] wraps a
//! [`BatchStream`], takes its batches apart into rows and batches the rows again, reordered,
//! into batches of the same size (the last of the epoch may be smaller).
//!
//! - [`ShuffleKind::None`]: the stream as it is.
//! - [`ShuffleKind::Buffer`]: the classic bounded shuffle buffer. The first `rows` rows fill
//!   it; then each row read replaces a row drawn uniformly from the buffer, which goes out;
//!   at the end of the stream the buffer drains in random order. A row goes out at most
//!   `rows - 1` positions before the position it was read at (a buffer of 1 keeps the order).
//! - [`ShuffleKind::Full`]: the whole epoch is read, then goes out in a uniform random
//!   permutation (Fisher-Yates).
//!
//! Every row read goes out exactly once. The order is a function of the input stream and the
//! seed [`shuffle_seed`] makes of the run's seed, the epoch and the rank, so a rank that reads
//! the same stream again (a resumed run skipping the batches it had trained) reads the same
//! batches. The permutation is within the stream, which for the built-in samplers is this
//! rank's share of the rows: ranks stay disjoint.
//!
//! Memory: `buffer` holds the batches its buffered rows belong to, by reference (rows are not
//! copied as they are read); when those batches hold more than twice the buffer (plus a batch),
//! the buffered rows are copied into one batch of their own, so it holds at most about
//! `2 × rows + 2 × batch_size` rows, and copies each row at most once more on average. `full`
//! holds the rank's whole epoch.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use trainrec_sparse::KeyedJaggedTensor;
pub use trainrec_types::{Shuffle, ShuffleKind};

use crate::{Batch, BatchStream, DataError, hash_words};

/// The seed of one rank's shuffle of one epoch.
pub fn shuffle_seed(run_seed: u64, epoch: u64, rank: usize) -> u64 {
    // "SHUFFLE" in ASCII: this seed differs from the samplers' own uses of the run seed.
    hash_words(&[run_seed, 0x0053_4855_4646_4C45, epoch, rank as u64])
}

/// `stream` reordered as `shuffle` says, in batches of `batch_size` rows, drawn from `seed`
/// (see [`shuffle_seed`]). `none` returns the stream itself.
pub fn shuffled(stream: BatchStream, shuffle: &Shuffle, batch_size: usize, seed: u64) -> BatchStream {
    let batch_size = batch_size.max(1);
    let rng = StdRng::seed_from_u64(seed);
    match shuffle.kind {
        ShuffleKind::None => stream,
        ShuffleKind::Buffer => {
            let capacity = shuffle.rows.unwrap_or(1).clamp(1, trainrec_types::shuffle::MAX_BUFFER_ROWS) as usize;
            Box::new(BufferShuffle {
                input: Some(stream),
                pool: Pool::default(),
                buffer: Vec::new(),
                incoming: None,
                capacity,
                batch_size,
                rng,
            })
        }
        ShuffleKind::Full => {
            Box::new(FullShuffle { input: Some(stream), pool: Pool::default(), order: Vec::new(), rng, batch_size })
        }
    }
}

/// A row of a pooled batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RowRef {
    slot: u32,
    row: u32,
}

/// The input batches whose rows have not all gone out, each with a count of its rows still
/// referenced; a slot is freed when its count reaches 0.
#[derive(Default)]
struct Pool {
    batches: Vec<Option<Batch>>,
    live: Vec<usize>,
    free: Vec<u32>,
    /// Rows of the batches held.
    held_rows: usize,
}

impl Pool {
    /// Holds `batch` (a variable-batch KJT expanded to one bag per example); its slot.
    fn insert(&mut self, mut batch: Batch) -> Result<u32, DataError> {
        if batch.sparse.variable_stride_per_key() {
            batch.sparse = batch.sparse.full_batch()?.into_owned();
        }
        self.held_rows += batch.batch_size;
        let live = batch.batch_size;
        Ok(match self.free.pop() {
            Some(slot) => {
                self.batches[slot as usize] = Some(batch);
                self.live[slot as usize] = live;
                slot
            }
            None => {
                self.batches.push(Some(batch));
                self.live.push(live);
                (self.batches.len() - 1) as u32
            }
        })
    }

    /// Forgets `rows` (gone out), freeing the batches none of whose rows remain.
    fn release(&mut self, rows: &[RowRef]) {
        for r in rows {
            let s = r.slot as usize;
            self.live[s] -= 1;
            if self.live[s] == 0 {
                self.free_slot(r.slot);
            }
        }
    }

    fn free_slot(&mut self, slot: u32) {
        if let Some(b) = self.batches[slot as usize].take() {
            self.held_rows -= b.batch_size;
            self.free.push(slot);
        }
    }

    /// A batch of `rows`, in that order.
    fn gather(&self, rows: &[RowRef]) -> Result<Batch, DataError> {
        gather_rows(&self.batches, rows)
    }
}

/// The rows `rows` of the pooled `batches` as one batch, in that order: dense features, labels,
/// groups, and every key's bags (with their weights when weighted), in the first batch's key
/// order. Batches that disagree (keys, widths, weights or groups present in some only) are an
/// error naming what differs.
fn gather_rows(batches: &[Option<Batch>], rows: &[RowRef]) -> Result<Batch, DataError> {
    let inconsistent =
        |what: String| DataError::config("", format!("the sampler's batches cannot be shuffled together: {what}"));
    let get = |r: &RowRef| batches[r.slot as usize].as_ref().expect("a referenced slot holds its batch");
    let first = get(rows.first().ok_or_else(|| inconsistent("no rows to gather".into()))?);
    let num_dense = first.num_dense;
    let num_labels = first.labels.len() / first.batch_size.max(1);
    let keys = first.sparse.keys().to_vec();
    let weighted = first.sparse.weights().is_some();
    let grouped = first.groups.is_some();
    let sample_weighted = first.weights.is_some();
    // Each distinct batch is checked once (rows of one batch tend to be neighbours).
    let mut checked = u32::MAX;
    for r in rows {
        if r.slot == checked {
            continue;
        }
        checked = r.slot;
        let b = get(r);
        if b.num_dense != num_dense || b.labels.len() != num_labels * b.batch_size {
            return Err(inconsistent(format!(
                "a batch has {} dense features and {} labels per example, another {num_dense} and {num_labels}",
                b.num_dense,
                b.labels.len() / b.batch_size.max(1)
            )));
        }
        if b.sparse.stride() != b.batch_size || b.sparse.variable_stride_per_key() {
            return Err(inconsistent(format!(
                "a batch of {} examples has {} bags per key",
                b.batch_size,
                b.sparse.stride()
            )));
        }
        if b.sparse.keys() != keys.as_slice() {
            return Err(inconsistent(format!("a batch has keys {:?}, another {keys:?}", b.sparse.keys())));
        }
        if b.sparse.weights().is_some() != weighted
            || b.groups.is_some() != grouped
            || b.weights.is_some() != sample_weighted
        {
            return Err(inconsistent("some batches have weighted ids, groups or sample weights and others not".into()));
        }
        if b.weights.as_ref().is_some_and(|w| w.len() != b.batch_size) {
            return Err(inconsistent(format!(
                "a batch of {} examples has a different number of sample weights",
                b.batch_size
            )));
        }
    }
    let n = rows.len();
    let mut dense = Vec::with_capacity(n * num_dense);
    let mut labels = Vec::with_capacity(n * num_labels);
    let mut groups = grouped.then(|| Vec::with_capacity(n));
    let mut sample_weights = sample_weighted.then(|| Vec::with_capacity(n));
    for r in rows {
        let (b, i) = (get(r), r.row as usize);
        dense.extend_from_slice(&b.dense[i * num_dense..(i + 1) * num_dense]);
        labels.extend_from_slice(&b.labels[i * num_labels..(i + 1) * num_labels]);
        if let (Some(out), Some(g)) = (&mut groups, &b.groups) {
            out.push(g[i]);
        }
        if let (Some(out), Some(w)) = (&mut sample_weights, &b.weights) {
            out.push(w[i]);
        }
    }
    let mut lengths = Vec::with_capacity(n * keys.len());
    let mut values = Vec::new();
    let mut weights = weighted.then(Vec::new);
    for k in 0..keys.len() {
        for r in rows {
            // Pooled KJTs have one bag per example (see `Pool::insert`): key k's bag of row i
            // is bag `k × batch_size + i`.
            let b = get(r);
            let bag = k * b.batch_size + r.row as usize;
            let (start, end) = (b.sparse.offsets()[bag], b.sparse.offsets()[bag + 1]);
            lengths.push((end - start) as u32);
            values.extend_from_slice(&b.sparse.values()[start..end]);
            if let (Some(out), Some(w)) = (&mut weights, b.sparse.weights()) {
                out.extend_from_slice(&w[start..end]);
            }
        }
    }
    let sparse = KeyedJaggedTensor::new(keys, values, weights, lengths, n)?;
    Ok(Batch { dense, num_dense, sparse, labels, batch_size: n, groups, weights: sample_weights })
}

/// The next batch of `input` with rows, `None` at its end; the input is dropped at its end or
/// after an error.
fn next_input(input: &mut Option<BatchStream>) -> Option<Result<Batch, DataError>> {
    loop {
        match input.as_mut()?.next() {
            Some(Ok(b)) if b.batch_size == 0 => continue,
            Some(Ok(b)) => return Some(Ok(b)),
            Some(Err(e)) => {
                *input = None;
                return Some(Err(e));
            }
            None => {
                *input = None;
                return None;
            }
        }
    }
}

/// [`ShuffleKind::Buffer`].
struct BufferShuffle {
    input: Option<BatchStream>,
    pool: Pool,
    /// The buffered rows.
    buffer: Vec<RowRef>,
    /// The batch being read: its slot, the next row, its rows.
    incoming: Option<(u32, u32, u32)>,
    capacity: usize,
    batch_size: usize,
    rng: StdRng,
}

impl BufferShuffle {
    /// The next row read, `None` at the end of the input.
    fn read(&mut self) -> Result<Option<RowRef>, DataError> {
        loop {
            if let Some((slot, row, n)) = &mut self.incoming {
                if *row < *n {
                    *row += 1;
                    return Ok(Some(RowRef { slot: *slot, row: *row - 1 }));
                }
                self.incoming = None;
            }
            match next_input(&mut self.input) {
                None => return Ok(None),
                Some(b) => {
                    let b = b?;
                    let n = u32::try_from(b.batch_size).map_err(|_| {
                        DataError::config("", format!("a batch of {} rows is too large to shuffle", b.batch_size))
                    })?;
                    let slot = self.pool.insert(b)?;
                    self.incoming = Some((slot, 0, n));
                }
            }
        }
    }

    /// Copies the buffered rows into one batch of their own when the batches they point into
    /// hold more than twice as many rows (plus a batch), so memory stays bounded however the
    /// rows drawn are spread over the batches read.
    fn compact(&mut self) -> Result<(), DataError> {
        if self.buffer.is_empty() || self.pool.held_rows <= 2 * self.capacity + self.batch_size {
            return Ok(());
        }
        let copy = self.pool.gather(&self.buffer)?;
        let incoming = self.incoming.map(|(slot, _, _)| slot);
        for slot in 0..self.pool.batches.len() as u32 {
            if Some(slot) != incoming {
                self.pool.free_slot(slot);
            }
        }
        let rows = self.buffer.len();
        let slot = self.pool.insert(copy)?;
        for (i, r) in self.buffer.iter_mut().enumerate() {
            *r = RowRef { slot, row: i as u32 };
        }
        debug_assert_eq!(self.pool.live[slot as usize], rows);
        if let Some((s, row, n)) = self.incoming {
            self.pool.live[s as usize] = (n - row) as usize;
            if n == row {
                self.pool.free_slot(s);
                self.incoming = None;
            }
        }
        Ok(())
    }

    fn next_batch(&mut self) -> Result<Option<Batch>, DataError> {
        let mut out = Vec::with_capacity(self.batch_size);
        while out.len() < self.batch_size {
            match self.read()? {
                Some(r) if self.buffer.len() < self.capacity => self.buffer.push(r),
                Some(r) => {
                    let j = self.rng.random_range(0..self.buffer.len());
                    out.push(std::mem::replace(&mut self.buffer[j], r));
                }
                None if self.buffer.is_empty() => break,
                None => {
                    let j = self.rng.random_range(0..self.buffer.len());
                    out.push(self.buffer.swap_remove(j));
                }
            }
        }
        if out.is_empty() {
            return Ok(None);
        }
        let batch = self.pool.gather(&out)?;
        self.pool.release(&out);
        self.compact()?;
        Ok(Some(batch))
    }
}

impl Iterator for BufferShuffle {
    type Item = Result<Batch, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        match self.next_batch() {
            Ok(b) => b.map(Ok),
            Err(e) => {
                // An error ends the epoch.
                self.input = None;
                self.buffer.clear();
                self.incoming = None;
                Some(Err(e))
            }
        }
    }
}

/// [`ShuffleKind::Full`].
struct FullShuffle {
    /// The input, until it is read (on the first call).
    input: Option<BatchStream>,
    pool: Pool,
    /// The rows still to go out; each batch is cut from the end.
    order: Vec<RowRef>,
    rng: StdRng,
    batch_size: usize,
}

impl FullShuffle {
    fn read_all(&mut self) -> Result<(), DataError> {
        while let Some(b) = next_input(&mut self.input) {
            let b = b?;
            let n = u32::try_from(b.batch_size).map_err(|_| {
                DataError::config("", format!("a batch of {} rows is too large to shuffle", b.batch_size))
            })?;
            let slot = self.pool.insert(b)?;
            self.order.extend((0..n).map(|row| RowRef { slot, row }));
        }
        self.order.shuffle(&mut self.rng);
        tracing::debug!(rows = self.order.len(), "epoch read for a full shuffle");
        Ok(())
    }
}

impl Iterator for FullShuffle {
    type Item = Result<Batch, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.input.is_some() {
            if let Err(e) = self.read_all() {
                self.input = None;
                self.order.clear();
                return Some(Err(e));
            }
        }
        if self.order.is_empty() {
            return None;
        }
        // From the end: the permutation's tail is as uniform as its head, and cheap to cut.
        let rows = self.order.split_off(self.order.len().saturating_sub(self.batch_size));
        let batch = self.pool.gather(&rows);
        self.pool.release(&rows);
        Some(batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Row `id`: dense `[id, -id]`, labels `[id % 2, id]`, group `id / 3`, key `a` one id
    /// `10 id`, key `b` `id % 4` ids `id, id + 1, ...` weighted `id / 1000 + j`.
    fn row_batch(ids: &[u32], weighted: bool, grouped: bool) -> Batch {
        let n = ids.len();
        let dense = ids.iter().flat_map(|&i| [i as f32, -(i as f32)]).collect();
        let labels = ids.iter().flat_map(|&i| [(i % 2) as f32, i as f32]).collect();
        let mut lengths = Vec::new();
        let mut values = Vec::new();
        let mut weights = Vec::new();
        for &i in ids {
            lengths.push(1);
            values.push(10 * i as i64);
            weights.push(0.5);
        }
        for &i in ids {
            lengths.push(i % 4);
            for j in 0..i % 4 {
                values.push((i + j) as i64);
                weights.push(i as f32 / 1000.0 + j as f32);
            }
        }
        let sparse =
            KeyedJaggedTensor::new(vec!["a".into(), "b".into()], values, weighted.then_some(weights), lengths, n)
                .unwrap();
        Batch {
            dense,
            num_dense: 2,
            sparse,
            labels,
            batch_size: n,
            groups: grouped.then(|| ids.iter().map(|&i| (i / 3) as i64).collect()),
            // Sample weights that name the row, so a row's weight travels with it.
            weights: weighted.then(|| ids.iter().map(|&i| i as f32 * 0.25).collect()),
        }
    }

    /// Rows `0..n` in batches of `batch_size` (the last smaller).
    fn stream(n: u32, batch_size: u32, weighted: bool, grouped: bool) -> BatchStream {
        let ids: Vec<u32> = (0..n).collect();
        let batches: Vec<_> = ids.chunks(batch_size as usize).map(|c| Ok(row_batch(c, weighted, grouped))).collect();
        Box::new(batches.into_iter())
    }

    /// The ids of the rows of `batches`, each row checked equal to the row of that id.
    fn ids_of(batches: &[Batch], weighted: bool, grouped: bool) -> Vec<u32> {
        let mut out = Vec::new();
        for b in batches {
            let ids: Vec<u32> = (0..b.batch_size).map(|i| b.dense[2 * i] as u32).collect();
            assert_eq!(b, &row_batch(&ids, weighted, grouped), "rows gathered whole");
            out.extend(ids);
        }
        out
    }

    fn run(n: u32, batch_size: u32, shuffle: Shuffle, seed: u64, weighted: bool, grouped: bool) -> Vec<Batch> {
        shuffled(stream(n, batch_size, weighted, grouped), &shuffle, batch_size as usize, seed)
            .collect::<Result<Vec<_>, _>>()
            .unwrap()
    }

    fn order(n: u32, shuffle: Shuffle, seed: u64) -> Vec<u32> {
        ids_of(&run(n, 16, shuffle, seed, false, false), false, false)
    }

    #[test]
    fn every_row_goes_out_exactly_once_in_full_batches() {
        for shuffle in
            [Shuffle::buffer(1), Shuffle::buffer(7), Shuffle::buffer(100), Shuffle::buffer(5000), Shuffle::FULL]
        {
            for (weighted, grouped) in [(false, false), (true, true)] {
                let batches = run(1003, 64, shuffle, 42, weighted, grouped);
                let sizes: Vec<usize> = batches.iter().map(|b| b.batch_size).collect();
                assert_eq!(sizes.len(), 16, "{shuffle}");
                assert!(sizes[..15].iter().all(|&s| s == 64) && sizes[15] == 1003 - 15 * 64, "{shuffle}: {sizes:?}");
                let mut ids = ids_of(&batches, weighted, grouped);
                ids.sort_unstable();
                assert_eq!(ids, (0..1003).collect::<Vec<_>>(), "{shuffle}");
            }
        }
    }

    #[test]
    fn the_order_is_a_function_of_seed_epoch_and_rank() {
        for shuffle in [Shuffle::buffer(50), Shuffle::FULL] {
            let base = order(500, shuffle, shuffle_seed(7, 0, 0));
            assert_eq!(order(500, shuffle, shuffle_seed(7, 0, 0)), base, "{shuffle}: same (seed, epoch, rank)");
            for other in [shuffle_seed(7, 1, 0), shuffle_seed(7, 0, 1), shuffle_seed(8, 0, 0)] {
                assert_ne!(order(500, shuffle, other), base, "{shuffle}");
            }
        }
    }

    #[test]
    fn none_and_a_buffer_of_one_keep_the_order() {
        assert_eq!(order(300, Shuffle::NONE, 1), (0..300).collect::<Vec<_>>());
        assert_eq!(order(300, Shuffle::buffer(1), 1), (0..300).collect::<Vec<_>>());
    }

    /// The row read at position `i` goes out at a position `>= i - (rows - 1)`: when it goes
    /// out, it was in a buffer of `rows` rows filled before the row that takes its place was
    /// read. The bound is reached, and rows also go out far later than they were read.
    #[test]
    fn a_buffer_row_goes_out_at_most_rows_minus_one_positions_early() {
        for rows in [2u32, 10, 100] {
            let out = order(2000, Shuffle::buffer(rows as u64), 3);
            let earliest = out.iter().enumerate().map(|(pos, &id)| pos as i64 - id as i64).min().unwrap();
            assert_eq!(earliest, -(rows as i64 - 1), "buffer of {rows}");
            let latest = out.iter().enumerate().map(|(pos, &id)| pos as i64 - id as i64).max().unwrap();
            assert!(latest > 2 * rows as i64, "buffer of {rows}: latest {latest}");
        }
    }

    #[test]
    fn a_full_shuffle_moves_nearly_every_row_far() {
        let out = order(1000, Shuffle::FULL, shuffle_seed(0, 0, 0));
        let fixed = out.iter().enumerate().filter(|&(pos, &id)| pos as u32 == id).count();
        // A uniform permutation has one fixed point on average.
        assert!(fixed <= 5, "{fixed} rows stayed");
        // Rows of the first batch land all over the epoch.
        let first: Vec<usize> = out.iter().enumerate().filter(|&(_, &id)| id < 16).map(|(pos, _)| pos).collect();
        assert!(first.iter().any(|&p| p > 500), "{first:?}");
        // A uniform permutation moves a row n / 3 on average; a buffer of 100 rows about 100.
        let mean_move = |out: &[u32]| {
            out.iter().enumerate().map(|(pos, &id)| (pos as f64 - id as f64).abs()).sum::<f64>() / out.len() as f64
        };
        assert!(mean_move(&out) > 280.0, "{}", mean_move(&out));
        let buffered = mean_move(&order(1000, Shuffle::buffer(100), 0));
        assert!((50.0..150.0).contains(&buffered), "{buffered}");
    }

    #[test]
    fn a_buffer_holds_a_bounded_number_of_rows() {
        let (capacity, batch_size) = (300usize, 64usize);
        let mut s = BufferShuffle {
            input: Some(stream(20_000, batch_size as u32, true, false)),
            pool: Pool::default(),
            buffer: Vec::new(),
            incoming: None,
            capacity,
            batch_size,
            rng: StdRng::seed_from_u64(9),
        };
        let mut batches = Vec::new();
        let mut most = 0;
        while let Some(b) = s.next() {
            batches.push(b.unwrap());
            most = most.max(s.pool.held_rows);
            assert_eq!(s.pool.held_rows, s.pool.batches.iter().flatten().map(|b| b.batch_size).sum::<usize>());
        }
        assert!(most <= 2 * capacity + 2 * batch_size, "held {most} rows");
        assert_eq!(s.pool.held_rows, 0, "every batch freed at the end");
        let mut ids = ids_of(&batches, true, false);
        ids.sort_unstable();
        assert_eq!(ids, (0..20_000).collect::<Vec<_>>());
    }

    #[test]
    fn an_input_error_ends_the_epoch() {
        for shuffle in [Shuffle::buffer(10), Shuffle::FULL] {
            let items: Vec<Result<Batch, DataError>> =
                vec![Ok(row_batch(&[0, 1, 2], false, false)), Err(DataError::Reader("boom".into()))];
            let mut s = shuffled(Box::new(items.into_iter()), &shuffle, 2, 0);
            let first_err = s.by_ref().find_map(|b| b.err()).expect("the error comes out");
            assert!(first_err.to_string().contains("boom"));
            assert!(s.next().is_none(), "{shuffle}");
        }
    }

    #[test]
    fn batches_that_disagree_are_an_error() {
        let items: Vec<Result<Batch, DataError>> =
            vec![Ok(row_batch(&[0, 1], false, false)), Ok(row_batch(&[2, 3], true, false))];
        let e = shuffled(Box::new(items.into_iter()), &Shuffle::FULL, 4, 0).find_map(|b| b.err()).unwrap();
        assert!(e.to_string().contains("weighted"), "{e}");
    }
}
