//! What tells the crate's wire formats apart: the magic bytes each protocol's messages start
//! with, and [`WireFormat`], the name an error gives a protocol. Below every protocol that speaks
//! them ([`transfer`](crate::transfer), [`channel`](crate::channel), [`pool`](crate::pool)) and
//! below the error type, which names the format a wrongly paired peer speaks by its magic.

use std::fmt;

/// Magic of a region message on a Unix socket ([`transfer`](crate::transfer)).
pub(crate) const REGION_MAGIC: [u8; 4] = *b"TMSR";

/// Magic of a [`channel`](crate::channel)'s setup frame, and the first word of its memory's
/// header.
pub(crate) const CHANNEL_MAGIC: [u8; 4] = *b"TMCH";

/// Magic of a [`channel`](crate::channel)'s fd frame.
pub(crate) const FD_MAGIC: [u8; 4] = *b"TMFD";

/// Magic of the accept frame of a plain [`Channel::accept`](crate::channel::Channel::accept) (a
/// pool's producer sends [`POOL_MAGIC`] instead).
pub(crate) const ACCEPT_MAGIC: [u8; 4] = *b"TMCA";

/// Magic of a [pool](crate::pool) connection's messages (and of its producer's accept frame).
pub(crate) const POOL_MAGIC: [u8; 4] = *b"TMPL";

/// Which of the crate's wire formats an [`Error::Protocol`](crate::Error::Protocol) concerns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WireFormat {
    /// A region message on a Unix socket ([`transfer`](crate::transfer)).
    Region,
    /// A shared-memory [`channel`](crate::channel): its setup, its fd frames, its ring.
    Channel,
    /// A [pool](crate::pool) connection: region messages to the consumer, its records back.
    Pool,
}

impl fmt::Display for WireFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Region => "region",
            Self::Channel => "channel",
            Self::Pool => "pool",
        })
    }
}

impl WireFormat {
    /// The first four bytes of this format's messages (a channel's: its setup frame).
    pub(crate) const fn magic(self) -> [u8; 4] {
        match self {
            Self::Region => REGION_MAGIC,
            Self::Channel => CHANNEL_MAGIC,
            Self::Pool => POOL_MAGIC,
        }
    }
}
