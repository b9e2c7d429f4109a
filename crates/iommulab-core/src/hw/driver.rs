//! What the core asks of an IOMMU driver before it has an IOMMU, as iommu.c and dma-iommu.c ask a driver's
//! `iommu_ops` (capable, def_domain_type) and never name it: the architectures it serves, its boot switches
//! and quirks that decide the default domain, its page-table format and profile checks, how QEMU emulates it,
//! and its commands' names. Each vendor's file implements [`Driver`]; [`super::drivers`] lists them.

use super::cache::QemuIotlb;
use super::emul::{Shadow, Trap};
use super::translator::Translator;
use super::{HypervisorProfile, InvClass, Iommu, IommuProfile, Platform, PtFormat, Vendor};
use crate::kernel::{Arch, KernelVersion};

/// What one of a driver's own boot options (`intel_iommu=`, `amd_iommu=`, `s390_iommu=`) does to the
/// default domain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Switch {
    /// DMA domains go strict; the kernel's log line.
    Strict(&'static str),
    /// The IOMMU is not used: the kernel's log line, if it prints one.
    Off(Option<&'static str>),
    /// Only a log line (a deprecated or ignored option).
    Log(&'static str),
}

/// The kernel side of an IOMMU driver: what decides its devices' default domain.
pub trait KernelDriver: Sync {
    /// Its name on the command line (`--iommu`) and in a profile's `vendor`: "vtd".
    fn name(&self) -> &'static str;
    /// The hardware in prose: "Intel VT-d".
    fn title(&self) -> &'static str;
    /// Architectures whose kernels have this driver.
    fn archs(&self) -> &'static [Arch];
    /// What `os.arch` must be, said when it is not.
    fn arch_expected(&self) -> &'static str;
    /// The kernel command-line parameter of the driver's own options (`intel_iommu`), if it has one.
    fn param(&self) -> Option<&'static str> {
        None
    }
    /// What option `opt` of that parameter does (None: nothing the default domain sees).
    fn switch(&self, _opt: &str, _k: KernelVersion) -> Option<Switch> {
        None
    }
    /// The capability by which a virtual IOMMU asks to be told of every map, so the VMM sees new mappings
    /// (VT-d CAP.CM); None: this IOMMU has none.
    fn caching_mode_cap(&self) -> Option<&'static str> {
        None
    }
    /// Under that capability the driver makes every DMA domain strict: its log line and the reason.
    fn strict_under_caching_mode(&self, _k: KernelVersion) -> Option<(&'static str, &'static str)> {
        None
    }
    /// IOMMU_CAP_DEFERRED_FLUSH, which a DMA-FQ domain needs (else iommu_dma_init_domain() falls back to
    /// strict): Err with the reason where the driver lacks it.
    fn deferred_flush(&self, _k: KernelVersion) -> Result<(), &'static str> {
        Ok(())
    }
    /// dev->iommu->shadow_on_flush on some devices: a lazy domain gets one large flush queue (s390's zPCI).
    fn shadow_on_flush(&self) -> Option<&'static str> {
        None
    }
    /// The kernels the driver exists in on `arch`: Err says which.
    fn check_kernel(&self, _k: KernelVersion, _arch: Arch) -> Result<(), &'static str> {
        Ok(())
    }
}

/// One column of what a replay reports per phase, in the vendor's own word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Column {
    /// Commands of a class.
    Class(InvClass),
    /// Commands of any of these classes (one command whose encoding spans them).
    Classes(&'static [InvClass]),
    /// Synchronisations waited for (wait descriptors, CMD_SYNCs).
    Syncs,
    /// Doorbell writes (submissions not gathered into another CPU's).
    Doorbells,
}

/// The parts of an emulated IOMMU the hypervisor adds: trapped doorbells and shadowed maps.
pub struct Emulation {
    pub trap: Option<Trap>,
    pub shadow: Option<Shadow>,
}

/// An IOMMU iommulab models: the kernel driver and the hardware behind it.
pub trait Driver: KernelDriver {
    fn vendor(&self) -> Vendor;
    /// A paravirtual IOMMU (virtio-iommu): only in a guest, whatever the host's; QEMU does not emulate
    /// hardware for it and nothing nests.
    fn paravirtual(&self) -> bool {
        false
    }
    /// The IOMMU walks page tables and caches translations (the profile gives the caches' geometry and
    /// the walk's read latency).
    fn walks_tables(&self) -> bool {
        true
    }
    /// The driver enables ATS on a device of a DMA domain (PCIe ATS in the platform), so the device caches
    /// translations and gets device-TLB invalidations.
    fn enables_ats(&self, _p: &IommuProfile, _k: KernelVersion) -> bool {
        true
    }
    /// The page-table format of its DMA domains, from the profile. Errors name the key under
    /// `platform.iommu`.
    fn pt_format(&self, p: &IommuProfile) -> Result<PtFormat, (&'static str, String)>;
    /// The vendor's own profile section and keys; `guest`: the platform is a guest's. Errors name the key
    /// under `platform.iommu`.
    fn check(&self, p: &IommuProfile, guest: bool) -> Result<(), (&'static str, String)>;
    /// The driver invalidates after every map (caching mode), so QEMU can shadow a VFIO device's mappings.
    fn caching_mode(&self, _p: &IommuProfile) -> bool {
        false
    }
    /// The profile key that turns caching mode on, under `platform.iommu`.
    fn caching_mode_key(&self) -> Option<&'static str> {
        None
    }
    /// What QEMU `qemu` (MAJOR, MINOR) cannot do behind its emulation of this IOMMU: shadow a VFIO device's
    /// mappings (`vfio`), or keep a vhost device IOTLB coherent (`vhost`). Err: the key and why.
    fn emulation_refuses(
        &self,
        _qemu: (u32, u32),
        _vfio: bool,
        _vhost: bool,
    ) -> Result<(), (&'static str, &'static str)> {
        Ok(())
    }
    /// A guest's hardware command queue its invalidations do not trap through (NVIDIA's vCMDQ).
    fn hardware_guest_queue(&self) -> bool {
        false
    }
    /// QEMU's own translation cache for this IOMMU (its capacity and how invalidations match it).
    fn qemu_iotlb(&self, h: &HypervisorProfile, entries: u32) -> QemuIotlb<(u64, u64)>;
    /// Build the IOMMU.
    fn build(
        &self,
        p: &Platform,
        cpus: usize,
        kernel: KernelVersion,
        tr: Translator,
        emu: Emulation,
    ) -> Box<dyn Iommu>;
    /// The built-in profile a replay models it with, and the traced kernel's architecture.
    fn replay_profile(&self) -> (&'static str, Arch);
    /// What a replay reports per phase, in the vendor's names (QEMU's traces count the same).
    fn replay_columns(&self) -> &'static [(&'static str, Column)];
}
