//! `from_file` (PyTorch: `UntypedStorage.from_file(filename, shared, nbytes)`, `MapAllocator` on
//! a regular file).

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

use tensormem_shm::{CreateMode, MapOptions};

use crate::error::{check_size, Error, Result};
use crate::owner::Owner;
use crate::storage::Storage;

impl Storage {
    /// A storage over the regular file at `path` (PyTorch: `UntypedStorage.from_file`).
    ///
    /// - `shared = true`: the file is mapped `MAP_SHARED`, so writes reach the file and every
    ///   other process mapping it. With `size = Some(n)` the file is created if missing and grown
    ///   to `n` bytes if shorter (as PyTorch does); with `None` it must exist and its whole length
    ///   is mapped. The descriptor is kept, so [`share_fd`](Self::share_fd) can pass it on.
    /// - `shared = false`: a private copy of the first `n` bytes (or the whole file); writes stay
    ///   in this process (PyTorch maps `MAP_PRIVATE`, copy-on-write; this reads the file with
    ///   `read(2)` instead, so a file truncated by someone else is an error, never a `SIGBUS`).
    ///
    /// # Errors
    ///
    /// [`Error::Shm`] wrapping `NotFound`, `WrongKind` (a directory, FIFO, socket, device: the kind
    /// is checked before anything is read, so a FIFO without a writer is refused, not waited on),
    /// `TooSmall`
    /// (`size` larger than a file that is not grown), `ForeignOwner` (a shared mapping of a
    /// file another user owns), `PermissionDenied`; [`Error::Empty`] for an empty file or
    /// `size = Some(0)`; [`Error::InvalidSize`] beyond the address space.
    pub fn from_file(path: impl AsRef<Path>, shared: bool, size: Option<u64>) -> Result<Storage> {
        let path = path.as_ref();
        if size == Some(0) {
            return Err(Error::Empty { op: "from_file" });
        }
        if let Some(size) = size {
            check_size(size, "from_file")?;
        }
        if shared {
            let mut options = MapOptions::new().keep_fd(true);
            if let Some(size) = size {
                options = options.create(CreateMode::OpenOrCreate).len(size);
            }
            let region = options.map_path(path).map_err(|e| match e {
                // Opening an empty file without a size asks for "at least one byte".
                tensormem_shm::Error::TooSmall { actual: 0, .. } if size.is_none() => {
                    Error::Empty { op: "from_file" }
                }
                other => Error::Shm(other),
            })?;
            tracing::debug!(path = %path.display(), len = region.len(), "mapped a file shared");
            return Ok(Self::with_owner(region.len(), Owner::File(region)));
        }
        let bytes = read_private(path, size)?;
        if bytes.is_empty() {
            return Err(Error::Empty { op: "from_file" });
        }
        Ok(Self::from_vec(bytes))
    }
}

/// Reads `size` bytes (or everything) of the regular file at `path`.
fn read_private(path: &Path, size: Option<u64>) -> Result<Vec<u8>> {
    let object = format!("file {:?}", path.display().to_string());
    let io_err = |op: &'static str| {
        let object = object.clone();
        move |source: std::io::Error| {
            Error::Shm(match source.kind() {
                std::io::ErrorKind::NotFound => tensormem_shm::Error::NotFound { object },
                std::io::ErrorKind::PermissionDenied => {
                    tensormem_shm::Error::PermissionDenied { object, op, source }
                }
                _ => tensormem_shm::Error::Os { object, op, source },
            })
        }
    };
    // `O_NONBLOCK`: opening a FIFO for reading would otherwise wait for a writer before the kind
    // could be checked. It changes nothing for the regular files read below.
    let file: File = OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
        .open(path)
        .map_err(io_err("open"))?;
    let meta = file.metadata().map_err(io_err("fstat"))?;
    if !meta.is_file() {
        let kind = meta.file_type();
        let kind = if kind.is_dir() {
            tensormem_shm::ObjectKind::Directory
        } else if kind.is_fifo() {
            tensormem_shm::ObjectKind::Fifo
        } else if kind.is_socket() {
            tensormem_shm::ObjectKind::Socket
        } else if kind.is_char_device() {
            tensormem_shm::ObjectKind::CharDevice
        } else if kind.is_block_device() {
            tensormem_shm::ObjectKind::BlockDevice
        } else {
            tensormem_shm::ObjectKind::Unknown
        };
        return Err(Error::Shm(tensormem_shm::Error::WrongKind { object, kind }));
    }
    let wanted = size.unwrap_or(meta.len());
    if meta.len() < wanted {
        return Err(Error::Shm(tensormem_shm::Error::TooSmall {
            object,
            actual: meta.len(),
            needed: wanted,
        }));
    }
    let wanted = check_size(wanted, "from_file")?;
    let mut bytes = vec![0u8; wanted];
    let mut reader = file.take(wanted as u64);
    let mut filled = 0;
    while filled < wanted {
        match reader.read(&mut bytes[filled..]).map_err(io_err("read"))? {
            // Truncated while reading: what is there is less than asked for.
            0 => {
                return Err(Error::Shm(tensormem_shm::Error::TooSmall {
                    object,
                    actual: filled as u64,
                    needed: wanted as u64,
                }))
            }
            n => filled += n,
        }
    }
    Ok(bytes)
}
