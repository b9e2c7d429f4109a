//! Loading a scenario: its file or a built-in, the profile it names (merged under its own keys), `--set`
//! overrides and the `[compare]` axes, into checked variants.

#[allow(unused_imports)]
use super::*;

/// Where a scenario comes from.
pub enum Source<'a> {
    Builtin(&'a str),
    File(&'a Path),
    /// TOML text with a display name (used for errors).
    Text {
        name: &'a str,
        text: &'a str,
    },
}

/// One concrete run of a loaded scenario: the `[compare]` values that produced it, and the scenario.
#[derive(Debug, Clone)]
pub struct Variant {
    pub label: String,
    pub overrides: Vec<(String, toml::Value)>,
    pub scenario: Scenario,
}

struct Origins<'a> {
    doc: &'a SourceDoc,
    profile: Option<&'a SourceDoc>,
    overrides: &'a [(String, String)],
}

impl Origins<'_> {
    /// Attribute an error at key `path` to the `--set` flag, scenario line or profile line that wrote it.
    fn error(&self, path: &[String], msg: &str) -> InputError {
        let key = path.join(".");
        for (k, v) in self.overrides.iter().rev() {
            let kp = input::split_key(k).unwrap_or_default();
            let n = kp.len().min(path.len());
            if n > 0 && kp[..n] == path[..n] {
                return InputError::new(format!("--set {k}={v}"), format!("key `{key}`: {msg}"));
            }
        }
        let (loc, full) = self.doc.locate(path);
        if !full && path.first().map(String::as_str) == Some("platform") {
            if let Some(p) = self.profile {
                let (ploc, pfull) = p.locate(&path[1..]);
                if pfull {
                    return InputError::new(ploc, format!("key `{}`: {msg}", path[1..].join(".")));
                }
            }
        }
        let key = if key.is_empty() {
            "(top level)".to_string()
        } else {
            format!("`{key}`")
        };
        InputError::new(loc, format!("key {key}: {msg}"))
    }
}

/// The size of a scenario or profile file, at most: the built-in ones are under 12 KiB, so a file over a
/// thousand times larger is not one (a log, a trace, /dev/zero). A reading bound, not a kernel constant.
pub const MAX_INPUT_FILE_BYTES: u64 = 16 << 20;

/// A scenario or profile file's text: a regular file (a FIFO or a device is refused before it is opened, so
/// nothing blocks or reads without end) of at most [`MAX_INPUT_FILE_BYTES`], in UTF-8.
fn read_named(path: &Path) -> Result<String, InputError> {
    use std::io::Read;
    let fail = |why: String| InputError::new(path.display().to_string(), why);
    let cannot = |e: std::io::Error| {
        fail(match e.kind() {
            std::io::ErrorKind::NotFound => "cannot read: no such file".to_string(),
            _ => format!("cannot read: {e}"),
        })
    };
    let regular = |t: std::fs::FileType| {
        t.is_file()
            .then_some(())
            .ok_or_else(|| fail(format!("{}; expected a TOML file", file_kind(t))))
    };
    regular(std::fs::metadata(path).map_err(cannot)?.file_type())?;
    let f = std::fs::File::open(path).map_err(cannot)?;
    regular(f.metadata().map_err(cannot)?.file_type())?;
    let mut b = Vec::new();
    f.take(MAX_INPUT_FILE_BYTES + 1)
        .read_to_end(&mut b)
        .map_err(cannot)?;
    if b.len() as u64 > MAX_INPUT_FILE_BYTES {
        return Err(fail(format!(
            "larger than {MAX_INPUT_FILE_BYTES} bytes; expected a TOML file"
        )));
    }
    String::from_utf8(b).map_err(|_| fail("expected UTF-8 TOML text".into()))
}

/// What a file that is not a regular one is, for an error.
fn file_kind(t: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    match () {
        _ if t.is_dir() => "a directory",
        _ if t.is_fifo() => "a FIFO",
        _ if t.is_char_device() => "a character device",
        _ if t.is_block_device() => "a block device",
        _ if t.is_socket() => "a socket",
        _ => "not a regular file",
    }
}

/// A built-in profile as a platform (the host a guest profile names).
pub fn builtin_platform(name: &str) -> Option<Platform> {
    let (n, text) = BUILTIN_PROFILES.iter().find(|(n, _)| *n == name)?;
    let mut t: toml::Table = toml::from_str(text).ok()?;
    t.insert("profile".into(), toml::Value::String(n.to_string()));
    toml::Value::Table(t).try_into().ok()
}

fn load_profile(name: &str, base: Option<&Path>) -> Result<SourceDoc, InputError> {
    let doc = find_profile(name, base)?;
    // The profile's own [ranges] against its own values, before a scenario's keys go over them.
    crate::hw::ranges::check(&doc.table()?).map_err(|(path, msg)| {
        let (loc, _) = doc.locate(&path);
        InputError::new(loc, format!("key `{}`: {msg}", path.join(".")))
    })?;
    Ok(doc)
}

fn find_profile(name: &str, base: Option<&Path>) -> Result<SourceDoc, InputError> {
    if let Some((n, text)) = BUILTIN_PROFILES.iter().find(|(n, _)| *n == name) {
        return SourceDoc::parse(&format!("profile:{n}"), text);
    }
    let p = PathBuf::from(name);
    let p = match base {
        Some(b) if p.is_relative() => b.join(p),
        _ => p,
    };
    if !p.exists() {
        let names: Vec<_> = BUILTIN_PROFILES.iter().map(|(n, _)| *n).collect();
        return Err(InputError::new(
            "platform.profile",
            format!(
                "no built-in profile or file `{name}` (built-in: {})",
                names.join(", ")
            ),
        ));
    }
    SourceDoc::parse(&p.display().to_string(), &read_named(&p)?)
}

/// Flatten `[compare]` into (key path, values) axes. Arrays are leaves; tables nest (`[compare.os] policy = [..]`
/// and `[compare] "os.policy" = [..]` mean the same).
fn compare_axes(
    t: &toml::Table,
    prefix: &[String],
    out: &mut Vec<(Vec<String>, Vec<toml::Value>)>,
) -> Result<(), (Vec<String>, String)> {
    for (k, v) in t {
        let mut path = prefix.to_vec();
        path.extend(input::split_key(k).map_err(|m| (prefix.to_vec(), m))?);
        match v {
            // A named axis: `[[compare.NAME]]` tables, each a `label` and the keys it sets.
            toml::Value::Array(a) if !a.is_empty() && a.iter().all(|x| x.is_table()) => {
                let mut labels = std::collections::BTreeSet::new();
                for (i, x) in a.iter().enumerate() {
                    let mut at = vec!["compare".to_string()];
                    at.extend(path.iter().cloned());
                    at.push(i.to_string());
                    let tbl = x.as_table().expect("checked");
                    let label = tbl.get("label").and_then(|l| l.as_str());
                    let Some(label) =
                        label.filter(|l| !l.is_empty() && !l.contains(char::is_whitespace))
                    else {
                        at.push("label".into());
                        return Err((at, "expected a label: one word naming this setting".into()));
                    };
                    if !labels.insert(label.to_string()) {
                        at.push("label".into());
                        return Err((at, format!("label `{label}` is used twice")));
                    }
                    if tbl.len() < 2 {
                        return Err((
                            at,
                            "expected at least one `\"key.path\" = value` besides label".into(),
                        ));
                    }
                    for k in tbl.keys().filter(|k| *k != "label") {
                        input::split_key(k).map_err(|m| (at.clone(), m))?;
                    }
                }
                out.push((path, a.clone()))
            }
            toml::Value::Array(a) if !a.is_empty() => out.push((path, a.clone())),
            toml::Value::Table(sub) => compare_axes(sub, &path, out)?,
            _ => {
                let mut full = vec!["compare".to_string()];
                full.extend(path);
                return Err((
                    full,
                    "expected a non-empty array of values to compare".into(),
                ));
            }
        }
    }
    Ok(())
}

/// The sections of its host profile a guest takes (`with_host`).
const FROM_HOST: [&str; 3] = ["pcie", "cpu", "kvm"];

/// A guest runs on its host: take the host profile's `[pcie]` (its devices sit on the host's PCIe), `[cpu]`
/// (the vCPUs are the host's cores) and `[kvm]` (what its KVM, QEMU and vhost cost) into the guest's platform
/// `profile`; what the guest profile says itself (the built-in ones: the vCPUs' number) goes over the
/// host's. A VFIO-assigned device (a hardware workload) also translates
/// through the host's IOMMU: take its IOMMU caches and table format and walk latency too (and, nested, its
/// command costs: the hardware executes the guest's commands). The scenario's own platform keys `own` go
/// over them.
fn with_host(profile: &mut toml::Table, own: &toml::Table, workload: Option<&toml::Value>) {
    let hardware = workload.and_then(|w| w.as_table()).is_some_and(|w| {
        ["nic_rx", "nic_tx", "rr", "nvme"]
            .iter()
            .any(|k| w.contains_key(*k))
    });
    let hyp = |t: &toml::Table, k: &str| t.get("hypervisor").and_then(|h| h.get(k)).cloned();
    let Some(host_name) = hyp(own, "host_profile").or_else(|| hyp(profile, "host_profile")) else {
        return;
    };
    let host = host_name
        .as_str()
        .and_then(|n| BUILTIN_PROFILES.iter().find(|(b, _)| *b == n))
        .and_then(|(_, text)| toml::from_str::<toml::Table>(text).ok());
    let Some(host) = host else {
        return;
    };
    for section in FROM_HOST {
        if let Some(toml::Value::Table(theirs)) = host.get(section) {
            let mut t = theirs.clone();
            if let Some(toml::Value::Table(mine)) = profile.remove(section) {
                input::merge(&mut t, mine);
            }
            profile.insert(section.into(), toml::Value::Table(t));
        }
    }
    // And their ranges, likewise.
    take_ranges(
        profile,
        &host,
        host_name.as_str().unwrap_or_default(),
        |k| {
            k.split_once('.')
                .is_some_and(|(section, _)| FROM_HOST.contains(&section))
        },
    );
    // And their sources, where the guest profile gives none of its own.
    if let Some(toml::Value::Table(theirs)) = host.get("sources") {
        let name = host_name.as_str().unwrap_or_default();
        let mine = profile
            .entry("sources")
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if let toml::Value::Table(mine) = mine {
            for (k, v) in theirs {
                let taken = k
                    .split_once('.')
                    .is_some_and(|(section, _)| FROM_HOST.contains(&section));
                if let (true, false, Some(v)) = (taken, mine.contains_key(k), v.as_str()) {
                    mine.insert(k.clone(), toml::Value::String(format!("host {name}: {v}")));
                }
            }
        }
    }
    if !hardware {
        return;
    }
    let nested = hyp(own, "nested")
        .or_else(|| hyp(profile, "nested"))
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    let mut copy = |path: &[&str]| {
        let p: Vec<String> = path.iter().map(|s| s.to_string()).collect();
        let mut cur = Some(&host);
        for seg in &p[..p.len() - 1] {
            cur = cur.and_then(|t| t.get(seg)).and_then(|v| v.as_table());
        }
        if let Some(v) = cur.and_then(|t| t.get(&p[p.len() - 1])) {
            let _ = input::set_path(profile, &p, v.clone());
        }
    };
    let name = host_name.as_str().unwrap_or_default();
    let mut taken = vec!["memory.walk_read_ns".to_string()];
    copy(&["memory", "walk_read_ns"]);
    for k in [
        "iotlb_entries",
        "iotlb_ways",
        "pwc_entries",
        "pwc_ways",
        "ias_bits",
        "granule_kb",
        "large_pages",
    ] {
        copy(&["iommu", k]);
        taken.push(format!("iommu.{k}"));
    }
    if nested {
        for k in ["vtd", "smmuv3"] {
            if let Some(v) = host.get("iommu").and_then(|i| i.get(k)) {
                let _ = input::set_path(profile, &["iommu".into(), k.into()], v.clone());
                taken.push(format!("iommu.{k}."));
            }
        }
    }
    // The ranges go with the values taken (over the guest's own: the value is the host's now).
    if let Some(toml::Value::Table(r)) = profile.get_mut("ranges") {
        r.retain(|k, _| {
            !taken
                .iter()
                .any(|t| k == t || (t.ends_with('.') && k.starts_with(t.as_str())))
        });
    }
    take_ranges(profile, &host, name, |k| {
        taken
            .iter()
            .any(|t| k == t || (t.ends_with('.') && k.starts_with(t.as_str())))
    });
}

/// The host's `[ranges]` for the keys `taken` says the guest took from it, where the guest has none; each
/// reason names the host.
fn take_ranges(
    profile: &mut toml::Table,
    host: &toml::Table,
    name: &str,
    taken: impl Fn(&str) -> bool,
) {
    let Some(toml::Value::Table(theirs)) = host.get("ranges") else {
        return;
    };
    let mine = profile
        .entry("ranges")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    let toml::Value::Table(mine) = mine else {
        return;
    };
    for (k, v) in theirs.iter().filter(|(k, _)| taken(k)) {
        if mine.contains_key(k) {
            continue;
        }
        let mut v = v.clone();
        if let Some(toml::Value::String(why)) = v.get_mut("why") {
            *why = format!("host {name}: {why}");
        }
        mine.insert(k.clone(), v);
    }
}

/// The part of `over` whose keys `base` has (tables recursively; `profile` always).
fn shared_keys(over: &toml::Table, base: &toml::Table) -> toml::Table {
    let mut out = toml::Table::new();
    for (k, v) in over {
        match (v, base.get(k)) {
            (toml::Value::Table(o), Some(toml::Value::Table(b))) => {
                out.insert(k.clone(), toml::Value::Table(shared_keys(o, b)));
            }
            (v, Some(_)) => {
                out.insert(k.clone(), v.clone());
            }
            (v, None) if k == "profile" => {
                out.insert(k.clone(), v.clone());
            }
            _ => {}
        }
    }
    out
}

/// `key` is one of `[kvm]`'s (a host's costs, once `[hypervisor]` keys).
fn is_kvm_key(key: &str) -> bool {
    let schema = schemars::schema_for!(super::KvmProfile);
    schema
        .schema
        .object
        .is_some_and(|o| o.properties.contains_key(key))
}

fn deserialize(mut table: toml::Table) -> Result<Scenario, (Vec<String>, String)> {
    check_provenance(&table)?;
    with_platform_defaults(&mut table);
    let de = toml::Value::Table(table);
    let sc: Scenario = serde_path_to_error::deserialize(de).map_err(|e| {
        let path: Vec<String> = e
            .path()
            .iter()
            .filter_map(|s| match s {
                serde_path_to_error::Segment::Map { key } => Some(key.clone()),
                serde_path_to_error::Segment::Seq { index } => Some(index.to_string()),
                _ => None,
            })
            .collect();
        let mut msg = e.into_inner().message().to_string();
        if let [p, h, key] = &path[..] {
            if p == "platform"
                && h == "hypervisor"
                && msg.starts_with("unknown field")
                && is_kvm_key(key)
            {
                msg = format!(
                    "moved: a host's cost, now `platform.kvm.{key}` (the host profile's [kvm])"
                );
            }
        }
        (path, msg)
    })?;
    sc.validate()?;
    Ok(sc)
}

fn value_label(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The text of the `--set` flag that wrote key `path` when TOML read it as a number or boolean but the key
/// expects a string (`msg` is the deserializer's complaint), so it can be taken as written. The last flag for
/// a key is the value the key holds (profile keys too: overrides are merged over the profile).
fn set_as_written(path: &[String], msg: &str, overrides: &[(String, String)]) -> Option<String> {
    // serde's complaint for a plain string key, and toml's for a named choice (an enum).
    if !(msg.contains("expected a string") || msg.contains("expected string only")) {
        return None;
    }
    let (_, raw) = overrides
        .iter()
        .rev()
        .find(|(k, _)| input::split_key(k).is_ok_and(|kp| kp == path))?;
    matches!(
        input::parse_value(raw),
        toml::Value::Integer(_) | toml::Value::Float(_) | toml::Value::Boolean(_)
    )
    .then(|| raw.trim().to_string())
}

/// Load a scenario, apply `--set key=value` overrides, merge its platform profile and expand `[compare]`.
pub fn load(
    source: Source<'_>,
    overrides: &[(String, String)],
) -> Result<Vec<Variant>, InputError> {
    let (name, text, base) = match source {
        Source::Builtin(n) => {
            let Some((n, t)) = super::builtin_scenario(n) else {
                if let Some((_, new)) = super::RENAMED_BUILTINS.iter().find(|(old, _)| *old == n) {
                    return Err(InputError::new(
                        "scenario",
                        format!("`{n}` is now `{new}`: run it by that name"),
                    ));
                }
                let names: Vec<_> = BUILTIN_SCENARIOS.iter().map(|(n, _)| *n).collect();
                return Err(InputError::new(
                    "scenario",
                    format!(
                        "no built-in scenario `{n}` (built-in: {})",
                        names.join(", ")
                    ),
                ));
            };
            (format!("builtin:{n}"), t.to_string(), None)
        }
        Source::File(p) => (
            p.display().to_string(),
            read_named(p)?,
            p.parent().map(Path::to_path_buf),
        ),
        Source::Text { name, text } => (name.to_string(), text.to_string(), None),
    };
    let doc = SourceDoc::parse(&name, &text)?;
    let mut table = doc.table()?;

    for (k, raw) in overrides {
        let path =
            input::split_key(k).map_err(|m| InputError::new(format!("--set {k}={raw}"), m))?;
        input::set_path(&mut table, &path, input::parse_value(raw))
            .map_err(|m| InputError::new(format!("--set {k}={raw}"), m))?;
        forget_provenance(&mut table, &path);
        // Pinning a key on the command line removes it from the comparison.
        if path.first().map(String::as_str) != Some("compare") {
            if let Some(toml::Value::Table(c)) = table.get_mut("compare") {
                c.remove(&path.join("."));
                let quoted = path
                    .iter()
                    .map(|s| {
                        if s.contains('.') {
                            format!("\"{s}\"")
                        } else {
                            s.clone()
                        }
                    })
                    .collect::<Vec<_>>();
                input::remove_path(c, &quoted);
            }
        }
    }

    let mut origins = Origins {
        doc: &doc,
        profile: None,
        overrides,
    };
    let profile_doc;
    // The scenario's own [platform] keys (with --set's), to merge over another profile a variant names.
    let mut own_platform = toml::Table::new();
    match table
        .get("platform")
        .and_then(|p| p.as_table())
        .map(|p| p.get("profile"))
    {
        Some(Some(toml::Value::String(pname))) => {
            let pname = pname.clone();
            profile_doc = load_profile(&pname, base.as_deref()).map_err(|e| {
                if e.origin == "platform.profile" {
                    origins.error(&["platform".into(), "profile".into()], &e.msg)
                } else {
                    e
                }
            })?;
            let mut merged = profile_doc.table()?;
            if let Some(toml::Value::Table(p)) = table.remove("platform") {
                if p.contains_key("hypervisor") && !merged.contains_key("hypervisor") {
                    return Err(origins.error(
                        &["platform".into(), "hypervisor".into()],
                        &format!(
                            "expected no [hypervisor] keys: `{pname}` is a bare-metal profile (a guest \
                             profile, e.g. kvm-vtd-guest, names its host)"
                        ),
                    ));
                }
                if p.contains_key("ranges") {
                    return Err(origins.error(
                        &["platform".into(), "ranges".into()],
                        "ranges belong to a profile's constants: write them in a profile file's [ranges] \
                         (a scenario's value for a key is exact)",
                    ));
                }
                own_platform = p.clone();
                with_host(&mut merged, &p, table.get("workload"));
                let mut set = vec![];
                crate::hw::ranges::leaf_keys(&p, "", &mut set);
                input::merge(&mut merged, p);
                crate::hw::ranges::pin(&mut merged, &set);
            }
            table.insert("platform".into(), toml::Value::Table(merged));
            origins.profile = Some(&profile_doc);
        }
        Some(Some(_)) => {
            return Err(origins.error(
                &["platform".into(), "profile".into()],
                "expected a profile name or path (a string)",
            ))
        }
        _ => {
            return Err(origins.error(
                &["platform".into()],
                "expected `profile = \"NAME\"` in [platform] (built-in: vtd-server)",
            ))
        }
    }

    let mut axes = Vec::new();
    match table.remove("compare") {
        Some(toml::Value::Table(c)) => {
            compare_axes(&c, &[], &mut axes).map_err(|(p, m)| origins.error(&p, &m))?
        }
        Some(_) => {
            return Err(origins.error(
                &["compare".into()],
                "expected a table of `key.path = [values…]`",
            ))
        }
        None => {}
    }

    let base_sc = loop {
        match deserialize(table.clone()) {
            Ok(sc) => break sc,
            Err((p, m)) => match set_as_written(&p, &m, overrides) {
                // `--set os.kernel=6.10`: TOML reads a number, the key wants text; take it as written.
                Some(raw) => input::set_path(&mut table, &p, toml::Value::String(raw))
                    .map_err(|e| origins.error(&p, &e))?,
                None => return Err(origins.error(&p, &m)),
            },
        }
    };
    if axes.is_empty() {
        return Ok(vec![Variant {
            label: base_sc.os.policy.as_str().into(),
            overrides: vec![],
            scenario: base_sc,
        }]);
    }
    // Cartesian product of the axes, in the order written.
    let mut combos: Vec<Vec<(usize, usize)>> = vec![vec![]];
    for (ai, (_, vals)) in axes.iter().enumerate() {
        combos = combos
            .into_iter()
            .flat_map(|c| {
                (0..vals.len()).map(move |vi| {
                    let mut c = c.clone();
                    c.push((ai, vi));
                    c
                })
            })
            .collect();
    }
    if combos.len() > 4096 {
        return Err(origins.error(
            &["compare".into()],
            &format!("expected at most 4096 combinations, got {}", combos.len()),
        ));
    }
    let mut out = Vec::with_capacity(combos.len());
    for combo in combos {
        let mut t = table.clone();
        let mut ov = Vec::new();
        // Label parts, in axis order: a named setting's label, or (key, value).
        let mut parts: Vec<Result<String, (String, toml::Value)>> = Vec::new();
        for (ai, vi) in combo {
            let (path, vals) = &axes[ai];
            let cp = || {
                let mut cp = vec!["compare".to_string()];
                cp.extend(path.iter().cloned());
                cp
            };
            if let toml::Value::Table(named) = &vals[vi] {
                for (k, v) in named.iter().filter(|(k, _)| *k != "label") {
                    let kp = input::split_key(k).map_err(|m| origins.error(&cp(), &m))?;
                    // A key pinned with --set keeps the user's value.
                    if overrides
                        .iter()
                        .any(|(o, _)| input::split_key(o).is_ok_and(|op| op == kp))
                    {
                        continue;
                    }
                    input::set_path(&mut t, &kp, v.clone())
                        .map_err(|m| origins.error(&cp(), &m))?;
                    forget_provenance(&mut t, &kp);
                    ov.push((k.clone(), v.clone()));
                }
                parts.push(Ok(named["label"].as_str().unwrap_or_default().to_string()));
                continue;
            }
            input::set_path(&mut t, path, vals[vi].clone())
                .map_err(|m| origins.error(&cp(), &m))?;
            forget_provenance(&mut t, path);
            ov.push((path.join("."), vals[vi].clone()));
            parts.push(Err((path.join("."), vals[vi].clone())));
        }
        // A variant naming another profile: that profile, under the scenario's own platform keys and the
        // variant's.
        let profile_of = |t: &toml::Table| {
            t.get("platform")
                .and_then(|p| p.get("profile"))
                .and_then(|p| p.as_str())
                .map(str::to_string)
        };
        if let Some(pname) = profile_of(&t).filter(|n| Some(n) != profile_of(&table).as_ref()) {
            let doc = load_profile(&pname, base.as_deref()).map_err(|e| {
                InputError::new(
                    doc.locate(&["compare".into()]).0,
                    format!("platform.profile {pname}: {}", e.msg),
                )
            })?;
            let mut merged = doc.table()?;
            // The scenario's platform keys the named profile has; one it lacks configures another vendor
            // (an [iommu.smmuv3] key beside a virtio-iommu variant) and is left out of that variant.
            with_host(&mut merged, &own_platform, t.get("workload"));
            let shared = shared_keys(&own_platform, &merged);
            let mut set = vec![];
            crate::hw::ranges::leaf_keys(&shared, "", &mut set);
            input::merge(&mut merged, shared);
            crate::hw::ranges::pin(&mut merged, &set);
            let mut fresh = t.clone();
            fresh.insert("platform".into(), toml::Value::Table(merged));
            for (k, v) in ov.iter().filter(|(k, _)| k.starts_with("platform.")) {
                let kp = input::split_key(k).map_err(|m| InputError::new("compare", m))?;
                input::set_path(&mut fresh, &kp, v.clone())
                    .map_err(|m| InputError::new("compare", m))?;
            }
            // What [provenance] said of keys the variant's profile lacks goes with them.
            let gone: Vec<Vec<String>> = fresh
                .get("provenance")
                .and_then(|p| p.as_table())
                .map(|p| {
                    p.keys()
                        .filter_map(|k| input::split_key(k).ok())
                        .filter(|kp| kp[0] == "platform" && !input::has_path(&fresh, kp))
                        .collect()
                })
                .unwrap_or_default();
            for kp in gone {
                forget_provenance(&mut fresh, &kp);
            }
            t = fresh;
        }
        // A key a variant sets is its value, exact.
        if let Some(toml::Value::Table(p)) = t.get_mut("platform") {
            let set: Vec<String> = ov
                .iter()
                .filter_map(|(k, _)| k.strip_prefix("platform.").map(str::to_string))
                .collect();
            crate::hw::ranges::pin(p, &set);
        }
        // Named settings lead the label ("strict-cm rx vhost=on").
        parts.sort_by_key(|p| p.is_err());
        let sc = deserialize(t).map_err(|(p, m)| {
            let axis = ov.iter().find(|(k, _)| p.join(".").starts_with(k.as_str()));
            match axis {
                Some((k, v)) => {
                    let mut cp = vec!["compare".to_string()];
                    cp.extend(input::split_key(k).unwrap_or_default());
                    let (qloc, qfull) = doc.locate(&["compare".into(), k.clone()]);
                    let loc = if qfull { qloc } else { doc.locate(&cp).0 };
                    InputError::new(loc, format!("compare `{k}` value {v}: {m}"))
                }
                None => origins.error(&p, &m),
            }
        })?;
        // With a named axis: its labels, names as they are, flags as key=on|off, numbers as key=value
        // ("strict-cm rx vhost=on"). Otherwise one axis of names (policies, kernels) reads as its value; a
        // flag or a number needs its key.
        let label = if parts.iter().any(|p| p.is_ok()) {
            parts
                .iter()
                .map(|p| match p {
                    Ok(l) => l.clone(),
                    Err((_, toml::Value::String(v))) => v.clone(),
                    Err((k, v)) => {
                        let k = k.rsplit('.').next().unwrap_or(k);
                        match v.as_bool() {
                            Some(b) => format!("{k}={}", if b { "on" } else { "off" }),
                            None => format!("{k}={}", value_label(v)),
                        }
                    }
                })
                .collect::<Vec<_>>()
                .join(" ")
        } else if ov.len() == 1 && ov[0].1.is_str() {
            value_label(&ov[0].1)
        } else {
            ov.iter()
                .map(|(k, v)| format!("{}={}", k.rsplit('.').next().unwrap_or(k), value_label(v)))
                .collect::<Vec<_>>()
                .join(" ")
        };
        out.push(Variant {
            label,
            overrides: ov,
            scenario: sc,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 4: a scenario or profile path naming a device or a FIFO was read without end, or blocked.
    #[test]
    fn a_scenario_that_is_not_a_regular_file_is_refused_before_it_is_read() {
        let dir = std::env::temp_dir();
        let e = load(Source::File(&dir), &[]).unwrap_err();
        let want = format!("{}: a directory; expected a TOML file", dir.display());
        assert_eq!(e.to_string(), want);
    }

    /// Issue 4: a file of any size was read whole.
    #[test]
    fn a_scenario_file_over_the_bound_is_refused() {
        let p = std::env::temp_dir().join(format!("iommulab-big-{}.toml", std::process::id()));
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(MAX_INPUT_FILE_BYTES + 1).unwrap(); // sparse: nothing is written
        let e = load(Source::File(&p), &[]).unwrap_err();
        std::fs::remove_file(&p).unwrap();
        let want = format!(
            "{}: larger than 16777216 bytes; expected a TOML file",
            p.display()
        );
        assert_eq!(e.to_string(), want);
    }

    /// Issue 64 item 10: the `seed…` names meant nothing to a user; an old name is refused, naming the new one.
    #[test]
    fn a_renamed_builtin_is_refused_naming_its_new_name() {
        let e = load(Source::Builtin("seed004"), &[]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "scenario: `seed004` is now `iotlb-sync-map`: run it by that name"
        );
        assert!(load(Source::Builtin("iotlb-sync-map"), &[]).is_ok());
    }
}
