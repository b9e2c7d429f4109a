//! Streaming reader of Linux ftrace text as `trace` / `trace_pipe` print it:
//!
//! ```text
//!      kworker/0:1-10      [000] b..1.     3.579441: map: IOMMU: iova=0x00000000ffebc000 - 0x00000000ffebd000 paddr=0x0000000002f1d000 size=4096
//!      kworker/0:1-10      [000] ..s2.     3.580036: unmap: IOMMU: iova=0x00000000ffebc000 - 0x00000000ffebd000 size=4096 unmapped_size=4096
//!            init-1       [000] .....     4.491812: tracing_mark_write: TB_BEGIN idle
//! ```
//!
//! The prefix is `TASK-PID [CPU] FLAGS TIMESTAMP:` (task names may hold spaces and dashes; the tgid column
//! `(  123)` and the flags column are optional, as trace_options allow). `trace-cmd report` prints the same
//! layout (the event's name may be padded); `perf script` prints tracepoints as `TASK TID [CPU] TIMESTAMP: SYSTEM:EVENT:
//! BODY` (tools/perf/builtin-script.c, default fields comm, tid, cpu, time, event, trace), read here too, off the
//! byte-level path the kernel's own layout takes. Event bodies follow
//! include/trace/events/iommu.h (`map`: iova range, paddr, size; `unmap`: iova range, size, unmapped_size;
//! kernels before 5.x printed `iova=… paddr=… size=…` without the range end, which is accepted too). One line
//! at a time; a line that cannot be read is returned as [`Record::Bad`], never an error.

use memchr::{memchr, memchr2, memchr_iter, memrchr};

/// Where the two bytes `pat` first occur in `b` (a two-byte needle: cheaper than building a substring finder
/// per line). The search runs on the byte other than a space: the task column is padded with spaces, and
/// stopping at each cost the parser a tenth of its time.
fn find2(b: &[u8], pat: &[u8; 2]) -> Option<usize> {
    if pat[0] == b' ' && pat[1] != b' ' {
        memchr_iter(pat[1], b)
            .find(|&i| i > 0 && b[i - 1] == b' ')
            .map(|i| i - 1)
    } else {
        memchr_iter(pat[0], b).find(|&i| b.get(i + 1) == Some(&pat[1]))
    }
}

/// CPU numbers a trace can show: the largest NR_CPUS any architecture allows (arch/x86/Kconfig, MAXSMP).
/// Per-CPU state is indexed by them; a larger number is a garbled line.
pub const MAX_CPUS: u32 = 8192;

/// trace_seq.h TRACE_SEQ_SIZE: the kernel prints each line of `trace` / `trace_pipe` into one trace_seq, of
/// 8 KiB in recent kernels and of a page in older ones (up to 64 KiB on arm64 with 64 KiB pages), so no real
/// line is longer.
/// A line longer than this bound, 16 times the largest, is not ftrace text (a binary file, /dev/zero): the
/// reader stops there instead of buffering it. A reading bound, not a kernel constant.
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// What one line of the trace holds.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    Map {
        ev: EventHead,
        iova: u64,
        paddr: u64,
        size: u64,
    },
    Unmap {
        ev: EventHead,
        iova: u64,
        size: u64,
        unmapped: u64,
    },
    /// A `tracing_mark_write:` line: its text.
    Marker { ev: EventHead, text: String },
    /// A kprobe at `__iommu_map` / `__iommu_unmap` naming the domain of the map or unmap that follows on its
    /// CPU (`tb_map: (__iommu_map+0x0/…) dom=0x… iova=0x… size=N`, as the testbed and `iommulab capture
    /// --domains` record them).
    Domain {
        ev: EventHead,
        map: bool,
        dom: u64,
        iova: u64,
        size: u64,
    },
    /// A kprobe at `fq_flush_timeout`: the flush queue's timer fired on this CPU (dma-iommu.c; `iommulab
    /// capture --timer` records it where the kernel allows), with the cookie's `fq_domain` where it read it.
    Timer { ev: EventHead, dom: Option<u64> },
    /// A DMA API event naming the device of a map (`dma_map_page`, `dma_map_sg`, `dma_alloc`, …) or an unmap
    /// (`dma_unmap_page`, `dma_unmap_sg`, `dma_free`, …) on its CPU (include/trace/events/dma.h, Linux
    /// 6.12+), with the DMA address range it names (none for `dma_unmap_sg`, which prints physical addresses).
    Device {
        ev: EventHead,
        map: bool,
        dev: String,
        range: Option<(u64, u64)>,
    },
    /// `# iommulab capture: iommu group N: DEV DEV …`: devices sharing an IOMMU group (and so a domain).
    Group { id: u64, devs: Vec<String> },
    /// A kprobe at the IOMMU driver's `flush_iotlb_all` naming the domain flushed (`tb_flush_all_intel: (…)
    /// dom=0x…`): right after a [`Record::Timer`] on its CPU, the domain whose timer fired.
    FlushAll { ev: EventHead, dom: u64 },
    /// The capture's note that it records those (`# iommulab capture: flush queue timer's domain recorded`):
    /// a firing's flush names its domain.
    TimerDomains,
    /// A kprobe at `dma_iova_unlink()` (`tb_iova_unlink:`): the next unmap on this CPU is an IOVA-API unlink,
    /// which syncs the IOTLB at once even in a lazy domain (dma-iommu.c __iommu_dma_iova_unlink(), free_iova
    /// false: not queued).
    IovaUnlink { ev: EventHead },
    /// `swiotlb:swiotlb_bounced` (kernel/dma/swiotlb.c swiotlb_map(), before the slots are searched): a
    /// bounce the kernel attempted for device `dev`.
    Bounced { ev: EventHead, dev: String },
    /// The capture's note on the swiotlb pool when it started or stopped recording (debugfs
    /// `/sys/kernel/debug/swiotlb`).
    SwiotlbNote(SwiotlbNote),
    /// Another event, a header or comment line, or an empty line.
    Other,
    /// A line that could not be read (cut by a buffer overrun, garbled): its number and why.
    Bad { line: u64, why: &'static str },
}

/// `# iommulab capture: swiotlb at start: nslabs=N used=N hiwater=N possible=CPULIST start=0xHEX transient=N`
/// (`at end:` when recording stopped): debugfs's io_tlb_nslabs, io_tlb_used, io_tlb_used_hiwater (6.4+),
/// io_tlb_transient_nslabs (CONFIG_SWIOTLB_DYNAMIC only), the possible CPUs and the pool's start from the
/// kernel log; each key only where the capture found it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SwiotlbNote {
    pub end: bool,
    pub nslabs: Option<u64>,
    pub used: Option<u64>,
    pub hiwater: Option<u64>,
    /// The possible CPUs, counted from the list (`0-3,8`).
    pub possible_cpus: Option<u32>,
    pub start: Option<u64>,
    pub transient: Option<u64>,
}

/// The context an event ran in, from the irq-info flags column (its third character: `h`/`H` hardirq,
/// `s` softirq, `z`/`Z` NMI; `.` or no flags column: task context).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Ctx {
    Task,
    Softirq,
    Hardirq,
    Nmi,
}

/// The common prefix of an event line.
#[derive(Debug, Clone, PartialEq)]
pub struct EventHead {
    pub pid: u32,
    pub cpu: u32,
    pub ctx: Ctx,
    /// Trace clock in ns.
    pub ts_ns: u64,
    pub line: u64,
}

/// Parse one line (without its line ending).
pub fn parse_line(s: &str, line: u64) -> Record {
    fast_event(s.as_bytes(), line).unwrap_or_else(|| parse_general(s, line))
}

/// Digits of `b` in `radix` (10 or 16) as a u64; None if empty, not all digits, or too large.
fn digits(b: &[u8], radix: u32) -> Option<u64> {
    if b.is_empty() {
        return None;
    }
    b.iter().try_fold(0u64, |n, &c| {
        n.checked_mul(radix as u64)?
            .checked_add((c as char).to_digit(radix)? as u64)
    })
}

/// Each byte's value as a hex digit, or [`NOT_HEX`].
const HEX_DIGIT: [u8; 256] = {
    let mut t = [NOT_HEX; 256];
    let mut c = 0;
    while c < 256 {
        t[c] = match c as u8 {
            b'0'..=b'9' => c as u8 - b'0',
            b'a'..=b'f' => c as u8 - b'a' + 10,
            b'A'..=b'F' => c as u8 - b'A' + 10,
            _ => NOT_HEX,
        };
        c += 1;
    }
    t
};
const NOT_HEX: u8 = 0xff;

/// Eight ASCII hex digits, the first in the top byte, as their value (None if any is not a hex digit): every
/// byte at once, as bit operations on the word (SWAR), instead of a dependent shift per digit.
#[inline]
fn hex8(x: u64) -> Option<u64> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    // A byte of 0x80 or above is no digit; with every byte below it, the sums below carry neither between
    // bytes nor out of the word.
    if x & HIGH != 0 {
        return None;
    }
    // Per byte, the high bit set where the byte is at least k.
    let at_least = |x: u64, k: u64| (x + (0x80 - k) * ONES) & HIGH;
    let folded = x | (0x20 * ONES); // 'A'..'F' to 'a'..'f'
    let digit = at_least(x, 0x30) & !at_least(x, 0x3a);
    let letter = at_least(folded, 0x61) & !at_least(folded, 0x67);
    if (digit | letter) != HIGH {
        return None;
    }
    // A letter's value is its low nibble + 9.
    let v = (x & (0x0f * ONES)) + (letter >> 7) * 9;
    // Nibbles into bytes, bytes into 16-bit halves, halves into the word.
    let v = (v | v >> 4) & 0x00ff_00ff_00ff_00ff;
    let v = (v | v >> 8) & 0x0000_ffff_0000_ffff;
    Some((v | v >> 16) & 0xffff_ffff)
}

/// A hex number `0x…` up to the next byte that is not a hex digit, in one pass: (value, the rest); None if it
/// has no digit or does not fit 64 bits.
fn hex_word(b: &[u8]) -> Option<(u64, &[u8])> {
    let b = b.strip_prefix(b"0x")?;
    // The kernel prints addresses as 0x%016llx: sixteen digits, read without a branch per digit.
    if let Some((word, after)) = b.split_first_chunk::<16>() {
        if after
            .first()
            .is_none_or(|&c| HEX_DIGIT[c as usize] == NOT_HEX)
        {
            let (hi, lo) = word.split_at(8);
            let hex = |h: &[u8]| hex8(u64::from_be_bytes(h.try_into().expect("eight bytes")));
            if let (Some(hi), Some(lo)) = (hex(hi), hex(lo)) {
                return Some((hi << 32 | lo, after));
            }
        }
    }
    let mut v = 0u64;
    let mut n = 0;
    for &c in b {
        // A table, not a match: digits and letters alternate unpredictably in addresses.
        let d = HEX_DIGIT[c as usize];
        if d == NOT_HEX {
            break;
        }
        if v >> 60 != 0 {
            return None;
        }
        v = v << 4 | d as u64;
        n += 1;
    }
    (n > 0).then_some((v, &b[n..]))
}

/// The kernel's own layout of the two events replay lives on, read byte by byte:
/// `TASK-PID [CPU] FLAGS SEC.FRAC: map: IOMMU: iova=0x… - 0x… paddr=0x… size=N` and `…: unmap: IOMMU: iova=0x… -
/// 0x… size=N unmapped_size=N`. Anything else (another event or layout, a tgid column, a torn or odd line) is
/// None, and the general reader takes it; where this one answers, the general reader answers the same.
fn fast_event(b: &[u8], line: u64) -> Option<Record> {
    // Fields a few bytes long are searched by plain loops (memchr's setup costs more than they do).
    // Comments and the ring buffer's own notes are the general reader's.
    let t = b.trim_ascii_start();
    if t.starts_with(b"#") || t.starts_with(b"CPU:") {
        return None;
    }
    let open = find2(b, b" [")?;
    let close = open + b[open..].iter().position(|&c| c == b']')?;
    let cpu_txt = b[open + 2..close].trim_ascii();
    let cpu = u32::try_from(digits(cpu_txt, 10)?)
        .ok()
        .filter(|&c| c < MAX_CPUS)?;
    let taskpid = b[..open].trim_ascii_end();
    if taskpid.ends_with(b")") {
        return None;
    }
    let dash = taskpid.iter().rposition(|&c| c == b'-')?;
    let pid = u32::try_from(digits(&taskpid[dash + 1..], 10)?).ok()?;
    let rest = &b[close + 1..];
    let colon = find2(rest, b": ")?;
    let words = rest[..colon].trim_ascii();
    let (flags, ts) = match words.iter().rposition(|&c| c == b' ') {
        Some(sp) => (Some(words[..sp].trim_ascii()), &words[sp + 1..]),
        None => (None, words),
    };
    // More than one word before the timestamp: the general reader's layout rules apply.
    if flags.is_some_and(|f| f.is_empty() || f.contains(&b' ') || f.contains(&b'\t')) {
        return None;
    }
    // parse_ts()'s rule on bytes (a str parse here cost the parser 6 %): a dot, at most nine decimals.
    let dot = ts.iter().position(|&c| c == b'.')?;
    let frac = &ts[dot + 1..];
    if frac.is_empty() || frac.len() > 9 {
        return None;
    }
    let ts_ns = digits(&ts[..dot], 10)?
        .checked_mul(1_000_000_000)?
        .checked_add(digits(frac, 10)? * 10u64.pow(9 - frac.len() as u32))?;
    let ctx = ctx_of(flags);
    let ev = EventHead {
        pid,
        cpu,
        ctx,
        ts_ns,
        line,
    };
    let body = &rest[colon + 2..];
    if let Some(m) = body.strip_prefix(b"map: IOMMU: iova=") {
        let (iova, m) = hex_word(m)?;
        let (_, m) = hex_word(m.strip_prefix(b" - ")?)?;
        let (paddr, m) = hex_word(m.strip_prefix(b" paddr=")?)?;
        let size = digits(m.strip_prefix(b" size=")?, 10)?;
        return Some(Record::Map {
            ev,
            iova,
            paddr,
            size,
        });
    }
    let m = body.strip_prefix(b"unmap: IOMMU: iova=")?;
    let (iova, m) = hex_word(m)?;
    let (_, m) = hex_word(m.strip_prefix(b" - ")?)?;
    let m = m.strip_prefix(b" size=")?;
    let sp = m.iter().position(|&c| c == b' ')?;
    let size = digits(&m[..sp], 10)?;
    let unmapped = digits(m[sp..].strip_prefix(b" unmapped_size=")?, 10)?;
    Some(Record::Unmap {
        ev,
        iova,
        size,
        unmapped,
    })
}

/// Parse one line the general way: any layout ftrace prints, every event replay reads.
fn parse_general(s: &str, line: u64) -> Record {
    let t = s.trim_start();
    if let Some(g) = t.strip_prefix(GROUP_NOTE) {
        return parse_group(g);
    }
    if t.starts_with(TIMER_DOMAINS_NOTE) {
        return Record::TimerDomains;
    }
    if let Some(n) = t.strip_prefix(SWIOTLB_NOTE) {
        return parse_swiotlb_note(n);
    }
    if t.is_empty() || t.starts_with('#') {
        return Record::Other;
    }
    // "CPU:3 [LOST 120 EVENTS]" and similar overrun notes.
    if t.starts_with("CPU:") || t.starts_with("##### CPU") {
        return Record::Other;
    }
    let Some((head, rest)) = split_head(t, line) else {
        // Not an event line we can read; it may still be one of ours, cut short.
        return if s.contains("map: IOMMU") || s.contains("tracing_mark_write") {
            Record::Bad {
                line,
                why: "an iommu or marker event without a readable TASK-PID [CPU] TIMESTAMP: prefix",
            }
        } else {
            Record::Other
        };
    };
    let (event, body) = match find2(rest.as_bytes(), b": ") {
        Some(c) => (rest[..c].trim(), &rest[c + 2..]),
        None => (rest.trim_end_matches(':').trim(), ""),
    };
    match event {
        "map" | "iommu:map" => parse_map(head, body),
        "unmap" | "iommu:unmap" => parse_unmap(head, body),
        "tb_map" | "tb_unmap" => {
            let [dom, iova, size] = fields(body, ["dom", "iova", "size"]).map(|v| v.and_then(num));
            let (Some(dom), Some(iova), Some(size)) = (dom, iova, size) else {
                return Record::Bad {
                    line,
                    why: "a domain kprobe line without dom=, iova= and size=",
                };
            };
            Record::Domain {
                ev: head,
                map: event == "tb_map",
                dom,
                iova,
                size,
            }
        }
        "fq_flush_timeout" => Record::Timer {
            ev: head,
            dom: fields(body, ["fq_domain"])[0].and_then(num),
        },
        "tb_iova_unlink" => Record::IovaUnlink { ev: head },
        // One kprobe per IOMMU driver built in (`tb_flush_all_intel`, …; older captures: one `tb_flush_all`).
        e if e == "tb_flush_all" || e.starts_with("tb_flush_all_") => {
            match fields(body, ["dom"])[0].and_then(num) {
                Some(dom) => Record::FlushAll { ev: head, dom },
                None => Record::Bad {
                    line,
                    why: "a flush_iotlb_all kprobe line without dom=",
                },
            }
        }
        "swiotlb_bounced" | "swiotlb:swiotlb_bounced" => {
            // "dev_name: DEVICE dma_mask=… dev_addr=… size=N FORCE"
            match body
                .trim_start()
                .strip_prefix("dev_name:")
                .and_then(|r| r.split_whitespace().next())
            {
                Some(dev) => Record::Bounced {
                    ev: head,
                    dev: dev.to_string(),
                },
                None => Record::Bad {
                    line,
                    why: "a swiotlb_bounced event without dev_name:",
                },
            }
        }
        e if e.starts_with("dma_") || e.starts_with("dma:dma_") => {
            parse_dma(head, e.trim_start_matches("dma:"), body)
        }
        "tracing_mark_write" | "print" => Record::Marker {
            ev: head,
            text: body.trim().to_string(),
        },
        _ => Record::Other,
    }
}

/// `TASK-PID [CPU] FLAGS TIMESTAMP: ` → (head, the rest after the timestamp's colon). Byte searches (every
/// delimiter is ASCII, so the cuts fall on character boundaries).
fn split_head(t: &str, line: u64) -> Option<(EventHead, &str)> {
    let b = t.as_bytes();
    // The CPU field "[NNN]" is the first bracketed number after the task-pid.
    let open = find2(b, b" [").or_else(|| memchr(b'[', b))?;
    let close = open + memchr(b']', &b[open..])?;
    let cpu: u32 = t[open..close]
        .trim_start_matches([' ', '['])
        .trim()
        .parse()
        .ok()
        .filter(|&c| c < MAX_CPUS)?;
    let taskpid = t[..open].trim_end();
    // Optional "(tgid)" column before the CPU.
    let taskpid = match taskpid.rfind('(') {
        Some(p) if taskpid.ends_with(')') => taskpid[..p].trim_end(),
        _ => taskpid,
    };
    let pid = task_pid(taskpid)?;
    let after = &t[close + 1..];
    // FLAGS (optional) then TIMESTAMP followed by ':'.
    let colon = find2(after.as_bytes(), b": ")?;
    let before = after[..colon].trim();
    let mut words = before.split_whitespace();
    let ts = words.next_back()?;
    let ts_ns = parse_ts(ts)?;
    let ctx = ctx_of(words.next_back().map(str::as_bytes));
    Some((
        EventHead {
            pid,
            cpu,
            ctx,
            ts_ns,
            line,
        },
        &after[colon + 2..],
    ))
}

/// The thread id at the end of the task column: ftrace's `COMM-PID`, or `perf script`'s `COMM TID` and `COMM
/// PID/TID` (tools/perf/builtin-script.c perf_sample__fprintf_start(): `%16s ` then `%5d ` or `%5d/%-5d `).
fn task_pid(taskpid: &str) -> Option<u32> {
    let ftrace = memrchr(b'-', taskpid.as_bytes()).and_then(|d| taskpid[d + 1..].parse().ok());
    ftrace.or_else(|| {
        let (comm, id) = taskpid.rsplit_once([' ', '\t'])?;
        let tid = id.rsplit('/').next()?;
        (!comm.trim().is_empty()).then(|| tid.parse().ok())?
    })
}

/// The context an event ran in, from its flags column (third character), if it has one.
fn ctx_of(flags: Option<&[u8]>) -> Ctx {
    match flags.and_then(|f| f.get(2)) {
        Some(b'h' | b'H') => Ctx::Hardirq,
        Some(b's') => Ctx::Softirq,
        Some(b'z' | b'Z') => Ctx::Nmi,
        _ => Ctx::Task,
    }
}

/// "123.456789" seconds (any number of decimals) → ns.
fn parse_ts(s: &str) -> Option<u64> {
    let (sec, frac) = s.split_once('.').unwrap_or((s, ""));
    let sec: u64 = sec.parse().ok()?;
    if frac.len() > 9 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let frac_ns: u64 = if frac.is_empty() {
        0
    } else {
        frac.parse::<u64>().ok()? * 10u64.pow(9 - frac.len() as u32)
    };
    sec.checked_mul(1_000_000_000)?.checked_add(frac_ns)
}

/// The values of `keys` in a body of `key=value` words separated by spaces or tabs (the first of each), in
/// one pass over its bytes.
fn fields<'a, const N: usize>(body: &'a str, keys: [&str; N]) -> [Option<&'a str>; N] {
    let mut out = [None; N];
    let b = body.as_bytes();
    let mut start = 0;
    while start <= b.len() {
        let end = start + memchr2(b' ', b'\t', &b[start..]).unwrap_or(b.len() - start);
        let w = &b[start..end];
        if let Some(eq) = memchr(b'=', w) {
            let k = &w[..eq];
            if let Some(i) = keys.iter().position(|&x| x.as_bytes() == k) {
                if out[i].is_none() {
                    out[i] = Some(&body[start + eq + 1..end]);
                }
            }
        }
        start = end + 1;
    }
    out
}

fn num(s: &str) -> Option<u64> {
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).ok(),
        None => s.parse().ok(),
    }
}

/// The capture's note on an IOMMU group and its devices.
const GROUP_NOTE: &str = "# iommulab capture: iommu group ";
/// The capture's note that the flush timer's firings name their domain.
const TIMER_DOMAINS_NOTE: &str = "# iommulab capture: flush queue timer's domain recorded";
/// The capture's notes on the swiotlb pool.
const SWIOTLB_NOTE: &str = "# iommulab capture: swiotlb at ";

fn parse_swiotlb_note(n: &str) -> Record {
    let (end, rest) = match n.split_once(':') {
        Some(("start", r)) => (false, r),
        Some(("end", r)) => (true, r),
        _ => return Record::Other,
    };
    let [nslabs, used, hiwater, possible, start, transient] = fields(
        rest,
        [
            "nslabs",
            "used",
            "hiwater",
            "possible",
            "start",
            "transient",
        ],
    );
    Record::SwiotlbNote(SwiotlbNote {
        end,
        nslabs: nslabs.and_then(num),
        used: used.and_then(num),
        hiwater: hiwater.and_then(num),
        possible_cpus: possible.and_then(cpu_list_count),
        start: start.and_then(num),
        transient: transient.and_then(num),
    })
}

/// CPUs in a kernel CPU list (`0`, `0-3`, `0-3,8-11`): None if it is not one.
fn cpu_list_count(s: &str) -> Option<u32> {
    s.split(',').try_fold(0u32, |n, r| {
        let (a, b) = r.split_once('-').unwrap_or((r, r));
        let (a, b): (u32, u32) = (a.parse().ok()?, b.parse().ok()?);
        (b >= a && b < MAX_CPUS).then(|| n + b - a + 1)
    })
}

/// A DMA API call as its event prints it (include/trace/events/dma.h, 6.12+), with what a bounce replay needs.
#[derive(Debug, Clone, PartialEq)]
pub struct DmaCall {
    pub kind: DmaKind,
    pub dir: crate::scenario::MapDir,
    /// Mapped segments: (DMA address, bytes, physical address). An unmap_page: its one (address, bytes, 0); an
    /// unmap_sg: (0, 0, physical address) per entry.
    pub segs: Vec<(u64, u64, u64)>,
    /// DMA_ATTR_SKIP_CPU_SYNC.
    pub skip_cpu_sync: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DmaKind {
    MapPage,
    MapSg,
    UnmapPage,
    UnmapSg,
    /// Resources and coherent allocations, and their frees: never bounced (dma_direct_map_resource,
    /// dma_direct_alloc).
    MapOther,
    UnmapOther,
}

impl DmaKind {
    /// The call a DMA API event names (kernel/dma/mapping.c), if it maps or unmaps.
    fn of(event: &str) -> Option<Self> {
        Some(match event {
            // dma_map_phys / dma_unmap_phys: newer kernels' names for the page and resource pairs, same layout.
            "dma_map_page" | "dma_map_phys" => DmaKind::MapPage,
            "dma_map_sg" => DmaKind::MapSg,
            "dma_unmap_page" | "dma_unmap_phys" => DmaKind::UnmapPage,
            "dma_unmap_sg" => DmaKind::UnmapSg,
            "dma_map_resource" | "dma_alloc" | "dma_alloc_pages" | "dma_alloc_sgt" => {
                DmaKind::MapOther
            }
            "dma_unmap_resource" | "dma_free" | "dma_free_pages" | "dma_free_sgt" => {
                DmaKind::UnmapOther
            }
            _ => return None,
        })
    }

    fn maps(self) -> bool {
        matches!(self, DmaKind::MapPage | DmaKind::MapSg | DmaKind::MapOther)
    }
}

/// A hex number as the DMA events print it (`3e800000`, `0x3e800000`).
fn hex(v: &str) -> Option<u64> {
    u64::from_str_radix(v.trim().trim_start_matches("0x"), 16).ok()
}

/// A DMA event's `{0xA,0xB}` array; None if any entry is not a hex number.
fn hex_list(v: Option<&str>) -> Option<Vec<u64>> {
    v?.trim_matches(['{', '}']).split(',').map(hex).collect()
}

/// DMA_MAPPING_ERROR: what a failed map returns (and its event prints).
pub const DMA_MAPPING_ERROR: u64 = u64::MAX;

/// The DMA API call an event line prints, if it is one (its head and the call).
pub fn dma_call(s: &str, line: u64) -> Option<(EventHead, String, DmaCall)> {
    let (head, rest) = split_head(s.trim_start(), line)?;
    let c = find2(rest.as_bytes(), b": ")?;
    let kind = DmaKind::of(rest[..c].trim().trim_start_matches("dma:"))?;
    let body = &rest[c + 2..];
    let dev = body.split_whitespace().next()?.to_string();
    let [dir, addr, size, phys, addrs, sizes, physs, attrs] = fields(
        body,
        [
            "dir",
            "dma_addr",
            "size",
            "phys_addr",
            "dma_addrs",
            "sizes",
            "phys_addrs",
            "attrs",
        ],
    );
    use crate::scenario::MapDir;
    let dir = match dir {
        Some("TO_DEVICE") => MapDir::ToDevice,
        Some("FROM_DEVICE") => MapDir::FromDevice,
        _ => MapDir::Bidirectional,
    };
    let segs = match kind {
        DmaKind::MapPage | DmaKind::UnmapPage => {
            let a = addr.and_then(hex)?;
            let n = size.and_then(num)?;
            vec![(a, n, phys.and_then(hex).unwrap_or(0))]
        }
        DmaKind::MapSg => {
            let (a, n) = (hex_list(addrs)?, hex_list(sizes)?);
            let p = hex_list(physs).unwrap_or_default();
            a.iter()
                .zip(&n)
                .enumerate()
                .map(|(i, (&a, &n))| (a, n, p.get(i).copied().unwrap_or(0)))
                .collect()
        }
        DmaKind::UnmapSg => hex_list(physs)?.into_iter().map(|p| (0, 0, p)).collect(),
        DmaKind::MapOther | DmaKind::UnmapOther => Vec::new(),
    };
    let skip_cpu_sync = attrs.is_some_and(|a| a.split('|').any(|f| f == "SKIP_CPU_SYNC"));
    Some((
        head,
        dev,
        DmaCall {
            kind,
            dir,
            segs,
            skip_cpu_sync,
        },
    ))
}

fn parse_group(g: &str) -> Record {
    let Some((id, devs)) = g.split_once(':') else {
        return Record::Other;
    };
    match id.trim().parse() {
        Ok(id) => Record::Group {
            id,
            devs: devs.split_whitespace().map(str::to_string).collect(),
        },
        Err(_) => Record::Other,
    }
}

/// A DMA API event (kernel/dma/mapping.c): `DEVICE dir=… dma_addr=HEX size=N …`, or for `dma_map_sg`
/// `… dma_addrs={0xA,0xB} sizes={0xN,0xM} …`. Events that neither map nor unmap (the syncs) are other lines.
fn parse_dma(ev: EventHead, event: &str, body: &str) -> Record {
    let Some(kind) = DmaKind::of(event) else {
        return Record::Other;
    };
    let line = ev.line;
    let Some(dev) = body.split_whitespace().next().filter(|d| !d.contains('=')) else {
        return Record::Bad {
            line,
            why: "a DMA API event without its device name",
        };
    };
    let range = if kind == DmaKind::UnmapSg {
        None
    } else if kind == DmaKind::MapSg {
        // Every mapped segment: the range from the lowest address to the highest segment's end.
        let [addrs, sizes] = fields(body, ["dma_addrs", "sizes"]);
        let (Some(a), Some(n)) = (hex_list(addrs), hex_list(sizes)) else {
            return Record::Bad {
                line,
                why: "a dma_map_sg event without dma_addrs={…} and sizes={…}",
            };
        };
        let lo = a.iter().copied().min();
        let hi = a.iter().zip(&n).map(|(a, n)| a.saturating_add(*n)).max();
        lo.zip(hi)
    } else {
        let [addr, size] = fields(body, ["dma_addr", "size"]);
        let (Some(a), Some(n)) = (addr.and_then(hex), size.and_then(num)) else {
            return Record::Bad {
                line,
                why: "a DMA API event without dma_addr= and size=",
            };
        };
        Some((a, a.saturating_add(n.max(1))))
    };
    Record::Device {
        ev,
        map: kind.maps(),
        dev: dev.to_string(),
        range,
    }
}

fn parse_map(ev: EventHead, body: &str) -> Record {
    let line = ev.line;
    let bad = |why| Record::Bad { line, why };
    let [iova, paddr, size] = fields(body, ["iova", "paddr", "size"]).map(|v| v.and_then(num));
    let (Some(iova), Some(paddr), Some(size)) = (iova, paddr, size) else {
        return bad("a map event without iova=, paddr= and size=");
    };
    Record::Map {
        ev,
        iova,
        paddr,
        size,
    }
}

fn parse_unmap(ev: EventHead, body: &str) -> Record {
    let line = ev.line;
    let [iova, size, unmapped] =
        fields(body, ["iova", "size", "unmapped_size"]).map(|v| v.and_then(num));
    let (Some(iova), Some(size)) = (iova, size) else {
        return Record::Bad {
            line,
            why: "an unmap event without iova= and size=",
        };
    };
    let unmapped = unmapped.unwrap_or(size);
    Record::Unmap {
        ev,
        iova,
        size,
        unmapped,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_flush_timers_kprobe_and_the_captures_note_are_read() {
        let r = parse_line(
            "     ksoftirqd/1-20      [001] d.s..     8.693557: fq_flush_timeout: (fq_flush_timeout+0x0/0x160)",
            1,
        );
        let Record::Timer { ev, dom: None } = r else {
            panic!("{r:?}")
        };
        assert_eq!((ev.cpu, ev.ts_ns, ev.ctx), (1, 8_693_557_000, Ctx::Softirq));
        assert_eq!(
            parse_line(
                "# iommulab capture: flush queue timer recorded (kprobe fq_flush_timeout)",
                1
            ),
            Record::Other,
            "the capture's note that it recorded the timer is a comment"
        );
        assert_eq!(
            parse_line("# iommulab capture: 3 events lost", 1),
            Record::Other
        );
    }

    proptest! {
        /// A hex word reads as its digits say, whether it has the kernel's sixteen or not (leading zeros,
        /// upper case, a non-digit anywhere, no digit at all, more than 64 bits).
        #[test]
        fn hex_words_read_as_their_digits(digits in "[0-9a-fA-F]{0,24}", tail in "[ g:=xX0-9a-f-]{0,3}", zeros in 0usize..20,
                                          v in any::<u64>(), cut in 0usize..16, junk in "[ g:=xX-]") {
            let kernel = format!("0x{v:016x}{tail}");
            let n = 2 + kernel[2..].bytes().take_while(|c| c.is_ascii_hexdigit()).count();
            if n == 18 {
                prop_assert_eq!(hex_word(kernel.as_bytes()), Some((v, &kernel.as_bytes()[18..])));
            }
            // A non-digit inside the sixteen: the digits before it.
            let mut torn = format!("0x{v:016X} ");
            torn.replace_range(2 + cut..3 + cut, &junk);
            let want = (cut > 0).then(|| (u64::from_str_radix(&torn[2..2 + cut], 16).unwrap(), &torn.as_bytes()[2 + cut..]));
            prop_assert_eq!(hex_word(torn.as_bytes()), want);
            let text = format!("0x{}{digits}{tail}", "0".repeat(zeros));
            let b = text.as_bytes();
            let n = b[2..].iter().take_while(|c| c.is_ascii_hexdigit()).count();
            let want = u128::from_str_radix(&text[2..2 + n], 16)
                .ok()
                .filter(|&v| v <= u64::MAX as u128)
                .map(|v| (v as u64, &b[2 + n..]));
            prop_assert_eq!(hex_word(b), want, "{}", text);
        }

        /// Eight bytes read as hex digits all at once agree with reading them one by one, at the edges of the
        /// digit and letter ranges and with bytes above 0x7f.
        #[test]
        fn eight_hex_digits_read_at_once_as_one_by_one(
            digits in "[0-9a-fA-F]{8}", at in 0usize..8, odd in any::<Option<u8>>(),
            edge in proptest::sample::select(vec![b'/', b'0', b'9', b':', b'@', b'A', b'F', b'G', b'`', b'a', b'f',
                                                  b'g', 0x7f, 0x80, 0xb0, 0xc1, 0xe6, 0xff]),
        ) {
            // Hex digits, one of them maybe swapped for a byte at the edge of a range or any byte.
            let mut bytes = digits.into_bytes();
            bytes[at] = odd.unwrap_or(edge);
            let one_by_one = bytes.iter().try_fold(0u64, |v, &c| {
                (c as char).to_digit(16).map(|d| v << 4 | d as u64)
            });
            let word = u64::from_be_bytes(bytes.clone().try_into().unwrap());
            prop_assert_eq!(hex8(word), one_by_one, "{:?}", bytes);
        }

        /// The two-byte search finds the first occurrence, whichever byte it runs on.
        #[test]
        fn find2_finds_the_first_occurrence(b in "[ \\[:a-z]{0,40}") {
            for pat in [b" [", b": ", b"  ", b"a["] {
                let naive = b.as_bytes().windows(2).position(|w| w == pat);
                prop_assert_eq!(find2(b.as_bytes(), pat), naive);
            }
        }

        /// A map or unmap line in any of the layouts ftrace prints reads back as written; any other text
        /// (multi-byte characters next to the delimiters included) reads as something, never a panic.
        #[test]
        fn lines_read_back_what_was_written(
            task in "[a-z<>/:0-9 -]{1,16}", pid in 0u32..1_000_000, cpu in 0u32..512,
            flags in prop::option::of("[.dNnhHsSzZb][.hHsSzZ][.hHsSzZ][0-9.]{1,2}"),
            tgid in prop::option::of(0u32..100_000), sec in 0u64..100_000, us in 0u64..1_000_000,
            iova in any::<u64>(), paddr in any::<u64>(), size in any::<u32>(), map in any::<bool>(),
            pad in "[ \t]{0,3}", noise in "\\PC{0,40}",
        ) {
            let tgid = tgid.map(|t| format!(" ({t:>7})")).unwrap_or_default();
            let flags = flags.map(|f| format!(" {f}")).unwrap_or_default();
            let head = format!("{pad}{task}-{pid}{tgid} [{cpu:03}]{flags} {sec}.{us:06}: ");
            let body = if map {
                format!("map: IOMMU: iova=0x{iova:016x} - 0x{:016x} paddr=0x{paddr:016x} size={size}", iova.wrapping_add(size as u64))
            } else {
                format!("unmap: IOMMU: iova=0x{iova:016x} - 0x{:016x} size={size} unmapped_size={size}", iova.wrapping_add(size as u64))
            };
            let ctx = match flags.as_bytes().get(3) {
                Some(b'h' | b'H') => Ctx::Hardirq,
                Some(b's') => Ctx::Softirq,
                Some(b'z' | b'Z') => Ctx::Nmi,
                _ => Ctx::Task,
            };
            let ev = EventHead { pid, cpu, ctx, ts_ns: sec * 1_000_000_000 + us * 1000, line: 7 };
            let want = if map {
                Record::Map { ev, iova, paddr, size: size as u64 }
            } else {
                Record::Unmap { ev, iova, size: size as u64, unmapped: size as u64 }
            };
            prop_assert_eq!(parse_line(&(head.clone() + &body), 7), want.clone());
            prop_assert_eq!(parse_general(&(head.clone() + &body), 7), want);
            // Wherever the byte-level reader answers, the general one answers the same.
            for l in [head.clone() + &body, head.clone() + &noise, noise.clone(), format!("{head}{body}{noise}"),
                      format!("{body}{head}"), (head.clone() + &body).replacen(' ', &pad, 3)] {
                if let Some(r) = fast_event(l.as_bytes(), 11) {
                    prop_assert_eq!(r, parse_general(&l, 11), "{}", l);
                }
            }
            let _ = parse_line(&(head.clone() + &noise), 8);
            let _ = parse_line(&noise, 9);
            let cut = (head + &body).chars().take(noise.len()).collect::<String>();
            let _ = parse_line(&cut, 10);
        }
    }

    #[test]
    fn the_dma_apis_events_and_the_captures_group_notes_are_read() {
        let head = "              dd-271     [000] d....     5.634651: ";
        let read = |body: &str| match parse_line(&format!("{head}{body}"), 1) {
            Record::Device {
                ev,
                map,
                dev,
                range,
            } => Some((ev.cpu, map, dev, range)),
            _ => None,
        };
        let dev = |d: &str| d.to_string();
        for (body, want) in [
            ("dma_map_page: 0000:00:02.0 dir=FROM_DEVICE dma_addr=ffffa000 size=4096 phys_addr=427f2000 attrs=",
             (true, dev("0000:00:02.0"), Some((0xffffa000, 0xffffb000)))),
            ("dma_map_sg: 0000:00:03.0 dir=FROM_DEVICE nents=3/3 ents=2/2 dma_addrs={0xfffa0000,0xfffb0000} sizes={0x10000,0x2000} phys_addrs={0x426f5000,0x1,0x2} attrs=NO_WARN",
             (true, dev("0000:00:03.0"), Some((0xfffa0000, 0xfffb2000)))),
            ("dma_unmap_sg: 0000:00:03.0 dir=FROM_DEVICE phys_addrs={0x426f5000} attrs=",
             (false, dev("0000:00:03.0"), None)),
            // Linux 7.3's names for the page pair.
            ("dma_map_phys: 0000:00:02.0 dir=TO_DEVICE dma_addr=fffe0000 size=1514 phys_addr=3a2b1000 attrs=",
             (true, dev("0000:00:02.0"), Some((0xfffe0000, 0xfffe05ea)))),
            ("dma_unmap_phys: 0000:00:02.0 dir=TO_DEVICE dma_addr=fffe0000 size=1514 attrs=",
             (false, dev("0000:00:02.0"), Some((0xfffe0000, 0xfffe05ea)))),
            ("dma_free: 0000:00:04.0 dir=BIDIRECTIONAL dma_addr=fffff000 size=4096 virt_addr=0000000012345678 attrs=",
             (false, dev("0000:00:04.0"), Some((0xfffff000, 0x1_0000_0000)))),
        ] {
            assert_eq!(read(body), Some((0, want.0, want.1, want.2)), "{body}");
        }
        // The syncs neither map nor unmap; a device-less line is unreadable.
        assert_eq!(parse_line(&format!("{head}dma_sync_single_for_cpu: 0000:00:02.0 dir=FROM_DEVICE dma_addr=ffffa000 size=4096"), 5), Record::Other);
        assert!(matches!(
            parse_line(
                &format!("{head}dma_map_page: dir=TO_DEVICE dma_addr=1 size=1"),
                6
            ),
            Record::Bad { line: 6, .. }
        ));
        assert_eq!(
            parse_line(
                "# iommulab capture: iommu group 3: 0000:00:03.0 0000:00:03.1 ",
                7
            ),
            Record::Group {
                id: 3,
                devs: vec!["0000:00:03.0".into(), "0000:00:03.1".into()]
            }
        );
        assert_eq!(
            parse_line(
                "# iommulab capture: flush queue timer's domain recorded (kprobe tb_flush_all)",
                8
            ),
            Record::TimerDomains
        );
        assert!(matches!(
            parse_line(
                &format!(
                    "{head}tb_flush_all: (intel_flush_iotlb_all+0x0/0x30) dom=0xffff8881004d2e00"
                ),
                9
            ),
            Record::FlushAll {
                dom: 0xffff8881004d2e00,
                ..
            }
        ));
        assert!(matches!(
            parse_line(
                &format!("{head}tb_flush_all_viommu: (viommu_flush_iotlb_all+0x0/0x30) dom=0x10"),
                10
            ),
            Record::FlushAll { dom: 0x10, .. }
        ));
        assert!(matches!(
            parse_line(&format!("{head}tb_flush_allx: (f+0x0/0x30) dom=0x10"), 11),
            Record::Other
        ));
    }

    const MAP: &str = "     kworker/0:1-10      [000] b..1.     3.579441: map: IOMMU: iova=0x00000000ffebc000 - 0x00000000ffebd000 paddr=0x0000000002f1d000 size=4096";
    const UNMAP: &str = "          <idle>-0       [000] d.H1.    14.017936: unmap: IOMMU: iova=0x00000000ffec0000 - 0x00000000ffee0000 size=131072 unmapped_size=131072";

    #[test]
    fn hex_words_read_as_the_general_reader_reads_them() {
        for w in [
            "0x0",
            "0x00000000ffebc000",
            "0xFFFFFFFFFFFFFFFF",
            "0x000000000000000000ff",
            "0x1ffffffffffffffff",
            "0x",
            "0xg",
            "0x12 rest",
            "12",
        ] {
            let end = w.find(' ').unwrap_or(w.len());
            let general = w[..end]
                .strip_prefix("0x")
                .and_then(|h| u64::from_str_radix(h, 16).ok());
            assert_eq!(hex_word(w.as_bytes()).map(|(v, _)| v), general, "{w}");
        }
    }

    #[test]
    fn the_kernels_own_layout_takes_the_byte_level_path() {
        for l in [MAP, UNMAP] {
            assert_eq!(
                fast_event(l.as_bytes(), 1),
                Some(parse_general(l, 1)),
                "{l}"
            );
        }
        // A tgid column, or any other event, is the general reader's.
        let tgid = MAP.replace("-10      [000]", "-10 (     10) [000]");
        assert_eq!(fast_event(tgid.as_bytes(), 1), None);
        assert!(matches!(parse_line(&tgid, 1), Record::Map { .. }));
    }

    #[test]
    fn reads_the_kernels_map_unmap_and_marker_lines() {
        let Record::Map {
            ev,
            iova,
            paddr,
            size,
        } = parse_line(MAP, 1)
        else {
            panic!()
        };
        assert_eq!(
            (ev.pid, ev.cpu, ev.ts_ns, ev.ctx),
            (10, 0, 3_579_441_000, Ctx::Task)
        );
        assert_eq!((iova, paddr, size), (0xffebc000, 0x2f1d000, 4096));
        let Record::Unmap {
            ev,
            iova,
            size,
            unmapped,
        } = parse_line(UNMAP, 2)
        else {
            panic!()
        };
        assert_eq!(ev.ctx, Ctx::Hardirq, "flags d.H1.");
        assert_eq!((iova, size, unmapped), (0xffec0000, 131072, 131072));
        let m = parse_line(
            "            init-1       [000] .....     4.491812: tracing_mark_write: TB_BEGIN idle",
            3,
        );
        assert!(matches!(m, Record::Marker { ref text, .. } if text == "TB_BEGIN idle"));
    }

    #[test]
    fn perf_scripts_and_trace_cmds_layouts_read_as_the_kernels() {
        // Issue 15: `perf script` of iommu:map / iommu:unmap (comm, tid, cpu, time, event, trace; the event
        // names padded to the longest) was refused as holding no events. Its task column has no dash; with
        // `-F +pid` it prints PID/TID.
        let perf = [
            "            wget   196 [000]     3.579441:   iommu:map: IOMMU: iova=0x00000000ffebc000 - 0x00000000ffebd000 paddr=0x0000000002f1d000 size=4096",
            " kworker/0:1-ev   196 [000]     3.579441:   iommu:map: IOMMU: iova=0x00000000ffebc000 - 0x00000000ffebd000 paddr=0x0000000002f1d000 size=4096",
            "            wget   190/196   [000]     3.579441: iommu:map: IOMMU: iova=0x00000000ffebc000 - 0x00000000ffebd000 paddr=0x0000000002f1d000 size=4096",
        ];
        let kernel = parse_line(MAP.replace("kworker/0:1-10", "wget-196").as_str(), 1);
        for l in perf {
            // The byte-level path leaves it to the general reader, which reads what the kernel's layout says
            // (no flags column: task context).
            assert_eq!(fast_event(l.as_bytes(), 1), None, "{l}");
            let Record::Map {
                ev,
                iova,
                paddr,
                size,
            } = parse_line(l, 1)
            else {
                panic!("{l}: {:?}", parse_line(l, 1))
            };
            let Record::Map { ev: want, .. } = &kernel else {
                panic!()
            };
            assert_eq!(
                (ev.pid, ev.cpu, ev.ts_ns),
                (want.pid, want.cpu, want.ts_ns),
                "{l}"
            );
            assert_eq!((iova, paddr, size), (0xffebc000, 0x2f1d000, 4096));
        }
        let unmap = "          <idle>     0 [000]    14.017936: iommu:unmap: IOMMU: iova=0x00000000ffec0000 - 0x00000000ffee0000 size=131072 unmapped_size=131072";
        assert!(matches!(
            parse_line(unmap, 2),
            Record::Unmap { size: 131072, .. }
        ));
        // trace-cmd report: the kernel's layout, the event's name padded.
        let tc = "            wget-196   [000]     3.579441: map:                  IOMMU: iova=0x00000000ffebc000 - 0x00000000ffebd000 paddr=0x0000000002f1d000 size=4096";
        assert!(matches!(parse_line(tc, 3), Record::Map { size: 4096, .. }));
        // A task column with neither shape: an iommu event whose prefix cannot be read.
        let bare = "            wget [000]     3.579441:   iommu:map: IOMMU: iova=0x1000 paddr=0x2000 size=4096";
        assert!(matches!(parse_line(bare, 4), Record::Bad { line: 4, .. }));
    }

    #[test]
    fn tolerates_other_formats_and_noise() {
        // tgid column, no flags column, a task name with spaces, nanosecond timestamps.
        let l = "   my task-1234  (  1200) [003]   12.000000001: map: IOMMU: iova=0x1000 paddr=0x2000 size=8192";
        let Record::Map { ev, iova, size, .. } = parse_line(l, 1) else {
            panic!("{:?}", parse_line(l, 1))
        };
        assert_eq!(
            (ev.pid, ev.cpu, ev.ts_ns, iova, size),
            (1234, 3, 12_000_000_001, 0x1000, 8192)
        );
        for other in [
            "# tracer: nop",
            "",
            "CPU:0 [LOST 1234 EVENTS]",
            "  sshd-100 [001] ..... 5.000000: sched_switch: prev_comm=sshd",
        ] {
            assert_eq!(parse_line(other, 1), Record::Other, "{other}");
        }
        // A CPU number no kernel has is a garbled line, not a reason to size per-CPU state by it.
        let far = MAP.replace("[000]", "[4000000000]");
        assert!(matches!(parse_line(&far, 5), Record::Bad { line: 5, .. }));
        // A line cut by an overrun.
        let cut = &MAP[..MAP.len() - 30];
        assert!(
            matches!(parse_line(cut, 9), Record::Bad { line: 9, .. }),
            "{:?}",
            parse_line(cut, 9)
        );
        assert!(matches!(
            parse_line("ffebc000 paddr=0x2f1d000 size=4096 map: IOMMU", 4),
            Record::Bad { .. }
        ));
    }
}
