//! Which process is which: a pid alone is reused, so processes are identified by pid, start time
//! (`/proc/<pid>/stat` field 22) and pid namespace, which is what the ref-counter files record for
//! the slots consumers hold and for their creator.

use std::sync::OnceLock;

/// A process, told apart from later processes that reuse its pid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessIdentity {
    /// Its pid.
    pub pid: u32,
    /// When it started, in clock ticks since boot.
    pub start_time: u64,
    /// The inode of its pid namespace (pids of other namespaces cannot be checked).
    pub pid_namespace: u64,
}

/// Whether a recorded process still runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// It runs (or might: another pid namespace, unreadable `/proc`).
    Alive,
    /// It has exited (or is a zombie), and its pid is free or taken by another process.
    Dead,
}

impl ProcessIdentity {
    /// This process.
    pub fn current() -> Self {
        static CURRENT: OnceLock<ProcessIdentity> = OnceLock::new();
        *CURRENT.get_or_init(|| {
            let pid = std::process::id();
            ProcessIdentity {
                pid,
                start_time: stat_of(pid).map_or(0, |s| s.1),
                pid_namespace: own_pid_namespace(),
            }
        })
    }

    /// Whether the process still runs. Errs towards [`Liveness::Alive`]: a process of another pid
    /// namespace, or one whose `/proc` entry cannot be read for another reason than its absence, counts
    /// as alive (reclaiming a live consumer's memory would corrupt it; keeping a dead one's only leaks).
    pub fn liveness(&self) -> Liveness {
        if self.pid == 0 || self.pid_namespace != own_pid_namespace() {
            return Liveness::Alive;
        }
        match stat_of(self.pid) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Liveness::Dead,
            Err(_) => Liveness::Alive,
            Ok((state, start)) => {
                if state == 'Z' || state == 'X' || start != self.start_time {
                    Liveness::Dead
                } else {
                    Liveness::Alive
                }
            }
        }
    }
}

fn own_pid_namespace() -> u64 {
    use std::os::unix::fs::MetadataExt;
    static NS: OnceLock<u64> = OnceLock::new();
    *NS.get_or_init(|| std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino()))
}

/// State letter and start time of `pid` from `/proc/<pid>/stat`.
fn stat_of(pid: u32) -> std::io::Result<(char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_stat(&text).ok_or_else(|| std::io::Error::other("unparseable /proc/<pid>/stat"))
}

/// The comm field may hold spaces and parentheses: fields are counted after the last `)`.
fn parse_stat(text: &str) -> Option<(char, u64)> {
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // Fields 3.. follow; start time is field 22, the 20th after the state.
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_parsing_survives_odd_names() {
        let line = "42 (a) b) c) S 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 12345 23 24";
        assert_eq!(parse_stat(line), Some(('S', 12345)));
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn this_process_is_alive_and_a_changed_start_time_is_not() {
        let me = ProcessIdentity::current();
        assert!(me.start_time > 0);
        assert_eq!(me.liveness(), Liveness::Alive);
        let reused = ProcessIdentity {
            start_time: me.start_time + 1,
            ..me
        };
        assert_eq!(reused.liveness(), Liveness::Dead);
        let other_ns = ProcessIdentity {
            pid_namespace: me.pid_namespace + 1,
            start_time: 1,
            ..me
        };
        assert_eq!(other_ns.liveness(), Liveness::Alive);
    }

    #[test]
    fn an_exited_child_is_dead() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let start = stat_of(pid).map(|s| s.1).unwrap_or(0);
        child.wait().unwrap();
        let gone = ProcessIdentity {
            pid,
            start_time: start,
            pid_namespace: ProcessIdentity::current().pid_namespace,
        };
        assert_eq!(gone.liveness(), Liveness::Dead);
    }
}
