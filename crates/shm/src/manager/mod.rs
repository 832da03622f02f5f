//! Managed named regions and the manager daemon: leak-free named shared memory even when
//! processes are killed.
//!
//! # The problem
//!
//! A named shared memory object outlives every process that mapped it until someone calls
//! `shm_unlink`. A refcounted region's last closer unlinks it, but a process killed with
//! `kill -9` closes nothing, and its names stay in `/dev/shm` until reboot. PyTorch's
//! `file_system` sharing strategy therefore registers every name with `torch_shm_manager`, a
//! daemon that outlives the workers and unlinks the names of clients that went away.
//!
//! # How tensormem does it
//!
//! - The first [`Manager::connect`] (or [`ManagedRegion::create`]) that finds no daemon starts
//!   one, which detaches (`setsid`) and listens on a Unix socket in a private runtime directory
//!   ([`ManagerConfig`]). No binary is needed: unless `TENSORMEM_SHM_MANAGER` names one, the
//!   program re-runs its own image, and a start-up hook of this library turns that process into
//!   the daemon before the program's `main`; where that is impossible (the library inside a
//!   shared object) a single-threaded client forks the daemon instead ([`StartMethod`]; details
//!   and the reasoning in `docs/shm-manager.md`). [`serve`] and [`run`] host the daemon in a process of your own. Racing starters leave exactly one daemon: the
//!   daemon holds `flock` on a lock file, and losers step back once the winner answers.
//! - Each client process holds one connection. The daemon records, per connection, the names
//!   it holds. When a connection closes, which the kernel does for a dead process whatever
//!   killed it, the daemon drops that client's holds and unlinks every name no other live
//!   client holds.
//! - A region's normal close also goes through the daemon ([`Manager::release`]): the last
//!   holder's release unlinks the name, so closes and deaths cannot race.
//! - With no clients for a quiet period (5 s by default), the daemon exits.
//! - Both ends check the peer's uid (`SO_PEERCRED`); the socket directory is mode 0700.
//!
//! The protocol and lifecycle are documented in `docs/shm-manager.md`.
//!
//! ```no_run
//! use tensormem_shm::manager::ManagedRegion;
//!
//! let region = ManagedRegion::create(4096)?; // starts the daemon if needed
//! let peer_view = ManagedRegion::open(region.name())?; // in another process, usually
//! drop(region);
//! drop(peer_view); // last holder: the daemon unlinks the name
//! # Ok::<(), tensormem_shm::Error>(())
//! ```

mod client;
mod config;
mod daemon;
mod error;
#[doc(hidden)]
pub mod fuzzing;
mod launch;
mod log;
mod protocol;
mod region;
mod registry;

pub use client::{Manager, ManagerStatus};
pub use config::{
    ManagerConfig, StartMethod, BINARY_NAME, DEFAULT_CONNECT_TIMEOUT, DEFAULT_QUIET_PERIOD,
    ENV_BINARY, ENV_DIR, ENV_LOG, ENV_QUIET_MS, LOCK_NAME, SOCKET_NAME,
};
pub use daemon::{serve, Startup};
pub use error::ManagerError;
pub use launch::{run, RunMode, ENV_ROLE};
pub use log::ENV_LOG_LEVEL;
pub use region::ManagedRegion;
