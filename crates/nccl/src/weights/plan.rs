//! The plan of one rank, made once per (sender layout, this rank's tensors): the sender's tensors
//! laid end to end in its order and cut into buckets of the agreed size, each bucket a list of
//! spans of this rank's tensors.

use std::collections::HashMap;

use tensormem_cuda_alloc::DeviceAddress;

use super::layout::{LocalTensor, WeightLayout};
use crate::error::{Error, Mismatch, Result};

/// A piece of one of this rank's tensors inside a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Where the piece starts in the bucket.
    pub offset: usize,
    /// Where it lies in this rank's memory.
    pub addr: DeviceAddress,
    /// Its length in bytes.
    pub len: usize,
}

/// One broadcast: `len` bytes, the spans that fill them in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    len: usize,
    /// In bucket order, covering `[0, len)` without gaps.
    spans: Vec<Span>,
}

impl Bucket {
    /// The bucket's bytes: the bucket size, less for the last bucket.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the bucket is empty (never, in a plan).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The pieces of this rank's tensors, in bucket order.
    #[must_use]
    pub fn spans(&self) -> &[Span] {
        &self.spans
    }

    /// Where the bucket lies in this rank's memory if it is one piece of one tensor: it is then
    /// broadcast from or into the tensor itself, without a copy through a staging buffer.
    #[must_use]
    pub fn direct(&self) -> Option<DeviceAddress> {
        match self.spans.as_slice() {
            [only] if only.len == self.len => Some(only.addr),
            _ => None,
        }
    }
}

/// This rank's part of a weight sync: its buckets in order, and the fingerprint every rank checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncPlan {
    buckets: Vec<Bucket>,
    bytes: u64,
    bucket_bytes: usize,
    fingerprint: u64,
}

impl SyncPlan {
    /// The plan of a rank holding `local` for weights laid out as `layout` (the sender's),
    /// bucketed by `bucket_bytes`.
    ///
    /// # Errors
    ///
    /// [`Error::Layout`] with every difference between `layout` and `local` (by name: a tensor
    /// sent but not here or here but not sent, another size, other metadata);
    /// [`Error::DuplicateName`] in `local`.
    pub fn new(layout: &WeightLayout, local: &[LocalTensor], bucket_bytes: usize) -> Result<Self> {
        assert!(bucket_bytes > 0, "buckets hold at least one byte");
        let addrs = match_by_name(layout, local)?;
        let pieces = layout
            .tensors()
            .iter()
            .zip(addrs)
            .map(|(t, addr)| (addr, t.bytes as usize));
        Ok(Self {
            buckets: cut(pieces, bucket_bytes),
            bytes: layout.total_bytes(),
            bucket_bytes,
            fingerprint: layout.fingerprint(bucket_bytes),
        })
    }

    /// The buckets, in the order they are broadcast.
    #[must_use]
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// The bytes of all tensors.
    #[must_use]
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The bucket size.
    #[must_use]
    pub fn bucket_bytes(&self) -> usize {
        self.bucket_bytes
    }

    /// The fingerprint of the sender's layout and the bucket size
    /// ([`WeightLayout::fingerprint`]).
    #[must_use]
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
}

/// The address of each of `layout`'s tensors among `local`, matched by name, or every difference.
fn match_by_name(layout: &WeightLayout, local: &[LocalTensor]) -> Result<Vec<DeviceAddress>> {
    let mut by_name: HashMap<&str, &LocalTensor> = HashMap::with_capacity(local.len());
    for t in local {
        if by_name.insert(t.name.as_str(), t).is_some() {
            return Err(Error::DuplicateName {
                name: t.name.clone(),
            });
        }
    }
    let mut mismatches = Vec::new();
    let mut addrs = Vec::with_capacity(layout.tensors().len());
    for sent in layout.tensors() {
        let Some(here) = by_name.remove(sent.name.as_str()) else {
            mismatches.push(Mismatch::Missing {
                name: sent.name.clone(),
            });
            continue;
        };
        if here.bytes != sent.bytes {
            mismatches.push(Mismatch::Size {
                name: sent.name.clone(),
                sent: sent.bytes,
                here: here.bytes,
            });
        } else if here.meta != sent.meta {
            mismatches.push(Mismatch::Meta {
                name: sent.name.clone(),
                sent: sent.meta.clone(),
                here: here.meta.clone(),
            });
        }
        addrs.push(here.ptr);
    }
    // This rank's tensors the sender does not send, in this rank's order.
    mismatches.extend(
        local
            .iter()
            .filter(|t| by_name.contains_key(t.name.as_str()))
            .map(|t| Mismatch::Unsent {
                name: t.name.clone(),
            }),
    );
    if mismatches.is_empty() {
        Ok(addrs)
    } else {
        Err(Error::Layout { mismatches })
    }
}

/// The tensors (address, bytes) laid end to end and cut every `bucket_bytes`: a tensor crossing a
/// cut is split between the buckets; empty tensors take no span.
fn cut(tensors: impl Iterator<Item = (DeviceAddress, usize)>, bucket_bytes: usize) -> Vec<Bucket> {
    let mut buckets = Vec::new();
    let mut current = Bucket {
        len: 0,
        spans: Vec::new(),
    };
    for (addr, bytes) in tensors {
        let mut done = 0;
        while done < bytes {
            let len = (bytes - done).min(bucket_bytes - current.len);
            current.spans.push(Span {
                offset: current.len,
                addr: addr.offset(done),
                len,
            });
            current.len += len;
            done += len;
            if current.len == bucket_bytes {
                buckets.push(std::mem::replace(
                    &mut current,
                    Bucket {
                        len: 0,
                        spans: Vec::new(),
                    },
                ));
            }
        }
    }
    if !current.is_empty() {
        buckets.push(current);
    }
    buckets
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(name: &str, ptr: u64, bytes: u64) -> LocalTensor {
        LocalTensor {
            name: name.into(),
            ptr: DeviceAddress(ptr),
            bytes,
            meta: String::new(),
        }
    }

    #[test]
    fn buckets_are_cut_at_the_size_and_tensors_split_across_them() {
        let local = [
            tensor("a", 0x1000, 6),
            tensor("empty", 0x9000, 0),
            tensor("b", 0x2000, 25),
            tensor("c", 0x3000, 3),
        ];
        let plan = SyncPlan::new(&WeightLayout::of(&local).unwrap(), &local, 10).unwrap();
        let spans: Vec<Vec<(usize, u64, usize)>> = plan
            .buckets()
            .iter()
            .map(|b| {
                b.spans()
                    .iter()
                    .map(|s| (s.offset, s.addr.0, s.len))
                    .collect()
            })
            .collect();
        assert_eq!(
            spans,
            vec![
                vec![(0, 0x1000, 6), (6, 0x2000, 4)],
                vec![(0, 0x2004, 10)],
                vec![(0, 0x200e, 10)],
                vec![(0, 0x2018, 1), (1, 0x3000, 3)],
            ]
        );
        let lens: Vec<usize> = plan.buckets().iter().map(Bucket::len).collect();
        assert_eq!(lens, [10, 10, 10, 4]);
        let direct: Vec<Option<u64>> = plan
            .buckets()
            .iter()
            .map(|b| b.direct().map(|a| a.0))
            .collect();
        assert_eq!(direct, [None, Some(0x2004), Some(0x200e), None]);
        assert_eq!(plan.bytes(), 34);
    }

    #[test]
    fn a_receiver_matches_by_name_whatever_its_order() {
        let sender = [tensor("a", 0x1000, 4), tensor("b", 0x2000, 4)];
        let receiver = [tensor("b", 0x8000, 4), tensor("a", 0x9000, 4)];
        let layout = WeightLayout::of(&sender).unwrap();
        let plan = SyncPlan::new(&layout, &receiver, 8).unwrap();
        let addrs: Vec<u64> = plan.buckets()[0].spans().iter().map(|s| s.addr.0).collect();
        assert_eq!(
            addrs,
            [0x9000, 0x8000],
            "the sender's order, this rank's addresses"
        );
        assert_eq!(
            plan.fingerprint(),
            SyncPlan::new(&layout, &sender, 8).unwrap().fingerprint()
        );
    }

    #[test]
    fn every_difference_is_named() {
        let sender = [
            tensor("a", 0, 4),
            tensor("b", 0, 4),
            tensor("c", 0, 4),
            LocalTensor {
                meta: "f32[1]".into(),
                ..tensor("d", 0, 4)
            },
        ];
        let receiver = [
            tensor("z", 0, 4),
            tensor("c", 0, 8),
            tensor("a", 0, 4),
            LocalTensor {
                meta: "i32[1]".into(),
                ..tensor("d", 0, 4)
            },
        ];
        let layout = WeightLayout::of(&sender).unwrap();
        let Err(Error::Layout { mismatches }) = SyncPlan::new(&layout, &receiver, 8) else {
            panic!("refused")
        };
        assert_eq!(
            mismatches,
            [
                Mismatch::Missing { name: "b".into() },
                Mismatch::Size {
                    name: "c".into(),
                    sent: 4,
                    here: 8
                },
                Mismatch::Meta {
                    name: "d".into(),
                    sent: "f32[1]".into(),
                    here: "i32[1]".into()
                },
                Mismatch::Unsent { name: "z".into() },
            ]
        );
    }
}
