//! [`SegmentTable`]: which segment of a batch each piece of shared memory lies in, for the two
//! producers of batches (a [`BatchBuilder`](super::BatchBuilder)'s allocations, a weights
//! publication's tensors): one segment per base allocation, and one per run of contiguous chunks
//! of expandable segments, so that the consumer opens each piece of memory once and maps each run
//! in one range.

use std::collections::HashMap;

use super::model::BatchSegment;
use crate::chunks::ChunkHandle;
use crate::driver::MemHandle;

/// Memory of the producer, added to a [`SegmentTable`].
#[derive(Debug)]
enum Piece {
    /// A base allocation at this address.
    Allocation(u64),
    /// Chunks mapped one after another from this address (the index of the run).
    Run(usize),
}

/// Chunks mapped one after another in the producer from `base`.
#[derive(Debug)]
struct Run {
    base: u64,
    chunks: ChunkHandle,
}

/// Where a piece of memory lies: its segment, and the producer's address the segment starts at
/// (views' offsets count from there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Placement {
    pub(crate) segment: u32,
    pub(crate) base: u64,
}

/// Collects the memory under a batch's views, then [`finish`](Self::finish)es into segments.
#[derive(Debug, Default)]
pub(crate) struct SegmentTable {
    pieces: Vec<Piece>,
    /// Base allocations by address: size and memory handle.
    allocations: HashMap<u64, (u64, MemHandle)>,
    runs: Vec<Run>,
}

impl SegmentTable {
    /// Adds the base allocation at `base` (`size` bytes, named by `mem_handle`); returns the
    /// piece's number for [`finish`](Self::finish)'s placements.
    pub(crate) fn add_allocation(&mut self, base: u64, size: u64, mem_handle: MemHandle) -> usize {
        self.allocations.entry(base).or_insert((size, mem_handle));
        self.pieces.push(Piece::Allocation(base));
        self.pieces.len() - 1
    }

    /// Adds `chunks`, mapped one after another from `base` in the producer; returns the piece's
    /// number.
    pub(crate) fn add_chunks(&mut self, base: u64, chunks: ChunkHandle) -> usize {
        self.runs.push(Run { base, chunks });
        self.pieces.push(Piece::Run(self.runs.len() - 1));
        self.pieces.len() - 1
    }

    /// The segments, in the order their memory was first added, and each piece's placement, in
    /// the order the pieces were added.
    ///
    /// Runs of chunks that overlap or touch (one producer, one chunk size, chunk boundaries that
    /// line up, the same descriptor wherever they overlap) are one segment: the consumer maps it
    /// in one range, so views in it keep their distances, and copies between them can be merged.
    /// Runs apart are segments of their own.
    pub(crate) fn finish(self) -> (Vec<BatchSegment>, Vec<Placement>) {
        let merged = merge_runs(&self.runs);
        let mut segments = Vec::new();
        let mut allocation_segment: HashMap<u64, u32> = HashMap::new();
        let mut group_segment: HashMap<usize, u32> = HashMap::new();
        let mut placements = Vec::with_capacity(self.pieces.len());
        for piece in &self.pieces {
            let placement = match *piece {
                Piece::Allocation(base) => {
                    let segment = *allocation_segment.entry(base).or_insert_with(|| {
                        let (size, handle) = self.allocations[&base];
                        segments.push(BatchSegment::allocation(handle, size));
                        (segments.len() - 1) as u32
                    });
                    Placement { segment, base }
                }
                Piece::Run(run) => {
                    let group = merged.of_run[run];
                    let (base, chunks) = &merged.groups[group];
                    let segment = *group_segment.entry(group).or_insert_with(|| {
                        segments.push(BatchSegment::chunks(chunks.clone()));
                        (segments.len() - 1) as u32
                    });
                    Placement {
                        segment,
                        base: *base,
                    }
                }
            };
            placements.push(placement);
        }
        (segments, placements)
    }
}

/// Runs merged where they continue one another: the merged runs (start and chunks), and which
/// merged run each run went into.
struct Merged {
    groups: Vec<(u64, ChunkHandle)>,
    of_run: Vec<usize>,
}

fn merge_runs(runs: &[Run]) -> Merged {
    let mut order: Vec<usize> = (0..runs.len()).collect();
    order.sort_unstable_by_key(|&i| (runs[i].chunks.pid, runs[i].chunks.chunk_size, runs[i].base));
    let mut groups: Vec<(u64, ChunkHandle)> = Vec::new();
    let mut of_run = vec![0; runs.len()];
    for i in order {
        let run = &runs[i];
        if let Some((start, into)) = groups.last_mut() {
            if continues(*start, into, run) {
                let size = into.chunk_size;
                let at = ((run.base - *start) / size) as usize;
                let have = into.fds.len();
                into.fds
                    .extend_from_slice(run.chunks.fds.get(have - at..).unwrap_or_default());
                of_run[i] = groups.len() - 1;
                continue;
            }
        }
        groups.push((run.base, run.chunks.clone()));
        of_run[i] = groups.len() - 1;
    }
    Merged { groups, of_run }
}

/// Whether `run` continues the merged run `into` (starting at `start`): same producer and chunk
/// size, starting on one of its chunk boundaries at or before its end, and naming the same
/// descriptors where the two overlap.
fn continues(start: u64, into: &ChunkHandle, run: &Run) -> bool {
    let size = into.chunk_size;
    if run.chunks.pid != into.pid || run.chunks.chunk_size != size || size == 0 {
        return false;
    }
    let Some(offset) = run.base.checked_sub(start) else {
        return false;
    };
    if offset % size != 0 || offset > into.extent() {
        return false;
    }
    let at = (offset / size) as usize;
    into.fds[at..]
        .iter()
        .zip(&run.chunks.fds)
        .all(|(a, b)| a == b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handle::SegmentMemory;

    const MIB: u64 = 1 << 20;

    fn chunks(fds: &[i32]) -> ChunkHandle {
        ChunkHandle {
            pid: 7,
            chunk_size: 20 * MIB,
            fds: fds.to_vec(),
        }
    }

    #[test]
    fn allocations_once_each_and_touching_runs_as_one_segment() {
        let mut table = SegmentTable::default();
        let base = 1 << 40;
        let a = table.add_chunks(base + 20 * MIB, chunks(&[11, 12])); // chunks 1, 2
        let alloc = table.add_allocation(0x1000, 4096, MemHandle([1; 64]));
        let b = table.add_chunks(base, chunks(&[10, 11])); // chunks 0, 1: overlaps a
        let c = table.add_chunks(base + 60 * MIB, chunks(&[13])); // chunk 3: touches
        let apart = table.add_chunks(base + 100 * MIB, chunks(&[15])); // chunk 5: a gap
        let again = table.add_allocation(0x1000, 4096, MemHandle([1; 64]));
        let (segments, placed) = table.finish();
        assert_eq!(segments.len(), 3, "{segments:?}");
        assert_eq!(placed[a], Placement { segment: 0, base });
        assert_eq!(placed[b], placed[a]);
        assert_eq!(placed[c], placed[a]);
        assert_eq!(
            placed[alloc],
            Placement {
                segment: 1,
                base: 0x1000
            }
        );
        assert_eq!(placed[again], placed[alloc]);
        assert_eq!(
            placed[apart],
            Placement {
                segment: 2,
                base: base + 100 * MIB
            }
        );
        assert_eq!(
            segments[0].memory,
            SegmentMemory::Chunks(chunks(&[10, 11, 12, 13]))
        );
        assert_eq!(segments[0].size, 80 * MIB);
    }

    #[test]
    fn runs_that_do_not_line_up_stay_apart() {
        let base = 1 << 40;
        let other_size = ChunkHandle {
            chunk_size: 2 * MIB,
            ..chunks(&[20])
        };
        let other_pid = ChunkHandle {
            pid: 8,
            ..chunks(&[21])
        };
        for (first, second, second_base) in [
            (chunks(&[10]), other_size, base + 20 * MIB),
            (chunks(&[10]), other_pid, base + 20 * MIB),
            // Overlapping, but another descriptor for the shared chunk.
            (chunks(&[10, 11]), chunks(&[12, 13]), base + 20 * MIB),
            // Not on a chunk boundary.
            (chunks(&[10]), chunks(&[14]), base + 10 * MIB),
        ] {
            let mut table = SegmentTable::default();
            let a = table.add_chunks(base, first);
            let b = table.add_chunks(second_base, second);
            let (segments, placed) = table.finish();
            assert_eq!(segments.len(), 2, "{segments:?}");
            assert_ne!(placed[a].segment, placed[b].segment);
        }
    }
}
