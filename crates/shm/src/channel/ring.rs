//! One single-producer / single-consumer ring of fixed-size slots, and the doorbell protocol
//! that lets either side sleep. Pure memory operations on a [`RingControl`] and its slots (which
//! live in the shared mapping, or on the heap in the loom models); no system call except the
//! futex wait and wake.
//!
//! # Indices
//!
//! `head` counts the messages the producer has published, `tail` those the consumer has taken;
//! both are free-running `u32`s (they wrap), the slot of message `n` is `n % slots` (`slots` a
//! power of two, so wrapping keeps the mapping continuous). Each side keeps its own index locally
//! and only ever *reads* the peer's, so a peer that scribbles on the shared words cannot move
//! this side's index: it can only present a peer index this side checks before use
//! (`0 <= head - tail <= slots`, never backwards), or a slot length above the maximum. Either
//! is [`Corrupt`].
//!
//! # Sleeping (the doorbell)
//!
//! A side that finds nothing to do (consumer: ring empty; producer: ring full) announces that it
//! sleeps by storing `SLEEPING` in its doorbell word (`rx_sleep` / `tx_sleep`), then, after a
//! `SeqCst` fence, looks at the ring once more, and only then `futex`-waits on the word while it
//! still reads `SLEEPING`. The other side, after publishing (storing `head` or `tail`), issues a
//! `SeqCst` fence and reads the word: only when it reads `SLEEPING` does it clear it and make
//! the `futex` wake call. The two fences order "announce, look" against "publish, look": at
//! least one side sees the other's store, so either the sleeper sees the message or the
//! publisher sees the announcement (Dekker's pattern); a wake that comes before the wait finds
//! the word cleared and the wait returns at once. A side that is awake or spinning never makes
//! its peer enter the kernel.

use std::time::{Duration, Instant};

#[cfg(not(loom))]
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

#[cfg(loom)]
use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

use super::futex::{FutexWord, Wake};

/// Bytes of one slot: an 8-byte word (message length and flags) and the message.
pub(crate) const SLOT_BYTES: usize = 512;
/// 8-byte words per slot.
pub(crate) const SLOT_WORDS: usize = SLOT_BYTES / 8;
/// Longest message a slot holds.
pub(crate) const MAX_MESSAGE: usize = SLOT_BYTES - 8;

/// Doorbell values.
pub(crate) const AWAKE: u32 = 0;
pub(crate) const SLEEPING: u32 = 1;

/// Flag bit of a slot's first word: an fd travels on the socket with this message.
pub(crate) const SLOT_FD: u64 = 1 << 32;

/// A value on its own cache line, so the producer's and the consumer's words do not share one.
#[repr(C, align(64))]
pub(crate) struct Line<T>(pub(crate) T);

/// The control words of one ring (in shared memory: 256 bytes, `repr(C)`).
#[repr(C)]
pub(crate) struct RingControl {
    /// Messages published (written by the producer only).
    pub(crate) head: Line<AtomicU32>,
    /// Messages taken (written by the consumer only).
    pub(crate) tail: Line<AtomicU32>,
    /// The consumer sleeps (or is about to) waiting for a message.
    pub(crate) rx_sleep: Line<FutexWord>,
    /// The producer sleeps (or is about to) waiting for a free slot.
    pub(crate) tx_sleep: Line<FutexWord>,
}

#[cfg(loom)]
impl RingControl {
    pub(crate) fn new() -> Self {
        Self {
            head: Line(AtomicU32::new(0)),
            tail: Line(AtomicU32::new(0)),
            rx_sleep: Line(FutexWord::new()),
            tx_sleep: Line(FutexWord::new()),
        }
    }
}

/// What the peer left in shared memory that no correct peer writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Corrupt(pub(crate) String);

/// A borrowed ring: its control words, its slots, its slot count.
#[derive(Clone, Copy)]
pub(crate) struct Ring<'a> {
    pub(crate) control: &'a RingControl,
    /// `slots * SLOT_WORDS` words.
    pub(crate) words: &'a [AtomicU64],
    pub(crate) slots: u32,
}

impl Ring<'_> {
    fn slot(&self, index: u32) -> &[AtomicU64] {
        let start = (index & (self.slots - 1)) as usize * SLOT_WORDS;
        &self.words[start..start + SLOT_WORDS]
    }
}

/// The producer's local state: its own index and the last peer index it validated.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Producer {
    head: u32,
    tail_seen: u32,
}

impl Producer {
    /// Free slots, reading the consumer's `tail` only when the ring looks full.
    pub(crate) fn free(&mut self, ring: Ring<'_>) -> Result<u32, Corrupt> {
        let used = self.head.wrapping_sub(self.tail_seen);
        if used < ring.slots {
            return Ok(ring.slots - used);
        }
        Ok(ring.slots - self.unread(ring)?)
    }

    /// Messages published and not yet taken, reading the consumer's `tail` now.
    pub(crate) fn unread(&mut self, ring: Ring<'_>) -> Result<u32, Corrupt> {
        let used = self.head.wrapping_sub(self.tail_seen);
        let tail = ring.control.tail.0.load(Ordering::Acquire);
        // The consumer can only have taken messages that were published: tail moves forward
        // from the last value seen, and not past head.
        if tail.wrapping_sub(self.tail_seen) > used {
            return Err(Corrupt(format!(
                "the consumer's index {tail} is outside {}..={} (the messages published)",
                self.tail_seen, self.head
            )));
        }
        self.tail_seen = tail;
        Ok(self.head.wrapping_sub(tail))
    }

    /// Writes `message` (at most [`MAX_MESSAGE`] bytes, checked by the caller) into the next
    /// slot and publishes it; `Ok(false)` if the ring is full. Rings the consumer's doorbell
    /// only if it announced that it sleeps.
    pub(crate) fn push(
        &mut self,
        ring: Ring<'_>,
        message: &[u8],
        flags: u64,
    ) -> Result<bool, Corrupt> {
        debug_assert!(message.len() <= MAX_MESSAGE);
        if self.free(ring)? == 0 {
            return Ok(false);
        }
        let slot = ring.slot(self.head);
        slot[0].store(message.len() as u64 | flags, Ordering::Relaxed);
        for (word, chunk) in slot[1..].iter().zip(message.chunks(8)) {
            let mut bytes = [0u8; 8];
            bytes[..chunk.len()].copy_from_slice(chunk);
            word.store(u64::from_le_bytes(bytes), Ordering::Relaxed);
        }
        self.head = self.head.wrapping_add(1);
        ring.control.head.0.store(self.head, Ordering::Release);
        ring_doorbell(&ring.control.rx_sleep.0);
        Ok(true)
    }

    /// The index the next message gets.
    pub(crate) fn position(&self) -> u32 {
        self.head
    }

    /// Messages published and not yet taken, as far as this side knows.
    pub(crate) fn in_flight(&self) -> u32 {
        self.head.wrapping_sub(self.tail_seen)
    }
}

/// The consumer's local state.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Consumer {
    tail: u32,
    head_seen: u32,
}

/// A message found in a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Peeked {
    pub(crate) len: usize,
    pub(crate) flags: u64,
}

impl Consumer {
    /// The index of the next message to take.
    pub(crate) fn position(&self) -> u32 {
        self.tail
    }

    /// Messages ready, reading the producer's `head` only when none is known to be.
    pub(crate) fn available(&mut self, ring: Ring<'_>) -> Result<u32, Corrupt> {
        let ready = self.head_seen.wrapping_sub(self.tail);
        if ready > 0 {
            return Ok(ready);
        }
        let head = ring.control.head.0.load(Ordering::Acquire);
        // Here head_seen == tail: the producer may be ahead by at most a full ring.
        let ready = head.wrapping_sub(self.tail);
        if ready > ring.slots {
            return Err(Corrupt(format!(
                "the producer's index {head} is more than {} slots ahead of {} (the messages taken), or behind it",
                ring.slots, self.tail
            )));
        }
        self.head_seen = head;
        Ok(ready)
    }

    /// The next message's length and flags, without taking it; `None` if the ring is empty.
    pub(crate) fn peek(&mut self, ring: Ring<'_>) -> Result<Option<Peeked>, Corrupt> {
        if self.available(ring)? == 0 {
            return Ok(None);
        }
        let first = ring.slot(self.tail)[0].load(Ordering::Relaxed);
        let len = (first & 0xffff_ffff) as usize;
        let flags = first & !0xffff_ffff;
        if len > MAX_MESSAGE || flags & !SLOT_FD != 0 {
            return Err(Corrupt(format!(
                "slot {} says {len} bytes with flags {flags:#x}; messages are at most {MAX_MESSAGE} bytes",
                self.tail
            )));
        }
        Ok(Some(Peeked { len, flags }))
    }

    /// Copies the message [`peek`](Self::peek) found (`peeked.len <= out.len()`, checked by
    /// the caller) into `out`, takes it, and rings the producer's doorbell if it sleeps.
    pub(crate) fn take(&mut self, ring: Ring<'_>, peeked: Peeked, out: &mut [u8]) {
        let slot = ring.slot(self.tail);
        let out = &mut out[..peeked.len];
        for (word, chunk) in slot[1..].iter().zip(out.chunks_mut(8)) {
            let bytes = word.load(Ordering::Relaxed).to_le_bytes();
            chunk.copy_from_slice(&bytes[..chunk.len()]);
        }
        self.tail = self.tail.wrapping_add(1);
        ring.control.tail.0.store(self.tail, Ordering::Release);
        ring_doorbell(&ring.control.tx_sleep.0);
    }
}

/// After publishing: wake the peer only if it announced that it sleeps.
#[inline]
pub(crate) fn ring_doorbell(word: &FutexWord) {
    fence(Ordering::SeqCst);
    if word.word().load(Ordering::Relaxed) != AWAKE
        && word.word().swap(AWAKE, Ordering::Relaxed) != AWAKE
    {
        word.wake();
    }
}

/// Wakes a sleeper whatever it announced (a side closing its end).
pub(crate) fn wake_unconditionally(word: &FutexWord) {
    fence(Ordering::SeqCst);
    word.word().store(AWAKE, Ordering::Relaxed);
    word.wake();
}

/// How a wait ends when the ring has nothing for it.
#[derive(Debug)]
pub(crate) enum Stop<E> {
    /// The deadline passed.
    TimedOut,
    /// `check_peer` said so (the peer is gone, or a liveness check failed).
    Peer(E),
    /// The ring is corrupt.
    Corrupt(Corrupt),
}

/// How long to spin before sleeping, how long a sleep lasts at most before the peer is checked,
/// and when to give up.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WaitPlan {
    pub(crate) spin: Duration,
    pub(crate) check_every: Option<Duration>,
    pub(crate) deadline: Option<Instant>,
}

/// Waits until `ready` returns `Some`: spins up to `plan.spin` (yielding the CPU between looks,
/// in case the peer waits for this very CPU), then sleeps on `word` with the doorbell protocol.
/// `peer_closed` (a load of the peer's closed flag: no system call) is consulted after every
/// announcement, and `check_peer` (which may make system calls) after every sleep that timed
/// out; either ends the wait with [`Stop::Peer`].
pub(crate) fn wait_for<T, E>(
    word: &FutexWord,
    plan: WaitPlan,
    mut ready: impl FnMut() -> Result<Option<T>, Corrupt>,
    mut peer_closed: impl FnMut() -> Option<E>,
    mut check_peer: impl FnMut() -> Option<E>,
) -> Result<T, Stop<E>> {
    if let Some(got) = ready().map_err(Stop::Corrupt)? {
        return Ok(got);
    }
    if !plan.spin.is_zero() {
        let start = Instant::now();
        loop {
            for _ in 0..SPIN_HINTS {
                std::hint::spin_loop();
            }
            if let Some(got) = ready().map_err(Stop::Corrupt)? {
                return Ok(got);
            }
            if start.elapsed() >= plan.spin {
                break;
            }
            #[cfg(not(loom))]
            std::thread::yield_now();
            #[cfg(loom)]
            loom::thread::yield_now();
        }
    }
    loop {
        word.word().store(SLEEPING, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        match ready() {
            Ok(None) => {}
            Ok(Some(got)) => {
                word.word().store(AWAKE, Ordering::Relaxed);
                return Ok(got);
            }
            Err(corrupt) => {
                word.word().store(AWAKE, Ordering::Relaxed);
                return Err(Stop::Corrupt(corrupt));
            }
        }
        if let Some(err) = peer_closed() {
            word.word().store(AWAKE, Ordering::Relaxed);
            // The peer published everything before closing: what the look above missed
            // (it ran before the flag was read) is visible now.
            return last_look(&mut ready, err);
        }
        let mut timeout = plan.check_every;
        if let Some(deadline) = plan.deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                word.word().store(AWAKE, Ordering::Relaxed);
                return Err(Stop::TimedOut);
            }
            timeout = Some(timeout.map_or(left, |t| t.min(left)));
        }
        if word.wait(SLEEPING, timeout) == Wake::TimedOut {
            if let Some(err) = check_peer() {
                word.word().store(AWAKE, Ordering::Relaxed);
                return last_look(&mut ready, err);
            }
        }
    }
}

/// The peer is gone: one more look at the ring, for what it published last.
fn last_look<T, E>(
    ready: &mut impl FnMut() -> Result<Option<T>, Corrupt>,
    err: E,
) -> Result<T, Stop<E>> {
    match ready() {
        Ok(Some(got)) => Ok(got),
        Ok(None) => Err(Stop::Peer(err)),
        Err(corrupt) => Err(Stop::Corrupt(corrupt)),
    }
}

/// `spin_loop` hints between two looks at the ring.
const SPIN_HINTS: u32 = 32;

#[cfg(all(test, not(loom)))]
mod tests {
    use std::collections::VecDeque;

    use proptest::prelude::*;

    use super::*;

    fn control(start: u32) -> RingControl {
        RingControl {
            head: Line(AtomicU32::new(start)),
            tail: Line(AtomicU32::new(start)),
            rx_sleep: Line(FutexWord(AtomicU32::new(AWAKE))),
            tx_sleep: Line(FutexWord(AtomicU32::new(AWAKE))),
        }
    }

    proptest! {
        /// Against a queue model: pushes succeed exactly while fewer than `slots` messages wait,
        /// pops return them in order with their bytes, across the `u32` wrap of the indices.
        #[test]
        fn the_ring_is_a_bounded_fifo_across_index_wrap(
            slots_log in 0u32..4,
            start in prop_oneof![Just(0u32), Just(u32::MAX - 5), any::<u32>()],
            ops in proptest::collection::vec(prop_oneof![
                (0usize..=MAX_MESSAGE).prop_map(Some),
                Just(None),
            ], 1..200),
        ) {
            let slots = 1u32 << slots_log;
            let ctl = control(start);
            let words: Vec<AtomicU64> = (0..slots as usize * SLOT_WORDS).map(|_| AtomicU64::new(0)).collect();
            let ring = Ring { control: &ctl, words: &words, slots };
            let mut producer = Producer { head: start, tail_seen: start };
            let mut consumer = Consumer { tail: start, head_seen: start };
            let mut model: VecDeque<Vec<u8>> = VecDeque::new();
            for (n, op) in ops.into_iter().enumerate() {
                match op {
                    Some(len) => {
                        let message: Vec<u8> = (0..len).map(|k| (n + k) as u8).collect();
                        let pushed = producer.push(ring, &message, 0).unwrap();
                        prop_assert_eq!(pushed, model.len() < slots as usize);
                        if pushed {
                            model.push_back(message);
                        }
                    }
                    None => {
                        let mut out = vec![0u8; MAX_MESSAGE];
                        match consumer.peek(ring).unwrap() {
                            Some(peeked) => {
                                consumer.take(ring, peeked, &mut out);
                                let expected = model.pop_front();
                                prop_assert_eq!(Some(&out[..peeked.len]), expected.as_deref());
                            }
                            None => prop_assert!(model.is_empty()),
                        }
                    }
                }
                // `free` reads the consumer's index only when the ring looks full: a lower
                // bound, exact about "any room at all".
                let free = producer.free(ring).unwrap();
                prop_assert!(free <= slots - model.len() as u32);
                prop_assert_eq!(free > 0, model.len() < slots as usize);
            }
        }

        /// Any head the peer writes is either a valid count of waiting messages or corrupt; never
        /// a panic or an index outside the slots.
        #[test]
        fn any_peer_head_is_valid_or_corrupt(start in any::<u32>(), head in any::<u32>(), first in any::<u64>()) {
            let slots = 8;
            let ctl = control(start);
            let words: Vec<AtomicU64> = (0..slots as usize * SLOT_WORDS).map(|_| AtomicU64::new(first)).collect();
            let ring = Ring { control: &ctl, words: &words, slots };
            let mut consumer = Consumer { tail: start, head_seen: start };
            ctl.head.0.store(head, Ordering::Relaxed);
            let ahead = head.wrapping_sub(start);
            match consumer.peek(ring) {
                Ok(None) => prop_assert_eq!(ahead, 0),
                Ok(Some(peeked)) => {
                    prop_assert!(ahead >= 1 && ahead <= slots);
                    prop_assert!(peeked.len <= MAX_MESSAGE);
                }
                Err(_) => prop_assert!(ahead > slots || (first & 0xffff_ffff) as usize > MAX_MESSAGE || first >> 32 > 1),
            }
        }
    }
}
