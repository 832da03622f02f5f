//! The daemon's bookkeeping: which client holds which name, how many times.
//!
//! Pure state with no system calls: every operation returns the names whose last holder just
//! went away, and the daemon unlinks exactly those. A client may hold a name several times (two
//! regions of one process on one object); each hold is released separately.

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// A connection's identity inside the daemon (never reused while the daemon runs).
pub(crate) type ClientId = u64;

/// Outcome of [`Registry::release`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Released {
    /// The client did not hold the name (already released, or forgotten by a peer).
    NotHeld,
    /// The client, or another one, still holds the name.
    StillHeld,
    /// That was the last hold: the caller unlinks the name.
    LastHold,
}

/// Names and their holders, indexed both ways.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    /// Name -> (client -> number of holds, >= 1). No empty inner maps.
    holders: HashMap<String, BTreeMap<ClientId, u32>>,
    /// Client -> names it holds; mirrors `holders`. No empty entries.
    held: HashMap<ClientId, BTreeSet<String>>,
}

impl Registry {
    /// Adds one hold of `name` by `client`.
    pub(crate) fn register(&mut self, client: ClientId, name: &str) {
        *self
            .holders
            .entry(name.to_owned())
            .or_default()
            .entry(client)
            .or_insert(0) += 1;
        self.held.entry(client).or_default().insert(name.to_owned());
    }

    /// Drops one hold of `name` by `client`.
    pub(crate) fn release(&mut self, client: ClientId, name: &str) -> Released {
        let Some(clients) = self.holders.get_mut(name) else {
            return Released::NotHeld;
        };
        let Some(count) = clients.get_mut(&client) else {
            return Released::NotHeld;
        };
        *count -= 1;
        if *count > 0 {
            return Released::StillHeld;
        }
        clients.remove(&client);
        let last = clients.is_empty();
        if last {
            self.holders.remove(name);
        }
        self.unindex(client, name);
        if last {
            Released::LastHold
        } else {
            Released::StillHeld
        }
    }

    /// Drops `name` for every holder (a client unlinked it itself). Returns whether it was known.
    pub(crate) fn forget(&mut self, name: &str) -> bool {
        let Some(clients) = self.holders.remove(name) else {
            return false;
        };
        for client in clients.keys() {
            self.unindex(*client, name);
        }
        true
    }

    /// Drops every hold of a client that went away; returns the names nobody holds any more,
    /// which the caller unlinks.
    pub(crate) fn disconnect(&mut self, client: ClientId) -> Vec<String> {
        let Some(names) = self.held.remove(&client) else {
            return Vec::new();
        };
        let mut orphans = Vec::new();
        for name in names {
            if let Some(clients) = self.holders.get_mut(&name) {
                clients.remove(&client);
                if clients.is_empty() {
                    self.holders.remove(&name);
                    orphans.push(name);
                }
            }
        }
        orphans
    }

    /// Number of names held by at least one client.
    pub(crate) fn name_count(&self) -> usize {
        self.holders.len()
    }

    fn unindex(&mut self, client: ClientId, name: &str) {
        if let Some(names) = self.held.get_mut(&client) {
            names.remove(name);
            if names.is_empty() {
                self.held.remove(&client);
            }
        }
    }

    /// Checks that both indexes agree and hold no empty entries; panics with the broken
    /// invariant otherwise. Run by tests after every operation.
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) {
        for (name, clients) in &self.holders {
            assert!(!clients.is_empty(), "{name} has an empty holder set");
            for (client, count) in clients {
                assert!(*count >= 1, "{name} held {count} times by {client}");
                assert!(
                    self.held.get(client).is_some_and(|n| n.contains(name)),
                    "{client} holds {name} but is not indexed"
                );
            }
        }
        for (client, names) in &self.held {
            assert!(!names.is_empty(), "{client} has an empty name set");
            for name in names {
                assert!(
                    self.holders
                        .get(name)
                        .is_some_and(|c| c.contains_key(client)),
                    "{client} indexed for {name} without holding it"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_orphaned_only_when_its_last_holder_disconnects() {
        let mut r = Registry::default();
        r.register(1, "/a");
        r.register(2, "/a");
        r.register(1, "/b");
        r.check_invariants();
        assert_eq!(r.disconnect(1), vec!["/b".to_owned()]);
        r.check_invariants();
        assert_eq!(r.name_count(), 1);
        assert_eq!(r.disconnect(2), vec!["/a".to_owned()]);
        r.check_invariants();
        assert_eq!(r.name_count(), 0);
        assert!(r.disconnect(2).is_empty());
    }

    #[test]
    fn release_counts_holds_per_client() {
        let mut r = Registry::default();
        r.register(1, "/a");
        r.register(1, "/a");
        r.register(2, "/a");
        assert_eq!(r.release(1, "/a"), Released::StillHeld);
        r.check_invariants();
        assert_eq!(r.release(1, "/a"), Released::StillHeld);
        r.check_invariants();
        assert_eq!(r.release(1, "/a"), Released::NotHeld);
        assert_eq!(r.release(2, "/a"), Released::LastHold);
        r.check_invariants();
        assert_eq!(r.release(2, "/a"), Released::NotHeld);
        assert_eq!(r.name_count(), 0);
    }

    #[test]
    fn forget_drops_every_holder_without_orphaning() {
        let mut r = Registry::default();
        r.register(1, "/a");
        r.register(2, "/a");
        r.register(2, "/b");
        assert!(r.forget("/a"));
        r.check_invariants();
        assert!(!r.forget("/a"));
        assert!(r.disconnect(1).is_empty());
        assert_eq!(r.disconnect(2), vec!["/b".to_owned()]);
        r.check_invariants();
    }

    #[test]
    fn random_operation_sequences_keep_the_indexes_in_step() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut r = Registry::default();
        // Model: multiset of (client, name) holds.
        let mut model: BTreeMap<(ClientId, String), u32> = BTreeMap::new();
        for _ in 0..5000 {
            let client = rng.gen_range(0..4u64);
            let name = format!("/n{}", rng.gen_range(0..6));
            match rng.gen_range(0..10) {
                0..=4 => {
                    r.register(client, &name);
                    *model.entry((client, name)).or_default() += 1;
                }
                5..=7 => {
                    let got = r.release(client, &name);
                    let key = (client, name.clone());
                    let expected = match model.get_mut(&key) {
                        None => Released::NotHeld,
                        Some(n) => {
                            *n -= 1;
                            if *n == 0 {
                                model.remove(&key);
                            }
                            if model.keys().any(|(_, m)| *m == name) {
                                Released::StillHeld
                            } else {
                                Released::LastHold
                            }
                        }
                    };
                    assert_eq!(got, expected);
                }
                8 => {
                    let mut orphans = r.disconnect(client);
                    orphans.sort();
                    let mine: Vec<String> = model
                        .keys()
                        .filter(|(c, _)| *c == client)
                        .map(|(_, n)| n.clone())
                        .collect();
                    model.retain(|(c, _), _| *c != client);
                    let mut expected: Vec<String> = mine
                        .into_iter()
                        .filter(|n| !model.keys().any(|(_, m)| m == n))
                        .collect();
                    expected.sort();
                    assert_eq!(orphans, expected);
                }
                _ => {
                    let known = model.keys().any(|(_, m)| *m == name);
                    assert_eq!(r.forget(&name), known);
                    model.retain(|(_, m), _| *m != name);
                }
            }
            r.check_invariants();
            let names: std::collections::BTreeSet<&String> = model.keys().map(|(_, n)| n).collect();
            assert_eq!(r.name_count(), names.len());
        }
    }
}
