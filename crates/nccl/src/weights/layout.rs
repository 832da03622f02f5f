//! What every rank agrees on: the tensors' names, sizes and metadata in the sending rank's order
//! ([`WeightLayout`]), its bytes (sent once, when ranks connect) and its fingerprint (checked at
//! every sync).

use std::collections::HashSet;

use tensormem_cuda_alloc::DeviceAddress;

use crate::error::{Error, Result};

/// One of this rank's tensors: where it lies and what it is.
///
/// `meta` is opaque text compared whole between ranks (an element type and a shape, e.g.
/// `"bf16[4096,4096]"`); tensors whose sizes agree but whose metadata differ are refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalTensor {
    /// The name, unique among this rank's tensors (a state dict's key).
    pub name: String,
    /// Its first byte, in this rank's device memory; the tensor is contiguous.
    pub ptr: DeviceAddress,
    /// Its size in bytes.
    pub bytes: u64,
    /// Element type and shape, or whatever else both sides must agree on.
    pub meta: String,
}

/// A tensor as the ranks agree on it: [`LocalTensor`] without the address.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TensorSpec {
    /// The name.
    pub name: String,
    /// The size in bytes.
    pub bytes: u64,
    /// Opaque metadata, compared whole.
    pub meta: String,
}

/// The tensors of a state dict in the sending rank's order: the order in which their bytes travel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightLayout {
    /// Unique names (checked by every constructor).
    tensors: Vec<TensorSpec>,
}

/// The first bytes of an encoded layout, and its format's version.
const MAGIC: [u8; 4] = *b"TMWL";
const VERSION: u32 = 1;

impl WeightLayout {
    /// A layout of `tensors`, in their order.
    ///
    /// # Errors
    ///
    /// [`Error::DuplicateName`] if two tensors share a name.
    pub fn new(tensors: Vec<TensorSpec>) -> Result<Self> {
        let mut seen = HashSet::with_capacity(tensors.len());
        if let Some(t) = tensors.iter().find(|t| !seen.insert(t.name.as_str())) {
            return Err(Error::DuplicateName {
                name: t.name.clone(),
            });
        }
        Ok(Self { tensors })
    }

    /// The layout of this rank's tensors, in their order.
    ///
    /// # Errors
    ///
    /// [`Error::DuplicateName`] if two tensors share a name.
    pub fn of(local: &[LocalTensor]) -> Result<Self> {
        Self::new(
            local
                .iter()
                .map(|t| TensorSpec {
                    name: t.name.clone(),
                    bytes: t.bytes,
                    meta: t.meta.clone(),
                })
                .collect(),
        )
    }

    /// The tensors, in order.
    #[must_use]
    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    /// The bytes of all tensors together.
    #[must_use]
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.bytes).sum()
    }

    /// The layout as bytes: `TMWL`, a version, the count, then each tensor's name, size and
    /// metadata (lengths little-endian).
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.tensors.len() * 64);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&t.bytes.to_le_bytes());
            put_str(&mut out, &t.meta);
        }
        out
    }

    /// The layout [`encode`](Self::encode) wrote.
    ///
    /// # Errors
    ///
    /// [`Error::LayoutBytes`] for bytes that are not an encoded layout of this version;
    /// [`Error::DuplicateName`].
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader(bytes);
        if r.take(4)? != MAGIC {
            return Err(bad("no layout magic"));
        }
        if r.u32()? != VERSION {
            return Err(bad("another version of the layout format"));
        }
        let count = r.u64()?;
        // Each tensor takes at least 16 bytes: a bound before reserving room for `count`.
        if count > (r.0.len() / 16) as u64 {
            return Err(bad("more tensors than bytes"));
        }
        let mut tensors = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let name = r.str()?;
            let bytes = r.u64()?;
            let meta = r.str()?;
            tensors.push(TensorSpec { name, bytes, meta });
        }
        if !r.0.is_empty() {
            return Err(bad("bytes after the last tensor"));
        }
        Self::new(tensors)
    }

    /// A 64-bit fingerprint of the layout and a bucket size (FNV-1a over the encoding and the
    /// size), never 0: ranks that computed the same fingerprint move the same bytes in the same
    /// buckets.
    #[must_use]
    pub fn fingerprint(&self, bucket_bytes: usize) -> u64 {
        let mut hash = Fnv::default();
        hash.write(&self.encode());
        hash.write(&(bucket_bytes as u64).to_le_bytes());
        hash.0.max(1)
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn bad(reason: &'static str) -> Error {
    Error::LayoutBytes { reason }
}

/// A cursor over encoded bytes.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.0.len() < n {
            return Err(bad("cut short"));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }

    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64> {
        let mut word = [0u8; 8];
        word.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(word))
    }

    fn str(&mut self) -> Result<String> {
        let len = self.u32()? as usize;
        String::from_utf8(self.take(len)?.to_vec()).map_err(|_| bad("a name that is not UTF-8"))
    }
}

/// FNV-1a, 64 bits: the same on every machine and every build (unlike `std`'s hashers).
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, bytes: u64) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            bytes,
            meta: format!("u8[{bytes}]"),
        }
    }

    #[test]
    fn a_layout_survives_its_encoding_and_every_cut_is_refused() {
        let layout = WeightLayout::new(vec![spec("wte", 4096), spec("ln.é", 0)]).unwrap();
        let bytes = layout.encode();
        assert_eq!(WeightLayout::decode(&bytes).unwrap(), layout);
        for cut in 0..bytes.len() {
            assert!(WeightLayout::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(
            WeightLayout::decode(&longer),
            Err(Error::LayoutBytes {
                reason: "bytes after the last tensor"
            })
        );
    }

    #[test]
    fn names_are_unique() {
        assert_eq!(
            WeightLayout::new(vec![spec("a", 1), spec("b", 1), spec("a", 2)]),
            Err(Error::DuplicateName { name: "a".into() })
        );
    }

    #[test]
    fn the_fingerprint_follows_names_sizes_order_metadata_and_bucket_size() {
        let base = WeightLayout::new(vec![spec("a", 8), spec("b", 16)]).unwrap();
        let fp = base.fingerprint(1 << 20);
        assert_eq!(fp, base.clone().fingerprint(1 << 20));
        let others = [
            WeightLayout::new(vec![spec("b", 16), spec("a", 8)]).unwrap(),
            WeightLayout::new(vec![spec("a", 8), spec("b", 24)]).unwrap(),
            WeightLayout::new(vec![spec("a", 8), spec("c", 16)]).unwrap(),
            WeightLayout::new(vec![
                spec("a", 8),
                TensorSpec {
                    meta: "bf16[8]".into(),
                    ..spec("b", 16)
                },
            ])
            .unwrap(),
        ];
        for other in &others {
            assert_ne!(other.fingerprint(1 << 20), fp, "{other:?}");
        }
        assert_ne!(base.fingerprint(2 << 20), fp);
    }
}
