//! [`InstallPlan`]: which bytes go where when published weights are copied into tensors the consumer
//! owns, checked once and reduced to as few copies as the two layouts allow.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use tensormem_cuda_alloc::DeviceAddress;

use super::meta::TensorMeta;
use crate::driver::DeviceCopy;
use crate::error::{Error, Result};

/// One tensor on either side of an install: its name, where its first element is, what it is.
#[derive(Debug, Clone, Copy)]
pub struct PlacedTensor<'a> {
    /// The name both sides know it by (a state dict's key).
    pub name: &'a str,
    /// The address of its first element in this process.
    pub ptr: DeviceAddress,
    /// Element type, shape and strides.
    pub meta: &'a TensorMeta,
}

/// What an install may leave out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanOptions {
    /// Published tensors no destination names are skipped instead of refused (a consumer that
    /// holds part of the model). Every destination must still be published.
    pub allow_unused_sources: bool,
}

/// The copies that move every source into the destination of the same name (see
/// [`build`](Self::build)). Computed once per pair of layouts; replaying it costs only the copies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstallPlan {
    copies: Vec<DeviceCopy>,
    tensors: usize,
    bytes: u64,
    key: u64,
}

/// At most this many names are listed in one error.
const LISTED: usize = 5;

fn listed(names: &[&str]) -> String {
    let mut text = names
        .iter()
        .take(LISTED)
        .map(|n| format!("{n:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > LISTED {
        text.push_str(&format!(" and {} more", names.len() - LISTED));
    }
    text
}

impl InstallPlan {
    /// Checks that `sources` and `destinations` match by name, element type, shape and strides, and
    /// plans the copies: one per tensor, then runs adjacent on both sides (a tensor ending where the
    /// next begins, in both processes) merged into one.
    ///
    /// Nothing is copied here; every problem is found before any byte could be written.
    ///
    /// # Errors
    ///
    /// [`Error::WeightsMismatch`] naming the tensors: a destination nobody published, a published
    /// tensor without destination (unless [`PlanOptions::allow_unused_sources`]), a different
    /// element type, shape or strides, a tensor whose elements do not fill its bytes exactly once
    /// (a strided slice or a broadcast: copy it with a strided kernel, such as PyTorch's
    /// `_foreach_copy_`), a name given twice, or destinations that overlap.
    pub fn build(
        sources: &[PlacedTensor<'_>],
        destinations: &[PlacedTensor<'_>],
        options: PlanOptions,
    ) -> Result<Self> {
        Self::build_in_regions(sources, &[], destinations, &[], options)
    }

    /// [`build`](Self::build), told which region each tensor lies in (`source_regions[i]` for
    /// `sources[i]`, any number naming the region, such as its base address), so that copies
    /// adjacent on both sides merge: a merged copy never leaves one region on either side. A region
    /// is memory mapped as one piece, which one copy may run through: an allocation (the driver
    /// refuses a copy that spans two), or a range of chunks mapped contiguously (see
    /// [`crate::weights#how-copies-are-merged`]). Empty slices: nothing merges.
    ///
    /// # Errors
    ///
    /// As [`build`](Self::build); [`Error::WeightsMismatch`] if a non-empty slice of regions is
    /// not as long as its tensors.
    pub fn build_in_regions(
        sources: &[PlacedTensor<'_>],
        source_regions: &[u64],
        destinations: &[PlacedTensor<'_>],
        destination_regions: &[u64],
        options: PlanOptions,
    ) -> Result<Self> {
        let merge = !source_regions.is_empty() || !destination_regions.is_empty();
        if merge
            && (source_regions.len() != sources.len()
                || destination_regions.len() != destinations.len())
        {
            return Err(Error::WeightsMismatch {
                problem: format!(
                    "{} source regions for {} sources and {} destination regions for {} \
                     destinations; give one region per tensor",
                    source_regions.len(),
                    sources.len(),
                    destination_regions.len(),
                    destinations.len()
                ),
            });
        }
        let mismatch = |problem: String| Error::WeightsMismatch { problem };
        let mut by_name: HashMap<&str, (usize, &PlacedTensor<'_>)> =
            HashMap::with_capacity(sources.len());
        for (i, s) in sources.iter().enumerate() {
            if by_name.insert(s.name, (i, s)).is_some() {
                return Err(mismatch(format!("the source {:?} is named twice", s.name)));
            }
        }
        let mut seen: HashMap<&str, ()> = HashMap::with_capacity(destinations.len());
        let mut missing = Vec::new();
        let mut different = Vec::new();
        let mut strided = Vec::new();
        let mut copies = Vec::with_capacity(destinations.len());
        for (di, d) in destinations.iter().enumerate() {
            if seen.insert(d.name, ()).is_some() {
                return Err(mismatch(format!(
                    "the destination {:?} is named twice",
                    d.name
                )));
            }
            d.meta
                .check()
                .map_err(|p| mismatch(format!("destination {:?}: {p}", d.name)))?;
            let Some(&(si, s)) = by_name.get(d.name) else {
                missing.push(d.name);
                continue;
            };
            if s.meta != d.meta {
                different.push(format!("{:?} is {} there, {} here", d.name, s.meta, d.meta));
                continue;
            }
            if !d.meta.is_dense() {
                strided.push(d.name);
                continue;
            }
            let len = d.meta.span();
            if len > 0 {
                // Without regions every copy is a region of its own: nothing merges.
                let region = if merge {
                    (source_regions[si], destination_regions[di])
                } else {
                    (u64::MAX, di as u64)
                };
                copies.push((
                    DeviceCopy {
                        src: s.ptr,
                        dst: d.ptr,
                        len,
                    },
                    region,
                ));
            }
        }
        if !missing.is_empty() {
            return Err(mismatch(format!(
                "{} destination(s) were not published: {}",
                missing.len(),
                listed(&missing)
            )));
        }
        if !different.is_empty() {
            let n = different.len();
            different.truncate(LISTED);
            return Err(mismatch(format!(
                "{n} tensor(s) differ: {}{}",
                different.join("; "),
                if n > LISTED { "; ..." } else { "" }
            )));
        }
        if !strided.is_empty() {
            return Err(mismatch(format!(
                "{} tensor(s) do not fill their bytes exactly once (strided slices or broadcasts), \
                 so they cannot be copied as byte ranges: {}; publish and install contiguous \
                 tensors (or copy these with a strided kernel)",
                strided.len(),
                listed(&strided)
            )));
        }
        if !options.allow_unused_sources && sources.len() > seen.len() {
            let unused: Vec<&str> = sources
                .iter()
                .map(|s| s.name)
                .filter(|n| !seen.contains_key(n))
                .collect();
            return Err(mismatch(format!(
                "{} published tensor(s) have no destination: {}; give them one, or allow unused \
                 sources (PlanOptions::allow_unused_sources)",
                unused.len(),
                listed(&unused)
            )));
        }
        copies.sort_unstable_by_key(|(c, _)| (c.dst.0, c.len, c.src.0));
        // Tied weights (two names for one tensor) on both sides: one copy.
        copies.dedup_by_key(|(c, _)| *c);
        for pair in copies.windows(2) {
            let (a, b) = (&pair[0].0, &pair[1].0);
            if a.dst.0 + a.len > b.dst.0 {
                return Err(mismatch(format!(
                    "two destinations overlap (bytes {:#x}..{:#x} and {:#x}..{:#x}); each \
                     destination must be memory of its own",
                    a.dst.0,
                    a.dst.0 + a.len,
                    b.dst.0,
                    b.dst.0 + b.len
                )));
            }
        }
        let tensors = destinations.len();
        let bytes = copies.iter().map(|(c, _)| c.len).sum();
        let copies = merge_adjacent(copies);
        Ok(Self {
            copies,
            tensors,
            bytes,
            key: layout_key(sources, destinations),
        })
    }

    /// The copies, in destination order.
    #[must_use]
    pub fn copies(&self) -> &[DeviceCopy] {
        &self.copies
    }

    /// How many destination tensors it installs.
    #[must_use]
    pub fn tensors(&self) -> usize {
        self.tensors
    }

    /// How many bytes it copies.
    #[must_use]
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// A fingerprint of the two layouts it was built for (names, types, shapes, strides and
    /// addresses on both sides): equal keys, equal plans.
    #[must_use]
    pub fn key(&self) -> u64 {
        self.key
    }
}

/// The fingerprint of a pair of layouts (see [`InstallPlan::key`]).
#[must_use]
pub fn layout_key(sources: &[PlacedTensor<'_>], destinations: &[PlacedTensor<'_>]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for side in [sources, destinations] {
        side.len().hash(&mut h);
        for t in side {
            (t.name, t.ptr.0, t.meta).hash(&mut h);
        }
    }
    h.finish()
}

/// Merges copies (sorted by destination) that continue one another on both sides inside one
/// region (allocation) of each side.
fn merge_adjacent(copies: Vec<(DeviceCopy, (u64, u64))>) -> Vec<DeviceCopy> {
    let mut merged: Vec<(DeviceCopy, (u64, u64))> = Vec::with_capacity(copies.len());
    for (c, region) in copies {
        match merged.last_mut() {
            Some((last, last_region))
                if *last_region == region
                    && last.dst.0 + last.len == c.dst.0
                    && last.src.0 + last.len == c.src.0 =>
            {
                last.len += c.len;
            }
            _ => merged.push((c, region)),
        }
    }
    merged.into_iter().map(|(c, _)| c).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::meta::DType;

    fn t<'a>(name: &'a str, ptr: u64, meta: &'a TensorMeta) -> PlacedTensor<'a> {
        PlacedTensor {
            name,
            ptr: DeviceAddress(ptr),
            meta,
        }
    }

    #[test]
    fn adjacent_runs_merge_and_others_do_not() {
        let m = TensorMeta::contiguous(DType::BFloat16, &[256]); // 512 bytes
        let src = [t("a", 0x1000, &m), t("b", 0x1200, &m), t("c", 0x9000, &m)];
        // a and b adjacent on both sides; c adjacent to b here but not there.
        let dst = [
            t("b", 0x20200, &m),
            t("a", 0x20000, &m),
            t("c", 0x20400, &m),
        ];
        // Without regions nothing merges.
        let plain = InstallPlan::build(&src, &dst, PlanOptions::default()).unwrap();
        assert_eq!(plain.copies().len(), 3);
        // One allocation on each side (c's source in another): a and b merge.
        let (src_regions, dst_regions) = ([1, 1, 2], [7, 7, 7]);
        let plan = InstallPlan::build_in_regions(
            &src,
            &src_regions,
            &dst,
            &dst_regions,
            PlanOptions::default(),
        )
        .unwrap();
        assert_eq!(
            plan.copies(),
            &[
                DeviceCopy {
                    src: DeviceAddress(0x1000),
                    dst: DeviceAddress(0x20000),
                    len: 1024
                },
                DeviceCopy {
                    src: DeviceAddress(0x9000),
                    dst: DeviceAddress(0x20400),
                    len: 512
                },
            ]
        );
        assert_eq!((plan.tensors(), plan.bytes()), (3, 1536));
        // Adjacent, but in two allocations of the destination: never one copy.
        let split = InstallPlan::build_in_regions(
            &src,
            &src_regions,
            &dst,
            &[7, 8, 7],
            PlanOptions::default(),
        )
        .unwrap();
        assert_eq!(split.copies().len(), 3);
        let err =
            InstallPlan::build_in_regions(&src, &[1], &dst, &dst_regions, PlanOptions::default())
                .unwrap_err();
        assert!(err.to_string().contains("one region per tensor"), "{err}");
        let again = InstallPlan::build(&src, &dst, PlanOptions::default()).unwrap();
        assert_eq!(again.key(), plain.key());
    }

    #[test]
    fn mismatches_are_named_before_anything_is_planned() {
        let m = TensorMeta::contiguous(DType::Float32, &[4, 4]);
        let other = TensorMeta::contiguous(DType::Float32, &[4, 5]);
        let half = TensorMeta::contiguous(DType::Float16, &[4, 4]);
        let src = [t("w", 0x1000, &m), t("x", 0x2000, &m)];
        let err =
            |dst: &[PlacedTensor<'_>], o| InstallPlan::build(&src, dst, o).unwrap_err().to_string();
        let e = err(
            &[t("w", 0x10, &m), t("y", 0x900, &m)],
            PlanOptions::default(),
        );
        assert!(e.contains("not published") && e.contains("\"y\""), "{e}");
        let e = err(
            &[t("w", 0x10, &other), t("x", 0x900, &m)],
            PlanOptions::default(),
        );
        assert!(
            e.contains("[4, 4] there") && e.contains("[4, 5] here"),
            "{e}"
        );
        let e = err(
            &[t("w", 0x10, &half), t("x", 0x900, &m)],
            PlanOptions::default(),
        );
        assert!(e.contains("float32") && e.contains("float16"), "{e}");
        let e = err(&[t("w", 0x10, &m)], PlanOptions::default());
        assert!(e.contains("no destination") && e.contains("\"x\""), "{e}");
        let ok = InstallPlan::build(
            &src,
            &[t("w", 0x10, &m)],
            PlanOptions {
                allow_unused_sources: true,
            },
        )
        .unwrap();
        assert_eq!(ok.tensors(), 1);
        let e = err(
            &[t("w", 0x1000, &m), t("x", 0x1020, &m)],
            PlanOptions::default(),
        );
        assert!(e.contains("overlap"), "{e}");
        let e = err(
            &[t("w", 0x10, &m), t("w", 0x900, &m)],
            PlanOptions::default(),
        );
        assert!(e.contains("named twice"), "{e}");
        // Tied on both sides: one copy; tied here only: refused.
        let tied = [t("w", 0x1000, &m), t("x", 0x1000, &m)];
        let plan = InstallPlan::build(
            &tied,
            &[t("w", 0x10, &m), t("x", 0x10, &m)],
            PlanOptions::default(),
        )
        .unwrap();
        assert_eq!(plan.copies().len(), 1);
        let e = err(
            &[t("w", 0x10, &m), t("x", 0x10, &m)],
            PlanOptions::default(),
        );
        assert!(e.contains("overlap"), "{e}");
    }

    #[test]
    fn strided_tensors_are_refused_and_transposes_copy_whole() {
        let sliced = TensorMeta {
            dtype: DType::Float32,
            shape: vec![4, 2],
            strides: vec![4, 2],
        };
        let e = InstallPlan::build(
            &[t("s", 0x1000, &sliced)],
            &[t("s", 0x2000, &sliced)],
            PlanOptions::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("strided"), "{e}");
        let transposed = TensorMeta {
            dtype: DType::Float32,
            shape: vec![3, 4],
            strides: vec![1, 3],
        };
        let plan = InstallPlan::build(
            &[t("t", 0x1000, &transposed)],
            &[t("t", 0x2000, &transposed)],
            PlanOptions::default(),
        )
        .unwrap();
        assert_eq!(plan.bytes(), 48);
    }
}
