//! Arm SMMUv3: LPAE page table (4K/16K/64K granule, stage 1 or 2), TLB and walk caches (shared [`Translator`]) and the command
//! queue as drivers/iommu/arm/arm-smmu-v3/arm-smmu-v3.c drives it: TLBI_NH_VA / TLBI_S2_IPA per granule, or
//! range commands (TG/SCALE/NUM/TTL) with RIL; TLBI_NH_ASID / TLBI_S12_VMALL for a whole domain; batches of
//! CMDQ_BATCH_ENTRIES issued without sync and a CMD_SYNC at the end; ATC_INV for ATS devices; CFGI_STE /
//! CFGI_CD on attach; one queue shared by all CPUs (the lock-free insertion still serialises on the
//! producer index) or per-CPU ECMDQs.

use super::cache::{PsiMatch, QemuIotlb};
use super::driver::{Column, Driver, Emulation, KernelDriver};
use super::emul::{ExitCause, ExitStats, Shadow, Trap, BQL};
use super::translator::{CacheInval, Translator};
use super::{DomainId, InvClass, InvKind, Iommu, IotlbGather};
use super::{HypervisorProfile, IommuProfile, Platform, PtFormat, Vendor};
use crate::kernel::{Arch, KernelVersion};
use crate::sim::{Coherence, FifoServer, LockStats, SpinLock, Time};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// SMMUv3's commands (spec §4), as arm-smmu-v3.c names them.
pub const TLBI_NH_VA: InvKind = InvKind::new(0, "tlbi_nh_va", InvClass::Range);
pub const TLBI_NH_ASID: InvKind = InvKind::new(1, "tlbi_nh_asid", InvClass::Domain);
pub const ATC_INV: InvKind = InvKind::new(2, "atc_inv", InvClass::DevTlb);
pub const CFGI_STE: InvKind = InvKind::new(3, "cfgi_ste", InvClass::Config);
pub const CFGI_CD: InvKind = InvKind::new(4, "cfgi_cd", InvClass::Config);
pub const TLBI_S2_IPA: InvKind = InvKind::new(5, "tlbi_s2_ipa", InvClass::Range);
pub const TLBI_S12_VMALL: InvKind = InvKind::new(6, "tlbi_s12_vmall", InvClass::Domain);

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Smmuv3Profile {
    /// CPU time to insert one 16-byte command (slot reservation on the shared producer index, copy).
    pub submit_cmd_ns: u64,
    /// SMMU time to consume one TLBI command.
    pub cmd_ns: u64,
    /// SMMU time a CMD_SYNC holds its queue: the commands before it complete (SMMUv3 §4.7.3).
    pub sync_ns: u64,
    /// What a CMD_SYNC's round trip adds outside the queue: the doorbell reaching the SMMU, the command
    /// fetch, the MSI write and the polling CPU seeing it (the time of a CMD_SYNC on an empty queue).
    #[serde(default)]
    pub sync_signal_ns: u64,
    /// IDR3.RIL: range invalidation commands.
    pub ril: bool,
    /// Per-CPU enhanced command queues (SMMUv3.3 ECMDQ) instead of one shared queue.
    pub ecmdq: bool,
    /// The SMMU consumes its ECMDQs in parallel (one consumer per queue) rather than one after another.
    #[serde(default)]
    pub ecmdq_parallel: bool,
    /// Translation stage of DMA domains: 1 (TLBI_NH_*, by ASID) or 2 (TLBI_S2_IPA / S12_VMALL, by VMID).
    pub stage: u32,
    /// A "caching mode" for an emulated SMMUv3 (E. Auger's vSMMUv3 series, a firmware quirk): the driver
    /// also invalidates after every map, so the VMM sees new mappings (for VFIO). No hardware has it.
    #[serde(default)]
    pub caching_mode: bool,
}

/// arm-smmu-v3.h CMDQ_BATCH_ENTRIES (BITS_PER_LONG): commands per batch before an unsynchronised issue.
pub const CMDQ_BATCH_ENTRIES: usize = 64;
/// arm-smmu-v3.h CMDQ_TLBI_RANGE_NUM_MAX: the 5-bit NUM field.
pub const CMDQ_TLBI_RANGE_NUM_MAX: u64 = 31;

/// One TLBI command by address, with the fields __arm_smmu_tlb_inv_range() fills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TlbiRange {
    /// First 4 KiB page the command covers.
    pub addr_pfn: u64,
    /// 4 KiB pages it covers.
    pub pages: u64,
    /// Range fields (0 without RIL): TG = (tg-10)/2, SCALE, NUM (encoded as num-1), TTL (0 = any level).
    pub tg: u32,
    pub scale: u32,
    pub num: u32,
    pub ttl: u32,
    pub leaf: bool,
}

/// __arm_smmu_tlb_inv_range(): the TLBI commands for [iova_pfn, iova_pfn + pages) of 4 KiB pages, for a
/// table whose leaf pages are 2^`tg` bytes and an invalidation granule (the gather's page size, or the
/// leaf size for a walk flush) of 2^`granule` bytes. With RIL, one command per 5-bit chunk of the page
/// count; without, one command per granule.
pub fn tlbi_range_cmds(
    iova_pfn: u64,
    pages: u64,
    tg: u32,
    granule: u32,
    leaf: bool,
    ril: bool,
) -> Vec<TlbiRange> {
    let mut out = Vec::new();
    if pages == 0 {
        return out;
    }
    let end = iova_pfn + pages;
    if !ril {
        let step = 1u64 << (granule - 12);
        let mut addr = iova_pfn;
        while addr < end {
            out.push(TlbiRange {
                addr_pfn: addr,
                pages: step,
                tg: 0,
                scale: 0,
                num: 0,
                ttl: 0,
                leaf,
            });
            addr += step;
        }
        return out;
    }
    let tg_pages = tg - 12;
    let mut num_pages = pages >> tg_pages;
    // Leaf: TTL from the granule's level; non-leaf keeps TTL 0 and avoids a lone NUM of 1 by rounding up.
    let ttl = if leaf {
        4 - (granule - 3) / (tg - 3)
    } else {
        0
    };
    if !leaf && (num_pages & CMDQ_TLBI_RANGE_NUM_MAX) == 1 {
        num_pages += 1;
    }
    let mut addr = iova_pfn;
    while addr < end && num_pages > 0 {
        let scale = num_pages.trailing_zeros();
        let num = (num_pages >> scale) & CMDQ_TLBI_RANGE_NUM_MAX;
        let span = num << (scale + tg_pages);
        out.push(TlbiRange {
            addr_pfn: addr,
            pages: span,
            tg: (tg - 10) / 2,
            scale,
            num: num as u32 - 1,
            ttl,
            leaf,
        });
        num_pages -= num << scale;
        addr += span;
    }
    out
}

/// arm_smmu_atc_inv_to_cmd(): the one ATC_INV covering [pfn, pfn + pages) (4 KiB grain): the smallest
/// aligned power of two holding it. Returns (aligned base pfn, log2 span).
pub fn atc_inv_span(pfn: u64, pages: u64) -> (u64, u32) {
    let (start, end) = (pfn, pfn + pages - 1);
    let log2_span = 64 - (start ^ end).leading_zeros();
    let mask = if log2_span >= 64 {
        u64::MAX
    } else {
        (1u64 << log2_span) - 1
    };
    (start & !mask, log2_span)
}

pub struct Smmuv3 {
    cfg: Smmuv3Profile,
    tr: Translator,
    /// The device's ATS invalidation completion time (a CMD_SYNC after ATC_INV waits for it).
    ats_inv_ns: u64,
    /// The shared queue's lines every CPU writes (arm_smmu_cmdq_issue_cmdlist): `llq` (prod/cons/owned,
    /// cmpxchg'd to reserve slots, fetch_andnot'd by the owner), the line of `lock` and `owner_prod` (the
    /// shared lock taken around a CMD_SYNC wait, the owner hand-off), and the valid bitmap word.
    llq: SpinLock,
    /// When an owner's fetch_andnot changed llq, in time order over the last LOOKBEHIND_NS: a cmpxchg fails
    /// if llq changed after the CPU last saw it.
    llq_writes: std::collections::VecDeque<Time>,
    /// Each reservation's loop on llq, (entered, succeeded), in the order of their successes, over the last
    /// LOOKBEHIND_NS: a CPU entering the loop waits behind those still in it, failing once at each success.
    llq_loops: std::collections::VecDeque<(Time, Time)>,
    /// Scratch: the successes a CPU entering the loop waits through.
    ahead: Vec<Time>,
    lock_owner: SpinLock,
    valid_map: SpinLock,
    /// Before 5.4 (`KernelVersion::smmuv3_cmdq_batched` false): `cmdq.lock`, taken for every command's
    /// insertion and, without MSI, held through a CMD_SYNC's poll.
    cmdq_lock: Option<SpinLock>,
    /// Each command queue as the SMMU consumes it, in the order commands reach it (the shared one, or one
    /// ECMDQ per CPU): busy while it consumes commands, and while a CMD_SYNC waits for completion
    /// (SMMUv3 §4.7.3: commands after a CMD_SYNC do not begin processing until it completes).
    queues: Vec<FifoServer>,
    /// The current owner's gathering window on the shared queue (from its cmpxchg to its fetch_andnot) and
    /// when it rang the doorbell for what it gathered.
    gathering: (Time, Time, Time),
    /// With ECMDQs executed one after another: one consumer for every queue, and when each queue is free.
    consumer: FifoServer,
    queue_free: Vec<Time>,
    /// In a guest: the doorbell (CMDQ_PROD) write exits to the VMM, whose handler is the SMMU (`queues`:
    /// its work under the BQL, at the profile's per-command costs).
    trap: Option<Trap>,
    /// A VFIO device in that guest: QEMU shadows the guest's mappings into the host IOMMU on each TLBI.
    shadow: Option<Shadow>,
    /// Shadow-sync work of the commands about to be issued (added to their consumption).
    shadow_ns: u64,
}

/// A command for [`Smmuv3::issue`]: what it costs the SMMU.
#[derive(Clone, Copy)]
enum Cmd {
    Tlbi,
    Cfgi,
    AtcInv,
}

impl Smmuv3 {
    pub fn new(
        p: &IommuProfile,
        tr: Translator,
        cpus: usize,
        ats_inv_ns: u64,
        coh: Coherence,
        kernel: KernelVersion,
    ) -> Self {
        let cfg = p
            .smmuv3
            .clone()
            .expect("validated: vendor smmuv3 has [iommu.smmuv3]");
        let queues = if cfg.ecmdq { cpus.max(1) } else { 1 };
        Smmuv3 {
            cfg,
            tr,
            ats_inv_ns,
            llq: SpinLock::new(coh),
            llq_writes: Default::default(),
            llq_loops: Default::default(),
            ahead: Vec::new(),
            lock_owner: SpinLock::new(coh),
            valid_map: SpinLock::new(coh),
            cmdq_lock: (!kernel.smmuv3_cmdq_batched()).then(|| SpinLock::new(coh)),
            // The SMMU's side moves no CPU cache lines.
            queues: vec![FifoServer::default(); queues],
            consumer: FifoServer::default(),
            gathering: (0, 0, 0),
            queue_free: vec![0; queues],
            trap: None,
            shadow: None,
            shadow_ns: 0,
        }
    }

    /// The same SMMU emulated by a hypervisor (QEMU's smmuv3), when `trap` is given; `shadow` when a VFIO
    /// device sits behind it.
    pub fn emulated(mut self, trap: Option<Trap>, shadow: Option<Shadow>) -> Self {
        self.trap = trap;
        self.shadow = shadow.filter(|_| self.trap.is_some());
        self
    }

    /// QEMU's shadow sync for the invalidations about to be consumed (its IOMMU notifier on each TLBI).
    fn shadow_sync(&mut self, invs: &[CacheInval]) {
        let (Some(sh), Some(trap)) = (self.shadow.as_mut(), self.trap.as_mut()) else {
            return;
        };
        for inv in invs {
            self.shadow_ns += match *inv {
                CacheInval::Range { dom, pfn, n, .. } => {
                    sh.sync(&mut trap.stats, &self.tr, dom, pfn, n)
                }
                CacheInval::Domain { dom } => sh.sync_all(&mut trap.stats, &self.tr, dom),
                _ => 0,
            };
        }
    }

    fn by_va(&self) -> InvKind {
        if self.cfg.stage == 2 {
            TLBI_S2_IPA
        } else {
            TLBI_NH_VA
        }
    }

    /// Time the SMMU takes to consume one command of `what`.
    fn cmd_ns(&self, what: Cmd) -> u64 {
        match what {
            Cmd::Tlbi if self.notifies_vhost() => self.cfg.cmd_ns + self.ats_inv_ns,
            Cmd::Tlbi | Cmd::Cfgi => self.cfg.cmd_ns,
            Cmd::AtcInv => self.cfg.cmd_ns + self.ats_inv_ns,
        }
    }

    /// Emulated with vhost's device IOTLB behind it: QEMU's SMMUv3 has no ATS (IDR0.ATS = 0), so the
    /// guest sends no ATC_INV; each TLBI reaches vhost through QEMU's IOMMU notifier
    /// (smmuv3_inv_notifiers_iova), at the cost of one VHOST_IOTLB_INVALIDATE.
    fn notifies_vhost(&self) -> bool {
        self.trap.is_some() && self.tr.has_atc()
    }

    /// A command's effect on the caches when the SMMU consumes it at `at` (and on vhost's IOTLB when QEMU
    /// notifies it).
    fn consumed(&mut self, at: Time, inv: CacheInval) {
        self.tr.invalidate(at, inv);
        if self.notifies_vhost() {
            let atc = match inv {
                CacheInval::Range { dom, pfn, n, .. } => CacheInval::Atc {
                    dom,
                    range: Some((pfn, n)),
                },
                CacheInval::Domain { dom } | CacheInval::WalkCaches { dom } => {
                    CacheInval::Atc { dom, range: None }
                }
                other => other,
            };
            self.tr.invalidate(at, atc);
        }
    }

    /// arm_smmu_cmdq_issue_cmdlist() for `n` commands of one type, with a CMD_SYNC appended when `sync`.
    /// Returns the time the SMMU starts consuming them and the time the CPU is released: after insertion,
    /// or after the SMMU has consumed up to its CMD_SYNC (which completes only once the devices have
    /// answered outstanding ATC invalidations).
    fn issue(&mut self, now: Time, cpu: usize, n: usize, what: Cmd, sync: bool) -> (Time, Time) {
        if self.cmdq_lock.is_some() {
            return self.issue_locked(now, cpu, n, what, sync);
        }
        let cmds = n as u64 + sync as u64;
        let c = cpu as u32;
        let nq = self.queues.len();
        let q = if self.cfg.ecmdq { cpu % nq } else { 0 };
        let gathered = self.tr.c.gathered;
        let written = if self.cfg.ecmdq {
            // An ECMDQ is this CPU's own: write the commands, then its PROD register; nothing shared.
            now + cmds * self.cfg.submit_cmd_ns
        } else {
            self.shared_insert(now, c, cmds, sync)
        };
        let inserted = written - now;
        let work = n as u64 * self.cmd_ns(what) + std::mem::take(&mut self.shadow_ns);
        let sync_ns = if sync { self.cfg.sync_ns } else { 0 };
        // In a guest the PROD write exits to QEMU's smmuv3_cmdq_consume(), which consumes every command up to
        // PROD, CMD_SYNCs included, before the vCPU re-enters (the handler is the SMMU).
        let handler = self.trap.as_ref().map_or(0, Trap::handler_ns);
        let arrive = self.trap.as_ref().map_or(written, |tr| tr.exit(written));
        let (start, done) = if self.cfg.ecmdq && !self.cfg.ecmdq_parallel {
            // One consumer takes every queue's commands in turn; a CMD_SYNC then holds only its own queue.
            let ready = written.max(self.queue_free[q]);
            let (start, consumed) = self.consumer.serve(ready, work);
            self.queue_free[q] = consumed + sync_ns;
            (start, consumed + sync_ns)
        } else {
            self.queues[q].serve(arrive, work + handler + sync_ns)
        };
        self.tr.c.submissions += 1;
        // The owner that rang is back when the handler returns; a CPU whose commands it gathered spins in the
        // guest until CONS passes its CMD_SYNC. On hardware the CPU sees the completion sync_signal_ns later
        // (MSI write, its poll).
        // Each CPU waiting for a CMD_SYNC then reads CMDQ_CONS: one more trap, answered once the handler
        // that consumed its commands has returned.
        let (written, seen) = match self.trap.as_mut() {
            None => (written, done + self.cfg.sync_signal_ns),
            Some(trap) => {
                let work = work + handler + sync_ns;
                // (the vCPU back in the guest, when its commands are consumed)
                let (back, ready) = if self.tr.c.gathered == gathered {
                    let back = trap.resume(ExitCause::CmdqProd, written, done, work, cmds);
                    (back, back)
                } else {
                    trap.consumed(work, cmds);
                    (written, done)
                };
                let seen = if sync {
                    trap.read(ExitCause::CmdqCons, back, ready)
                } else {
                    ready
                };
                (back, seen)
            }
        };
        if !sync {
            return (start, written);
        }
        self.tr.c.syncs += 1;
        // Then arm_smmu_cmdq_shared_tryunlock() (an ECMDQ has nothing shared).
        let rel = if self.cfg.ecmdq {
            seen
        } else {
            self.lock_owner.rmw_on(seen, c)
        };
        self.book_wait(now, inserted, rel);
        (start, rel)
    }

    /// An invalidation the CPU waited for, from `now` to `rel`: its first `inserted` ns, until the SMMU can
    /// see the commands, are the command queue's insertion (`cmdq_insert_ns`), the rest the wait for the
    /// CMD_SYNC's completion (`inv_wait_ns`, a guest's exits to the emulator included). An issue without a
    /// CMD_SYNC that the CPU does not wait for is booked in neither: its insertion is the DMA API's own time.
    fn book_wait(&mut self, now: Time, inserted: u64, rel: Time) {
        debug_assert!(
            inserted <= rel - now,
            "inserted {inserted} past {now}..{rel}"
        );
        let inserted = inserted.min(rel - now);
        self.tr.c.cmdq_insert_ns += inserted;
        self.tr.c.inv_wait_ns += rel - now - inserted;
    }

    /// Before 5.4 (arm_smmu_cmdq_issue_cmd, __arm_smmu_cmdq_issue_sync): `n` commands inserted one at a time
    /// under `cmdq.lock`, each writing PROD (so in a guest each one traps and QEMU consumes it alone), then a
    /// CMD_SYNC the same way. Without MSI (QEMU's SMMUv3) the CPU polls CONS with the lock held; with it (a
    /// hardware SMMU's IDR0.MSI) it drops the lock and waits for the MSI write.
    fn issue_locked(
        &mut self,
        now: Time,
        cpu: usize,
        n: usize,
        what: Cmd,
        sync: bool,
    ) -> (Time, Time) {
        let c = cpu as u32;
        let handler = self.trap.as_ref().map_or(0, Trap::handler_ns);
        let (mut t, mut first, mut done) = (now, None, now);
        // The insertion: cmdq.lock's waits and the command writes under it. In a guest the lock is held through
        // each exit, so a wait for it is partly its holder's exits; it is still the insertion, as the driver's
        // code has it.
        let mut inserted = 0;
        for i in 0..n + sync as usize {
            let work = if i == n {
                self.cfg.sync_ns
            } else {
                self.cmd_ns(what) + std::mem::take(&mut self.shadow_ns)
            } + handler;
            let lock = self.cmdq_lock.as_mut().expect("issue_locked: before 5.4");
            let (_, written) = lock.lock_on(t, c, self.cfg.submit_cmd_ns);
            inserted += written - t;
            let arrive = self.trap.as_ref().map_or(written, |tr| tr.exit(written));
            let (start, end) = self.queues[0].serve(arrive, work);
            first.get_or_insert(start);
            done = end;
            self.tr.c.submissions += 1;
            t = match self.trap.as_mut() {
                Some(trap) => {
                    let back = trap.resume(ExitCause::CmdqProd, written, end, work, 1);
                    lock.extend(written, back);
                    back
                }
                None => written,
            };
        }
        let start = first.unwrap_or(now);
        if !sync {
            // A trapped command holds its vCPU until QEMU has consumed it: that is invalidation wait too.
            if self.trap.is_some() {
                self.book_wait(now, inserted, t);
            }
            return (start, t);
        }
        self.tr.c.syncs += 1;
        let rel = match self.trap.as_mut() {
            Some(trap) => {
                let seen = trap.read(ExitCause::CmdqCons, t, done);
                if let Some(lock) = self.cmdq_lock.as_mut() {
                    lock.extend(t, seen);
                }
                seen
            }
            None => done + self.cfg.sync_signal_ns,
        };
        self.book_wait(now, inserted, rel);
        (start, rel)
    }

    /// The shared queue's insertion (arm_smmu_cmdq_issue_cmdlist steps 1-4) by `cpu`: cmpxchg on llq to
    /// reserve the slots, the command copy, the shared lock for a CMD_SYNC, the valid bitmap. A CPU whose
    /// cmpxchg found OWNED clear is the owner: it waits for the previous owner (owner_prod), clears OWNED
    /// on llq (fetch_andnot), polls the valid bitmap over what it gathered, rings the PROD doorbell and
    /// publishes owner_prod. A CPU whose cmpxchg landed while an owner was gathering leaves that to it: its
    /// commands reach the SMMU with that owner's doorbell. Returns when the SMMU can see the commands.
    fn shared_insert(&mut self, now: Time, cpu: u32, cmds: u64, sync: bool) -> Time {
        let reserved = self.cmpxchg_llq(now, cpu);
        let mut t = reserved + cmds * self.cfg.submit_cmd_ns;
        if sync {
            t = self.lock_owner.rmw_on(t, cpu);
        }
        t = self.valid_map.rmw_on(t, cpu);
        let (from, until, doorbell) = self.gathering;
        if from <= reserved && reserved < until {
            self.tr.c.gathered += 1;
            return t.max(doorbell);
        }
        t = self.lock_owner.rmw_on(t, cpu);
        let closed = self.llq.rmw_on(t, cpu);
        self.llq_written(closed);
        t = self.valid_map.rmw_on(closed, cpu);
        let rung = self.lock_owner.rmw_on(t, cpu);
        self.gathering = (reserved, closed, rung);
        rung
    }

    /// The cmpxchg loop on llq (arm_smmu_cmdq_issue_cmdlist step 1): READ_ONCE(llq), then cmpxchg it forward
    /// from the value read; a failed cmpxchg returns the current value and the CPU retries with it. Every
    /// attempt takes the line exclusively, so attempts by many CPUs queue for it and are served in order. A
    /// CPU that enters the loop while others are still in it therefore waits behind them, and each of their
    /// successes fails its next attempt once: a reservation takes 1 + (CPUs ahead) attempts, each a line
    /// transfer, and an owner's fetch_andnot during the wait fails one more. Simplification: a waiting CPU's
    /// failed attempts are booked on the line after the successes that caused them, as gaps allow, rather
    /// than pushing those successes later (the line's work and the count are the kernel's; which CPU of one
    /// round finishes first is not).
    fn cmpxchg_llq(&mut self, now: Time, cpu: u32) -> Time {
        let entered = self.llq.read_on(now, cpu);
        let mut ahead = std::mem::take(&mut self.ahead);
        ahead.clear();
        let lo = self.llq_loops.partition_point(|&(_, s)| s <= entered);
        ahead.extend(
            self.llq_loops
                .range(lo..)
                .filter(|&&(e, _)| e <= entered)
                .map(|&(_, s)| s),
        );
        // Fail once after each success ahead, with the value each failure returns.
        let mut seen = entered;
        for &success in &ahead {
            self.tr.c.cas_attempts += 1;
            seen = self.llq.rmw_on(seen.max(success), cpu);
        }
        self.ahead = ahead;
        for attempt in 1.. {
            self.tr.c.cas_attempts += 1;
            let done = self.llq.rmw_on(seen, cpu);
            let lo = self.llq_writes.partition_point(|&w| w <= seen);
            let changed = self.llq_writes.get(lo).is_some_and(|&w| w <= done);
            // A bound the kernel does not have: the model's clock only moves forward, so it always ends.
            if !changed || attempt >= 64 {
                self.tr.c.cas_successes += 1;
                self.llq_entered(entered, done);
                return done;
            }
            seen = done;
        }
        unreachable!("the loop returns")
    }

    /// A reservation's loop on llq: entered at `entered`, succeeded at `done`.
    fn llq_entered(&mut self, entered: Time, done: Time) {
        let i = self.llq_loops.partition_point(|&(_, s)| s <= done);
        self.llq_loops.insert(i, (entered, done));
        let latest = self.llq_loops.back().map_or(done, |&(_, s)| s);
        let floor = latest.saturating_sub(crate::sim::LOOKBEHIND_NS);
        while self.llq_loops.front().is_some_and(|&(_, s)| s < floor) {
            self.llq_loops.pop_front();
        }
    }

    /// llq's value changed at `at`.
    fn llq_written(&mut self, at: Time) {
        let i = self.llq_writes.partition_point(|&w| w <= at);
        self.llq_writes.insert(i, at);
        let latest = self.llq_writes.back().map_or(at, |&w| w);
        let floor = latest.saturating_sub(crate::sim::LOOKBEHIND_NS);
        while self.llq_writes.front().is_some_and(|&w| w < floor) {
            self.llq_writes.pop_front();
        }
    }

    /// One command of `what` with its CMD_SYNC; `inv` acts when the SMMU has consumed the command.
    fn issue_one(&mut self, now: Time, cpu: usize, what: Cmd, inv: Option<CacheInval>) -> Time {
        if let Some(inv) = inv {
            self.shadow_sync(&[inv]);
        }
        let (start, done) = self.issue(now, cpu, 1, what, true);
        if let Some(inv) = inv {
            self.consumed(start + self.cmd_ns(what), inv);
        }
        done
    }

    /// arm_smmu_cmdq_batch_add/submit: one TLBI per entry of `invs` in batches of CMDQ_BATCH_ENTRIES, the
    /// last with a CMD_SYNC; each acts when the SMMU has consumed its command.
    fn issue_batched(&mut self, now: Time, cpu: usize, invs: &[CacheInval]) -> Time {
        let mut t = now;
        let per_cmd = self.cmd_ns(Cmd::Tlbi);
        if self.cmdq_lock.is_some() {
            // Before 5.4: arm_smmu_tlb_inv_range_nosync() issues each TLBI on its own, then the sync.
            for &inv in invs {
                self.shadow_sync(&[inv]);
                let (start, rel) = self.issue(t, cpu, 1, Cmd::Tlbi, false);
                self.consumed(start + per_cmd, inv);
                t = rel;
            }
            return self.issue(t, cpu, 0, Cmd::Tlbi, true).1;
        }
        let batches = invs.len().div_ceil(CMDQ_BATCH_ENTRIES);
        for (b, batch) in invs.chunks(CMDQ_BATCH_ENTRIES).enumerate() {
            self.shadow_sync(batch);
            let (start, rel) = self.issue(t, cpu, batch.len(), Cmd::Tlbi, b + 1 == batches);
            for (k, &inv) in batch.iter().enumerate() {
                self.consumed(start + (k as u64 + 1) * per_cmd, inv);
            }
            t = rel;
        }
        t
    }

    /// arm_smmu_atc_inv_domain(): one ATC_INV for the device (all of its ATC when `range` is None), synced.
    fn atc_inv(&mut self, now: Time, cpu: usize, dom: DomainId, range: Option<(u64, u64)>) -> Time {
        if !self.tr.has_atc() || self.trap.is_some() {
            return now;
        }
        let span = range.map(|(pfn, n)| {
            let (base, log2) = atc_inv_span(pfn, n);
            (base, 1u64 << log2.min(63))
        });
        self.tr.c.count(ATC_INV, 1);
        let inv = CacheInval::Atc { dom, range: span };
        self.issue_one(now, cpu, Cmd::AtcInv, Some(inv))
    }

    /// arm_smmu_tlb_inv_range_domain(): the range TLBIs in batches with a CMD_SYNC, then the ATC.
    /// `range`: (first 4 KiB pfn, pages).
    fn inv_range(
        &mut self,
        now: Time,
        cpu: usize,
        dom: DomainId,
        range: (u64, u64),
        granule: u32,
        leaf: bool,
    ) -> Time {
        let tg = self.tr.format().granule_shift;
        let (pfn, pages) = range;
        let cmds = tlbi_range_cmds(pfn, pages, tg, granule.max(tg), leaf, self.cfg.ril);
        // Leaf=1 may keep walk-cache entries; a non-leaf TLBI removes them for the range.
        let invs: Vec<CacheInval> = cmds
            .iter()
            .map(|c| CacheInval::Range {
                dom,
                pfn: c.addr_pfn,
                n: c.pages,
                leaf_only: c.leaf,
            })
            .collect();
        let kind = self.by_va();
        self.tr.c.count(kind, cmds.len() as u64);
        let t = self.issue_batched(now, cpu, &invs);
        // "Unfortunately, this can't be leaf-only since we may have zapped an entire table."
        self.atc_inv(t, cpu, dom, Some((pfn, pages)))
    }
}

impl Iommu for Smmuv3 {
    /// "iommu/arm-smmu-v3: Implement the map_pages() IOMMU driver callback" (5.14).
    fn map_pages_since(&self) -> KernelVersion {
        KernelVersion(5, 14)
    }

    fn name(&self) -> &'static str {
        "smmuv3"
    }

    fn inv_kinds(&self) -> &'static [InvKind] {
        if self.cfg.stage == 2 {
            &[TLBI_S2_IPA, TLBI_S12_VMALL, ATC_INV, CFGI_STE]
        } else {
            &[TLBI_NH_VA, TLBI_NH_ASID, ATC_INV, CFGI_STE, CFGI_CD]
        }
    }

    fn translator(&self) -> &Translator {
        &self.tr
    }

    fn translator_mut(&mut self) -> &mut Translator {
        &mut self.tr
    }

    /// The CPU-side lines of the shared command queue, and the command queues as the SMMU consumes them.
    fn exit_stats(&self) -> Option<ExitStats> {
        self.trap.as_ref().map(|t| t.stats)
    }

    fn translates_msi(&self) -> bool {
        true
    }

    fn bql(&mut self) -> Option<&mut FifoServer> {
        // QEMU's smmuv3_cmdq_consume runs in the trapping vCPU's thread under the BQL (one queue: no ECMDQ).
        match self.trap {
            Some(_) => self.queues.first_mut(),
            None => None,
        }
    }

    fn lock_stats(&self) -> Vec<(&'static str, LockStats)> {
        let queues = std::iter::once(&self.consumer)
            .chain(&self.queues)
            .map(|q| &q.stats)
            .sum();
        let cpu_side = match &self.cmdq_lock {
            Some(lock) => vec![("smmu cmdq.lock", lock.stats.clone())],
            None => vec![
                ("smmu cmdq llq", self.llq.stats.clone()),
                ("smmu cmdq lock/owner_prod", self.lock_owner.stats.clone()),
                ("smmu cmdq valid_map", self.valid_map.stats.clone()),
            ],
        };
        let queue = if self.trap.is_some() {
            BQL
        } else {
            "smmu command queue"
        };
        cpu_side.into_iter().chain([(queue, queues)]).collect()
    }

    fn unmap_pages(
        &mut self,
        now: Time,
        cpu: usize,
        dom: DomainId,
        iova_pfn: u64,
        n: u64,
        gather: &mut IotlbGather,
    ) -> (u64, Time) {
        let before = gather.freed_tables;
        let un = self.tr.unmap(dom, iova_pfn, n, gather);
        // io-pgtable-arm: a freed table is flushed at once (tlb_flush_walk → non-leaf range invalidation at
        // the leaf granule), even when the unmap itself is queued for a lazy flush. Simplification: one
        // walk flush over the unmapped range, which covers every freed table's span.
        if gather.freed_tables > before {
            let tg = self.tr.format().granule_shift;
            let t = self.inv_range(now, cpu, dom, (iova_pfn, n), tg, false);
            return (un, t);
        }
        (un, now)
    }

    fn iotlb_sync_map(
        &mut self,
        now: Time,
        cpu: usize,
        dom: DomainId,
        iova_pfn: u64,
        n: u64,
    ) -> Time {
        // arm-smmu-v3 has no iotlb_sync_map; with the emulated SMMU's caching-mode quirk the new range is
        // invalidated (leaf, with a CMD_SYNC) as VT-d's caching mode does.
        if !self.cfg.caching_mode {
            return now;
        }
        let tg = self.tr.format().granule_shift;
        self.inv_range(now, cpu, dom, (iova_pfn, n), tg, true)
    }

    fn iotlb_sync(&mut self, now: Time, cpu: usize, dom: DomainId, g: &IotlbGather) -> Time {
        if g.is_empty() {
            return now;
        }
        // arm_smmu_iotlb_sync() → arm_smmu_tlb_inv_range_domain(granule = gather->pgsize, leaf = true).
        self.inv_range(now, cpu, dom, (g.start, g.pages()), g.pgsize_shift, true)
    }

    fn flush_iotlb_all(&mut self, now: Time, cpu: usize, dom: DomainId) -> Time {
        // arm_smmu_tlb_inv_context(): TLBI_NH_ASID (stage 1) or TLBI_S12_VMALL (stage 2) with sync, then
        // the whole ATC.
        let kind = if self.cfg.stage == 2 {
            TLBI_S12_VMALL
        } else {
            TLBI_NH_ASID
        };
        self.tr.c.count(kind, 1);
        let t = self.issue_one(now, cpu, Cmd::Tlbi, Some(CacheInval::Domain { dom }));
        self.atc_inv(t, cpu, dom, None)
    }

    fn attach_dev(&mut self, now: Time, cpu: usize, dom: DomainId) -> Time {
        // arm_smmu_attach_dev(): stage 1 writes the context descriptor (CFGI_CD + sync), then the STE
        // (arm_smmu_write_ste → CFGI_STE + sync); with ATS, arm_smmu_enable_ats() clears the ATC.
        let mut t = now;
        if self.cfg.stage == 1 {
            self.tr.c.count(CFGI_CD, 1);
            t = self.issue_one(t, cpu, Cmd::Cfgi, None);
        }
        self.tr.c.count(CFGI_STE, 1);
        t = self.issue_one(t, cpu, Cmd::Cfgi, None);
        self.atc_inv(t, cpu, dom, None)
    }
}

/// The SMMUv3 driver (drivers/iommu/arm/arm-smmu-v3/) and its hardware.
pub struct Smmuv3Driver;

impl KernelDriver for Smmuv3Driver {
    fn name(&self) -> &'static str {
        "smmuv3"
    }
    fn title(&self) -> &'static str {
        "Arm SMMUv3"
    }
    fn archs(&self) -> &'static [Arch] {
        &[Arch::Arm64]
    }
    fn arch_expected(&self) -> &'static str {
        "expected arm64: the platform's IOMMU is an Arm SMMUv3"
    }
}

impl Driver for Smmuv3Driver {
    fn vendor(&self) -> Vendor {
        Vendor::Smmuv3
    }
    fn pt_format(&self, p: &IommuProfile) -> Result<PtFormat, (&'static str, String)> {
        let stage = p.smmuv3.as_ref().map_or(1, |s| s.stage);
        if !matches!(p.granule_kb, 4 | 16 | 64) {
            return Err(("granule_kb", "expected a granule of 4, 16 or 64 KiB".into()));
        }
        PtFormat::lpae(p.granule_kb, p.ias_bits, stage, p.large_pages).map_err(|m| ("ias_bits", m))
    }
    fn check(&self, p: &IommuProfile, guest: bool) -> Result<(), (&'static str, String)> {
        let Some(v) = &p.smmuv3 else {
            return Err((
                "smmuv3",
                "expected an [iommu.smmuv3] section for vendor \"smmuv3\"".into(),
            ));
        };
        if v.stage != 1 && v.stage != 2 {
            return Err(("smmuv3.stage", "expected stage 1 or 2".into()));
        }
        if !guest && v.caching_mode {
            return Err((
                "smmuv3.caching_mode",
                "expected false on bare metal: only an emulated SMMUv3 has the caching-mode quirk"
                    .into(),
            ));
        }
        if guest && v.ecmdq {
            return Err((
                "smmuv3.ecmdq",
                "expected false in a guest: QEMU's SMMUv3 emulates no ECMDQ".into(),
            ));
        }
        Ok(())
    }
    fn caching_mode(&self, p: &IommuProfile) -> bool {
        p.smmuv3.as_ref().is_some_and(|s| s.caching_mode)
    }
    fn caching_mode_key(&self) -> Option<&'static str> {
        Some("smmuv3.caching_mode")
    }
    // NVIDIA's CMDQV (tegra241-cmdqv.c): a guest's own hardware command queue.
    fn hardware_guest_queue(&self) -> bool {
        true
    }
    fn qemu_iotlb(&self, _h: &HypervisorProfile, entries: u32) -> QemuIotlb<(u64, u64)> {
        QemuIotlb::new(entries as usize, PsiMatch::Range)
    }
    fn build(
        &self,
        p: &Platform,
        cpus: usize,
        kernel: KernelVersion,
        tr: Translator,
        emu: Emulation,
    ) -> Box<dyn Iommu> {
        let s = Smmuv3::new(
            &p.iommu,
            tr,
            cpus,
            p.pcie.ats_inv_ns,
            p.cpu.coherence(),
            kernel,
        );
        Box::new(s.emulated(emu.trap, emu.shadow))
    }
    fn replay_profile(&self) -> (&'static str, Arch) {
        ("smmuv3-server", Arch::Arm64)
    }
    // QEMU's smmuv3_cmdq_opcode (by opcode) and smmuv3_cmdq_consume_out (one per CMDQ_PROD write).
    fn replay_columns(&self) -> &'static [(&'static str, Column)] {
        &[
            ("tlbi_nh_va", Column::Class(InvClass::Range)),
            ("tlbi_nh_asid", Column::Class(InvClass::Domain)),
            ("cmd_sync", Column::Syncs),
            ("atc_inv", Column::Class(InvClass::DevTlb)),
            ("doorbells", Column::Doorbells),
        ]
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::hw::LATER;

    pub(crate) fn cfg(ril: bool, ecmdq: bool) -> IommuProfile {
        IommuProfile {
            iotlb_entries: 2048,
            iotlb_ways: 4,
            pwc_entries: vec![4, 28, 348],
            pwc_ways: 0,
            ias_bits: 48,
            granule_kb: 4,
            large_pages: true,
            shadow_on_flush: false,
            vtd: None,
            smmuv3: Some(Smmuv3Profile {
                submit_cmd_ns: 10,
                cmd_ns: 50,
                sync_ns: 500,
                sync_signal_ns: 0,
                ril,
                ecmdq,
                ecmdq_parallel: false,
                stage: 1,
                caching_mode: false,
            }),
            virtio: None,
            amdvi: None,
            riscv: None,
        }
    }

    /// An SMMUv3 with the profile's format and an ATC of `atc` entries when given.
    pub(crate) fn smmu_with(p: &IommuProfile, cpus: usize, atc: Option<u32>) -> Smmuv3 {
        let fmt = crate::hw::Vendor::Smmuv3.driver().pt_format(p).unwrap();
        let tr = Translator::new(p, fmt, atc.map(|n| (n, n)));
        Smmuv3::new(
            p,
            tr,
            cpus,
            2000,
            Coherence::default(),
            KernelVersion(6, 12),
        )
    }

    pub(crate) fn smmu(p: &IommuProfile, cpus: usize) -> Smmuv3 {
        smmu_with(p, cpus, None)
    }

    /// An SMMU of profile `c` for `cpus` CPUs driven by `kernel`'s driver, its lines moving at `coh()`'s costs.
    fn smmu_on(c: &IommuProfile, cpus: usize, kernel: KernelVersion) -> Smmuv3 {
        let fmt = crate::hw::Vendor::Smmuv3.driver().pt_format(c).unwrap();
        Smmuv3::new(c, Translator::new(c, fmt, None), cpus, 2000, coh(), kernel)
    }

    fn fields(c: &[TlbiRange]) -> Vec<(u32, u32, u64)> {
        c.iter().map(|c| (c.scale, c.num, c.pages)).collect()
    }

    #[test]
    fn ril_encodings_for_1_31_32_513_pages() {
        // (SCALE, NUM field = num-1, pages covered)
        assert_eq!(
            fields(&tlbi_range_cmds(0x100, 1, 12, 12, true, true)),
            vec![(0, 0, 1)]
        );
        assert_eq!(
            fields(&tlbi_range_cmds(0x100, 31, 12, 12, true, true)),
            vec![(0, 30, 31)]
        );
        assert_eq!(
            fields(&tlbi_range_cmds(0x100, 32, 12, 12, true, true)),
            vec![(5, 0, 32)]
        );
        let c = tlbi_range_cmds(0x100, 513, 12, 12, true, true);
        assert_eq!(fields(&c), vec![(0, 0, 1), (9, 0, 512)]);
        assert_eq!(
            (c[1].addr_pfn, c[0].tg, c[0].ttl),
            (0x101, 1, 3),
            "4K granule: TG=1, leaf TTL=3"
        );
        // Without RIL: one command per granule.
        assert_eq!(tlbi_range_cmds(0x100, 513, 12, 12, true, false).len(), 513);
        // Non-leaf with a lone NUM of 1 rounds up, TTL 0.
        let c = tlbi_range_cmds(0x200, 1, 12, 12, false, true);
        assert_eq!((fields(&c), c[0].ttl), (vec![(1, 0, 2)], 0));
    }

    /// An emulated SMMUv3 without RIL (QEMU's before range invalidation) driven by `kernel`'s driver, after a
    /// strict sync of 130 unmapped pages: the SMMU and the time the CPU is released.
    fn trapped_sync_of_130_pages(kernel: KernelVersion) -> (Smmuv3, Time) {
        let (h, k) = (
            crate::scenario::tests::hypervisor(),
            crate::scenario::tests::kvm(),
        );
        let mut s = smmu_on(&cfg(false, false), 2, kernel).emulated(Some(Trap::new(&h, &k)), None);
        s.map_pages(1, 0, 0, 1);
        let mut g = IotlbGather::new();
        g.add_range(0x1000, 130);
        let t = s.iotlb_sync(0, 0, 1, &g);
        (s, t)
    }

    #[test]
    fn in_a_guest_every_prod_write_traps_and_the_emulator_consumes_every_command() {
        // 130 pages are 130 TLBIs in three batches, each issue ringing CMDQ_PROD: three exits, the last one's
        // handler completing the CMD_SYNC.
        let (s, t) = trapped_sync_of_130_pages(KernelVersion(6, 12));
        let st = s.exit_stats().unwrap();
        // The CPU waiting for the CMD_SYNC then reads CMDQ_CONS once: QEMU advertises neither MSI nor SEV.
        assert_eq!(st.count, [0, 3, 1, 0, 0, 0, 0, 0]);
        assert_eq!(st.work.inv_processed, 130 + 1);
        let per_cmd = s.cmd_ns(Cmd::Tlbi);
        assert_eq!(st.emulator_ns, 130 * per_cmd + s.cfg.sync_ns);
        assert!(t >= 4 * 5000 + 130 * per_cmd + s.cfg.sync_ns, "{t}");
        assert_eq!(s.tr.c.get(TLBI_NH_VA), 130);
    }

    #[test]
    fn before_5_4_every_command_writes_prod_and_a_guest_traps_for_each_under_cmdq_lock() {
        // arm_smmu_cmdq_issue_cmd() wrote PROD per command: 130 TLBIs and the CMD_SYNC are 131 exits (against
        // three batches from 5.4), and the CONS poll is made with cmdq.lock held.
        let (mut s, t) = trapped_sync_of_130_pages(KernelVersion(4, 19));
        let st = s.exit_stats().unwrap();
        assert_eq!(st.count, [0, 131, 1, 0, 0, 0, 0, 0]);
        assert_eq!(st.work.inv_processed, 130 + 1);
        assert_eq!(s.tr.c.get(TLBI_NH_VA), 130);
        assert!(t >= 132 * crate::scenario::tests::kvm().mmio_exit_ns, "{t}");
        // Another CPU's command waits for the lock until the first is back from its CONS read.
        let u = s.issue(1000, 1, 1, Cmd::Tlbi, false).1;
        assert!(u > t, "{u} <= {t}");
        let names: Vec<_> = s.lock_stats().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["smmu cmdq.lock", BQL]);
    }

    #[test]
    fn batches_of_64_with_one_sync() {
        let mut s = smmu(&cfg(false, false), 2);
        s.map_pages(1, 0, 0, 1);
        let mut g = IotlbGather::new();
        g.add_range(0x1000, 130);
        let t = s.iotlb_sync(0, 0, 1, &g);
        assert_eq!(s.tr.c.get(TLBI_NH_VA), 130);
        assert_eq!(
            (s.tr.c.submissions, s.tr.c.syncs),
            (3, 1),
            "64 + 64 unsynced, 2 + CMD_SYNC"
        );
        // The SMMU starts on the first batch as soon as it is inserted; later insertions overlap with it.
        assert_eq!(t, 64 * 10 + 130 * 50 + 500);
    }

    #[test]
    fn flush_all_is_one_asid_command_and_drops_walk_caches() {
        let mut s = smmu(&cfg(true, false), 1);
        s.map_pages(1, 0x40000, 7, 2);
        s.translate(LATER, 1, 0x40000);
        assert_eq!(s.translate(LATER, 1, 0x40001).walk_reads, 1);
        s.flush_iotlb_all(0, 0, 1);
        assert_eq!(s.tr.c.get(TLBI_NH_ASID), 1);
        assert_eq!(s.translate(LATER, 1, 0x40001).walk_reads, 4);
    }

    /// The TLBI acts when the SMMU consumes it, before its CMD_SYNC completes: a device access before that
    /// still hits.
    #[test]
    fn a_tlbi_acts_when_the_smmu_consumes_it() {
        let p = cfg(true, false);
        let mut s = smmu(&p, 1);
        s.map_pages(1, 0x40000, 7, 2);
        s.translate(0, 1, 0x40000);
        let done = s.flush_iotlb_all(1_000, 0, 1);
        let consumed = done - p.smmuv3.as_ref().unwrap().sync_ns;
        assert!(consumed > 1_000);
        assert!(s.translate(consumed - 1, 1, 0x40000).iotlb_hit);
        assert!(!s.translate(consumed, 1, 0x40000).iotlb_hit);
    }

    #[test]
    fn freeing_a_table_issues_a_non_leaf_invalidation_at_once() {
        let mut s = smmu(&cfg(true, false), 1);
        s.map_pages(1, 512, 9000, 512); // exactly one leaf table
        s.translate(LATER, 1, 512);
        let mut g = IotlbGather::new();
        let (un, t) = s.unmap_pages(100, 0, 1, 512, 512, &mut g);
        assert_eq!((un, g.freed_tables), (512, 1));
        assert!(t > 100, "the walk flush is synchronous");
        assert_eq!(
            s.tr.c.get(TLBI_NH_VA),
            1,
            "512 pages: one range command (SCALE 9)"
        );
        assert_eq!(s.tr.c.syncs, 1);
        // Leaf-only unmap frees nothing and issues nothing until the sync.
        s.map_pages(1, 0x5000, 1, 4);
        let mut g = IotlbGather::new();
        let (_, t) = s.unmap_pages(200, 0, 1, 0x5000, 1, &mut g);
        assert_eq!(t, 200);
    }

    fn coh() -> Coherence {
        Coherence {
            cluster_cores: 4,
            socket_cores: 4,
            cluster_ns: 40,
            socket_ns: 40,
            remote_ns: 140,
        }
    }

    /// Two CPUs each issue one TLBI with its CMD_SYNC at time 0: when each is released.
    fn two_syncs(ecmdq: bool, parallel: bool) -> (Smmuv3, Time, Time) {
        let mut c = cfg(true, ecmdq);
        c.smmuv3.as_mut().unwrap().ecmdq_parallel = parallel;
        let mut s = smmu_on(&c, 2, KernelVersion(6, 12));
        let a = s.issue(0, 0, 1, Cmd::Tlbi, true).1;
        let b = s.issue(0, 1, 1, Cmd::Tlbi, true).1;
        (s, a, b)
    }

    #[test]
    fn the_shared_queue_moves_its_lines_between_cpus_and_ecmdqs_do_not() {
        let (shared, _, _) = two_syncs(false, false);
        let (per_cpu, _, _) = two_syncs(true, false);
        let transfers = |s: &Smmuv3| -> u64 {
            s.lock_stats()
                .iter()
                .filter(|(n, _)| n.contains("cmdq"))
                .map(|(_, l)| l.transfers)
                .sum()
        };
        assert!(transfers(&shared) >= 3, "{}", transfers(&shared));
        assert_eq!(transfers(&per_cpu), 0);
        assert_eq!(per_cpu.tr.c.cas_attempts, 0);
    }

    #[test]
    fn a_cpu_inserting_while_an_owner_gathers_leaves_the_doorbell_to_it() {
        let c = cfg(true, false);
        let mut s = smmu_on(&c, 2, KernelVersion(6, 12));
        // CPU 0 copies 64 commands (640 ns) before it closes its gathering window; CPU 1 reserves slots in it.
        let a = s.shared_insert(0, 0, 64, false);
        let b = s.shared_insert(100, 1, 1, true);
        assert_eq!(s.tr.c.gathered, 1);
        assert!(
            b >= a,
            "CPU 1's command reaches the SMMU with CPU 0's doorbell: {b} {a}"
        );
        // After the window closed, the next CPU is an owner of its own.
        s.shared_insert(a + 10_000, 1, 1, true);
        assert_eq!(s.tr.c.gathered, 1);
    }

    #[test]
    fn cpus_inserting_at_the_same_instant_retry_their_cmpxchg_and_all_get_in_in_order() {
        // arm_smmu_cmdq_issue_cmdlist step 1: each CPU cmpxchg's llq forward from the value it read; one
        // whose cmpxchg lands after another CPU's write to llq fails and retries with the value it got
        // back. Sixteen CPUs insert at one instant.
        let c = cfg(true, false);
        let cpus = 16;
        let fresh = || {
            let mut s = smmu_on(&c, cpus, KernelVersion(6, 12));
            // CPU 0 has the line (its first toucher takes it for nothing).
            s.issue(0, 0, 1, Cmd::Tlbi, true);
            let counts = (
                s.tr.c.cas_attempts,
                s.tr.c.cas_successes,
                s.tr.c.submissions,
            );
            (s, counts)
        };
        let (mut s, (attempts, successes, _)) = fresh();
        let reserved: Vec<Time> = (0..cpus as u32)
            .map(|cpu| s.cmpxchg_llq(10_000, cpu))
            .collect();
        // Each CPU waits behind the CPUs still in their loop when it read llq and fails once at each of their
        // successes: at most 1 + 2 + ... + 16 attempts (all sixteen in the loop together), at least one
        // failure for each CPU that read llq before the one ahead of it had succeeded.
        assert_eq!(s.tr.c.cas_successes - successes, cpus as u64);
        let made = s.tr.c.cas_attempts - attempts;
        let n = cpus as u64;
        assert!(made >= 2 * n - 2 && made <= n * (n + 1) / 2, "{made}");
        // Each reservation follows the one before it: no two CPUs claim the same slots.
        assert!(reserved.windows(2).all(|w| w[0] < w[1]), "{reserved:?}");
        // The whole insertion: every CPU's TLBI and CMD_SYNC reach the SMMU, which consumes them in the
        // order the slots were reserved; CPUs whose reservation fell in an owner's gathering window leave
        // the doorbell to it.
        let (mut s, (attempts, _, submissions)) = fresh();
        let done: Vec<Time> = (0..cpus)
            .map(|cpu| s.issue(10_000, cpu, 1, Cmd::Tlbi, true).1)
            .collect();
        assert_eq!(s.tr.c.submissions - submissions, cpus as u64);
        assert!(s.tr.c.cas_attempts - attempts > cpus as u64);
        assert!(done.windows(2).all(|w| w[1] - w[0] >= 50 + 500), "{done:?}");
        assert!((1..cpus as u64).contains(&s.tr.c.gathered));
    }

    /// N CPUs entering the cmpxchg loop at one instant on an idle queue: N reservations, each at its own
    /// time (no two claim the same slots), and more attempts per success the more CPUs contend, as John
    /// Garry counted on a D06 (iommu list 2020-07-16: 1.1 at 2 CPUs, 3.6 at 16, 12.6 at 64).
    fn attempts_per_success(cpus: usize) -> f64 {
        let c = cfg(true, false);
        let mut s = smmu_on(&c, cpus, KernelVersion(6, 12));
        s.issue(0, 0, 1, Cmd::Tlbi, true);
        let (a, n) = (s.tr.c.cas_attempts, s.tr.c.cas_successes);
        let mut reserved: Vec<Time> = (0..cpus as u32)
            .map(|cpu| s.cmpxchg_llq(10_000, cpu))
            .collect();
        assert_eq!(s.tr.c.cas_successes - n, cpus as u64);
        reserved.sort_unstable();
        reserved.dedup();
        assert_eq!(reserved.len(), cpus, "two CPUs reserved at one time");
        (s.tr.c.cas_attempts - a) as f64 / cpus as f64
    }

    #[test]
    fn attempts_per_success_grow_with_the_cpus_contending() {
        let rates: Vec<f64> = [1, 2, 4, 8, 16, 32, 64]
            .iter()
            .map(|&n| attempts_per_success(n))
            .collect();
        // Two CPUs: the second reads llq after the first's cmpxchg has already landed.
        assert_eq!(rates[..2], [1.0, 1.0]);
        assert!(rates.windows(2).all(|w| w[1] >= w[0]), "{rates:?}");
        assert!(
            rates[6] > rates[5] && rates[5] > rates[3] && rates[3] > rates[1],
            "{rates:?}"
        );
    }

    proptest::proptest! {
        /// CPUs arriving together on an idle shared queue, each with a TLBI and its CMD_SYNC, taken in the order
        /// they arrive (as the event loop runs them): every CPU reserves once and every command reaches the SMMU
        /// once, the SMMU completes the CMD_SYNCs one after another, each CPU released after its own, and no
        /// reservation takes more attempts than the CPUs contending allow.
        #[test]
        fn cpus_arriving_together_each_get_their_commands_consumed_once(
            offsets in proptest::collection::vec(0u64..400, 1..48),
        ) {
            let c = cfg(false, false);
            let n = offsets.len();
            let mut s = smmu_on(&c, n, KernelVersion(6, 12));
            let (subs, syncs, oks, tries) =
                (s.tr.c.submissions, s.tr.c.syncs, s.tr.c.cas_successes, s.tr.c.cas_attempts);
            let mut order: Vec<(u64, usize)> = offsets.iter().enumerate().map(|(cpu, &o)| (o, cpu)).collect();
            order.sort_unstable();
            let served: Vec<(Time, Time, Time)> = order
                .iter()
                .map(|&(o, cpu)| {
                    let (start, done) = s.issue(10_000 + o, cpu, 1, Cmd::Tlbi, true);
                    (start, done, 10_000 + o)
                })
                .collect();
            proptest::prop_assert_eq!(s.tr.c.submissions - subs, n as u64);
            proptest::prop_assert_eq!(s.tr.c.syncs - syncs, n as u64);
            proptest::prop_assert_eq!(s.tr.c.cas_successes - oks, n as u64);
            let made = s.tr.c.cas_attempts - tries;
            proptest::prop_assert!(made >= n as u64 && made <= (n * (n + 1) / 2 + n) as u64, "{}", made);
            // Each CMD_SYNC completes on its own (a request that overtook another in run-ahead may start with
            // it: `FifoServer` charges its work after the latest request).
            let mut done: Vec<Time> = served.iter().map(|&(_, d, _)| d).collect();
            done.sort_unstable();
            for w in done.windows(2) {
                proptest::prop_assert!(w[0] < w[1], "two CMD_SYNCs completed at one time: {:?}", w);
            }
            for &(start, done, arrived) in &served {
                proptest::prop_assert!(arrived <= start && start < done, "{} {} {}", arrived, start, done);
            }
        }
    }

    /// `cpus` CPUs, each in a loop (as dma_map_benchmark's threads): `think_ns` of other work, then one TLBI
    /// with its CMD_SYNC, run in time order for `span_ns`. Returns the shares of the CPUs' time spent in the
    /// queue's insertion and in the wait after it.
    fn closed_loop(
        c: &IommuProfile,
        coh: Coherence,
        cpus: usize,
        think_ns: u64,
        span_ns: Time,
    ) -> (f64, f64) {
        use std::cmp::Reverse;
        let fmt = crate::hw::Vendor::Smmuv3.driver().pt_format(c).unwrap();
        let mut s = Smmuv3::new(
            c,
            Translator::new(c, fmt, None),
            cpus,
            2000,
            coh,
            KernelVersion(6, 12),
        );
        let mut ready: std::collections::BinaryHeap<_> =
            (0..cpus).map(|cpu| Reverse((think_ns, cpu))).collect();
        while let Some(Reverse((now, cpu))) = ready.pop() {
            if now >= span_ns {
                break;
            }
            let (_, rel) = s.issue(now, cpu, 1, Cmd::Tlbi, true);
            ready.push(Reverse((rel + think_ns, cpu)));
        }
        let cap = (cpus as u64 * span_ns) as f64;
        (
            s.tr.c.cmdq_insert_ns as f64 / cap,
            s.tr.c.inv_wait_ns as f64 / cap,
        )
    }

    /// Kunpeng 920's command costs and lines (profiles/kunpeng920.toml): four cores a cluster, 24 a die.
    fn kunpeng920() -> (IommuProfile, Coherence) {
        let mut c = cfg(false, false);
        let v = c.smmuv3.as_mut().unwrap();
        (v.submit_cmd_ns, v.cmd_ns, v.sync_ns, v.sync_signal_ns) = (10, 69, 170, 90);
        let coh = Coherence {
            cluster_cores: 4,
            socket_cores: 24,
            cluster_ns: 40,
            socket_ns: 60,
            remote_ns: 180,
        };
        (c, coh)
    }

    #[test]
    fn one_cpu_spends_a_small_share_of_its_invalidation_in_the_insertion() {
        // Alone, a CPU's insertion is its command writes and its own lines (the doorbell, valid_map): tens
        // of ns against the CMD_SYNC's round trip (cmd_ns + sync_ns + sync_signal_ns = 329 ns).
        let (c, coh) = kunpeng920();
        let (insert, wait) = closed_loop(&c, coh, 1, 600, 2_000_000);
        assert!(insert < 0.05 && insert * 10.0 < wait, "{insert} {wait}");
    }

    #[test]
    fn on_kunpeng920_the_insertion_grows_with_cpus_then_the_poll_takes_over() {
        // A second CPU moves llq, the shared lock and valid_map back and forth: the insertion's share grows
        // several-fold. From 8 CPUs the SMMU consumes CMD_SYNCs back to back (239 ns each), each CPU's poll
        // waits behind the others' and grows with them, and the insertion's share falls again: at 64 CPUs
        // the poll is most of the CPUs' time.
        let (c, coh) = kunpeng920();
        let at = |n| closed_loop(&c, coh, n, 600, 2_000_000);
        let ((one, _), (two, _), (eight, _), (many, wait)) = (at(1), at(2), at(8), at(64));
        assert!(two > 5.0 * one && eight > 3.0 * one, "{one} {two} {eight}");
        assert!(
            many < eight && wait > 0.9 && wait > 20.0 * many,
            "{many} {wait}"
        );
    }

    #[test]
    fn with_a_consumer_faster_than_the_lines_move_the_insertion_dominates_at_many_cpus() {
        // An SMMU that consumes a TLBI and its CMD_SYNC in 15 ns: the queue never fills, and the CPUs' time
        // goes where they serialise, on the queue's lines (each move 40-180 ns).
        let (mut c, coh) = kunpeng920();
        let v = c.smmuv3.as_mut().unwrap();
        (v.cmd_ns, v.sync_ns, v.sync_signal_ns) = (5, 10, 0);
        let shares: Vec<(f64, f64)> = [1, 2, 4, 8, 16, 32, 64]
            .iter()
            .map(|&n| closed_loop(&c, coh, n, 600, 2_000_000))
            .collect();
        let (one, _) = shares[0];
        let (many, wait) = shares[6];
        assert!(one < 0.05, "{shares:?}");
        assert!(shares.windows(2).all(|w| w[1].0 >= w[0].0), "{shares:?}");
        assert!(many > 0.5 && many > 10.0 * wait, "{shares:?}");
    }

    proptest::proptest! {
        /// Every issue books its insertion and its wait so that they sum to what the CPU waited for, from the
        /// request to its release: a synced issue's whole time (and before 5.4 in a guest, an unsynced one's,
        /// which holds its vCPU until QEMU has consumed it); nothing for an unsynced issue the CPU does not
        /// wait for. On every path: the shared queue, ECMDQs, cmdq.lock before 5.4, trapped in a guest.
        #[test]
        fn insertion_and_wait_sum_to_the_time_from_request_to_release(
            path in 0usize..5,
            issues in proptest::collection::vec((0usize..8, 0u64..600, 0usize..70, proptest::bool::ANY), 1..40),
        ) {
            let (ecmdq, kernel, trapped) = [
                (false, KernelVersion(6, 12), false),
                (true, KernelVersion(6, 12), false),
                (false, KernelVersion(4, 19), false),
                (false, KernelVersion(6, 12), true),
                (false, KernelVersion(4, 19), true),
            ][path];
            let trap = trapped.then(|| {
                Trap::new(&crate::scenario::tests::hypervisor(), &crate::scenario::tests::kvm())
            });
            let mut s = smmu_on(&cfg(true, ecmdq), 8, kernel).emulated(trap, None);
            // Requests in time order, each CPU's after its previous release.
            let (mut at, mut free) = (1_000, [0; 8]);
            for (cpu, gap, n, sync) in issues {
                at += gap;
                let now = at.max(free[cpu]);
                let before = (s.tr.c.cmdq_insert_ns, s.tr.c.inv_wait_ns);
                let (_, rel) = s.issue(now, cpu, n, Cmd::Tlbi, sync || n == 0);
                free[cpu] = rel;
                let booked = s.tr.c.cmdq_insert_ns - before.0 + s.tr.c.inv_wait_ns - before.1;
                let waited = sync || n == 0 || (trapped && kernel < KernelVersion(5, 4));
                proptest::prop_assert_eq!(booked, if waited { rel - now } else { 0 });
                // The insertion holds at least the command writes, and never more than was booked.
                let inserted = s.tr.c.cmdq_insert_ns - before.0;
                let writes = (n as u64 + (sync || n == 0) as u64) * s.cfg.submit_cmd_ns;
                proptest::prop_assert!(inserted <= booked);
                proptest::prop_assert!(!waited || inserted >= writes, "{} < {}", inserted, writes);
            }
        }
    }

    #[test]
    fn an_ecmdq_cmd_sync_waits_only_for_its_own_queue() {
        let (cmd, sync) = (50, 500);
        // One shared queue: the second CMD_SYNC waits for the first to complete.
        let (_, a, b) = two_syncs(false, false);
        assert!(a >= cmd + sync && b >= 2 * (cmd + sync), "{a} {b}");
        // ECMDQs consumed one after another: the second queue's TLBI waits for the first's, not for its
        // CMD_SYNC.
        let (_, a, b) = two_syncs(true, false);
        let w = cfg(true, true).smmuv3.unwrap().submit_cmd_ns * 2;
        assert_eq!((a, b), (w + cmd + sync, w + 2 * cmd + sync));
        // In parallel: both complete together.
        let (_, a, b) = two_syncs(true, true);
        assert_eq!((a, b), (w + cmd + sync, w + cmd + sync));
    }

    #[test]
    fn range_fields_for_other_granules_and_block_leaves() {
        // 16K granule: TG=2; 8 pages of 16K = 32 4K pfns, NUM 8 → SCALE 3, NUM field 0.
        let c = tlbi_range_cmds(0, 32, 14, 14, true, true);
        assert_eq!(
            (c.len(), c[0].tg, c[0].scale, c[0].num, c[0].ttl),
            (1, 2, 3, 0, 3)
        );
        // A 2M block leaf (4K granule): TTL = 4 - (21-3)/(12-3) = 2; without RIL one command per 2M.
        let c = tlbi_range_cmds(512, 512, 12, 21, true, true);
        assert_eq!((c.len(), c[0].ttl, c[0].pages), (1, 2, 512));
        assert_eq!(tlbi_range_cmds(512, 1024, 12, 21, true, false).len(), 2);
        // A walk flush without RIL goes at leaf granule: 512 commands for one 2M table.
        assert_eq!(tlbi_range_cmds(512, 512, 12, 12, false, false).len(), 512);
    }

    #[test]
    fn atc_inv_covers_the_range_with_one_aligned_power_of_two() {
        // arm_smmu_atc_inv_to_cmd()'s own examples: [8; 11] → span 4 at 8; [7; 10] → span 16 at 0.
        assert_eq!(atc_inv_span(8, 4), (8, 2));
        assert_eq!(atc_inv_span(7, 4), (0, 4));
        assert_eq!(atc_inv_span(5, 1), (5, 0));
    }

    #[test]
    fn ats_adds_an_atc_inv_with_its_own_sync() {
        let mut s = smmu_with(&cfg(true, false), 1, Some(16));
        s.map_pages(1, 0x40, 3, 1);
        s.translate(LATER, 1, 0x40);
        let mut g = IotlbGather::new();
        s.unmap_pages(0, 0, 1, 0x40, 1, &mut g);
        let t = s.iotlb_sync(0, 0, 1, &g);
        assert_eq!(
            (s.tr.c.get(TLBI_NH_VA), s.tr.c.get(ATC_INV), s.tr.c.syncs),
            (1, 1, 2)
        );
        assert_eq!(t, (2 * 10 + 50 + 500) + (2 * 10 + 50 + 2000 + 500));
        assert!(!s.translate(LATER, 1, 0x40).stale);
    }

    #[test]
    fn attach_writes_cd_and_ste_with_cfgi() {
        let mut s = smmu(&cfg(true, false), 1);
        s.attach_dev(0, 0, 1);
        assert_eq!(
            (s.tr.c.get(CFGI_CD), s.tr.c.get(CFGI_STE), s.tr.c.syncs),
            (1, 1, 2)
        );
        assert_eq!(
            s.tr.c.invalidations(),
            0,
            "configuration commands are not TLB invalidations"
        );
        let mut c = cfg(true, false);
        c.smmuv3.as_mut().unwrap().stage = 2;
        let mut s = smmu(&c, 1);
        s.attach_dev(0, 0, 1);
        assert_eq!((s.tr.c.get(CFGI_CD), s.tr.c.get(CFGI_STE)), (0, 1));
    }

    #[test]
    fn block_unmap_is_one_command_at_the_block_size() {
        let mut s = smmu(&cfg(false, false), 1);
        assert_eq!(s.map_pages(1, 1024, 2048, 512), 1, "one 2M block");
        let mut g = IotlbGather::new();
        s.unmap_pages(0, 0, 1, 1024, 512, &mut g);
        assert_eq!(g.pgsize_shift, 21);
        s.iotlb_sync(0, 0, 1, &g);
        assert_eq!(s.tr.c.get(TLBI_NH_VA), 1);
    }
}
