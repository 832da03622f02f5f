//! `tensormem shm`: list and garbage-collect shared memory objects in `/dev/shm`.
//!
//! The scanning and the decisions live in `tensormem_shm::housekeeping`; this module parses the
//! arguments and formats the results as a table or as JSON.

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use serde_json::{json, Value};
use tensormem_shm::housekeeping::{
    self, GcOptions, GcReport, KeepReason, PidNamespace, ShmObject, Verdict, DEFAULT_PREFIXES,
};
use tensormem_shm::NameGenerator;

/// The `shm` subcommands.
#[derive(Debug, Subcommand)]
pub(crate) enum ShmCommand {
    /// List shared memory objects: name, size, owner, creating pid and whether it still lives,
    /// and how many live processes use each.
    List(ListArgs),
    /// Remove objects whose creating process is dead and that no live process maps or holds
    /// open. Outside the initial PID namespace (in a container) nothing is removed unless
    /// --this-namespace-only says no process outside uses these objects.
    Gc(GcArgs),
}

/// Which objects to look at.
#[derive(Debug, Args)]
pub(crate) struct Filter {
    /// Look at names starting with PREFIX_ (repeatable) [default: tensormem, torch]
    #[arg(long = "prefix", value_name = "PREFIX")]
    prefixes: Vec<String>,
}

impl Filter {
    /// The prefixes to scan, validated with the rules generated names follow.
    fn prefixes(&self) -> anyhow::Result<Vec<String>> {
        if self.prefixes.is_empty() {
            return Ok(DEFAULT_PREFIXES.iter().map(|p| (*p).to_owned()).collect());
        }
        for prefix in &self.prefixes {
            NameGenerator::with_prefix(prefix.as_str())?;
        }
        Ok(self.prefixes.clone())
    }
}

/// Arguments of `shm list`.
#[derive(Debug, Args)]
pub(crate) struct ListArgs {
    #[command(flatten)]
    filter: Filter,
    /// Print a JSON array instead of a table.
    #[arg(long)]
    json: bool,
}

/// Arguments of `shm gc`.
#[derive(Debug, Args)]
pub(crate) struct GcArgs {
    #[command(flatten)]
    filter: Filter,
    /// Only report what would be removed.
    #[arg(long)]
    dry_run: bool,
    /// Every process that uses these objects runs in this PID namespace (a container with a
    /// /dev/shm of its own): remove orphans even outside the initial namespace. Wrong with
    /// --ipc=host or a /dev/shm shared with other containers: their live memory would go.
    #[arg(long)]
    this_namespace_only: bool,
    /// Print a JSON report instead of text.
    #[arg(long)]
    json: bool,
}

/// Runs one `shm` subcommand, printing to stdout.
pub(crate) fn run(command: ShmCommand) -> anyhow::Result<()> {
    match command {
        ShmCommand::List(args) => {
            let prefixes = args.filter.prefixes()?;
            let objects = housekeeping::list(&as_strs(&prefixes))
                .context("cannot list shared memory objects")?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&list_json(&objects))?);
            } else {
                print!("{}", list_table(&objects, &prefixes));
                let namespace = housekeeping::current_pid_namespace();
                if namespace != PidNamespace::Initial && !objects.is_empty() {
                    println!(
                        "note: this runs in {namespace}, not the initial one: creators and \
                         users in other namespaces are not seen (ALIVE and USERS may be wrong)"
                    );
                }
            }
            Ok(())
        }
        ShmCommand::Gc(args) => {
            let prefixes = args.filter.prefixes()?;
            let options = GcOptions {
                dry_run: args.dry_run,
                this_namespace_only: args.this_namespace_only,
            };
            let report = housekeeping::collect_garbage_with(&as_strs(&prefixes), options)
                .context("cannot collect shared memory garbage")?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&gc_json(&report))?);
            } else {
                print!("{}", gc_text(&report));
            }
            if !report.failed.is_empty() {
                bail!(
                    "could not remove {} of {} orphaned objects (see above); \
                     objects of other users need their owner or root",
                    report.failed.len(),
                    report.failed.len() + report.removed.len()
                );
            }
            Ok(())
        }
    }
}

fn as_strs(prefixes: &[String]) -> Vec<&str> {
    prefixes.iter().map(String::as_str).collect()
}

/// `4.0 KiB`, `1.5 GiB`, `512 B`.
fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

fn owner(object: &ShmObject) -> String {
    object
        .owner
        .as_deref()
        .map_or_else(|| object.owner_uid.to_string(), printable)
}

/// `text` safe to print on a terminal: control characters (escape sequences, newlines, carriage
/// returns, backspaces) and the Unicode direction overrides become Rust escapes (`\u{1b}`, `\n`),
/// so an object name in `/dev/shm`, which any local user can choose, cannot move the cursor,
/// clear the screen, forge extra lines or reorder what follows it. Backslashes are doubled, so
/// the output stays unambiguous.
fn printable(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        let bidi = matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
        if c.is_control() || bidi || c == '\\' {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    out
}

fn object_json(object: &ShmObject) -> Value {
    json!({
        "name": object.name.as_str(),
        "size": object.size,
        "owner_uid": object.owner_uid,
        "owner": object.owner,
        "creator_pid": object.creator.map(|c| c.pid),
        "creator_alive": object.creator_alive(),
        "users": object.users,
        "garbage": object.verdict() == Verdict::Garbage,
    })
}

fn list_json(objects: &[ShmObject]) -> Value {
    Value::Array(objects.iter().map(object_json).collect())
}

fn list_table(objects: &[ShmObject], prefixes: &[String]) -> String {
    if objects.is_empty() {
        return format!(
            "no shared memory objects named {} in /dev/shm\n",
            prefixes
                .iter()
                .map(|p| format!("{p}_*"))
                .collect::<Vec<_>>()
                .join(" or ")
        );
    }
    let rows: Vec<[String; 6]> = objects
        .iter()
        .map(|o| {
            [
                printable(o.name.as_str()),
                human_size(o.size),
                owner(o),
                o.creator
                    .map_or_else(|| "-".to_owned(), |c| c.pid.to_string()),
                match o.creator_alive() {
                    Some(true) => "yes",
                    Some(false) => "no",
                    None => "?",
                }
                .to_owned(),
                o.users.len().to_string(),
            ]
        })
        .collect();
    let header = ["NAME", "SIZE", "OWNER", "CREATOR", "ALIVE", "USERS"];
    let mut widths = header.map(str::len);
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.len());
        }
    }
    let mut out = String::new();
    let mut line = |cells: [&str; 6]| {
        let text: Vec<String> = cells
            .iter()
            .zip(widths)
            .enumerate()
            .map(|(i, (cell, width))| {
                if i == 0 || i == 2 {
                    format!("{cell:<width$}")
                } else {
                    format!("{cell:>width$}")
                }
            })
            .collect();
        out.push_str(text.join("  ").trim_end());
        out.push('\n');
    };
    line(header);
    for row in &rows {
        line(row.each_ref().map(String::as_str));
    }
    let total: u64 = objects.iter().map(|o| o.size).sum();
    let garbage = objects
        .iter()
        .filter(|o| o.verdict() == Verdict::Garbage)
        .count();
    out.push_str(&format!(
        "{}, {}; {garbage} orphaned (creator dead, unused){}\n",
        crate::count(objects.len() as u64, "object", "objects"),
        human_size(total),
        if garbage > 0 {
            ": `tensormem shm gc` removes them"
        } else {
            ""
        }
    ));
    out
}

fn reason_name(reason: KeepReason) -> &'static str {
    match reason {
        KeepReason::UnknownCreator => "unknown_creator",
        KeepReason::CreatorAlive => "creator_alive",
        KeepReason::InUse => "in_use",
        KeepReason::OtherNamespace => "other_namespace",
    }
}

fn gc_json(report: &GcReport) -> Value {
    json!({
        "dry_run": report.dry_run,
        "removed": report.removed.iter().map(object_json).collect::<Vec<_>>(),
        "kept": report.kept.iter().map(|(o, reason)| {
            let mut value = object_json(o);
            value["reason"] = json!(reason_name(*reason));
            value
        }).collect::<Vec<_>>(),
        "failed": report.failed.iter().map(|(o, error)| {
            let mut value = object_json(o);
            value["error"] = json!(error.to_string());
            value
        }).collect::<Vec<_>>(),
        "uninspected_processes": report.uninspected,
        "pid_namespace": match report.namespace {
            PidNamespace::Initial => json!("initial"),
            PidNamespace::Other { inode } => json!(format!("pid:[{inode}]")),
            PidNamespace::Unknown => json!("unknown"),
        },
    })
}

fn gc_text(report: &GcReport) -> String {
    let verb = if report.dry_run {
        "would remove"
    } else {
        "removed"
    };
    let mut out = String::new();
    for object in &report.removed {
        out.push_str(&format!(
            "{verb} {} ({}, creator {} dead)\n",
            printable(object.name.as_str()),
            human_size(object.size),
            object.creator.map_or(0, |c| c.pid)
        ));
    }
    for (object, error) in &report.failed {
        out.push_str(&format!(
            "could not remove {}: {}\n",
            printable(object.name.as_str()),
            printable(&error.to_string())
        ));
    }
    let freed: u64 = report.removed.iter().map(|o| o.size).sum();
    out.push_str(&format!(
        "{verb} {} ({})",
        crate::count(report.removed.len() as u64, "object", "objects"),
        human_size(freed)
    ));
    if !report.kept.is_empty() {
        let count = |reason| report.kept.iter().filter(|(_, r)| *r == reason).count();
        let reasons: Vec<String> = [
            KeepReason::CreatorAlive,
            KeepReason::InUse,
            KeepReason::UnknownCreator,
            KeepReason::OtherNamespace,
        ]
        .into_iter()
        .filter(|r| count(*r) > 0)
        .map(|r| format!("{} {r}", count(r)))
        .collect();
        out.push_str(&format!(
            "; kept {} ({})",
            report.kept.len(),
            reasons.join(", ")
        ));
    }
    out.push('\n');
    if report.uninspected > 0 {
        out.push_str(&format!(
            "note: {} could not be inspected (permission denied); objects only they use look \
             unused\n",
            crate::count(report.uninspected as u64, "process", "processes")
        ));
    }
    let foreign = report
        .kept
        .iter()
        .filter(|(_, r)| *r == KeepReason::OtherNamespace)
        .count();
    if foreign > 0 {
        out.push_str(&format!(
            "note: gc runs in {}, not the initial one, where processes outside it are not seen: \
             {} that look{} orphaned {} kept. Run gc on the host; or, if no \
             process outside this namespace uses /dev/shm (a container with its own), run it \
             again with --this-namespace-only\n",
            report.namespace,
            crate::count(foreign as u64, "object", "objects"),
            if foreign == 1 { "s" } else { "" },
            if foreign == 1 { "was" } else { "were" },
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tensormem_shm::housekeeping::Creator;
    use tensormem_shm::ShmName;

    fn object(name: &str, size: u64, creator: Option<(u32, bool)>, users: Vec<u32>) -> ShmObject {
        ShmObject {
            name: ShmName::new(name).unwrap(),
            size,
            owner_uid: 1000,
            owner: Some("alice".to_owned()),
            creator: creator.map(|(pid, alive)| Creator { pid, alive }),
            users,
        }
    }

    #[test]
    fn names_cannot_reach_the_terminal_raw() {
        assert_eq!(printable("a\u{1b}[2Jb"), "a\\u{1b}[2Jb");
        assert_eq!(printable("x\ny\rz\u{8}"), "x\\ny\\rz\\u{8}");
        assert_eq!(printable("evil\u{202e}txt"), "evil\\u{202e}txt");
        assert_eq!(printable("a\\b"), "a\\\\b");
        assert_eq!(printable("torch_1_2_3 ü"), "torch_1_2_3 ü");
        let table = list_table(
            &[object("/a_\u{1b}[2J\nfake_line", 1, None, vec![])],
            &["a".to_owned()],
        );
        assert!(!table.contains('\u{1b}'), "{table}");
        assert_eq!(
            table.lines().count(),
            3,
            "header, one row, summary: {table}"
        );
    }

    #[test]
    fn sizes_are_human_readable() {
        assert_eq!(human_size(0), "0 B");
        assert_eq!(human_size(1023), "1023 B");
        assert_eq!(human_size(4096), "4.0 KiB");
        assert_eq!(human_size(3 << 29), "1.5 GiB");
    }

    #[test]
    fn the_table_aligns_columns_and_summarises() {
        let objects = [
            object("/torch_12_34_0", 4096, Some((12, false)), vec![]),
            object("/tensormem_7_1_2", 1 << 20, Some((7, true)), vec![7, 8]),
            object("/torch_odd", 1, None, vec![]),
        ];
        let table = list_table(&objects, &["torch".to_owned()]);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 5, "{table}");
        assert!(lines[0].starts_with("NAME"));
        let dead: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(
            dead,
            ["/torch_12_34_0", "4.0", "KiB", "alice", "12", "no", "0"]
        );
        let odd: Vec<&str> = lines[3].split_whitespace().collect();
        assert_eq!(odd, ["/torch_odd", "1", "B", "alice", "-", "?", "0"]);
        assert!(lines[4].contains("3 objects"), "{table}");
        assert!(lines[4].contains("1 orphaned"), "{table}");
        // The SIZE column is right-aligned: every row ends its size at the same column.
        let end = |l: &str| l.find(" alice").unwrap();
        assert_eq!(end(lines[1]), end(lines[2]));
    }

    #[test]
    fn an_empty_listing_says_what_was_searched() {
        let text = list_table(&[], &["a".to_owned(), "b".to_owned()]);
        assert_eq!(
            text,
            "no shared memory objects named a_* or b_* in /dev/shm\n"
        );
    }

    #[test]
    fn json_carries_every_field() {
        let value = list_json(&[object("/torch_12_34_0", 10, Some((12, false)), vec![])]);
        let o = &value[0];
        assert_eq!(o["name"], "/torch_12_34_0");
        assert_eq!(o["size"], 10);
        assert_eq!(o["owner"], "alice");
        assert_eq!(o["creator_pid"], 12);
        assert_eq!(o["creator_alive"], false);
        assert_eq!(o["garbage"], true);
    }

    #[test]
    fn gc_text_says_what_happened() {
        let report = GcReport {
            dry_run: true,
            removed: vec![object("/torch_12_34_0", 4096, Some((12, false)), vec![])],
            kept: vec![(
                object("/torch_7_1_2", 1, Some((7, true)), vec![]),
                KeepReason::CreatorAlive,
            )],
            failed: vec![],
            uninspected: 0,
            namespace: PidNamespace::Initial,
        };
        let text = gc_text(&report);
        assert!(
            text.contains("would remove /torch_12_34_0 (4.0 KiB, creator 12 dead)"),
            "{text}"
        );
        assert!(
            text.contains("would remove 1 object (4.0 KiB); kept 1 (1 creator alive)"),
            "{text}"
        );
        let json = gc_json(&report);
        assert_eq!(json["dry_run"], true);
        assert_eq!(json["kept"][0]["reason"], "creator_alive");
    }
}
