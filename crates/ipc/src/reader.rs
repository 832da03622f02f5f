//! Reading the crate's little-endian wire formats (batches, weights messages) field by field,
//! every read checked against the bytes that are there.

use crate::error::{Error, Result};

/// A cursor over a message's bytes; a read past the end is the format's own "malformed" error.
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    /// Where the next read starts.
    pub(crate) at: usize,
    malformed: fn(String) -> Error,
}

impl<'a> Reader<'a> {
    /// A reader of `bytes` from `at`, whose errors are made by `malformed` from the problem.
    pub(crate) fn new(bytes: &'a [u8], at: usize, malformed: fn(String) -> Error) -> Self {
        Self {
            bytes,
            at,
            malformed,
        }
    }

    /// The next `len` bytes, the `what` of the format.
    pub(crate) fn take(&mut self, len: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.at.checked_add(len).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return Err((self.malformed)(format!(
                "truncated: the {what} needs {len} bytes at {}, but the message has {}",
                self.at,
                self.bytes.len()
            )));
        };
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    pub(crate) fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    pub(crate) fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }

    pub(crate) fn u16(&mut self, what: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }
}
