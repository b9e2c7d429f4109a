//! Thin PyO3 bindings: load scenarios, step simulations, hand results back as JSON text.
//! Everything of substance lives in iommulab-core; everything user-facing lives in the Python package.

use iommulab_core::{replay, run, scenario};
use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::path::PathBuf;

create_exception!(
    _core,
    ScenarioError,
    PyValueError,
    "A scenario, profile or override is invalid (one line: where, what was expected)."
);

fn err(e: iommulab_core::input::InputError) -> PyErr {
    ScenarioError::new_err(e.to_string())
}

/// One concrete run of a scenario (one combination of its [compare] values).
#[pyclass(module = "iommulab._core", frozen)]
struct Variant {
    inner: scenario::Variant,
}

#[pymethods]
impl Variant {
    #[getter]
    fn label(&self) -> String {
        self.inner.label.clone()
    }
    /// The [compare] values that made this variant: (key, TOML value text).
    #[getter]
    fn overrides(&self) -> Vec<(String, String)> {
        self.inner
            .overrides
            .iter()
            .map(|(k, v)| (k.clone(), v.to_string()))
            .collect()
    }
    /// The fully resolved scenario (profile merged, overrides applied) as JSON text.
    fn scenario_json(&self) -> String {
        serde_json::to_string(&self.inner.scenario).expect("scenario serialises")
    }
    /// Build the simulation (the GIL is released meanwhile: runs are built and advanced on several threads).
    fn simulate(&self, py: Python<'_>) -> PyResult<Simulation> {
        let v = &self.inner;
        let inner = py
            .allow_threads(|| run::Simulation::try_new(v))
            .map_err(ScenarioError::new_err)?;
        Ok(Simulation { inner })
    }
}

/// A running simulation, advanced in steps so callers can show progress.
#[pyclass(module = "iommulab._core")]
struct Simulation {
    inner: run::Simulation,
}

#[pymethods]
impl Simulation {
    #[getter]
    fn end_ns(&self) -> u64 {
        self.inner.end_ns()
    }
    #[getter]
    fn warmup_end_ns(&self) -> u64 {
        self.inner.warmup_end_ns()
    }
    #[getter]
    fn now_ns(&self) -> u64 {
        self.inner.now_ns()
    }
    #[getter]
    fn done(&self) -> bool {
        self.inner.done()
    }
    /// Process events up to simulated time `ns` (the GIL is released meanwhile).
    /// Raises ScenarioError when the watchdog stops a run whose event rate explodes.
    fn advance_to(&mut self, py: Python<'_>, ns: u64) -> PyResult<()> {
        let sim = &mut self.inner;
        py.allow_threads(|| sim.advance_to(ns));
        match sim.stopped() {
            Some(why) => Err(ScenarioError::new_err(why.to_string())),
            None => Ok(()),
        }
    }
    /// The result so far (after warm-up) as JSON text.
    fn result_json(&self) -> String {
        serde_json::to_string(&self.inner.result()).expect("result serialises")
    }
    /// The result so far with every part only some runs report present (zero where absent): every key a
    /// result of this run can hold.
    fn every_part_json(&self) -> String {
        serde_json::to_string(&self.inner.result().with_every_part()).expect("result serialises")
    }
}

/// Load a scenario: kind is "builtin" (source = name), "file" (source = path, any bytes the file system
/// takes) or "text" (source = TOML, name = display name). Overrides are (key.path, value) pairs as `--set`
/// takes them.
#[pyfunction]
#[pyo3(signature = (kind, source, overrides, name = "<text>"))]
fn load(
    kind: &str,
    source: &Bound<'_, PyAny>,
    overrides: Vec<(String, String)>,
    name: &str,
) -> PyResult<Vec<Variant>> {
    let (path, text): (PathBuf, String);
    let src = match kind {
        "builtin" => {
            text = source.extract()?;
            scenario::Source::Builtin(&text)
        }
        "file" => {
            path = source.extract()?;
            scenario::Source::File(&path)
        }
        "text" => {
            text = source.extract()?;
            scenario::Source::Text { name, text: &text }
        }
        other => {
            return Err(PyValueError::new_err(format!(
                "unknown scenario source kind `{other}`"
            )))
        }
    };
    let vs = scenario::load(src, &overrides).map_err(err)?;
    Ok(vs.into_iter().map(|inner| Variant { inner }).collect())
}

/// A trace replay fed in chunks of bytes (decompression and file handling stay in Python).
#[pyclass(module = "iommulab._core")]
struct Replay {
    inner: Option<replay::ReplaySession>,
}

#[pymethods]
impl Replay {
    #[new]
    #[pyo3(signature = (name, vendor, caching_mode, ats, kernel, cmdline, mode, hz, jiffy_phase_ns = None, ats_phases = Vec::new()))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        name: &str,
        vendor: &str,
        caching_mode: bool,
        ats: bool,
        kernel: &str,
        cmdline: &str,
        mode: Option<&str>,
        hz: u32,
        jiffy_phase_ns: Option<u64>,
        ats_phases: Vec<String>,
    ) -> PyResult<Self> {
        let vendor = match vendor {
            "vtd" => scenario::Vendor::Vtd,
            "smmuv3" => scenario::Vendor::Smmuv3,
            "virtio" => scenario::Vendor::Virtio,
            other => {
                return Err(ScenarioError::new_err(format!(
                    "--iommu {other}: expected vtd, smmuv3 or virtio"
                )))
            }
        };
        if caching_mode && vendor != scenario::Vendor::Vtd {
            return Err(ScenarioError::new_err(
                "--caching-mode on: caching mode is a VT-d capability (CAP.CM); expected --iommu vtd",
            ));
        }
        let mode = match mode {
            None => None,
            Some("strict") => Some(scenario::PolicyName::Strict),
            Some("lazy") => Some(scenario::PolicyName::Lazy),
            Some("passthrough") => Some(scenario::PolicyName::Passthrough),
            Some(other) => {
                return Err(ScenarioError::new_err(format!(
                    "--mode {other}: expected strict, lazy or passthrough"
                )))
            }
        };
        let opts = replay::ReplayOptions {
            vendor,
            caching_mode,
            ats: ats || !ats_phases.is_empty(),
            ats_phases,
            kernel: kernel.to_string(),
            cmdline: cmdline.to_string(),
            mode,
            hz,
            jiffy_phase_ns,
        };
        let s = replay::ReplaySession::new(name, &opts).map_err(err)?;
        Ok(Replay { inner: Some(s) })
    }

    /// Feed the next chunk of trace bytes (the GIL is released meanwhile); a line too long to be ftrace
    /// text is a ScenarioError.
    fn feed(&mut self, py: Python<'_>, chunk: &[u8]) -> PyResult<()> {
        let s = self
            .inner
            .as_mut()
            .ok_or_else(|| PyValueError::new_err("replay already finished"))?;
        py.allow_threads(|| s.feed(chunk)).map_err(err)
    }

    /// End of the trace: the result as JSON text.
    fn finish(&mut self) -> PyResult<String> {
        let s = self
            .inner
            .take()
            .ok_or_else(|| PyValueError::new_err("replay already finished"))?;
        let r = s.finish().map_err(err)?;
        Ok(serde_json::to_string(&r).expect("result serialises"))
    }
}

/// The default domain a kernel gives its devices: JSON {"kernel_log": [...], "devices": [...]}.
#[pyfunction]
fn explain(
    arch: &str,
    kernel: &str,
    cmdline: &str,
    caching_mode: bool,
    iommu: &str,
) -> PyResult<String> {
    use iommulab_core::dma::default_domain::{self, Driver};
    let arch = match arch {
        "x86_64" | "x86" | "amd64" => scenario::Arch::X86_64,
        "arm64" | "aarch64" => scenario::Arch::Arm64,
        "s390" | "s390x" => scenario::Arch::S390,
        other => {
            return Err(ScenarioError::new_err(format!(
                "--arch {other}: expected x86_64, arm64 or s390"
            )))
        }
    };
    let driver = match iommu {
        "vtd" => Driver::Vtd,
        "smmuv3" => Driver::Smmuv3,
        "virtio" => Driver::Virtio,
        "s390" => Driver::S390,
        other => {
            return Err(ScenarioError::new_err(format!(
                "--iommu {other}: expected vtd, smmuv3, virtio or s390"
            )))
        }
    };
    let kernel = scenario::rules_kernel(kernel)
        .map_err(|m| ScenarioError::new_err(format!("--kernel: {m}")))?;
    // Each IOMMU driver serves its architectures: VT-d x86, SMMUv3 arm64, s390's zPCI s390; virtio-iommu
    // any guest but s390.
    let fits = matches!(
        (driver, arch),
        (Driver::Vtd, scenario::Arch::X86_64)
            | (Driver::Smmuv3, scenario::Arch::Arm64)
            | (Driver::S390, scenario::Arch::S390)
            | (
                Driver::Virtio,
                scenario::Arch::X86_64 | scenario::Arch::Arm64
            )
    );
    if !fits {
        let name = match arch {
            scenario::Arch::X86_64 => "x86_64",
            scenario::Arch::Arm64 => "arm64",
            scenario::Arch::S390 => "s390",
        };
        return Err(ScenarioError::new_err(format!(
            "--iommu {iommu}: no such IOMMU on {name} (VT-d is x86_64, SMMUv3 arm64, s390 s390, virtio x86_64 or arm64)"
        )));
    }
    if caching_mode && driver != Driver::Vtd {
        return Err(ScenarioError::new_err(
            "--caching-mode on: caching mode is a VT-d capability (CAP.CM); expected --iommu vtd",
        ));
    }
    let e = default_domain::explain(arch, kernel, cmdline, caching_mode, driver);
    Ok(serde_json::to_string(&e).expect("serialises"))
}

/// The scenario schema as JSON Schema text.
#[pyfunction]
fn scenario_schema() -> String {
    scenario::json_schema()
}

fn owned(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

/// (name, TOML text) of every built-in scenario.
#[pyfunction]
fn builtin_scenarios() -> Vec<(String, String)> {
    owned(scenario::BUILTIN_SCENARIOS)
}

/// (old name, its built-in's name) of every alias.
#[pyfunction]
fn builtin_aliases() -> Vec<(String, String)> {
    owned(scenario::BUILTIN_ALIASES)
}

/// (name, TOML text) of every built-in profile.
#[pyfunction]
fn builtin_profiles() -> Vec<(String, String)> {
    owned(scenario::BUILTIN_PROFILES)
}

/// The longest a lazy domain's freed IOVA waits for the flush-queue timer at CONFIG_HZ `hz`, µs.
#[pyfunction]
fn fq_timer_bound_us(hz: u32) -> f64 {
    iommulab_core::dma::flush_queue::longest_timer_wait_ns(
        iommulab_core::dma::flush_queue::IOVA_DEFAULT_FQ_TIMEOUT_MS,
        hz,
    ) as f64
        / 1e3
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", iommulab_core::VERSION)?;
    let newest = iommulab_core::scenario::KERNEL_NEWEST;
    m.add("KERNEL_NEWEST", format!("{}.{}", newest.0, newest.1))?;
    m.add(
        "MAX_INPUT_FILE_BYTES",
        iommulab_core::scenario::MAX_INPUT_FILE_BYTES,
    )?;
    m.add("ScenarioError", m.py().get_type::<ScenarioError>())?;
    m.add_class::<Variant>()?;
    m.add_class::<Simulation>()?;
    m.add_class::<Replay>()?;
    m.add_function(wrap_pyfunction!(load, m)?)?;
    m.add_function(wrap_pyfunction!(builtin_scenarios, m)?)?;
    m.add_function(wrap_pyfunction!(builtin_aliases, m)?)?;
    m.add_function(wrap_pyfunction!(fq_timer_bound_us, m)?)?;
    m.add(
        "FQ_TIMEOUT_MS",
        iommulab_core::dma::flush_queue::IOVA_DEFAULT_FQ_TIMEOUT_MS,
    )?;
    m.add_function(wrap_pyfunction!(scenario_schema, m)?)?;
    m.add_function(wrap_pyfunction!(explain, m)?)?;
    m.add_function(wrap_pyfunction!(builtin_profiles, m)?)?;
    Ok(())
}
