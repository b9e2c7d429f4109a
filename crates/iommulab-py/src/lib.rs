//! Thin PyO3 bindings: load scenarios, step simulations, hand results back as JSON text.
//! Everything of substance lives in iommulab-core; everything user-facing lives in the Python package.

use iommulab_core::{hw, replay, run, scenario};
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
        let Some(driver) = hw::driver(vendor) else {
            return Err(ScenarioError::new_err(format!(
                "--iommu {vendor}: expected {}",
                or_list(hw::drivers().iter().map(|d| d.name()))
            )));
        };
        if caching_mode && driver.caching_mode_cap().is_none() {
            return Err(ScenarioError::new_err(caching_mode_refusal()));
        }
        let vendor = driver.vendor();
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
    use iommulab_core::dma::default_domain;
    use iommulab_core::hw::kernel_drivers;
    let arch = scenario::Arch::parse(arch).ok_or_else(|| {
        ScenarioError::new_err(format!(
            "--arch {arch}: expected {}",
            or_list(scenario::Arch::ALL.iter().map(|a| a.as_str()))
        ))
    })?;
    let drivers = kernel_drivers();
    let Some(&driver) = drivers.iter().find(|d| d.name() == iommu) else {
        return Err(ScenarioError::new_err(format!(
            "--iommu {iommu}: expected {}",
            or_list(drivers.iter().map(|d| d.name()))
        )));
    };
    let asked = kernel;
    let kernel = scenario::rules_kernel(kernel)
        .map_err(|m| ScenarioError::new_err(format!("--kernel: {m}")))?;
    // Each IOMMU driver serves its architectures.
    if !driver.archs().contains(&arch) {
        let serves: Vec<String> = drivers
            .iter()
            .map(|d| {
                let archs: Vec<_> = d.archs().iter().map(|a| a.as_str()).collect();
                format!("{} {}", d.name(), archs.join(" or "))
            })
            .collect();
        return Err(ScenarioError::new_err(format!(
            "--iommu {iommu}: no such IOMMU on {} ({})",
            arch.as_str(),
            serves.join(", ")
        )));
    }
    if caching_mode && driver.caching_mode_cap().is_none() {
        return Err(ScenarioError::new_err(caching_mode_refusal()));
    }
    // A kernel without the driver has no domain to explain (the scenario check says the same).
    if let Err(m) = driver.check_kernel(kernel.into(), arch) {
        return Err(ScenarioError::new_err(format!("--kernel {asked}: {m}")));
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

/// (old name, new name) of every renamed built-in: loading the old name is refused with an error naming the new one.
#[pyfunction]
fn builtin_aliases() -> Vec<(String, String)> {
    owned(scenario::RENAMED_BUILTINS)
}

/// (name, TOML text) of every built-in profile.
#[pyfunction]
fn builtin_profiles() -> Vec<(String, String)> {
    owned(scenario::BUILTIN_PROFILES)
}

/// Why QEMU `qemu` ("MAJOR.MINOR") cannot put a VFIO device (`vfio`) or a vhost device IOTLB (`vhost`) behind
/// its emulation of IOMMU `vendor` (None: it can, or the vendor or version is unknown).
#[pyfunction]
fn emulation_refuses(vendor: &str, qemu: &str, vfio: bool, vhost: bool) -> Option<String> {
    let d = hw::driver(vendor)?;
    let (a, b) = qemu.split_once('.')?;
    let q = (a.parse().ok()?, b.parse().ok()?);
    d.emulation_refuses(q, vfio, vhost)
        .err()
        .map(|(_, m)| m.to_string())
}

/// Every policy a run can pin, cheapest protection first.
#[pyfunction]
fn policies() -> Vec<&'static str> {
    scenario::PolicyName::BY_PROTECTION
        .iter()
        .map(|p| p.as_str())
        .collect()
}

/// Every IOMMU driver the core knows, as JSON: name, title, archs, and for a modelled one its built-in
/// replay profile, caching-mode key and replay columns (`modelled` false: `explain` only).
#[pyfunction]
fn drivers() -> String {
    let v: Vec<serde_json::Value> = hw::kernel_drivers()
        .iter()
        .map(|k| {
            let archs: Vec<_> = k.archs().iter().map(|a| a.as_str()).collect();
            let mut o = serde_json::json!({
                "name": k.name(),
                "title": k.title(),
                "archs": archs,
                "param": k.param(),
                "caching_mode_cap": k.caching_mode_cap(),
                "modelled": false,
            });
            if let Some(d) = hw::driver(k.name()) {
                let (profile, arch) = d.replay_profile();
                let cols: Vec<_> = d.replay_columns().iter().map(|(n, _)| *n).collect();
                o["modelled"] = true.into();
                o["paravirtual"] = d.paravirtual().into();
                o["replay_profile"] = profile.into();
                o["replay_arch"] = arch.as_str().into();
                o["caching_mode_key"] = d.caching_mode_key().into();
                o["replay_columns"] = cols.into();
            }
            o
        })
        .collect();
    serde_json::to_string(&v).expect("serialises")
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
    m.add_function(wrap_pyfunction!(drivers, m)?)?;
    m.add_function(wrap_pyfunction!(policies, m)?)?;
    m.add_function(wrap_pyfunction!(emulation_refuses, m)?)?;
    Ok(())
}

/// "a, b or c".
fn or_list<'a>(names: impl Iterator<Item = &'a str>) -> String {
    let v: Vec<&str> = names.collect();
    match v.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => v.join(""),
    }
}

/// `--caching-mode on` for an IOMMU without the capability: which ones have it.
fn caching_mode_refusal() -> String {
    let with: Vec<String> = hw::kernel_drivers()
        .iter()
        .filter_map(|d| d.caching_mode_cap().map(|c| format!("{} ({c})", d.name())))
        .collect();
    format!(
        "--caching-mode on: caching mode is a capability of {}; expected --iommu {}",
        with.join(", "),
        or_list(
            hw::kernel_drivers()
                .iter()
                .filter(|d| d.caching_mode_cap().is_some())
                .map(|d| d.name())
        )
    )
}
