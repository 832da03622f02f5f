//! [`LeaseCache`]: values opened once per key and shared by every user in the process, closed when the
//! last user lets go (or kept a while, up to a number of idle entries).
//!
//! The consumer keeps two: opened memory handles (`cuIpcOpenMemHandle` once per base allocation and
//! device, PyTorch's `getIpcDevPtr`) and mapped ref-counter files. Threads that ask for the same key at
//! once open it once: the first runs the open, the others wait for its result.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::error::Result;

type Cell<V> = Arc<OnceLock<Option<Arc<V>>>>;

#[derive(Debug)]
struct Entry<V> {
    cell: Cell<V>,
    users: usize,
    idle_since: u64,
}

#[derive(Debug)]
struct State<K, V> {
    entries: HashMap<K, Entry<V>>,
    tick: u64,
    idle: usize,
}

/// Values shared per key (see the [module docs](self)).
#[derive(Debug)]
pub(crate) struct LeaseCache<K, V> {
    state: Mutex<State<K, V>>,
    max_idle: usize,
    /// Whether an entry of this key may be kept with no user (else it is closed at once).
    keep_idle: fn(&K) -> bool,
}

/// One user's hold on a cached value; letting go of it releases the hold.
#[derive(Debug)]
pub(crate) struct Lease<K: Hash + Eq + Clone, V> {
    cache: Arc<LeaseCache<K, V>>,
    key: K,
    cell: Cell<V>,
    value: Arc<V>,
}

impl<K: Hash + Eq + Clone, V> Lease<K, V> {
    pub(crate) fn get(&self) -> &V {
        &self.value
    }
}

impl<K: Hash + Eq + Clone, V> Drop for Lease<K, V> {
    fn drop(&mut self) {
        let evicted = self.cache.release(&self.key, &self.cell);
        // Dropped (and so closed) outside the lock.
        drop(evicted);
    }
}

impl<K: Hash + Eq + Clone, V> LeaseCache<K, V> {
    /// A cache keeping at most `max_idle` values nobody uses (0: close at once).
    pub(crate) fn new(max_idle: usize) -> Arc<Self> {
        Self::with_keep_idle(max_idle, |_| true)
    }

    /// A cache that keeps up to `max_idle` unused entries, only of keys `keep_idle` accepts.
    pub(crate) fn with_keep_idle(max_idle: usize, keep_idle: fn(&K) -> bool) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State {
                entries: HashMap::new(),
                tick: 0,
                idle: 0,
            }),
            max_idle,
            keep_idle,
        })
    }

    /// The value of `key`, opened with `open` if nobody in the process holds it.
    pub(crate) fn acquire(
        self: &Arc<Self>,
        key: &K,
        mut open: impl FnMut() -> Result<V>,
    ) -> Result<Lease<K, V>> {
        loop {
            let cell = {
                let mut st = self.state.lock();
                let st = &mut *st;
                // A warm key is found without cloning it (a file name would allocate).
                if !st.entries.contains_key(key) {
                    st.entries.insert(
                        key.clone(),
                        Entry {
                            cell: Arc::new(OnceLock::new()),
                            users: 0,
                            idle_since: 0,
                        },
                    );
                }
                let entry = st
                    .entries
                    .get_mut(key)
                    .expect("the entry was found or inserted just above, under the lock");
                if entry.users == 0 && entry.cell.get().is_some() {
                    st.idle -= 1;
                }
                entry.users += 1;
                Arc::clone(&entry.cell)
            };
            let mut failure = None;
            let value = cell.get_or_init(|| match open() {
                Ok(v) => Some(Arc::new(v)),
                Err(e) => {
                    failure = Some(e);
                    None
                }
            });
            if let Some(value) = value {
                let value = Arc::clone(value);
                return Ok(Lease {
                    cache: Arc::clone(self),
                    key: key.clone(),
                    cell,
                    value,
                });
            }
            drop(self.release(key, &cell));
            if let Some(err) = failure {
                return Err(err);
            }
            // Another thread's open failed; try ourselves.
        }
    }

    /// Another lease on `key` if it is open now (never opens).
    pub(crate) fn acquire_open(self: &Arc<Self>, key: &K) -> Option<Lease<K, V>> {
        let mut st = self.state.lock();
        let st = &mut *st;
        let entry = st.entries.get_mut(key)?;
        let value = Arc::clone(entry.cell.get()?.as_ref()?);
        if entry.users == 0 {
            st.idle -= 1;
        }
        entry.users += 1;
        Some(Lease {
            cache: Arc::clone(self),
            key: key.clone(),
            cell: Arc::clone(&entry.cell),
            value,
        })
    }

    /// Gives up one use of `key`; returns what must be dropped outside the lock.
    fn release(&self, key: &K, cell: &Cell<V>) -> Vec<Cell<V>> {
        let mut st = self.state.lock();
        let st = &mut *st;
        let mut out = Vec::new();
        let Some(entry) = st.entries.get_mut(key) else {
            return out;
        };
        if !Arc::ptr_eq(&entry.cell, cell) {
            return out;
        }
        entry.users -= 1;
        if entry.users > 0 {
            return out;
        }
        let failed = entry.cell.get().is_some_and(Option::is_none) || entry.cell.get().is_none();
        if failed || self.max_idle == 0 || !(self.keep_idle)(key) {
            if let Some(e) = st.entries.remove(key) {
                out.push(e.cell);
            }
            return out;
        }
        st.tick += 1;
        entry.idle_since = st.tick;
        st.idle += 1;
        while st.idle > self.max_idle {
            let oldest = st
                .entries
                .iter()
                .filter(|(_, e)| e.users == 0 && e.cell.get().is_some())
                .min_by_key(|(_, e)| e.idle_since)
                .map(|(k, _)| k.clone());
            let Some(oldest) = oldest else { break };
            if let Some(e) = st.entries.remove(&oldest) {
                out.push(e.cell);
            }
            st.idle -= 1;
        }
        out
    }

    /// Closes every value nobody uses.
    pub(crate) fn clear_idle(&self) {
        let removed: Vec<Cell<V>> = {
            let mut st = self.state.lock();
            let idle: Vec<K> = st
                .entries
                .iter()
                .filter(|(_, e)| e.users == 0)
                .map(|(k, _)| k.clone())
                .collect();
            st.idle = 0;
            idle.iter()
                .filter_map(|k| st.entries.remove(k))
                .map(|e| e.cell)
                .collect()
        };
        drop(removed);
    }

    /// Keys in the cache (used or idle).
    pub(crate) fn len(&self) -> usize {
        self.state.lock().entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Barrier;

    struct Counted(Arc<AtomicUsize>);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn many_threads_open_once_and_the_last_user_closes() {
        let cache = LeaseCache::<u32, Counted>::new(0);
        let opens = AtomicUsize::new(0);
        let closes = Arc::new(AtomicUsize::new(0));
        let barrier = Barrier::new(16);
        let leases: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..16)
                .map(|_| {
                    s.spawn(|| {
                        barrier.wait();
                        cache
                            .acquire(&7, || {
                                opens.fetch_add(1, Ordering::Relaxed);
                                std::thread::sleep(std::time::Duration::from_millis(20));
                                Ok(Counted(Arc::clone(&closes)))
                            })
                            .unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(opens.load(Ordering::Relaxed), 1);
        assert_eq!(cache.len(), 1);
        let mut leases = leases;
        let last = leases.pop().unwrap();
        drop(leases);
        assert_eq!(closes.load(Ordering::Relaxed), 0);
        drop(last);
        assert_eq!(closes.load(Ordering::Relaxed), 1);
        assert_eq!(cache.len(), 0);
    }

    #[test]
    fn idle_values_are_kept_up_to_the_limit_oldest_closed_first() {
        let cache = LeaseCache::<u32, Counted>::new(2);
        let closes = Arc::new(AtomicUsize::new(0));
        let open = |k: u32| {
            let closes = Arc::clone(&closes);
            cache
                .acquire(&k, move || Ok(Counted(Arc::clone(&closes))))
                .unwrap()
        };
        let (a, b, c) = (open(1), open(2), open(3));
        drop(a);
        drop(b);
        assert_eq!(closes.load(Ordering::Relaxed), 0);
        let again = open(1); // warm: no new open, taken out of the idle set
        drop(c); // idle: 2, 3 -> within the limit
        assert_eq!(closes.load(Ordering::Relaxed), 0);
        drop(again); // idle: 2, 3, 1 -> 2 (the oldest) closes
        assert_eq!(closes.load(Ordering::Relaxed), 1);
        assert_eq!(cache.len(), 2);
        cache.clear_idle();
        assert_eq!(closes.load(Ordering::Relaxed), 3);
        assert_eq!(cache.len(), 0);
    }

    #[test]
    fn a_failed_open_leaves_nothing_and_can_be_retried() {
        let cache = LeaseCache::<u32, u32>::new(4);
        let err = cache.acquire(&1, || {
            Err(crate::Error::MalformedHandle {
                problem: "test".into(),
            })
        });
        assert!(err.is_err());
        assert_eq!(cache.len(), 0);
        assert_eq!(*cache.acquire(&1, || Ok(5)).unwrap().get(), 5);
    }
}
