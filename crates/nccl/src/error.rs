//! The crate's one error type, and what it names: NCCL's result codes and the differences between
//! two weight layouts ([`Mismatch`]).

use std::fmt;

use tensormem_cuda_alloc::DeviceError;

/// What can go wrong registering memory with NCCL or moving weights through it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An NCCL registration call failed.
    #[error(
        "{call}({addr:#x}, {size} bytes) failed: {} (code {code}); check that the communicator \
         lives on the allocator's device and that NCCL supports buffer registration (2.19 or later)",
        result_name(*.code)
    )]
    Nccl {
        /// The call, `ncclCommRegister` or `ncclCommDeregister`.
        call: &'static str,
        /// The range concerned.
        addr: u64,
        /// Its size in bytes.
        size: u64,
        /// NCCL's result code (`ncclResult_t`), e.g. 5 for `ncclInvalidUsage`; the message names it.
        code: i32,
    },
    /// An NCCL collective or communicator query failed (`ncclBroadcast`, `ncclAllReduce`,
    /// `ncclCommUserRank`, ...).
    #[error(
        "{call} failed: {} (code {code}); NCCL_DEBUG=WARN says why",
        result_name(*.code)
    )]
    Collective {
        /// The call.
        call: &'static str,
        /// NCCL's result code (`ncclResult_t`).
        code: i32,
    },
    /// The collectives of a weight sync did not finish in time
    /// ([`SyncOptions::timeout`](crate::weights::SyncOptions::timeout)).
    #[error(
        "rank {rank}: the collectives of the weight sync did not finish within {waited:?}: another \
         rank most likely died or stopped syncing; this sync is broken (its staging buffers stay \
         allocated under the stalled collectives): abort the communicator (ncclCommAbort) on \
         every surviving rank and make a new one"
    )]
    TimedOut {
        /// This rank.
        rank: usize,
        /// How long it waited.
        waited: std::time::Duration,
    },
    /// The communicator is null.
    #[error("the NCCL communicator is null; pass one from ncclCommInitRank or ncclCommInitAll")]
    NullCommunicator,
    /// The device could not be opened, or a device call (a copy, an event, a stream) failed.
    #[error("CUDA device: {0}")]
    Device(#[from] DeviceError),
    /// This rank's tensors do not match the layout the sending rank announced; nothing was sent.
    #[error(
        "this rank's tensors do not match the sender's layout ({} difference{}): {}",
        .mismatches.len(),
        if .mismatches.len() == 1 { "" } else { "s" },
        Listed(.mismatches)
    )]
    Layout {
        /// Every difference, in the sender's order (then this rank's tensors the sender lacks).
        mismatches: Vec<Mismatch>,
    },
    /// Another rank's layout, bucket size or plan differs from this rank's (its own error names the
    /// differences); nothing was sent.
    #[error(
        "the ranks do not agree on the weights' layout (this rank's fingerprint {fingerprint:#018x}): \
         another rank's tensors or bucket size differ, and its error says how; nothing was sent"
    )]
    LayoutRejected {
        /// This rank's fingerprint of the agreed layout and bucket size.
        fingerprint: u64,
    },
    /// The sending rank buckets weights at another size than this rank.
    #[error(
        "the sender buckets weights by {sender} bytes, this rank by {here}: give every rank the same \
         bucket_bytes"
    )]
    BucketSize {
        /// The sender's bucket size.
        sender: u64,
        /// This rank's.
        here: u64,
    },
    /// A bucket size below the minimum.
    #[error("a bucket of {bytes} bytes is below the minimum of {min} bytes")]
    BucketTooSmall {
        /// The size asked for.
        bytes: usize,
        /// The smallest accepted.
        min: usize,
    },
    /// The sending rank is not a rank of the communicator.
    #[error("root rank {root} is not a rank of a communicator of {ranks}")]
    BadRoot {
        /// The root asked for.
        root: usize,
        /// The communicator's size.
        ranks: usize,
    },
    /// Two tensors of one rank have the same name.
    #[error("two tensors are named {name:?}; names must be unique")]
    DuplicateName {
        /// The name.
        name: String,
    },
    /// A layout's encoded bytes are not a layout (corrupt or from another version).
    #[error("the layout bytes received are not a layout: {reason}")]
    LayoutBytes {
        /// What is wrong with them.
        reason: &'static str,
    },
    /// An earlier sync failed part way: the ranks may be at different points of the exchange.
    #[error(
        "an earlier sync of these weights failed part way; make a new sync (and most likely a new \
         communicator) on every rank"
    )]
    Broken,
}

/// One difference between the sending rank's layout and a receiving rank's tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Mismatch {
    /// The sender sends a tensor this rank does not have.
    Missing {
        /// The tensor's name.
        name: String,
    },
    /// This rank has a tensor the sender does not send.
    Unsent {
        /// The tensor's name.
        name: String,
    },
    /// The tensor's size differs.
    Size {
        /// The tensor's name.
        name: String,
        /// Its bytes on the sender.
        sent: u64,
        /// Its bytes here.
        here: u64,
    },
    /// The tensor's metadata (element type, shape: opaque text, compared whole) differs.
    Meta {
        /// The tensor's name.
        name: String,
        /// The sender's.
        sent: String,
        /// This rank's.
        here: String,
    },
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Missing { name } => write!(f, "{name:?} is sent but not here"),
            Self::Unsent { name } => write!(f, "{name:?} is here but not sent"),
            Self::Size { name, sent, here } => {
                write!(f, "{name:?} is {sent} bytes on the sender, {here} here")
            }
            Self::Meta { name, sent, here } => {
                write!(f, "{name:?} is {sent:?} on the sender, {here:?} here")
            }
        }
    }
}

/// The first few mismatches, for a message.
struct Listed<'a>(&'a [Mismatch]);

impl fmt::Display for Listed<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 5;
        for (i, m) in self.0.iter().take(SHOWN).enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{m}")?;
        }
        if self.0.len() > SHOWN {
            write!(f, "; and {} more", self.0.len() - SHOWN)?;
        }
        Ok(())
    }
}

/// NCCL's name of result code `code` (`ncclResult_t` in `nccl.h`).
fn result_name(code: i32) -> &'static str {
    match code {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        _ => "an unknown NCCL result",
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::{Error, Mismatch};

    #[test]
    fn an_nccl_failure_keeps_its_code_and_names_it() {
        let error = Error::Nccl {
            call: "ncclCommRegister",
            addr: 0x1000,
            size: 512,
            code: 5,
        };
        let text = error.to_string();
        assert!(
            text.starts_with(
                "ncclCommRegister(0x1000, 512 bytes) failed: ncclInvalidUsage (code 5);"
            ),
            "{text}"
        );
        let unknown = Error::Nccl {
            call: "ncclCommDeregister",
            addr: 0,
            size: 1,
            code: 42,
        };
        assert!(unknown
            .to_string()
            .contains("an unknown NCCL result (code 42)"));
        let collective = Error::Collective {
            call: "ncclBroadcast",
            code: 6,
        };
        assert!(collective
            .to_string()
            .starts_with("ncclBroadcast failed: ncclRemoteError (code 6)"));
    }

    #[test]
    fn a_layout_error_lists_the_first_differences() {
        let mut mismatches: Vec<Mismatch> = (0..7)
            .map(|i| Mismatch::Missing {
                name: format!("w{i}"),
            })
            .collect();
        mismatches.insert(
            0,
            Mismatch::Size {
                name: "emb".into(),
                sent: 8,
                here: 4,
            },
        );
        let text = Error::Layout { mismatches }.to_string();
        assert!(
            text.starts_with(
                "this rank's tensors do not match the sender's layout (8 differences): \"emb\" is 8 \
                 bytes on the sender, 4 here; \"w0\" is sent but not here;"
            ),
            "{text}"
        );
        assert!(
            text.ends_with("\"w3\" is sent but not here; and 3 more"),
            "{text}"
        );
    }
}
