//! POSIX shared memory names: validation, generation and parsing.
//!
//! A name is what `shm_open(3)` takes: one leading `/`, then 1 to 255 bytes (`NAME_MAX`) with no
//! further `/` and no NUL. On Linux the object appears as `/dev/shm/<name without the slash>`.
//!
//! Generated names have the shape PyTorch's `NewProcessWideShmHandle` produces,
//! `/<prefix>_<pid>_<random>_<counter>`: the pid tells housekeeping tools (`tensormem shm gc`)
//! whether the creator still lives, the random part (8 bytes from the kernel's `getrandom(2)`)
//! makes names unguessable, and the process-wide counter makes them unique within the process
//! even if the random part repeated.

use std::borrow::Borrow;
use std::ffi::OsStr;
use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

pub use crate::error::MAX_PREFIX_LEN;
use crate::error::{Error, NameProblem, Result};

/// Most bytes allowed after the leading `/` (Linux `NAME_MAX`).
pub const MAX_NAME_LEN: usize = 255;

/// The prefix tensormem uses for the names it generates.
pub const DEFAULT_PREFIX: &str = "tensormem";

/// The prefix PyTorch uses (`/torch_<pid>_<random>_<counter>`).
pub const TORCH_PREFIX: &str = "torch";

/// Where Linux exposes POSIX shared memory objects.
pub const SHM_DIR: &str = "/dev/shm";

/// A validated POSIX shared memory name such as `/tensormem_4242_1234567890_0`.
///
/// Holding a `ShmName` proves the name passed [`ShmName::new`]'s checks, so every function taking
/// one can hand it to `shm_open` without re-validating.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ShmName(String);

impl ShmName {
    /// Validates `name`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] if the name does not start with `/`, has nothing or more than
    /// [`MAX_NAME_LEN`] bytes after it, contains another `/` or a NUL, or is `/.` or `/..`.
    pub fn new(name: impl Into<String>) -> Result<Self> {
        let name = name.into();
        match check_name(name.as_bytes()) {
            Ok(()) => Ok(Self(name)),
            Err(problem) => Err(Error::InvalidName { name, problem }),
        }
    }

    /// Validates a name given as raw bytes (for names read off a socket or a directory).
    ///
    /// # Errors
    ///
    /// As [`ShmName::new`]; non-UTF-8 names are refused with [`NameProblem::NotUtf8`].
    pub fn from_bytes(name: &[u8]) -> Result<Self> {
        check_name(name).map_err(|problem| Error::InvalidName {
            name: String::from_utf8_lossy(name).into_owned(),
            problem,
        })?;
        match std::str::from_utf8(name) {
            Ok(s) => Ok(Self(s.to_owned())),
            Err(_) => Err(Error::InvalidName {
                name: String::from_utf8_lossy(name).into_owned(),
                problem: NameProblem::NotUtf8,
            }),
        }
    }

    /// The name of the object behind a `/dev/shm` directory entry (`"torch_1_2_3"` gives
    /// `"/torch_1_2_3"`).
    ///
    /// # Errors
    ///
    /// As [`ShmName::from_bytes`].
    pub fn from_file_name(file_name: &OsStr) -> Result<Self> {
        let mut bytes = Vec::with_capacity(file_name.len() + 1);
        bytes.push(b'/');
        bytes.extend_from_slice(file_name.as_bytes());
        Self::from_bytes(&bytes)
    }

    /// The name, leading `/` included.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Where the object lives in the filesystem (`/dev/shm/<name>` on Linux).
    pub fn path(&self) -> PathBuf {
        Path::new(SHM_DIR).join(&self.0[1..])
    }

    /// Splits a generated name `/<prefix>_<pid>_<random>_<counter>` into its parts; `None` for
    /// names of any other shape. Works for PyTorch's names too (prefix `torch`).
    pub fn parse_generated(&self) -> Option<GeneratedName<'_>> {
        let body = &self.0[1..];
        let mut fields = body.rsplitn(4, '_');
        let counter = fields.next()?.parse().ok()?;
        let random = fields.next()?.parse().ok()?;
        let pid = fields.next()?.parse().ok()?;
        let prefix = fields.next()?;
        if prefix.is_empty() {
            return None;
        }
        Some(GeneratedName {
            prefix,
            pid,
            random,
            counter,
        })
    }

    /// A short description for messages and logs: `shm "/name"`.
    pub(crate) fn describe(&self) -> String {
        format!("shm {:?}", self.0)
    }
}

/// Eight bytes from `getrandom(2)`. Where the call is unavailable (kernels before 3.17, seccomp
/// filters), a SipHash of the counter keyed by std's `RandomState` (itself seeded by the OS),
/// which is just as unpredictable to other processes.
#[doc(alias = "getrandom")]
fn random_u64() -> u64 {
    let mut bytes = [0u8; 8];
    let mut filled = 0;
    while filled < bytes.len() {
        match rustix::rand::getrandom(&mut bytes[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(_) => {
                use std::hash::{BuildHasher, Hasher};
                let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
                hasher.write_u64(COUNTER.load(Ordering::Relaxed));
                hasher.write_u32(std::process::id());
                return hasher.finish();
            }
        }
    }
    u64::from_ne_bytes(bytes)
}

fn check_name(name: &[u8]) -> Result<(), NameProblem> {
    let Some(rest) = name.strip_prefix(b"/") else {
        return Err(NameProblem::NoLeadingSlash);
    };
    if rest.contains(&0) {
        return Err(NameProblem::Nul);
    }
    if rest.is_empty() {
        return Err(NameProblem::Empty);
    }
    if rest.contains(&b'/') {
        return Err(NameProblem::InnerSlash);
    }
    if rest.len() > MAX_NAME_LEN {
        return Err(NameProblem::TooLong);
    }
    if rest == b"." || rest == b".." {
        return Err(NameProblem::DotName);
    }
    Ok(())
}

impl fmt::Display for ShmName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ShmName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl AsRef<str> for ShmName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for ShmName {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl std::str::FromStr for ShmName {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::new(s)
    }
}

impl TryFrom<String> for ShmName {
    type Error = Error;

    fn try_from(s: String) -> Result<Self> {
        Self::new(s)
    }
}

impl TryFrom<&str> for ShmName {
    type Error = Error;

    fn try_from(s: &str) -> Result<Self> {
        Self::new(s)
    }
}

/// The parts of a generated name (see [`ShmName::parse_generated`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GeneratedName<'a> {
    /// The prefix (`tensormem`, `torch`, ...).
    pub prefix: &'a str,
    /// The pid of the process that made the name.
    pub pid: u32,
    /// The random part.
    pub random: u64,
    /// The creating process's counter.
    pub counter: u64,
}

/// Process-wide counter shared by every generator, as PyTorch's is: names stay unique in a
/// process whatever the prefixes.
static COUNTER: AtomicU64 = AtomicU64::new(0);

/// Makes process-unique, unguessable names `/<prefix>_<pid>_<random>_<counter>`.
///
/// ```
/// use tensormem_shm::{NameGenerator, TORCH_PREFIX};
///
/// let name = NameGenerator::default().next_name();
/// assert!(name.as_str().starts_with("/tensormem_"));
/// let parts = name.parse_generated().unwrap();
/// assert_eq!(parts.pid, std::process::id());
///
/// let torch = NameGenerator::with_prefix(TORCH_PREFIX)?.next_name();
/// assert!(torch.as_str().starts_with("/torch_"));
/// # Ok::<(), tensormem_shm::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct NameGenerator {
    prefix: String,
}

impl Default for NameGenerator {
    fn default() -> Self {
        Self {
            prefix: DEFAULT_PREFIX.to_owned(),
        }
    }
}

impl NameGenerator {
    /// A generator whose names start with `/<prefix>_`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidPrefix`] unless the prefix is 1 to [`MAX_PREFIX_LEN`] bytes of ASCII
    /// letters, digits, `-`, `.` or `_`.
    pub fn with_prefix(prefix: impl Into<String>) -> Result<Self> {
        let prefix = prefix.into();
        let valid = !prefix.is_empty()
            && prefix.len() <= MAX_PREFIX_LEN
            && prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'));
        if valid {
            Ok(Self { prefix })
        } else {
            Err(Error::InvalidPrefix { prefix })
        }
    }

    /// The prefix in use.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// A fresh name. Never repeats within this process; another process cannot predict it.
    pub fn next_name(&self) -> ShmName {
        let counter = COUNTER.fetch_add(1, Ordering::Relaxed);
        let random = random_u64();
        let name = format!(
            "/{}_{}_{}_{}",
            self.prefix,
            std::process::id(),
            random,
            counter
        );
        debug_assert!(check_name(name.as_bytes()).is_ok(), "{name}");
        ShmName(name)
    }
}
