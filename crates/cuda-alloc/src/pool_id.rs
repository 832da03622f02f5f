//! Names of private memory pools.

use std::fmt;

/// A private pool's id: PyTorch's `MempoolId_t`, a pair whose first half is set for pools made by
/// graph capture and whose second half is set for pools made by `graph_pool_handle()` /
/// `torch.cuda.MemPool`. `(0, 0)` names the default pools.
#[derive(
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Default,
    Debug,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct MempoolId(pub u64, pub u64);

impl MempoolId {
    /// The default pools' id, `(0, 0)`.
    pub const DEFAULT: MempoolId = MempoolId(0, 0);

    /// Whether this names the default pools.
    #[must_use]
    pub const fn is_default(self) -> bool {
        self.0 == 0 && self.1 == 0
    }
}

impl fmt::Display for MempoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "({}, {})", self.0, self.1)
    }
}
