//! [`Device`]: where a storage's bytes live.

use std::fmt;

/// Where a storage's bytes live (PyTorch's `torch.device` for storages).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Device {
    /// Host memory.
    Cpu,
    /// Memory of the CUDA device with this index.
    Cuda(u32),
}

impl Device {
    /// Whether this is host memory.
    pub fn is_cpu(self) -> bool {
        matches!(self, Self::Cpu)
    }

    /// Whether this is CUDA device memory.
    pub fn is_cuda(self) -> bool {
        matches!(self, Self::Cuda(_))
    }
}

/// `cpu` or `cuda:N`, as PyTorch prints devices.
impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(index) => write!(f, "cuda:{index}"),
        }
    }
}
