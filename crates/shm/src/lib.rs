//! CPU shared memory for tensors.
