//! `storage_copy` (PyTorch: `at::storage_copy`): bytes from one storage into another of the
//! same size, whatever memory each lives in.

#[cfg(feature = "manager")]
use tensormem_shm::Mapping;

use crate::error::{Error, Result};
use crate::owner::Owner;
use crate::storage::Storage;

/// Bytes moved per step when neither side is private memory (shared to shared), through a
/// buffer: shared memory is only reached through copies.
const CHUNK: usize = 1 << 20;

/// Copies every byte of `src` into `dst` (PyTorch: `at::storage_copy(dst, src, non_blocking)`).
///
/// Host to host copies are done when this returns, whatever `non_blocking` says. Copies that
/// involve a CUDA storage (feature `cuda`) are ordered on the current stream of the device
/// involved and, with `non_blocking`, may still be in flight when this returns (as PyTorch's
/// `copy_(src, non_blocking=True)`): synchronize that stream before reading the destination
/// from the host.
///
/// Copying a storage onto itself does nothing. Two threads copying `a -> b` and `b -> a` at
/// the same time do not deadlock (locks are taken in a fixed order).
///
/// # Errors
///
/// [`Error::SizeMismatch`] when the sizes differ (nothing is copied); errors of the memory
/// involved.
pub fn storage_copy(dst: &Storage, src: &Storage, non_blocking: bool) -> Result<()> {
    if dst.nbytes() != src.nbytes() {
        return Err(Error::SizeMismatch {
            dst: dst.nbytes(),
            src: src.nbytes(),
        });
    }
    if dst.ptr_eq(src) || dst.nbytes() == 0 {
        return Ok(());
    }
    let len = dst.nbytes();
    let (src_owner, mut dst_owner);
    if dst.lock_order() < src.lock_order() {
        dst_owner = dst.owner_mut();
        src_owner = src.owner();
    } else {
        src_owner = src.owner();
        dst_owner = dst.owner_mut();
    }
    #[cfg(feature = "cuda")]
    if !src_owner.is_host() || !dst_owner.is_host() {
        return copy_with_device(&mut dst_owner, &src_owner, len, non_blocking);
    }
    let _ = non_blocking; // host copies are synchronous
    copy_owner(&mut dst_owner, &src_owner, len)
}

/// Copies between two owners of which at least one is CUDA memory (called by `storage_copy`,
/// which checked the sizes and holds both locks).
#[cfg(feature = "cuda")]
fn copy_with_device(dst: &mut Owner, src: &Owner, len: usize, non_blocking: bool) -> Result<()> {
    match (dst, src) {
        (Owner::Cuda(d), Owner::Cuda(s)) => d.copy_from_device(s, len, non_blocking),
        (Owner::Cuda(d), host) => match host.private_bytes() {
            Some(bytes) => d.write_at(0, &bytes[..len]),
            None => {
                let mut staging = vec![0u8; len];
                host.read_at(0, &mut staging)?;
                d.write_at(0, &staging)
            }
        },
        (host, Owner::Cuda(s)) => match host.private_bytes_mut() {
            Some(bytes) => s.read_at(0, &mut bytes[..len]),
            None => {
                let mut staging = vec![0u8; len];
                s.read_at(0, &mut staging)?;
                host.write_at(0, &staging)
            }
        },
        (dst, src) => copy_owner(dst, src, len),
    }
}

/// Copies `len` bytes between two host owners.
fn copy_owner(dst: &mut Owner, src: &Owner, len: usize) -> Result<()> {
    if let Some(bytes) = dst.private_bytes_mut() {
        return src.read_at(0, &mut bytes[..len]);
    }
    if let Some(bytes) = src.private_bytes() {
        return dst.write_at(0, &bytes[..len]);
    }
    copy_through_buffer(src, len, |offset, piece| dst.write_at(offset, piece))
}

/// Copies the first `len` bytes of a host owner into a fresh mapping.
#[cfg(feature = "manager")] // its one caller moves a storage into a named region
pub(crate) fn copy_host(src: &Owner, dst: &mut Mapping, len: usize) -> Result<()> {
    if let Some(bytes) = src.private_bytes() {
        dst.write_at(0, &bytes[..len])?;
        return Ok(());
    }
    copy_through_buffer(src, len, |offset, piece| Ok(dst.write_at(offset, piece)?))
}

/// Copies the first `len` bytes of `src` through a buffer of at most [`CHUNK`] bytes, handing
/// each piece read to `write` with its offset.
fn copy_through_buffer(
    src: &Owner,
    len: usize,
    mut write: impl FnMut(usize, &[u8]) -> Result<()>,
) -> Result<()> {
    let mut buf = vec![0u8; len.min(CHUNK)];
    let mut offset = 0;
    while offset < len {
        let n = (len - offset).min(CHUNK);
        src.read_at(offset, &mut buf[..n])?;
        write(offset, &buf[..n])?;
        offset += n;
    }
    Ok(())
}
