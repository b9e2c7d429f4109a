//! A profile's `[ranges]`: how far each of its constants may be from the value it holds, and why. The value is
//! the model's point; the range is what the profile's sources allow (a source's own spread, what a calibration
//! leaves free, the spread of comparable hardware for an estimate). Ranged runs sample within them.
//!
//! Ranges belong to a profile's constants: a scenario neither sets nor narrows one, and a key a scenario
//! (or `--set`, or a `[compare]` axis) sets is the user's value, known, and loses its range.

use crate::input;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// One constant's range: absolute bounds in the key's own unit, or a factor around its value (a list's every
/// element scaled alike).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ConstRange {
    /// The lowest value the sources allow (with `high`; low <= value <= high).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub low: Option<f64>,
    /// The highest value the sources allow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub high: Option<f64>,
    /// `[a, b]` with a <= 1 <= b: the value times a to times b.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub factor: Option<[f64; 2]>,
    /// Why these bounds: "exact: …", "sourced: …", "calibrated: …" or "estimate: …".
    pub why: String,
}

/// The numbers a key holds: one, or a list's (None: not a number or a list of numbers).
fn numbers(v: &toml::Value) -> Option<Vec<f64>> {
    match v {
        toml::Value::Integer(i) => Some(vec![*i as f64]),
        toml::Value::Float(f) => Some(vec![*f]),
        toml::Value::Array(a) => a
            .iter()
            .map(|x| x.as_float().or_else(|| x.as_integer().map(|i| i as f64)))
            .collect(),
        _ => None,
    }
}

/// Check a profile's `[ranges]` against its own values: each names a number (or a list of numbers) the
/// profile sets, has one form, and holds the value. Err: the key path under the profile and what was expected.
pub fn check(profile: &toml::Table) -> Result<(), (Vec<String>, String)> {
    let expected =
        "expected a table of `\"section.key\" = { low, high, why }` or `{ factor = [a, b], why }`";
    let Some(ranges) = input::optional_table(profile, "ranges", expected)? else {
        return Ok(());
    };
    for (key, v) in ranges {
        let at = vec!["ranges".to_string(), key.clone()];
        let r: ConstRange = v
            .clone()
            .try_into()
            .map_err(|e: toml::de::Error| (at.clone(), e.message().to_string()))?;
        let Some(vals) = input::split_key(key)
            .ok()
            .filter(|path| path[0] != "ranges")
            .and_then(|path| input::get_path(profile, &path))
            .and_then(numbers)
        else {
            return Err((at, format!("`{key}` is not a number the profile sets")));
        };
        if r.why.trim().is_empty() {
            return Err((at, "expected a reason in `why`".into()));
        }
        let finite = |x: f64| x.is_finite() && x >= 0.0;
        match (r.low, r.high, r.factor) {
            (Some(lo), Some(hi), None) => {
                if vals.len() != 1 {
                    return Err((at, "a list's range is a factor: `factor = [a, b]`".into()));
                }
                if !(finite(lo) && finite(hi) && lo <= vals[0] && vals[0] <= hi) {
                    return Err((
                        at,
                        format!("expected 0 <= low <= {} <= high, finite", vals[0]),
                    ));
                }
            }
            (None, None, Some([a, b])) => {
                if !(a > 0.0 && a <= 1.0 && b >= 1.0 && b.is_finite()) {
                    return Err((at, "expected factor = [a, b] with 0 < a <= 1 <= b".into()));
                }
            }
            _ => {
                return Err((
                    at,
                    "expected either `low` and `high`, or `factor = [a, b]`".into(),
                ))
            }
        }
    }
    Ok(())
}

/// Every leaf key (dotted) a table sets: a scenario's own `[platform]` keys, which pin their ranges.
pub fn leaf_keys(t: &toml::Table, prefix: &str, out: &mut Vec<String>) {
    for (k, v) in t {
        let key = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        match v {
            toml::Value::Table(inner) => leaf_keys(inner, &key, out),
            _ => out.push(key),
        }
    }
}

/// A key the scenario sets is the user's value: its range goes.
pub fn pin(platform: &mut toml::Table, keys: &[String]) {
    if let Some(toml::Value::Table(r)) = platform.get_mut("ranges") {
        for k in keys {
            r.remove(k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(ranges: &str) -> toml::Table {
        toml::from_str(&format!(
            "[cpu]\npte_ns = 15\n[iommu]\npwc_entries = [4, 28]\n[ranges]\n{ranges}"
        ))
        .unwrap()
    }

    #[test]
    fn a_range_holds_its_value_names_a_number_and_gives_a_reason() {
        assert!(check(&profile(
            "\"cpu.pte_ns\" = { low = 5, high = 40, why = \"estimate\" }"
        ))
        .is_ok());
        assert!(check(&profile(
            "\"iommu.pwc_entries\" = { factor = [0.25, 4], why = \"estimate\" }"
        ))
        .is_ok());
        let err = |r: &str| check(&profile(r)).unwrap_err().1;
        assert!(err("\"cpu.pte_ns\" = { low = 20, high = 40, why = \"x\" }").contains("15"));
        assert!(err("\"cpu.pte_ns\" = { low = 5, high = 40, why = \" \" }").contains("reason"));
        assert!(err("\"cpu.nope\" = { low = 5, high = 40, why = \"x\" }").contains("not a number"));
        assert!(err("\"cpu.pte_ns\" = { factor = [2, 4], why = \"x\" }").contains("0 < a <= 1"));
        assert!(err("\"cpu.pte_ns\" = { low = 5, why = \"x\" }").contains("either"));
        assert!(
            err("\"iommu.pwc_entries\" = { low = 1, high = 40, why = \"x\" }").contains("factor")
        );
        assert!(
            err("\"cpu.pte_ns\" = { low = 5, high = 40, why = \"x\", wide = 1 }").contains("wide")
        );
    }

    #[test]
    fn a_set_key_loses_its_range() {
        let mut p = profile("\"cpu.pte_ns\" = { low = 5, high = 40, why = \"x\" }");
        pin(&mut p, &["cpu.pte_ns".into()]);
        assert!(p["ranges"].as_table().unwrap().is_empty());
    }
}
