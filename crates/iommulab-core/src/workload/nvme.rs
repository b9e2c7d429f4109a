//! fio against NVMe drives: `numjobs` threads, one per CPU, each keeping `iodepth` O_DIRECT I/Os of `bs`
//! in flight on its own queue pair of one drive (closed loop: a completion is reaped and the next I/O
//! submitted on the same CPU). Every I/O maps its buffer with one dma_map_sg() at submission (one IOVA
//! range, one iotlb_sync_map) and unmaps it at completion (nvme_unmap_data), so the domain's policy acts
//! once per I/O. Drives behind one bridge share one DMA domain; drives on root ports of their own have
//! one each (`same_bridge`). A drive moves data through its own DMA engine at its
//! bandwidth, each page translated by the IOMMU; its media latency overlaps across I/Os in flight.
//!
//! Simplification: each I/O buffer is physically contiguous (fio allocates them once, at start, and reuses
//! them; the kernel maps a user buffer page by page, which only matters for superpage eligibility).

use super::{event, Device, Workload, WorkloadStats};
use crate::host::Host;
use crate::hw::PAGE_SIZE as PAGE;
use crate::scenario::MapDir;
use crate::scenario::{Nvme, NvmeRw};
use crate::sim::{Ctx, Path, Time};

const EV_SUBMIT: u16 = 0;
const EV_DATA: u16 = 1;
const EV_COMPLETE: u16 = 2;

/// One in-flight I/O of a job (fio's io_u): its buffer and, while submitted, its DMA address.
#[derive(Debug, Clone)]
struct Slot {
    cpu: usize,
    drive: usize,
    phys: u64,
    dma: Option<u64>,
}

pub struct NvmeWorkload {
    cfg: Nvme,
    /// One drive's data bandwidth: its own, capped by the PCIe link.
    drive_gbps: f64,
    pages: u64,
    latency_ns: u64,
    slots: Vec<Slot>,
    drives: Vec<Device>,
    stats: WorkloadStats,
}

impl NvmeWorkload {
    pub fn new(cfg: &Nvme, link_gbps: f64, translation_slots: u32) -> Self {
        let gbps = cfg.drive_gbps.min(link_gbps);
        NvmeWorkload {
            cfg: cfg.clone(),
            drive_gbps: gbps,
            pages: cfg.bs_kb as u64 / 4,
            latency_ns: (cfg.latency_us * 1000.0).round() as u64,
            slots: Vec::new(),
            drives: (0..cfg.drives)
                .map(|_| Device::new(translation_slots, gbps))
                .collect(),
            stats: WorkloadStats::default(),
        }
    }

    /// The DMA domain of slot `s`'s drive.
    fn dom(&self, s: usize) -> usize {
        if self.cfg.same_bridge {
            0
        } else {
            self.slots[s].drive
        }
    }

    fn reads(&self) -> bool {
        matches!(self.cfg.rw, NvmeRw::Read | NvmeRw::Randread)
    }

    /// Submit slot `s` on its CPU from `t`: blk-mq and the driver, dma_map_sg(), the doorbell. Returns the
    /// CPU's release time; the drive sees the command then.
    fn submit(&mut self, host: &mut Host, s: usize, t: Time) -> Time {
        let (cpu, phys) = (self.slots[s].cpu, self.slots[s].phys);
        let t = t + host.platform.cpu.nvme_submit_ns;
        // nvme_map_data → dma_map_sg: the drive writes a read's pages and reads a write's.
        let dir = if self.reads() {
            MapDir::FromDevice
        } else {
            MapDir::ToDevice
        };
        let bytes = self.pages * PAGE;
        let mapped = host.dma_map_attrs_in(self.dom(s), t, cpu, phys, 0, bytes, dir, false);
        let Some((dma, _, t)) = mapped else {
            // IOVA space exhausted or the bounce pool full: nvme_queue_rq returns BLK_STS_RESOURCE and
            // blk-mq requeues the request after the I/Os in flight complete.
            self.stats.requeued += 1;
            host.schedule(t + self.latency_ns.max(1), event(EV_SUBMIT, s));
            return t;
        };
        self.slots[s].dma = Some(dma);
        self.stats.packets_offered += 1;
        // Reads: the media first, then the drive writes host memory. Writes: it reads host memory first.
        let data_at = if self.reads() { t + self.latency_ns } else { t };
        host.schedule(data_at, event(EV_DATA, s));
        t
    }

    /// The drive moves the I/O's pages through its DMA engine, each translated by the IOMMU.
    fn data(&mut self, host: &mut Host, now: Time, s: usize) {
        let dma = self.slots[s].dma.expect("data phase of a submitted I/O");
        let dom = self.dom(s);
        let drive = &mut self.drives[self.slots[s].drive];
        let mut done = now;
        for i in 0..self.pages {
            // The drive's writes (reads) and its reads of host memory (writes) share one ordered engine.
            done = drive.access_in(host, dom, Path::Receive, now, dma + i, PAGE);
        }
        self.stats.dma_pages += self.pages;
        self.stats.bytes_received += self.pages * PAGE;
        let complete_at = if self.reads() {
            done
        } else {
            done + self.latency_ns
        };
        host.schedule(complete_at, event(EV_COMPLETE, s));
    }

    /// The completion interrupt on the job's CPU: nvme_unmap_data(), the reap, and the next submission.
    fn complete(&mut self, host: &mut Host, now: Time, s: usize) {
        let cpu = self.slots[s].cpu;
        if !host.cpu_acquire(cpu, now, event(EV_COMPLETE, s), Ctx::Softirq) {
            return;
        }
        let dma = self.slots[s]
            .dma
            .take()
            .expect("completion of a submitted I/O");
        let t = now + host.platform.cpu.nvme_complete_ns;
        let dom = self.dom(s);
        let t = host.dma_unmap_in(dom, t, cpu, dma, self.pages);
        // A batch of one I/O for a policy that batches invalidations per completion batch (xSMMU).
        let t = host.dma_batch_end_in(dom, t, cpu);
        self.stats.packets_delivered += 1;
        self.stats.bytes_delivered += self.pages * PAGE;
        let t = self.submit(host, s, t);
        host.cpus[cpu].account(now, t);
    }
}

impl Workload for NvmeWorkload {
    fn start(&mut self, host: &mut Host, now: Time) -> Time {
        for job in 0..self.cfg.jobs as usize {
            for _ in 0..self.cfg.iodepth {
                // fio's buffers, allocated once: consecutive fresh pages. Memory that runs out here stops
                // the set-up; the run reports it (host.pages.exhausted).
                let Some(phys) = (0..self.pages)
                    .map(|_| host.pages.alloc())
                    .collect::<Option<Vec<u64>>>()
                    .and_then(|p| p.into_iter().min())
                else {
                    return now;
                };
                self.slots.push(Slot {
                    cpu: job,
                    drive: job % self.cfg.drives as usize,
                    phys,
                    dma: None,
                });
                host.schedule(now, event(EV_SUBMIT, self.slots.len() - 1));
            }
        }
        now
    }

    fn handle(&mut self, host: &mut Host, now: Time, kind: u16, id: u32) {
        let s = id as usize;
        match kind {
            EV_SUBMIT => {
                let cpu = self.slots[s].cpu;
                if host.cpu_acquire(cpu, now, event(EV_SUBMIT, s), Ctx::Task) {
                    let t = self.submit(host, s, now);
                    host.cpus[cpu].account(now, t);
                }
            }
            EV_DATA => self.data(host, now, s),
            EV_COMPLETE => self.complete(host, now, s),
            _ => unreachable!("nvme event kind {kind}"),
        }
    }

    fn stats(&self) -> WorkloadStats {
        WorkloadStats {
            dma_faults: self.drives.iter().map(|d| d.faults).sum(),
            device: self.drives.iter().fold(Default::default(), |mut b, d| {
                b.add(&d.busy());
                b
            }),
            ..self.stats.clone()
        }
    }

    fn cpus(&self) -> Vec<usize> {
        (0..self.cfg.jobs as usize).collect()
    }

    fn line_rate_gbps(&self) -> f64 {
        self.cfg.drives as f64 * self.drive_gbps
    }

    fn open_limit(&self) -> super::OpenLimit {
        super::OpenLimit::QueueDepth
    }
}
