//! CPU shared memory for tensors.

mod anon;
pub mod copy;
mod error;
pub mod mapping;
pub mod name;
mod object;
mod region;

pub use copy::copy_prefaulted;
pub use error::{Error, NameProblem, ObjectKind, Result, SizeProblem};
pub use mapping::{Access, Mapping, SharedAtomic};
pub use name::{GeneratedName, NameGenerator, ShmName, DEFAULT_PREFIX, TORCH_PREFIX};
pub use object::{unlink_shm, CreateMode};
pub use region::{Backing, MapOptions, SharedRegion};
