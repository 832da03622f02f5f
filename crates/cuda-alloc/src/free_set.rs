//! The ordered set of a pool's free blocks, keyed by `(size, address)`.
//!
//! Best fit needs "the first block at least this large" and ordered walks both ways. A pool usually
//! holds a handful of free blocks and the hot path inserts and removes one or two per call, so the
//! set is a sorted vector cut into chunks of at most [`CHUNK`] entries: lookups are two binary
//! searches, updates move at most one chunk's entries, and nothing is allocated unless a chunk
//! splits. (A `BTreeMap` costs several times more per update at these sizes.)

/// Most entries a chunk holds before it is split in two.
const CHUNK: usize = 128;

/// One free block: its key and its arena index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    size: u64,
    addr: u64,
    index: u32,
}

impl Entry {
    #[inline]
    fn key(&self) -> (u64, u64) {
        (self.size, self.addr)
    }
}

/// The first position in a sorted chunk whose key is at least `key`. Short chunks (the usual case)
/// are scanned, long ones searched.
#[inline]
fn lower_bound(chunk: &[Entry], key: (u64, u64)) -> usize {
    if chunk.len() <= 8 {
        chunk
            .iter()
            .position(|e| e.key() >= key)
            .unwrap_or(chunk.len())
    } else {
        chunk.partition_point(|e| e.key() < key)
    }
}

/// Free blocks sorted by `(size, address)`. Invariant: chunks are sorted, each chunk's keys are below
/// the next chunk's, and no chunk is empty unless it is the only one.
#[derive(Debug)]
pub(crate) struct FreeSet {
    chunks: Vec<Vec<Entry>>,
}

impl Default for FreeSet {
    fn default() -> Self {
        FreeSet {
            chunks: vec![Vec::with_capacity(8)],
        }
    }
}

impl FreeSet {
    /// The first position whose key is at least `key`: `(chunk, offset)`, or one past the end.
    #[inline(always)]
    fn locate(&self, key: (u64, u64)) -> (usize, usize) {
        if let [only] = self.chunks.as_slice() {
            return (0, lower_bound(only, key));
        }
        let chunk = self
            .chunks
            .partition_point(|c| c.last().is_some_and(|e| e.key() < key));
        match self.chunks.get(chunk) {
            Some(c) => (chunk, lower_bound(c, key)),
            None => (chunk, 0),
        }
    }

    /// The first block of at least `size` bytes (lowest address among equals): what best fit takes.
    #[inline]
    pub(crate) fn first_at_least(&self, size: u64) -> Option<(u64, u64, u32)> {
        let (chunk, at) = self.locate((size, 0));
        let e = match self.chunks.get(chunk)?.get(at) {
            Some(e) => e,
            // The position is one past a chunk's end: the next chunk starts with the answer.
            None => self.chunks.get(chunk + 1)?.first()?,
        };
        Some((e.size, e.addr, e.index))
    }

    #[inline]
    pub(crate) fn insert(&mut self, size: u64, addr: u64, index: u32) {
        let key = (size, addr);
        let (mut chunk, mut at) = self.locate(key);
        if chunk == self.chunks.len() {
            chunk -= 1;
            at = self.chunks[chunk].len();
        }
        let c = &mut self.chunks[chunk];
        debug_assert!(
            c.get(at).is_none_or(|e| e.key() != key),
            "block at {addr:#x} already free"
        );
        c.insert(at, Entry { size, addr, index });
        if c.len() > CHUNK {
            let mut upper = Vec::with_capacity(CHUNK + 1);
            upper.extend(c.drain(CHUNK / 2..));
            self.chunks.insert(chunk + 1, upper);
        }
    }

    #[inline]
    pub(crate) fn remove(&mut self, size: u64, addr: u64) -> Option<u32> {
        let (chunk, at) = self.locate((size, addr));
        let c = self.chunks.get_mut(chunk)?;
        if c.get(at)?.key() != (size, addr) {
            return None;
        }
        let entry = c.remove(at);
        if c.is_empty() && self.chunks.len() > 1 {
            self.chunks.remove(chunk);
        }
        Some(entry.index)
    }

    /// Gives the entry keyed `old` the key `new` and arena index `index` (a block that shrank, grew or
    /// moved). Updates in place when the order allows, which is the common case. Always inlined: as a
    /// call, half of its instructions were saving and restoring registers.
    #[inline(always)]
    pub(crate) fn rekey(&mut self, old: (u64, u64), new: (u64, u64), index: u32) {
        if let [only] = self.chunks.as_mut_slice() {
            let at = lower_bound(only, old);
            debug_assert_eq!(
                only.get(at).map(Entry::key),
                Some(old),
                "rekeyed block not in set"
            );
            let left_ok = at == 0 || only[at - 1].key() < new;
            let right_ok = at + 1 >= only.len() || new < only[at + 1].key();
            if left_ok && right_ok && at < only.len() {
                only[at] = Entry {
                    size: new.0,
                    addr: new.1,
                    index,
                };
                return;
            }
        }
        self.rekey_slow(old, new, index);
    }

    #[cold]
    #[inline(never)]
    fn rekey_slow(&mut self, old: (u64, u64), new: (u64, u64), index: u32) {
        let (chunk, at) = self.locate(old);
        let chunks = &self.chunks;
        let c = &chunks[chunk];
        debug_assert_eq!(
            c.get(at).map(Entry::key),
            Some(old),
            "rekeyed block not in the set"
        );
        let left = if at > 0 {
            Some(&c[at - 1])
        } else {
            chunks[..chunk].iter().rev().find_map(|c| c.last())
        };
        let right = if at + 1 < c.len() {
            Some(&c[at + 1])
        } else {
            chunks[chunk + 1..].iter().find_map(|c| c.first())
        };
        if left.is_none_or(|e| e.key() < new) && right.is_none_or(|e| new < e.key()) {
            self.chunks[chunk][at] = Entry {
                size: new.0,
                addr: new.1,
                index,
            };
        } else {
            self.remove(old.0, old.1);
            self.insert(new.0, new.1, index);
        }
    }

    /// Every entry from position `(chunk, at)` on.
    fn from(&self, chunk: usize, at: usize) -> impl Iterator<Item = (u64, u64, u32)> + '_ {
        self.chunks
            .get(chunk)
            .map_or(&[][..], |c| &c[at..])
            .iter()
            .chain(self.chunks.iter().skip(chunk + 1).flatten())
            .map(|e| (e.size, e.addr, e.index))
    }

    /// Every entry before position `(chunk, at)`, last first.
    fn before_position(
        &self,
        chunk: usize,
        at: usize,
    ) -> impl Iterator<Item = (u64, u64, u32)> + '_ {
        let head = self.chunks.get(chunk).map_or(&[][..], |c| &c[..at]);
        head.iter()
            .rev()
            .chain(
                self.chunks[..chunk.min(self.chunks.len())]
                    .iter()
                    .rev()
                    .flat_map(|c| c.iter().rev()),
            )
            .map(|e| (e.size, e.addr, e.index))
    }

    /// Blocks of at least `size` bytes, smallest (then lowest address) first.
    #[inline]
    pub(crate) fn at_least(&self, size: u64) -> impl Iterator<Item = (u64, u64, u32)> + '_ {
        let (chunk, at) = self.locate((size, 0));
        self.from(chunk, at)
    }

    /// Blocks ordered before `(size, addr)`, largest first.
    pub(crate) fn before(
        &self,
        size: u64,
        addr: u64,
    ) -> impl Iterator<Item = (u64, u64, u32)> + '_ {
        let (chunk, at) = self.locate((size, addr));
        self.before_position(chunk, at)
    }

    /// Blocks smaller than `size` bytes, largest (then highest address) first.
    pub(crate) fn below(&self, size: u64) -> impl Iterator<Item = (u64, u64, u32)> + '_ {
        self.before(size, 0)
    }

    /// Every block, in `(size, address)` order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64, u32)> + '_ {
        self.from(0, 0)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.chunks.iter().all(Vec::is_empty)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn behaves_like_an_ordered_map() {
        let mut set = FreeSet::default();
        let mut model = BTreeMap::new();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        // Fewer steps under miri (about a thousand times slower), still past one chunk.
        let steps = if cfg!(miri) { 2_000 } else { 20_000u32 };
        for step in 0..steps {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = ((x % 64) * 512, (x >> 32) % 512 * 4096);
            if x % 3 != 0 || model.is_empty() {
                if let std::collections::btree_map::Entry::Vacant(v) = model.entry(key) {
                    v.insert(step);
                    set.insert(key.0, key.1, step);
                }
            } else {
                let probe = *model.range(key..).next().or(model.iter().next()).unwrap().0;
                assert_eq!(set.remove(probe.0, probe.1), model.remove(&probe));
                assert_eq!(set.remove(probe.0, probe.1), None);
            }
            if step % 13 == 0 && !model.is_empty() {
                // Move an entry: shrink it and shift its address, as a split does.
                let (&old, &v) = model.iter().nth((x as usize >> 3) % model.len()).unwrap();
                let new = (old.0 / 2 * 2, old.1 + 512);
                if new == old || !model.contains_key(&new) {
                    model.remove(&old);
                    model.insert(new, v);
                    set.rekey(old, new, v);
                }
            }
            if step % 97 == 0 {
                let q = (x % 70) * 512;
                assert_eq!(
                    set.first_at_least(q).map(|(s, a, i)| ((s, a), i)),
                    model.range((q, 0)..).next().map(|(&k, &v)| (k, v))
                );
                let got: Vec<_> = set.at_least(q).map(|(s, a, i)| ((s, a), i)).collect();
                let want: Vec<_> = model.range((q, 0)..).map(|(&k, &v)| (k, v)).collect();
                assert_eq!(got, want);
                let got: Vec<_> = set.below(q).map(|(s, a, i)| ((s, a), i)).collect();
                let want: Vec<_> = model.range(..(q, 0)).rev().map(|(&k, &v)| (k, v)).collect();
                assert_eq!(got, want);
                assert_eq!(set.iter().count(), model.len());
            }
        }
        assert!(set.chunks.len() > 1, "the test grew past one chunk");
        while let Some((&k, _)) = model.iter().next() {
            model.remove(&k);
            set.remove(k.0, k.1).unwrap();
        }
        assert!(set.is_empty());
    }
}
