//! iommulab core: a simulator of IOMMU hardware, the Linux DMA-mapping layer and the I/O workloads on top.
//!
//! Layout mirrors the kernel stack: [`hw`] (vendors' IOMMUs, io-pgtable), [`dma`] (iova.c, dma-iommu.c
//! policies), [`workload`] (event sources), [`sim`] (the discrete-event engine), [`metrics`] (counters and
//! results). [`scenario`] is the input schema and [`run`] ties it together.
//!
//! ```
//! use iommulab_core::{scenario, run};
//! let ov = vec![("run.duration_ms".to_string(), "2".to_string())];
//! let variants = scenario::load(scenario::Source::Builtin("default"), &ov).unwrap();
//! let r = run::run_variant(&variants[0]);
//! assert!(r.sim_seconds > 0.0);
//! ```

pub mod dma;
pub mod host;
pub mod hw;
pub mod input;
pub mod kernel;
pub mod metrics;
pub mod net;
pub mod replay;
pub mod run;
pub mod scenario;
pub mod sim;
pub mod workload;

pub const VERSION: &str = env!("CARGO_PKG_VERSION");
