//! What every batch must satisfy, on both sides: the producer checks a batch before it takes a slot
//! for it, and [`BatchHandle::decode`](super::BatchHandle::decode) checks what arrives, with the
//! same function (see the [module docs](crate::batch)).

use super::model::{BatchSegment, BatchView, NO_SEGMENT};
use crate::handle::SegmentMemory;

/// Checks a batch's segments and views (see the [module docs](crate::batch)); returns the view
/// indices in name order, or the first problem found.
pub(super) fn validate(
    segments: &[BatchSegment],
    views: &[BatchView],
) -> std::result::Result<Vec<u32>, String> {
    if segments.is_empty() || views.is_empty() {
        return Err(format!(
            "{} segments and {} views; a batch has at least one of each",
            segments.len(),
            views.len()
        ));
    }
    if segments.len() >= NO_SEGMENT as usize || views.len() > u32::MAX as usize {
        return Err("too many segments or views".into());
    }
    check_segments(segments)?;
    check_views(segments, views)?;
    let mut by_name: Vec<u32> = (0..views.len() as u32).collect();
    by_name.sort_unstable_by(|&a, &b| views[a as usize].name.cmp(&views[b as usize].name));
    if let Some(w) = by_name
        .windows(2)
        .find(|w| views[w[0] as usize].name == views[w[1] as usize].name)
    {
        return Err(format!(
            "views {} and {} have the same name {:?}; names are keys and must be distinct",
            w[0], w[1], views[w[0] as usize].name
        ));
    }
    Ok(by_name)
}

/// Each segment on its own (a size, chunks that can be imported), then across segments: no
/// memory handle twice, no chunk descriptor twice, chunks of one process.
fn check_segments(segments: &[BatchSegment]) -> std::result::Result<(), String> {
    let mut handles: Vec<(&[u8], usize)> = Vec::new();
    // (descriptor, segment) of every chunk, and the pid of the first segment of chunks.
    let mut fds: Vec<(i32, usize)> = Vec::new();
    let mut pid: Option<(u32, usize)> = None;
    for (i, segment) in segments.iter().enumerate() {
        if segment.size == 0 {
            return Err(format!("segment {i} has a size of 0 bytes"));
        }
        match &segment.memory {
            SegmentMemory::Allocation(handle) => handles.push((&handle.0[..], i)),
            SegmentMemory::Chunks(chunks) => {
                if let Some(problem) = chunks.problem() {
                    return Err(format!("segment {i}: {problem}"));
                }
                let extent = chunks.chunk_size.checked_mul(chunks.fds.len() as u64);
                if extent != Some(segment.size) {
                    return Err(format!(
                        "segment {i} claims {} bytes, but its {} chunks of {} bytes cover {}",
                        segment.size,
                        chunks.fds.len(),
                        chunks.chunk_size,
                        extent.map_or_else(|| "more than 2^64".into(), |e| e.to_string())
                    ));
                }
                match pid {
                    None => pid = Some((chunks.pid, i)),
                    Some((first, j)) if first != chunks.pid => {
                        return Err(format!(
                            "segments {j} and {i} name chunks of processes {first} and {}; a \
                             batch is of one producer",
                            chunks.pid
                        ));
                    }
                    Some(_) => {}
                }
                fds.extend(chunks.fds.iter().map(|&fd| (fd, i)));
            }
        }
    }
    handles.sort_unstable();
    if let Some(w) = handles.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(format!(
            "segments {} and {} have the same memory handle",
            w[0].1, w[1].1
        ));
    }
    fds.sort_unstable();
    if let Some(w) = fds.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(format!(
            "chunk descriptor {} is named twice (segments {} and {}); each chunk of the producer \
             is named once",
            w[0].0, w[0].1, w[1].1
        ));
    }
    Ok(())
}

/// Each view inside its segment, every segment used by some view, and no two views overlapping
/// except as exact aliases.
fn check_views(segments: &[BatchSegment], views: &[BatchView]) -> std::result::Result<(), String> {
    let mut used = vec![false; segments.len()];
    // (segment, offset, len, view) of the views with bytes, for the overlap check.
    let mut ranges = Vec::with_capacity(views.len());
    for (i, view) in views.iter().enumerate() {
        if view.name.len() > usize::from(u16::MAX) {
            return Err(format!(
                "the name of view {i} is {} bytes long, more than {}",
                view.name.len(),
                u16::MAX
            ));
        }
        let Some(segment) = view.segment else {
            if view.offset != 0 || view.len != 0 {
                return Err(format!(
                    "view {i} ({:?}) names no segment but claims {} bytes at offset {}",
                    view.name, view.len, view.offset
                ));
            }
            continue;
        };
        let Some(seg) = segments.get(segment as usize) else {
            return Err(format!(
                "view {i} ({:?}) names segment {segment}, but there are {}",
                view.name,
                segments.len()
            ));
        };
        used[segment as usize] = true;
        let end = view.offset.checked_add(view.len);
        if end.is_none_or(|end| end > seg.size) {
            return Err(format!(
                "view {i} ({:?}) claims {} bytes at offset {} of segment {segment}, which has {} \
                 bytes",
                view.name, view.len, view.offset, seg.size
            ));
        }
        if view.len > 0 {
            ranges.push((segment, view.offset, view.len, i));
        }
    }
    if let Some(unused) = used.iter().position(|u| !u) {
        return Err(format!("segment {unused} is named by no view"));
    }
    ranges.sort_unstable();
    // The furthest end so far in the current segment, and the range that reached it.
    let mut reach: Option<(u32, u64, u64, usize)> = None;
    for &(segment, offset, len, i) in &ranges {
        if let Some((seg, start, end, j)) = reach {
            if seg == segment && offset < end {
                let same = start == offset && end == offset + len;
                if !same {
                    return Err(format!(
                        "views {j} ({:?}) and {i} ({:?}) overlap in segment {segment} (bytes \
                         {start}..{end} and {offset}..{}); views may share bytes only as exact \
                         aliases of one range",
                        views[j].name,
                        views[i].name,
                        offset + len
                    ));
                }
                continue;
            }
        }
        reach = Some((segment, offset, offset + len, i));
    }
    Ok(())
}
