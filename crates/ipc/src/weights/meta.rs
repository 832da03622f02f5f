//! What a published tensor is, beyond its bytes: element type, shape and strides ([`TensorMeta`]).

use std::fmt;

use tensormem_cuda_alloc::DeviceAddress;

/// An element type, by the name PyTorch prints for it (`torch.bfloat16` is `"bfloat16"`).
///
/// The set is what weights are stored in; the wire code of each is stable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// `torch.float32`.
    Float32,
    /// `torch.float16`.
    Float16,
    /// `torch.bfloat16`.
    BFloat16,
    /// `torch.float64`.
    Float64,
    /// `torch.float8_e4m3fn`.
    Float8E4M3Fn,
    /// `torch.float8_e5m2`.
    Float8E5M2,
    /// `torch.int64`.
    Int64,
    /// `torch.int32`.
    Int32,
    /// `torch.int16`.
    Int16,
    /// `torch.int8`.
    Int8,
    /// `torch.uint8`.
    UInt8,
    /// `torch.bool`.
    Bool,
}

const ALL: [DType; 12] = [
    DType::Float32,
    DType::Float16,
    DType::BFloat16,
    DType::Float64,
    DType::Float8E4M3Fn,
    DType::Float8E5M2,
    DType::Int64,
    DType::Int32,
    DType::Int16,
    DType::Int8,
    DType::UInt8,
    DType::Bool,
];

impl DType {
    /// Bytes per element.
    #[must_use]
    pub fn size(self) -> u64 {
        match self {
            Self::Float64 | Self::Int64 => 8,
            Self::Float32 | Self::Int32 => 4,
            Self::Float16 | Self::BFloat16 | Self::Int16 => 2,
            Self::Float8E4M3Fn | Self::Float8E5M2 | Self::Int8 | Self::UInt8 | Self::Bool => 1,
        }
    }

    /// PyTorch's name (`"bfloat16"` for `torch.bfloat16`).
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Float32 => "float32",
            Self::Float16 => "float16",
            Self::BFloat16 => "bfloat16",
            Self::Float64 => "float64",
            Self::Float8E4M3Fn => "float8_e4m3fn",
            Self::Float8E5M2 => "float8_e5m2",
            Self::Int64 => "int64",
            Self::Int32 => "int32",
            Self::Int16 => "int16",
            Self::Int8 => "int8",
            Self::UInt8 => "uint8",
            Self::Bool => "bool",
        }
    }

    /// The type PyTorch calls `name` (also its aliases `float`, `half`, `double`, `long`, `int`,
    /// `short`), or `None`.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Self> {
        let name = name.strip_prefix("torch.").unwrap_or(name);
        let alias = match name {
            "float" => Some(Self::Float32),
            "half" => Some(Self::Float16),
            "double" => Some(Self::Float64),
            "long" => Some(Self::Int64),
            "int" => Some(Self::Int32),
            "short" => Some(Self::Int16),
            _ => None,
        };
        alias.or_else(|| ALL.into_iter().find(|d| d.name() == name))
    }

    /// The stable wire code.
    pub(crate) fn code(self) -> u8 {
        ALL.iter()
            .position(|&d| d == self)
            .map_or(u8::MAX, |i| i as u8)
    }

    /// The type of wire code `code`.
    pub(crate) fn from_code(code: u8) -> Option<Self> {
        ALL.get(usize::from(code)).copied()
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The most dimensions a tensor may have (PyTorch's own limit is 64 as well).
pub const MAX_DIMS: usize = 64;

/// A tensor's element type, shape and strides (in elements), as PyTorch describes it. Its bytes are
/// elsewhere (a named view of a batch, or a pointer of the consumer's): `offset` 0 of those bytes is
/// its first element (PyTorch's `data_ptr()`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TensorMeta {
    /// Element type.
    pub dtype: DType,
    /// Sizes of each dimension.
    pub shape: Vec<u64>,
    /// Strides of each dimension, in elements (as `tensor.stride()`; never negative in PyTorch).
    pub strides: Vec<u64>,
}

impl TensorMeta {
    /// A contiguous (row-major) tensor of `shape`.
    #[must_use]
    pub fn contiguous(dtype: DType, shape: &[u64]) -> Self {
        let mut strides = vec![0; shape.len()];
        let mut step = 1u64;
        for (stride, &size) in strides.iter_mut().zip(shape).rev() {
            *stride = step;
            step = step.saturating_mul(size.max(1));
        }
        Self {
            dtype,
            shape: shape.to_vec(),
            strides,
        }
    }

    /// Number of elements.
    #[must_use]
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Bytes of its elements (`numel * element size`).
    #[must_use]
    pub fn nbytes(&self) -> u64 {
        self.numel().saturating_mul(self.dtype.size())
    }

    /// Bytes from its first element to one past its last (`0` when it has no elements): what a copy
    /// of the whole tensor touches.
    #[must_use]
    pub fn span(&self) -> u64 {
        if self.shape.contains(&0) {
            return 0;
        }
        let last: u64 = self
            .shape
            .iter()
            .zip(&self.strides)
            .map(|(&size, &stride)| (size - 1).saturating_mul(stride))
            .fold(0u64, u64::saturating_add);
        last.saturating_add(1).saturating_mul(self.dtype.size())
    }

    /// Whether its elements fill its span exactly once (contiguous up to a permutation of the
    /// dimensions, as `t.t()` is): then its bytes can be copied as one range.
    #[must_use]
    pub fn is_dense(&self) -> bool {
        self.span() == self.nbytes() && (self.nbytes() == 0 || self.non_overlapping())
    }

    /// Whether no two indices of it name one element (checked on strides sorted by size).
    fn non_overlapping(&self) -> bool {
        let mut dims: Vec<(u64, u64)> = self
            .shape
            .iter()
            .zip(&self.strides)
            .filter(|(&size, _)| size > 1)
            .map(|(&size, &stride)| (stride, size))
            .collect();
        dims.sort_unstable();
        let mut need = 1u64;
        for (stride, size) in dims {
            if stride < need {
                return false;
            }
            need = stride.saturating_mul(size);
        }
        true
    }

    /// Checks that shape and strides have one entry per dimension and at most [`MAX_DIMS`]; the
    /// problem as text.
    pub(crate) fn check(&self) -> Result<(), String> {
        if self.shape.len() != self.strides.len() {
            return Err(format!(
                "{} sizes but {} strides",
                self.shape.len(),
                self.strides.len()
            ));
        }
        if self.shape.len() > MAX_DIMS {
            return Err(format!(
                "{} dimensions (at most {MAX_DIMS})",
                self.shape.len()
            ));
        }
        Ok(())
    }
}

impl fmt::Display for TensorMeta {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {:?}", self.dtype, self.shape)?;
        if self.strides != Self::contiguous(self.dtype, &self.shape).strides {
            write!(f, " strides {:?}", self.strides)?;
        }
        Ok(())
    }
}

/// One tensor to publish: its name, the address of its first element, what it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishedTensor {
    /// The name consumers know it by (a state dict's key); distinct within a publication, except
    /// for tied weights (two names, the same bytes and layout).
    pub name: String,
    /// The address of its first element (PyTorch's `data_ptr()`).
    pub ptr: DeviceAddress,
    /// Element type, shape and strides.
    pub meta: TensorMeta,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_codes_round_trip() {
        for d in ALL {
            assert_eq!(DType::from_name(d.name()), Some(d));
            assert_eq!(DType::from_code(d.code()), Some(d));
        }
        assert_eq!(DType::from_name("torch.half"), Some(DType::Float16));
        assert_eq!(DType::from_name("complex64"), None);
        assert_eq!(DType::from_code(200), None);
    }

    #[test]
    fn span_and_density() {
        let m = TensorMeta::contiguous(DType::BFloat16, &[4, 3]);
        assert_eq!(
            (m.strides.clone(), m.span(), m.nbytes()),
            (vec![3, 1], 24, 24)
        );
        assert!(m.is_dense());
        // The transpose is dense; every other column is not.
        let t = TensorMeta {
            dtype: DType::Float32,
            shape: vec![3, 4],
            strides: vec![1, 3],
        };
        assert!(t.is_dense());
        let sliced = TensorMeta {
            dtype: DType::Float32,
            shape: vec![4, 2],
            strides: vec![4, 2],
        };
        assert!(!sliced.is_dense());
        assert_eq!(sliced.span(), (3 * 4 + 2 + 1) * 4);
        // A broadcast (stride 0) overlaps itself.
        let expanded = TensorMeta {
            dtype: DType::Float32,
            shape: vec![4, 2],
            strides: vec![0, 1],
        };
        assert!(!expanded.is_dense());
        let empty = TensorMeta::contiguous(DType::Int8, &[0, 5]);
        assert_eq!((empty.span(), empty.nbytes()), (0, 0));
        assert!(empty.is_dense());
    }
}
