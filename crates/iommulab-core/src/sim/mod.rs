//! The discrete-event engine: simulated time in ns, an ordered event queue, simulated CPUs, spinlocks with
//! contention, the device's DMA engine with bounded outstanding translations, and a seeded RNG.
//!
//! Everything here is deterministic: ties in time are broken by insertion order, and the RNG is
//! xoshiro256** seeded through splitmix64, so the same scenario and seed give bit-identical results anywhere.

mod coherence;
mod cpu;
mod dma_engine;
mod events;
mod fifo;
pub mod hist;
mod lock;
mod per_cpu;
mod rng;
mod sched;
mod split_deque;

pub use coherence::{Coherence, NO_CPU};
pub use cpu::Cpu;
pub use dma_engine::{DmaEngine, EngineBusy, Path};
pub use events::EventQueue;
pub use fifo::FifoServer;
pub use lock::{LockStats, SpinLock, LOOKBEHIND_NS, QSPINLOCK_HANDOFF_TRANSFERS};
pub use per_cpu::PerCpu;
pub use rng::Rng;
pub use sched::{Cfs, Ctx, RunQueue};

/// Simulated time in nanoseconds.
pub type Time = u64;

pub const NS_PER_MS: u64 = 1_000_000;
pub const NS_PER_SEC: u64 = 1_000_000_000;
