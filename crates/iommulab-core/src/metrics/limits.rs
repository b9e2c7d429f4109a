//! What bound a run: each resource's busy share over the window, where the workload CPUs' time went, the
//! resource that limited the result, and warnings about windows too short to read.

use crate::workload::OpenLimit;
use serde::Serialize;

/// A server (a CPU, a lock, the IOMMU's command consumer, a translation slot) busy this share of the window
/// or more is saturated: it serves back to back and what reaches it queues (an M/M/1 queue at 0.9 already
/// holds nine requests on average). A reading rule, not a kernel constant.
pub const SATURATED: f64 = 0.9;

/// The device side is the limit when the data it accepted reaches this share of its rate (the NIC's line
/// rate, the drives' bandwidth): closer to it than a busy server gets, since the wire has no queue to fill.
pub const RATE_REACHED: f64 = 0.95;

/// A rate measured from n independent events has a sampling error of about 1/sqrt(n): below this many
/// events per workload CPU the window is too short to read a per-CPU rate to ~3 %.
pub const MIN_EVENTS_PER_CPU: u64 = 1000;

/// A lazy flush queue's timer must fire at least this many times in the window for its share of the
/// flushes (and the exposure it bounds) to be measured, not sampled once.
pub const MIN_TIMER_PERIODS: f64 = 2.0;

/// Where the workload CPUs' time went over the window, as shares of it (they sum to 1).
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct CpuBreakdown {
    /// The DMA API's own work: IOVA allocation, page-table updates, invalidation submission, flush queues.
    pub dma_api: f64,
    /// Of an invalidation the CPU waits for, inserting its commands into a shared command queue until the
    /// IOMMU can see them (SMMUv3: the llq cmpxchg loop and its failed attempts, the shared lock, valid_map,
    /// the wait for ownership, the owner's gather and doorbell). Zero on IOMMUs whose insertion the model
    /// keeps in `inv_wait` (`IommuCounters::cmdq_insert_ns`).
    pub cmdq_insert: f64,
    /// Invalidating: from the request to its completion (VT-d wait descriptors, CMD_SYNCs, a vIOMMU's
    /// replies), spins on the IOMMU driver's locks and queue on the way included, less `cmdq_insert`.
    pub inv_wait: f64,
    /// Spinning on the DMA layer's own locks (the IOVA allocator's, the flush queue's) and stalling on its
    /// shared cache lines.
    pub lock_spin: f64,
    /// Everything outside the DMA API: the network stack or the block layer, the driver, the application.
    pub stack: f64,
    pub idle: f64,
}

impl CpuBreakdown {
    /// From ns over the window: `capacity` (CPUs × window), `busy`, and within it the DMA API's time,
    /// which holds the invalidation waits (`insert` of them in a command queue's insertion, `inv_wait` the
    /// rest) and the lock spins.
    pub fn new(capacity: u64, busy: u64, dma: u64, insert: u64, inv_wait: u64, spin: u64) -> Self {
        let cap = capacity.max(1) as f64;
        let busy = busy.min(capacity);
        let dma = dma.min(busy);
        // The whole invalidation time is clipped as one, and the insertion within it.
        let invalidating = (insert + inv_wait).min(dma);
        let insert = insert.min(invalidating);
        let spin = spin.min(dma - invalidating);
        CpuBreakdown {
            dma_api: (dma - invalidating - spin) as f64 / cap,
            cmdq_insert: insert as f64 / cap,
            inv_wait: (invalidating - insert) as f64 / cap,
            lock_spin: spin as f64 / cap,
            stack: (busy - dma) as f64 / cap,
            idle: (capacity - busy) as f64 / cap,
        }
    }

    /// The busy category that took most time: "dma_api", "cmdq_insert", "inv_wait", "lock_spin" or
    /// "stack". On a tie the first of this list is named (the insertion before the wait, in the order a
    /// CPU spends them).
    pub fn largest(&self) -> &'static str {
        [
            ("stack", self.stack),
            ("dma_api", self.dma_api),
            ("cmdq_insert", self.cmdq_insert),
            ("inv_wait", self.inv_wait),
            ("lock_spin", self.lock_spin),
        ]
        .into_iter()
        .fold(("stack", -1.0), |m, c| if c.1 > m.1 { c } else { m })
        .0
    }
}

/// Each resource's busy share over the window (0 where the run has none).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Utilisation {
    /// Data the device accepted over its rate (NIC line rate, drives' bandwidth).
    pub line: f64,
    /// The device's PCIe link, its busier direction.
    pub link: f64,
    /// The device's translation slots (requests awaiting the IOMMU's answer).
    pub translation_slots: f64,
    /// The busiest of the IOMMU's command consumers (VT-d's invalidation queue, an SMMU command queue).
    pub iommu_queue: f64,
    /// The busiest lock of the DMA path and its name.
    pub lock: f64,
    pub lock_name: String,
    /// The busiest workload CPU.
    pub cpu: f64,
    /// A guest's emulated IOMMU and its software device's thread (QEMU's or vhost's).
    pub emulator: f64,
    pub device_thread: f64,
    /// QEMU's big lock, which the emulator's handlers and QEMU's own device models both hold.
    pub bql: f64,
}

/// The resource that bound the run. Shared serial resources are read before the CPUs because a CPU that
/// waits on them is busy on their account: the device side (line, link), a guest's IOMMU emulator and its
/// software device's thread, QEMU's BQL they share, the IOMMU's command consumer, the CPUs racing into its
/// command queue, the busiest lock, the translation slots; then the busiest CPU (named by where its time
/// went: `cpu.dma_api`, `cpu.inv_wait`, `cpu.lock_spin`, `cpu.stack`); else the workload's own bound.
///
/// `cpu.cmdq_insert` is a saturated CPU whose time goes mostly into a shared command queue's insertion. It is
/// read after `iommu.queue`: with the consumer saturated, a faster insertion would only queue more for it.
/// It is read before the locks: the insertion serialises the CPUs on the queue's own lines (SMMUv3's llq,
/// shared lock and valid_map, each one of `lock`'s rows), which all saturate together when the CPUs race
/// for the queue, and the race is what binds, not whichever of its lines is reported busiest.
pub fn limited_by(u: &Utilisation, cpu: &CpuBreakdown, open: OpenLimit) -> String {
    if u.line >= RATE_REACHED {
        return "line".into();
    }
    if u.link >= RATE_REACHED {
        return "link".into();
    }
    let inserting = if cpu.largest() == "cmdq_insert" {
        u.cpu
    } else {
        0.0
    };
    // A guest's emulated IOMMU serves its command queue in the emulator: name the emulator, or QEMU's device
    // thread; when neither alone fills the BQL they share, the BQL (which is also the emulated IOMMU's
    // queue).
    let servers = [
        ("emulator", u.emulator),
        ("device_thread", u.device_thread),
        ("bql", u.bql),
        ("iommu.queue", u.iommu_queue),
        ("cpu.cmdq_insert", inserting),
        ("lock", u.lock),
        ("iommu.translation", u.translation_slots),
    ];
    if let Some((name, _)) = servers.iter().find(|(_, s)| *s >= SATURATED) {
        return if *name == "lock" {
            format!("lock:{}", u.lock_name)
        } else {
            name.to_string()
        };
    }
    if u.cpu >= SATURATED {
        return format!("cpu.{}", cpu.largest());
    }
    open.as_str().into()
}

/// Whether a bounce pool that was full bound the run: neither line nor link reached, and at least one map
/// in a hundred found no slots (`full` of `tries`): the driver dropped or requeued what it could not map.
pub fn pool_full(u: &Utilisation, full: u64, tries: u64) -> bool {
    u.line < RATE_REACHED && u.link < RATE_REACHED && full > 0 && full * 100 >= tries
}

/// Warnings about a window of `dt` ns too short to read: fewer than MIN_EVENTS_PER_CPU of the workload's
/// events (packets, I/Os, requests, map loops) per CPU, or a policy timer of `timer_period_ns` that fired
/// fewer than MIN_TIMER_PERIODS times.
pub fn warnings(
    events: u64,
    cpus: u64,
    dt: u64,
    timer_period_ns: Option<u64>,
    window_key: &str,
) -> Vec<String> {
    let mut w = Vec::new();
    let cpus = cpus.max(1);
    if events < MIN_EVENTS_PER_CPU * cpus {
        let per = events / cpus;
        let err = if per == 0 {
            "unbounded".to_string()
        } else {
            format!("±{:.0} %", 100.0 / (per as f64).sqrt())
        };
        w.push(format!(
            "short window: {events} events in it, {per} per CPU (at least {MIN_EVENTS_PER_CPU} wanted); \
             per-CPU rates read to {err}: lengthen {window_key}"
        ));
    }
    if let Some(p) = timer_period_ns.filter(|&p| p > 0) {
        let periods = dt as f64 / p as f64;
        if periods < MIN_TIMER_PERIODS {
            w.push(format!(
                "short window: the flush-queue timer ({} ms) fits {periods:.1} times in it (at least \
                 {MIN_TIMER_PERIODS} wanted): lengthen {window_key}",
                p / 1_000_000
            ));
        }
    }
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn breakdown_sums_to_one_and_clips_inconsistent_inputs() {
        let b = CpuBreakdown::new(1000, 800, 500, 0, 200, 100);
        assert_eq!(b.dma_api, 0.2);
        assert_eq!((b.cmdq_insert, b.inv_wait), (0.0, 0.2));
        assert_eq!(b.lock_spin, 0.1);
        assert_eq!(b.stack, 0.3);
        assert_eq!(b.idle, 0.2);
        assert_eq!(b.largest(), "stack");
        // Waits beyond the DMA time it holds (another CPU's), busy beyond capacity: clipped.
        let b = CpuBreakdown::new(1000, 2000, 100, 0, 300, 50);
        let sum = b.dma_api + b.cmdq_insert + b.inv_wait + b.lock_spin + b.stack + b.idle;
        assert!((sum - 1.0).abs() < 1e-12, "{b:?}");
        assert_eq!(b.inv_wait, 0.1);
    }

    #[test]
    fn the_insertion_is_split_from_the_wait_and_everything_else_is_as_without_it() {
        // 150 ns of 200 invalidating in the queue's insertion: inv_wait keeps the rest; the other shares
        // are those of the 200 ns booked as one wait.
        let one = CpuBreakdown::new(1000, 800, 500, 0, 200, 100);
        let split = CpuBreakdown::new(1000, 800, 500, 150, 50, 100);
        assert_eq!((split.cmdq_insert, split.inv_wait), (0.15, 0.05));
        assert_eq!(
            (split.dma_api, split.lock_spin, split.stack, split.idle),
            (one.dma_api, one.lock_spin, one.stack, one.idle)
        );
        // Clipped as one at the DMA API's time, the insertion first.
        let b = CpuBreakdown::new(1000, 1000, 100, 80, 300, 50);
        assert_eq!(
            (b.cmdq_insert, b.inv_wait, b.dma_api, b.lock_spin),
            (0.08, 0.02, 0.0, 0.0)
        );
        let b = CpuBreakdown::new(1000, 1000, 100, 300, 300, 0);
        assert_eq!((b.cmdq_insert, b.inv_wait), (0.1, 0.0));
    }

    #[test]
    fn cpus_racing_into_the_queue_are_named_apart_from_the_queue_and_the_wait() {
        // Many CPUs on one shared queue: 60 % of their time inserting, 30 % polling for CMD_SYNCs.
        let racing = CpuBreakdown::new(100, 100, 95, 60, 30, 0);
        let mut u = Utilisation {
            cpu: 1.0,
            iommu_queue: 0.5,
            ..Default::default()
        };
        assert_eq!(
            limited_by(&u, &racing, OpenLimit::Senders),
            "cpu.cmdq_insert"
        );
        // The consumer saturated instead: the queue, whatever the CPUs do while it is.
        u.iommu_queue = 0.95;
        assert_eq!(limited_by(&u, &racing, OpenLimit::Senders), "iommu.queue");
        // The CPUs mostly polling for their CMD_SYNCs: the wait.
        u.iommu_queue = 0.5;
        let polling = CpuBreakdown::new(100, 100, 95, 30, 60, 0);
        assert_eq!(limited_by(&u, &polling, OpenLimit::Senders), "cpu.inv_wait");
        // The race saturates the queue's lines with it: the race is named, not its busiest line; a line
        // saturated while the CPUs mostly poll is named as the lock it is.
        u.lock = 1.0;
        u.lock_name = "smmu cmdq llq".into();
        assert_eq!(
            limited_by(&u, &racing, OpenLimit::Senders),
            "cpu.cmdq_insert"
        );
        assert_eq!(
            limited_by(&u, &polling, OpenLimit::Senders),
            "lock:smmu cmdq llq"
        );
        // CPUs inserting most of the time they are busy, but rarely busy: not the bound.
        (u.lock, u.cpu) = (0.5, 0.5);
        assert_eq!(
            limited_by(&u, &racing, OpenLimit::QueueDepth),
            "queue_depth"
        );
    }

    #[test]
    fn a_short_window_warns_and_a_long_one_does_not() {
        assert!(warnings(8000, 8, 100_000_000, Some(10_000_000), "run.duration_ms").is_empty());
        let w = warnings(800, 8, 15_000_000, Some(10_000_000), "run.duration_ms");
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(
            w[0].contains("100 per CPU") && w[0].contains("±10 %"),
            "{w:?}"
        );
        assert!(w[1].contains("1.5 times"), "{w:?}");
    }

    #[test]
    fn serial_resources_are_read_before_the_cpus() {
        let cpu = CpuBreakdown::new(100, 100, 90, 0, 80, 0);
        let mut u = Utilisation {
            cpu: 1.0,
            iommu_queue: 0.95,
            ..Default::default()
        };
        assert_eq!(limited_by(&u, &cpu, OpenLimit::Senders), "iommu.queue");
        u.iommu_queue = 0.5;
        assert_eq!(limited_by(&u, &cpu, OpenLimit::Senders), "cpu.inv_wait");
        u.cpu = 0.5;
        assert_eq!(limited_by(&u, &cpu, OpenLimit::QueueDepth), "queue_depth");
        u.line = 0.97;
        assert_eq!(limited_by(&u, &cpu, OpenLimit::Senders), "line");
    }

    #[test]
    fn each_resource_is_named_over_every_one_read_after_it() {
        // limited_by's order, end to end: with a resource and every one after it saturated, that resource
        // is named. Swapping any two neighbours names the wrong one in one of these rows.
        let order = [
            "line",
            "link",
            "emulator",
            "device_thread",
            "bql",
            "iommu.queue",
            "cpu.cmdq_insert",
            "lock:iova_rbtree_lock",
            "iommu.translation",
            "cpu.inv_wait",
        ];
        for (i, want) in order.iter().enumerate() {
            let on = |name: &str, busy: f64| {
                let at = order.iter().position(|o| *o == name).expect("in the order");
                if at >= i {
                    busy
                } else {
                    0.0
                }
            };
            // The CPUs racing into the queue: 60 % of their time inserting, against 20 % waiting.
            let insert = on("cpu.cmdq_insert", 60.0) as u64;
            let cpu = CpuBreakdown::new(100, 100, 90, insert, 80 - insert, 0);
            let u = Utilisation {
                line: on("line", RATE_REACHED),
                link: on("link", RATE_REACHED),
                emulator: on("emulator", SATURATED),
                device_thread: on("device_thread", SATURATED),
                bql: on("bql", SATURATED),
                iommu_queue: on("iommu.queue", SATURATED),
                lock: on("lock:iova_rbtree_lock", SATURATED),
                lock_name: "iova_rbtree_lock".into(),
                translation_slots: on("iommu.translation", SATURATED),
                cpu: on("cpu.inv_wait", SATURATED),
            };
            assert_eq!(limited_by(&u, &cpu, OpenLimit::Senders), *want, "{u:?}");
        }
        // Nothing saturated, and each just below its threshold: the workload's own bound.
        let below = Utilisation {
            line: RATE_REACHED - 1e-9,
            link: RATE_REACHED - 1e-9,
            emulator: SATURATED - 1e-9,
            device_thread: SATURATED - 1e-9,
            bql: SATURATED - 1e-9,
            iommu_queue: SATURATED - 1e-9,
            lock: SATURATED - 1e-9,
            lock_name: "iova_rbtree_lock".into(),
            translation_slots: SATURATED - 1e-9,
            cpu: SATURATED - 1e-9,
        };
        let cpu = CpuBreakdown::new(100, 100, 90, 60, 20, 0);
        assert_eq!(limited_by(&below, &cpu, OpenLimit::Senders), "senders");
    }
}
