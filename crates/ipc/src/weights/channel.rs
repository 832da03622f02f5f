//! The version channel of a publication: a small shared-memory file in which the producer announces
//! each version and every consumer records which version it has installed, so that the producer
//! can wait for its consumers before writing the weights again (a version is never torn) and each
//! side notices when the other died.
//!
//! Layout (4 096 bytes, native byte order; the file is the producer's, mode 0600):
//!
//! | bytes | field |
//! | --- | --- |
//! | 0..8 | magic `TMWCHAN1` |
//! | 8..16 | producer pid |
//! | 16..24 | producer start time (clock ticks since boot) |
//! | 24..32 | producer pid namespace |
//! | 32..40 | published version (0: none yet) |
//! | 40..48 | closed (1 once the producer closed the publication) |
//! | 64 + 64 i .. | consumer slot `i` (63 slots): pid (0: free), start time, pid namespace, installed version, version being installed |
//!
//! # Who is alive
//!
//! Each side holds an open-file-description lock (`F_OFD_SETLK`) on one byte of the file while it
//! runs: the producer on byte 8, a consumer on the first byte of its slot. The kernel lets go of a
//! lock when its process dies, however it dies, and every process that maps the file sees the
//! locks whatever its pid namespace: so a consumer in another container that is killed stops
//! holding the producer back, and a killed producer ends its consumers' waits, where pids alone
//! could not tell (a pid of another namespace cannot be checked). Where the file system refuses
//! such locks, the pid, start time and namespace recorded beside them decide.

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tensormem_shm::{CreateMode, MapOptions, NameGenerator, SharedRegion, ShmName};

use crate::at_exit;
use crate::byte_lock::{byte_lock, byte_locked, Locked};
use crate::error::{Error, Result};
use crate::process::{Liveness, ProcessIdentity};

const MAGIC: u64 = u64::from_le_bytes(*b"TMWCHAN1");
const LEN: usize = 4096;
const SLOT_BASE: usize = 64;
const SLOT_LEN: usize = 64;
/// How many consumers one publication's channel has room for.
pub const MAX_CONSUMERS: usize = (LEN - SLOT_BASE) / SLOT_LEN;

const PID: usize = 8;
const START: usize = 16;
const NAMESPACE: usize = 24;
const PUBLISHED: usize = 32;
const CLOSED: usize = 40;

const S_PID: usize = 0;
const S_START: usize = 8;
const S_NAMESPACE: usize = 16;
const S_INSTALLED: usize = 24;
const S_READING: usize = 32;

/// The shared file, mapped.
pub(crate) struct Channel {
    region: SharedRegion,
    owner: bool,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel")
            .field("name", &self.region.name())
            .field("owner", &self.owner)
            .finish()
    }
}

fn shm(err: tensormem_shm::Error) -> Error {
    Error::WeightsChannel {
        problem: err.to_string(),
    }
}

impl Channel {
    /// Creates a channel for this process's publication.
    pub(crate) fn create(names: &NameGenerator) -> Result<Self> {
        let name = names.next_name();
        let region = MapOptions::new()
            .create(CreateMode::CreateExclusive)
            .len(LEN as u64)
            .keep_fd(true)
            .map_shm(&name)
            .map_err(shm)?;
        let channel = Self {
            region,
            owner: true,
        };
        // A publisher in a table that lives as long as the process is never dropped.
        at_exit::unlink_at_exit(&name);
        let me = ProcessIdentity::current();
        channel
            .word(PID)
            .store(u64::from(me.pid), Ordering::Relaxed);
        channel.word(START).store(me.start_time, Ordering::Relaxed);
        channel
            .word(NAMESPACE)
            .store(me.pid_namespace, Ordering::Relaxed);
        if channel.lock(PID, true) == Locked::Unsupported {
            tracing::debug!(
                target: "tensormem_ipc",
                channel = %name,
                "the file system refuses byte locks: liveness of the weights channel by pid only"
            );
        }
        channel.word(0).store(MAGIC, Ordering::Release);
        Ok(channel)
    }

    /// Maps the channel `name` a producer created.
    pub(crate) fn open(name: &ShmName) -> Result<Self> {
        let region =
            MapOptions::new()
                .keep_fd(true)
                .map_shm(name)
                .map_err(|e| Error::WeightsChannel {
                    problem: format!(
                    "cannot map the publication's channel {name}: {e}; the producer closed the \
                 publication or exited"
                ),
                })?;
        if region.mapping().len() < LEN {
            return Err(Error::WeightsChannel {
                problem: format!(
                    "{name} has {} bytes, not the {LEN} of a channel",
                    region.mapping().len()
                ),
            });
        }
        let channel = Self {
            region,
            owner: false,
        };
        if channel.word(0).load(Ordering::Acquire) != MAGIC {
            return Err(Error::WeightsChannel {
                problem: format!("{name} is not a weights channel (wrong magic)"),
            });
        }
        Ok(channel)
    }

    pub(crate) fn name(&self) -> &ShmName {
        self.region.name().expect("a channel is a named file")
    }

    fn word(&self, offset: usize) -> &AtomicU64 {
        self.region
            .mapping()
            .atomic::<AtomicU64>(offset)
            .expect("offsets inside the 4 KiB mapping, 8-aligned")
    }

    fn slot_word(&self, slot: usize, field: usize) -> &AtomicU64 {
        self.word(SLOT_BASE + slot * SLOT_LEN + field)
    }

    fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.region.fd()
    }

    /// Takes (`true`) or lets go of the lock on byte `offset` (see the module docs).
    fn lock(&self, offset: usize, take: bool) -> Locked {
        let Some(fd) = self.fd() else {
            return Locked::Unsupported;
        };
        byte_lock(fd, offset, take)
    }

    /// Whether a process recorded in the words at `pid`, `start` and `namespace`, which locks byte
    /// `lock` while it runs, still runs: its lock decides, else (no locks here) its identity.
    fn alive(&self, lock: usize, pid: usize, start: usize, namespace: usize) -> bool {
        match self.fd().and_then(|fd| byte_locked(fd, lock)) {
            Some(held) => held,
            None => self.identity(pid, start, namespace).liveness() == Liveness::Alive,
        }
    }

    fn identity(&self, pid: usize, start: usize, namespace: usize) -> ProcessIdentity {
        ProcessIdentity {
            pid: self.word(pid).load(Ordering::Acquire) as u32,
            start_time: self.word(start).load(Ordering::Acquire),
            pid_namespace: self.word(namespace).load(Ordering::Acquire),
        }
    }

    // ---- the producer's side ----

    /// Announces the next version; returns it.
    pub(crate) fn announce(&self) -> u64 {
        self.word(PUBLISHED).fetch_add(1, Ordering::AcqRel) + 1
    }

    /// The last version announced.
    pub(crate) fn published(&self) -> u64 {
        self.word(PUBLISHED).load(Ordering::Acquire)
    }

    /// Marks the publication closed (consumers see it on their next wait).
    pub(crate) fn close(&self) {
        self.word(CLOSED).store(1, Ordering::Release);
    }

    /// The attached consumers that have not installed `version` yet, after freeing the slots of
    /// consumers that died.
    pub(crate) fn lagging(&self, version: u64) -> Vec<u32> {
        let mut out = Vec::new();
        for slot in 0..MAX_CONSUMERS {
            let pid = self.slot_word(slot, S_PID).load(Ordering::Acquire);
            if pid == 0 {
                continue;
            }
            if self.slot_word(slot, S_INSTALLED).load(Ordering::Acquire) >= version {
                continue;
            }
            let base = SLOT_BASE + slot * SLOT_LEN;
            let who = self.identity(base + S_PID, base + S_START, base + S_NAMESPACE);
            if !self.alive(base, base + S_PID, base + S_START, base + S_NAMESPACE) {
                tracing::warn!(
                    target: "tensormem_ipc",
                    pid = who.pid,
                    "a weights consumer died before installing a version; it no longer holds the producer back"
                );
                let _ = self.slot_word(slot, S_PID).compare_exchange(
                    pid,
                    0,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
                continue;
            }
            out.push(who.pid);
        }
        out
    }

    // ---- a consumer's side ----

    /// Takes a consumer slot for this process.
    pub(crate) fn attach(&self) -> Result<usize> {
        let me = ProcessIdentity::current();
        for slot in 0..MAX_CONSUMERS {
            let claimed = match self.lock(SLOT_BASE + slot * SLOT_LEN, true) {
                // The slot is ours: a pid still written there is a dead consumer's.
                Locked::Taken => {
                    self.slot_word(slot, S_PID)
                        .store(u64::from(me.pid), Ordering::Release);
                    true
                }
                Locked::Held => false,
                Locked::Unsupported => self
                    .slot_word(slot, S_PID)
                    .compare_exchange(0, u64::from(me.pid), Ordering::AcqRel, Ordering::Acquire)
                    .is_ok(),
            };
            if claimed {
                self.slot_word(slot, S_START)
                    .store(me.start_time, Ordering::Release);
                self.slot_word(slot, S_NAMESPACE)
                    .store(me.pid_namespace, Ordering::Release);
                self.slot_word(slot, S_INSTALLED)
                    .store(0, Ordering::Release);
                self.slot_word(slot, S_READING).store(0, Ordering::Release);
                return Ok(slot);
            }
        }
        Err(Error::WeightsChannel {
            problem: format!(
                "{} already has {MAX_CONSUMERS} consumers attached; close a subscription first",
                self.name()
            ),
        })
    }

    /// Gives slot `slot` back.
    pub(crate) fn detach(&self, slot: usize) {
        self.slot_word(slot, S_PID).store(0, Ordering::Release);
        let _ = self.lock(SLOT_BASE + slot * SLOT_LEN, false);
    }

    /// Records that `slot` installs `version` now (reading) or has installed it.
    pub(crate) fn mark(&self, slot: usize, version: u64, done: bool) {
        let field = if done { S_INSTALLED } else { S_READING };
        self.slot_word(slot, field)
            .store(version, Ordering::Release);
    }

    /// Waits until a version after `after` is announced, the publication is closed or its producer
    /// died, or `timeout` passed.
    pub(crate) fn wait_version(&self, after: u64, timeout: Option<Duration>) -> Result<u64> {
        let producer = self.identity(PID, START, NAMESPACE);
        wait_until(
            timeout,
            "the producer's next version",
            || {
                let v = self.published();
                if v > after {
                    return Ok(Some(v));
                }
                if self.word(CLOSED).load(Ordering::Acquire) != 0 {
                    return Err(Error::PublicationClosed { pid: producer.pid });
                }
                Ok(None)
            },
            || (!self.producer_alive()).then_some(Error::PublicationClosed { pid: producer.pid }),
        )
    }

    /// Whether the producer that created the channel still runs.
    pub(crate) fn producer_alive(&self) -> bool {
        self.alive(PID, PID, START, NAMESPACE)
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        if self.owner {
            if let Some(name) = self.region.name() {
                at_exit::keep_at_exit(name);
            }
        }
        if self.owner || !self.producer_alive() {
            // The producer's file goes with it (or with the first consumer to see it died).
            let _ = self.region.unlink();
        }
    }
}

/// Polls `ready` until it answers, spinning first (a version usually follows within microseconds of
/// the wait), then yielding, then sleeping; every 10 ms `gone` is asked whether the other side died.
pub(crate) fn wait_until<T>(
    timeout: Option<Duration>,
    what: &str,
    mut ready: impl FnMut() -> Result<Option<T>>,
    mut gone: impl FnMut() -> Option<Error>,
) -> Result<T> {
    let start = Instant::now();
    let mut checked = start;
    let mut round = 0u32;
    loop {
        if let Some(v) = ready()? {
            return Ok(v);
        }
        round = round.saturating_add(1);
        let now = Instant::now();
        if now.duration_since(checked) >= Duration::from_millis(10) {
            checked = now;
            if let Some(err) = gone() {
                return Err(err);
            }
        }
        if let Some(limit) = timeout {
            if now.duration_since(start) >= limit {
                return Err(Error::WeightsTimedOut {
                    what: what.to_string(),
                    waited: limit,
                });
            }
        }
        if round < 2_000 {
            std::hint::spin_loop();
        } else if round < 4_000 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_consumer_that_is_gone_is_seen_gone_whatever_its_recorded_identity() {
        let names = NameGenerator::default();
        let producer = Channel::create(&names).unwrap();
        let consumer = Channel::open(producer.name()).unwrap();
        let slot = consumer.attach().unwrap();
        assert_eq!(producer.lagging(1), vec![std::process::id()]);
        // As a consumer of another pid namespace looks: its pid cannot be checked.
        consumer
            .slot_word(slot, S_NAMESPACE)
            .store(u64::MAX, Ordering::Release);
        assert_eq!(
            producer.lagging(1).len(),
            1,
            "alive while it holds its lock"
        );
        // Its file description closes, as when its process dies: the lock goes with it.
        drop(consumer);
        assert!(producer.lagging(1).is_empty());
        // The slot is free for the next consumer.
        let next = Channel::open(producer.name()).unwrap();
        assert_eq!(next.attach().unwrap(), slot);
    }

    #[test]
    fn a_consumer_sees_its_producer_go() {
        let names = NameGenerator::default();
        let producer = Channel::create(&names).unwrap();
        let consumer = Channel::open(producer.name()).unwrap();
        assert!(consumer.producer_alive());
        // Another namespace's producer: only its lock can tell.
        consumer.word(NAMESPACE).store(u64::MAX, Ordering::Release);
        assert!(consumer.producer_alive());
        drop(producer);
        assert!(!consumer.producer_alive());
        let err = consumer
            .wait_version(0, Some(Duration::from_secs(5)))
            .unwrap_err();
        assert!(matches!(err, Error::PublicationClosed { .. }), "{err}");
    }
}
