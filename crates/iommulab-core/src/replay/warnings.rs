//! What a replay warns its reader of, one line each: what it could not read, what it replayed as it was though
//! no kernel would have done it, and where its counts rest on the model's own timer or on one domain where
//! the trace had several. In the JSON as `warnings` (the Python API's result too); the text prints them under
//! its header.

use super::result::ReplayResult;

/// Why recorded firings of the flush timer were passed over, by how the trace names their domains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PassedOver {
    /// Its events' domains are named by device only, and these firings' pointers were never tied to one.
    Untied,
    /// Each firing names its domain (its flush, or the cookie's pointer), but not one the trace showed.
    Unnamed,
    /// The trace has several domains and its firings do not say whose.
    NotSaid,
}

/// The warnings for `r`; `newest`: the newest kernel modelled, when `r`'s kernel is newer (replayed with its
/// rules).
pub(super) fn warnings(
    r: &ReplayResult,
    newest: Option<(u32, u32)>,
    why: PassedOver,
) -> Vec<String> {
    let mut w = Vec::new();
    if let Some((a, b)) = newest {
        w.push(format!(
            "kernel {} (replayed with {a}.{b}'s rules): newer than the newest kernel the model follows",
            r.kernel
        ));
    }
    if r.lines.bad > 0 {
        let first = r
            .lines
            .bad_examples
            .first()
            .map(|e| format!(" (the first, line {e})"));
        w.push(format!(
            "{} unreadable lines skipped{}",
            r.lines.bad,
            first.unwrap_or_default()
        ));
    }
    w.extend(anomalies(r));
    w.extend(one_domain(r));
    w.extend(timer(r, why));
    w.extend(bounce(r));
    w
}

/// Where the bounce replay rests on less than the trace: a pool sized otherwise than the kernel's, devices
/// taken to bounce from the trace's own events, bounces no traced map shows.
fn bounce(r: &ReplayResult) -> Vec<String> {
    let Some(s) = &r.swiotlb else {
        return Vec::new();
    };
    let mut w = Vec::new();
    if let Some(k) = s.kernel_pool_slots.filter(|&k| k != s.pool_slots) {
        w.push(format!(
            "swiotlb: the model's pool has {} slots where the kernel reported {k} ({})",
            s.pool_slots, s.from
        ));
    }
    if !s.force {
        w.push(
            "swiotlb: no swiotlb=force on the command line given: every map of a device the trace's \
             swiotlb_bounced events name is taken to bounce"
                .to_string(),
        );
    }
    let (mut kernel, mut model) = (0, 0);
    for (_, p) in r.phases.iter() {
        if let Some(b) = &p.swiotlb {
            kernel += b.guest.swiotlb_bounced;
            model += b.model.bounces;
        }
    }
    if kernel > model {
        w.push(format!(
            "swiotlb: the kernel attempted {} bounces no traced map shows (a dma_map_sg that fails is not traced)",
            kernel - model
        ));
    } else if model > kernel {
        w.push(format!(
            "swiotlb: {} traced maps bounced in the model that the kernel did not bounce",
            model - kernel
        ));
    }
    w
}

/// The trace's oddities, replayed as they are. Pages unmapped that the trace never mapped are not among them:
/// nearly every capture has them (a NIC's receive ring is mapped before tracing starts); `anomalies` in the
/// JSON counts them, and a capture reports events it lost itself.
fn anomalies(r: &ReplayResult) -> Option<String> {
    let a = &r.anomalies;
    let odd: Vec<String> = [
        (a.unaligned, "IOVAs not 4 KiB aligned"),
        (a.time_backwards, "events stamped before the one before"),
        (a.unmatched_markers, "TB_END of a phase not begun"),
        (
            a.maps_over_live,
            "maps on IOVA still mapped (a domain never hands out a live IOVA: several domains, or unmap events lost)",
        ),
    ]
    .into_iter()
    .filter(|&(n, _)| n > 0)
    .map(|(n, what)| format!("{n} {what}"))
    .collect();
    (!odd.is_empty()).then(|| format!("anomalies (replayed as they are): {}", odd.join(" · ")))
}

/// A lazy trace of several domains that names none, replayed as one on the model's timer: its flushes are too
/// few where the domains were busy at once.
fn one_domain(r: &ReplayResult) -> Option<String> {
    let recorded = r.recorded_timer.as_ref().is_some_and(|t| t.firings > 0);
    (r.policy == "lazy"
        && r.domains.labelled_events == 0
        && r.anomalies.maps_over_live > 0
        && !recorded)
        .then(|| {
            "domains: the trace names none and is replayed as one, but it maps IOVA still mapped: it has several, \
             each with its own flush queue and timer. Where their devices were busy at the same time, the lazy \
             flush counts are too few; `iommulab capture` records the domains (kprobes, or the DMA API's events)"
                .to_string()
        })
}

/// Recorded firings passed over, and domains left on the model's own timer though the trace recorded it.
fn timer(r: &ReplayResult, why: PassedOver) -> Vec<String> {
    let Some(t) = &r.recorded_timer else {
        return Vec::new();
    };
    let mut w = Vec::new();
    if t.ignored > 0 {
        let why = match why {
            PassedOver::Untied => {
                "their pointer was not tied to one of the domains the trace names by device"
            }
            PassedOver::Unnamed => "their flush or its domain is not in the trace",
            PassedOver::NotSaid => {
                "the trace has several domains and does not say whose timer fired"
            }
        };
        w.push(format!(
            "{} recorded firings of fq_flush_timeout passed over: {why}",
            t.ignored
        ));
    }
    if t.own_timer_domains > 0 {
        let which = if t.own_timer_domains == r.domains.count {
            "every domain".to_string()
        } else {
            format!("{} of {} domains", t.own_timer_domains, r.domains.count)
        };
        w.push(format!(
            "lazy flush timer: {which} ran the model's own, not the one the trace recorded (no recorded firing \
             was given to it)"
        ));
    }
    w
}
