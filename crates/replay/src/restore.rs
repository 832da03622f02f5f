//! Checkpoint restores of CUDA graph trees, read back from a trace.
//!
//! Inductor's CUDA graph trees (`torch.compile(mode="reduce-overhead")`) record a graph into a
//! private pool, checkpoint the pool right after (`getCheckpointState`), and before recording a
//! graph that follows an earlier one on a new path, return the pool to that graph's checkpoint
//! (`setCheckpointPoolState`): replaying graphs allocates nothing, so only the checkpoint knows
//! which blocks the replayed graphs' outputs occupy.
//!
//! Neither call leaves an event of its own. A restore shows as ordinary events, back to back under
//! the allocator's lock: the blocks the pool had allocated are freed (ordinary frees), then, for
//! each checkpointed segment, one `alloc` per block of the checkpoint, in address order and of
//! exactly the block's size, from the segment's first byte to its last, followed by
//! `free_requested` / `free_completed` of every block that was free in the checkpoint. Replayed as
//! requests, those blocks would go where best fit puts them, which need not be there: a
//! checkpointed block can be of a size another pool class serves (a 1.9 MiB block of a 2 MiB small
//! segment).
//!
//! So the replay finds such runs ([`find`]) and restores the pool through the allocator's
//! checkpoint API. The checkpoint is not in the trace either: it was the pool's state after some
//! recording, which the replay went through earlier. Every earlier moment at which the blocks the
//! trace shows live in the restored segments are the checkpoint's live blocks is a candidate
//! ([`Restore::candidates`]); the replay checkpoints the pool at the latest few and restores the
//! latest one that agrees with the run (the same segments, the same live blocks).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use tensormem_cuda_alloc::snapshot::{TraceAction, TraceEntry};

/// Candidate checkpoint moments kept per restore (the latest ones).
pub(crate) const MAX_CANDIDATES: usize = 8;

/// Block sizes are whole multiples of this (PyTorch's `kMinBlockSize`).
const BLOCK_ALIGNMENT: u64 = 512;

/// One restore of a private pool to a checkpoint, as the trace shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Restore {
    /// The event of its first `alloc`.
    pub(crate) start: usize,
    /// One past its last event.
    pub(crate) end: usize,
    /// The checkpointed segments (start address, size), in the order the restore cuts them.
    pub(crate) segments: Vec<(u64, u64)>,
    /// The blocks allocated in the checkpoint (address, size), in address order.
    pub(crate) live: Vec<(u64, u64)>,
    /// The addresses of the blocks free in the checkpoint, in the order the restore frees them.
    pub(crate) free: Vec<u64>,
    /// Events after which the recorded pool may have been in the checkpointed state, in order.
    pub(crate) candidates: Vec<usize>,
}

/// One checkpointed segment cut again: its blocks and those freed right after.
struct Cut {
    head: u64,
    size: u64,
    blocks: Vec<(u64, u64)>,
    freed: Vec<u64>,
}

/// The recorded segments live at one point of the trace: start address -> (size, the event that
/// made it or last grew it). A segment is what a `segment_alloc` made, or a stretch of an
/// expandable segment mapped without a gap (PyTorch's checkpoints cut the mapped blocks).
#[derive(Default)]
struct Segments(BTreeMap<u64, (u64, usize)>);

impl Segments {
    fn get(&self, head: u64) -> Option<(u64, usize)> {
        self.0.get(&head).copied()
    }

    /// Follows the segment event `e` at `t`; returns the segment it made or grew.
    fn apply(&mut self, e: &TraceEntry, t: usize) -> Option<u64> {
        match e.action {
            TraceAction::SegmentAlloc => {
                self.0.insert(e.addr, (e.size, t));
                Some(e.addr)
            }
            TraceAction::SegmentFree => {
                self.0.remove(&e.addr);
                None
            }
            TraceAction::SegmentMap => {
                let below = self
                    .0
                    .range(..e.addr)
                    .next_back()
                    .filter(|(head, (size, _))| *head + *size == e.addr)
                    .map(|(&head, &(size, _))| (head, size));
                let (head, size) = below.unwrap_or((e.addr, 0));
                self.0.insert(head, (size + e.size, t));
                Some(head)
            }
            TraceAction::SegmentUnmap => {
                let (head, (size, made)) = self
                    .0
                    .range(..=e.addr)
                    .next_back()
                    .filter(|(head, (size, _))| e.addr < *head + *size)
                    .map(|(&head, &entry)| (head, entry))?;
                self.0.remove(&head);
                if e.addr > head {
                    self.0.insert(head, (e.addr - head, made));
                }
                let end = e.addr + e.size;
                if end < head + size {
                    self.0.insert(end, (head + size - end, made));
                }
                None
            }
            _ => None,
        }
    }
}

/// The restores of `trace`, in order, each with its candidate checkpoint moments.
pub(crate) fn find(trace: &[TraceEntry]) -> Vec<Restore> {
    let mut restores = Vec::new();
    let mut segments = Segments::default();
    let mut i = 0;
    while i < trace.len() {
        let e = &trace[i];
        if e.action == TraceAction::Alloc {
            if let Some(restore) = restore_at(trace, i, &segments) {
                i = restore.end;
                restores.push(restore);
                continue;
            }
        } else {
            segments.apply(e, i);
        }
        i += 1;
    }
    candidates(trace, &mut restores);
    restores
}

/// The restore starting with the `alloc` at `i`, if the events there are one.
fn restore_at(trace: &[TraceEntry], i: usize, segments: &Segments) -> Option<Restore> {
    let stream = trace[i].stream;
    let mut cuts: Vec<Cut> = Vec::new();
    let mut at = i;
    while let Some((cut, next)) = cut_at(trace, at, stream, segments) {
        if cuts.iter().any(|c| c.head == cut.head) {
            break;
        }
        cuts.push(cut);
        at = next;
    }
    // A run of whole-segment allocations nobody freed is what any program does; a segment cut
    // into several blocks, or blocks freed the moment they were made, is the restore's signature.
    if !cuts
        .iter()
        .any(|c| c.blocks.len() > 1 || !c.freed.is_empty())
    {
        return None;
    }
    let mut live: Vec<(u64, u64)> = cuts
        .iter()
        .flat_map(|c| c.blocks.iter().filter(|b| !c.freed.contains(&b.0)).copied())
        .collect();
    live.sort_unstable();
    Some(Restore {
        start: i,
        end: at,
        segments: cuts.iter().map(|c| (c.head, c.size)).collect(),
        live,
        free: cuts.iter().flat_map(|c| c.freed.iter().copied()).collect(),
        candidates: Vec::new(),
    })
}

/// One checkpointed segment cut again, starting with the `alloc` at `i`: allocations on `stream`
/// tiling a live segment that was made before (not by this allocation), then frees of some of
/// them in address order. Returns the cut and the event after it.
fn cut_at(
    trace: &[TraceEntry],
    i: usize,
    stream: u64,
    segments: &Segments,
) -> Option<(Cut, usize)> {
    let first = trace.get(i)?;
    if first.action != TraceAction::Alloc || first.stream != stream {
        return None;
    }
    let (size, made) = segments.get(first.addr)?;
    if made + 1 == i {
        return None;
    }
    let (head, end) = (first.addr, first.addr + size);
    let mut blocks = Vec::new();
    let mut at = head;
    let mut j = i;
    while at < end {
        let e = trace.get(j)?;
        let fits = e.action == TraceAction::Alloc
            && e.stream == stream
            && e.addr == at
            && e.size > 0
            && e.size.is_multiple_of(BLOCK_ALIGNMENT)
            && e.size <= end - at;
        if !fits {
            return None;
        }
        blocks.push((at, e.size));
        at += e.size;
        j += 1;
    }
    let mut freed: Vec<u64> = Vec::new();
    while let (Some(requested), Some(completed)) = (trace.get(j), trace.get(j + 1)) {
        let next = requested.action == TraceAction::FreeRequested
            && completed.action == TraceAction::FreeCompleted
            && completed.addr == requested.addr
            && blocks.iter().any(|b| b.0 == requested.addr)
            && freed.last().is_none_or(|&last| last < requested.addr);
        if !next {
            break;
        }
        freed.push(requested.addr);
        j += 2;
    }
    Some((
        Cut {
            head,
            size,
            blocks,
            freed,
        },
        j,
    ))
}

/// What one restore's candidate search tracks while the trace is read.
struct Search {
    /// The checkpoint's live blocks: address -> size.
    live: HashMap<u64, u64>,
    /// Recorded allocations live in the restored segments that are not checkpointed blocks.
    strangers: usize,
    /// Checkpointed blocks holding a recorded allocation that fits them.
    held: usize,
    /// The first event of the current stretch in the checkpointed state, if in one.
    since: Option<usize>,
}

impl Search {
    fn in_state(&self) -> bool {
        self.strangers == 0 && self.held == self.live.len()
    }

    /// Counts a recorded allocation of `size` bytes at `addr` in (`add`) or out.
    fn count(&mut self, addr: u64, size: u64, add: bool) {
        let fits = self.live.get(&addr).is_some_and(|&block| size <= block);
        let counter = if fits {
            &mut self.held
        } else {
            &mut self.strangers
        };
        if add {
            *counter += 1;
        } else {
            *counter = counter.saturating_sub(1);
        }
    }

    /// Ends the current stretch before event `t`: its last event is a candidate.
    fn close(&mut self, t: usize, found: &mut Vec<usize>) {
        if let Some(since) = self.since.take() {
            if t > since {
                found.push(t - 1);
            }
        }
    }
}

/// Fills every restore's [`Restore::candidates`]: the last event of each stretch of the trace
/// during which the recorded allocations live in its segments were exactly its checkpoint's live
/// blocks, from the moment all its segments exist to its start; the latest [`MAX_CANDIDATES`]. A
/// stretch also ends where any segment is made (the checkpoint holds every segment the pool had,
/// and the pool may have gained that one).
fn candidates(trace: &[TraceEntry], restores: &mut [Restore]) {
    if restores.is_empty() {
        return;
    }
    let mut searches: Vec<Search> = restores
        .iter()
        .map(|r| Search {
            live: r.live.iter().copied().collect(),
            strangers: 0,
            held: 0,
            since: None,
        })
        .collect();
    // Restored segment -> the restores that cut it, by start address.
    let mut by_segment: BTreeMap<u64, (u64, Vec<usize>)> = BTreeMap::new();
    for (id, r) in restores.iter().enumerate() {
        for &(head, size) in &r.segments {
            let entry = by_segment.entry(head).or_insert((head + size, Vec::new()));
            entry.0 = entry.0.max(head + size);
            entry.1.push(id);
        }
    }
    let mut allocations: HashMap<u64, u64> = HashMap::new();
    let mut segments = Segments::default();
    let mut found: Vec<Vec<usize>> = vec![Vec::new(); restores.len()];
    let mut open: BTreeSet<usize> = BTreeSet::new();
    // Restores before `next` have started.
    let mut next = 0usize;
    for (t, e) in trace.iter().enumerate() {
        while next < restores.len() && restores[next].start <= t {
            searches[next].close(t, &mut found[next]);
            open.remove(&next);
            next += 1;
        }
        let (addr, size, add) = match e.action {
            TraceAction::SegmentAlloc
            | TraceAction::SegmentFree
            | TraceAction::SegmentMap
            | TraceAction::SegmentUnmap => {
                if segments.apply(e, t).is_some() {
                    for &id in &open {
                        searches[id].close(t, &mut found[id]);
                        searches[id].since = Some(t);
                    }
                }
                continue;
            }
            TraceAction::Alloc => {
                allocations.insert(e.addr, e.size);
                (e.addr, e.size, true)
            }
            TraceAction::FreeRequested => match allocations.remove(&e.addr) {
                Some(size) => (e.addr, size, false),
                None => continue,
            },
            _ => continue,
        };
        let Some((_, (end, ids))) = by_segment.range(..=addr).next_back() else {
            continue;
        };
        if addr >= *end {
            continue;
        }
        for &id in ids.iter().filter(|&&id| id >= next) {
            let search = &mut searches[id];
            search.count(addr, size, add);
            let ready = restores[id]
                .segments
                .iter()
                .map(|&(head, _)| segments.get(head).map(|(_, m)| m + 1))
                .try_fold(0usize, |acc, m| m.map(|m| acc.max(m)))
                .is_some_and(|ready| ready <= t);
            let now = ready && search.in_state();
            if search.since.is_some() && !now {
                search.close(t, &mut found[id]);
                open.remove(&id);
            } else if search.since.is_none() && now {
                search.since = Some(t);
                open.insert(id);
            }
        }
    }
    for (id, restore) in restores.iter_mut().enumerate() {
        let list = &mut found[id];
        list.sort_unstable();
        list.dedup();
        let skip = list.len().saturating_sub(MAX_CANDIDATES);
        restore.candidates = list.split_off(skip);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(action: TraceAction, addr: u64, size: u64) -> TraceEntry {
        TraceEntry {
            action,
            addr,
            size,
            stream: 7,
            ..TraceEntry::default()
        }
    }

    #[test]
    fn a_restore_is_found_with_the_moment_its_checkpoint_was_taken() {
        use TraceAction::*;
        let small = 0x1000_0000;
        let large = 0x2000_0000;
        let trace = [
            entry(SegmentAlloc, small, 2 << 20),
            entry(Alloc, small, 131_072),
            entry(SegmentAlloc, large, 32 << 20),
            entry(Alloc, large, 32 << 20),
            entry(FreeRequested, large, 32 << 20),
            entry(FreeCompleted, large, 32 << 20),
            // 6: the checkpoint's state (only the first block live) ends here.
            entry(FreeRequested, small, 131_072),
            entry(FreeCompleted, small, 131_072),
            // 8: the restore.
            entry(Alloc, small, 131_072),
            entry(Alloc, small + 131_072, (2 << 20) - 131_072),
            entry(FreeRequested, small + 131_072, (2 << 20) - 131_072),
            entry(FreeCompleted, small + 131_072, (2 << 20) - 131_072),
            entry(Alloc, large, 32 << 20),
            entry(FreeRequested, large, 32 << 20),
            entry(FreeCompleted, large, 32 << 20),
            // 15: the capture that follows.
            entry(Alloc, small + 131_072, 4096),
        ];
        let restores = find(&trace);
        assert_eq!(
            restores,
            vec![Restore {
                start: 8,
                end: 15,
                segments: vec![(small, 2 << 20), (large, 32 << 20)],
                live: vec![(small, 131_072)],
                free: vec![small + 131_072, large],
                candidates: vec![5],
            }]
        );
    }

    #[test]
    fn whole_segment_allocations_are_not_restores() {
        use TraceAction::*;
        let trace = [
            entry(SegmentAlloc, 0x1000_0000, 32 << 20),
            entry(Alloc, 0x1000_0000, 32 << 20),
            entry(FreeRequested, 0x1000_0000, 32 << 20),
            entry(FreeCompleted, 0x1000_0000, 32 << 20),
            entry(Alloc, 0x1000_0000, 32 << 20),
            entry(Alloc, 0x3000_0000, 4096),
        ];
        // The segment is reused by one whole allocation that stays live: nothing says restore.
        assert!(find(&trace).is_empty());
    }
}
