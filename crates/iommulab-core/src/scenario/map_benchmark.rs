//! `[workload.dma_map_benchmark]`: the kernel's own map/unmap benchmark (kernel/dma/map_benchmark.c, driven
//! by tools/testing/selftests/dma/dma_map_benchmark.c).

#[allow(unused_imports)]
use super::*;

/// kernel/dma/map_benchmark.c: `threads` kernel threads, each mapping one buffer of `granule` pages with
/// dma_map_single() and unmapping it, in a loop, timing both. The keys are the tool's options.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MapBenchmark {
    /// -t: threads (DMA_MAP_MAX_THREADS 1024), one per CPU of the node here (the kernel lets its scheduler
    /// spread them over the node's CPUs).
    #[serde(default = "one")]
    pub threads: u32,
    /// -s: seconds of benchmark, the measured window (the kernel allows up to DMA_MAP_MAX_SECONDS, 300; a
    /// run simulates at most a minute). Absent: the run's `duration_ms`.
    pub seconds: Option<u32>,
    /// -g: pages per map (1..=1024): one dma_map_single() of granule × 4 KiB.
    #[serde(default = "one")]
    pub granule: u32,
    /// -d: the DMA direction. Unless from_device, each thread fills its buffer (memset 0x66) before every
    /// map, outside the timed calls.
    #[serde(default)]
    pub dma_dir: MapDir,
    /// -n: the NUMA node whose CPUs run the threads (a node is `platform.cpu.socket_cores` CPUs); -1
    /// (NUMA_NO_NODE): from CPU 0.
    #[serde(default = "no_node")]
    pub node: i32,
    /// -b: the device's DMA mask in bits (20..=64; the tool's default 32): IOVAs come from below it.
    #[serde(default = "default_dma_bits")]
    pub dma_bits: u32,
    /// -x: ns the thread busy-waits between map and unmap (ndelay, "pretend DMA is transmitting"), at most
    /// DMA_MAP_MAX_TRANS_DELAY (10 ms).
    #[serde(default)]
    pub dma_trans_ns: u64,
}

/// -d's values (DMA_MAP_BIDIRECTIONAL 0, DMA_MAP_TO_DEVICE 1, DMA_MAP_FROM_DEVICE 2).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum MapDir {
    #[default]
    Bidirectional,
    ToDevice,
    FromDevice,
}

impl MapDir {
    /// As the tool prints it (`directions[]` in dma_map_benchmark.c).
    pub fn as_str(self) -> &'static str {
        match self {
            MapDir::Bidirectional => "BIDIRECTIONAL",
            MapDir::ToDevice => "TO_DEVICE",
            MapDir::FromDevice => "FROM_DEVICE",
        }
    }
    /// The device reads the buffer (enum dma_data_direction: DMA_TO_DEVICE or DMA_BIDIRECTIONAL).
    pub fn to_device(self) -> bool {
        self != MapDir::FromDevice
    }
    /// The device writes the buffer (DMA_FROM_DEVICE or DMA_BIDIRECTIONAL).
    pub fn from_device(self) -> bool {
        self != MapDir::ToDevice
    }
}

fn one() -> u32 {
    1
}
fn no_node() -> i32 {
    -1
}
fn default_dma_bits() -> u32 {
    32
}

impl MapBenchmark {
    /// The CPUs the threads run on: from the first of node `node` (CPU 0 without a node).
    pub fn cpus(&self, socket_cores: u32) -> std::ops::Range<usize> {
        let first = self.node.max(0) as usize * socket_cores as usize;
        first..first + self.threads as usize
    }

    pub(super) fn validate(
        &self,
        cores: u32,
        socket_cores: u32,
        warmup_ms: f64,
    ) -> Result<(), (Vec<String>, String)> {
        let key = |k: &str| format!("workload.dma_map_benchmark.{k}");
        let nodes = (cores / socket_cores.max(1)).max(1);
        check(
            self.node == -1 || (0..nodes as i32).contains(&self.node),
            &key("node"),
            format!("expected -1 or a node 0..{nodes} ({socket_cores} CPUs each, platform.cpu.socket_cores)"),
        )?;
        let room = if self.node < 0 { cores } else { socket_cores };
        check(
            (1..=room.min(1024)).contains(&self.threads),
            &key("threads"),
            format!(
                "expected 1..={} threads (one CPU each, {})",
                room.min(1024),
                if self.node < 0 {
                    "platform.cpu.cores"
                } else {
                    "the node's CPUs"
                }
            ),
        )?;
        check(
            self.seconds
                .is_none_or(|s| s >= 1 && s as f64 * 1000.0 + warmup_ms <= 60_000.0),
            &key("seconds"),
            "expected 1 or more seconds, at most a minute with run.warmup_ms (the kernel allows 300)",
        )?;
        check(
            (1..=1024).contains(&self.granule),
            &key("granule"),
            "expected 1..=1024 pages per map",
        )?;
        check(
            (20..=64).contains(&self.dma_bits),
            &key("dma_bits"),
            "expected a DMA mask of 20..=64 bits",
        )?;
        check(
            self.dma_trans_ns <= 10_000_000,
            &key("dma_trans_ns"),
            "expected at most 10000000 ns (DMA_MAP_MAX_TRANS_DELAY)",
        )
    }
}
