//! `[workload.nvme]`: fio against NVMe drives.

#[allow(unused_imports)]
use super::*;

/// fio against NVMe drives (O_DIRECT, closed loop): every I/O maps its buffer with one dma_map_sg() when it
/// is submitted and unmaps it when it completes.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Nvme {
    /// Drives.
    pub drives: u32,
    /// The drives sit behind one PCIe bridge without ACS (a dual-port drive): one IOMMU group, so one
    /// default domain for all of them. False: each on its own root port, in a domain of its own.
    #[serde(default = "default_true")]
    pub same_bridge: bool,
    /// fio numjobs: one submitting thread per CPU; job j drives drive j % drives through its own queue pair.
    pub jobs: u32,
    /// fio iodepth: I/Os each job keeps in flight.
    pub iodepth: u32,
    /// fio bs, in KiB (a multiple of 4).
    pub bs_kb: u32,
    /// fio rw. Reads: the drive writes host memory; writes: it reads it. Both translate every page.
    #[serde(default = "default_rw")]
    pub rw: NvmeRw,
    /// Media latency of one I/O inside the drive, µs (overlaps across the I/Os in flight).
    pub latency_us: f64,
    /// Data bandwidth of one drive, Gbps (its PCIe link and media, whichever is lower).
    pub drive_gbps: f64,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum NvmeRw {
    Read,
    Randread,
    Write,
    Randwrite,
}
fn default_rw() -> NvmeRw {
    NvmeRw::Randread
}

impl Nvme {
    pub(super) fn validate(&self, cores: u32) -> Result<(), (Vec<String>, String)> {
        check(
            (1..=1024).contains(&self.drives),
            "workload.nvme.drives",
            "expected 1..=1024 drives",
        )?;
        check(
            self.jobs >= 1 && self.jobs <= cores,
            "workload.nvme.jobs",
            format!("expected 1..={cores} jobs (one CPU each, platform.cpu.cores)"),
        )?;
        check(
            (1..=65536).contains(&self.iodepth),
            "workload.nvme.iodepth",
            "expected 1..=65536 I/Os in flight per job",
        )?;
        check(
            self.bs_kb >= 4 && self.bs_kb.is_multiple_of(4) && self.bs_kb <= 16384,
            "workload.nvme.bs_kb",
            "expected a block size in KiB, a multiple of 4 from 4 to 16384",
        )?;
        check(
            self.latency_us >= 0.0 && self.latency_us.is_finite(),
            "workload.nvme.latency_us",
            "expected a finite latency >= 0",
        )?;
        check(
            (MIN_LINE_RATE_GBPS..=3200.0).contains(&self.drive_gbps),
            "workload.nvme.drive_gbps",
            format!("expected a bandwidth in [{MIN_LINE_RATE_GBPS}, 3200] Gbps"),
        )
    }
}
