"""Generate docs/scenario-reference.md from the scenario schema: every key with its type, default, valid range
and meaning. Keys, types, defaults and meanings come from the Rust types (their JSON Schema, via schemars: field
doc comments, serde defaults); the valid ranges from the loader's checks in scenario/*.rs and from each IOMMU
driver's checks of its own profile section in hw/*.rs (each names its key and says what it expects). tests/test_readme.py fails when the committed page differs from what this writes.

    python tools/scenario_reference.py > docs/scenario-reference.md
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).parent.parent
SCENARIO_DIR = ROOT / "crates/iommulab-core/src/scenario"
HW_DIR = ROOT / "crates/iommulab-core/src/hw"
# Tables in the order a scenario file has them.
ORDER = ["run", "platform", "os", "workload", "hypervisor", "attack", "provenance", "compare"]


def _consts(src: str) -> dict[str, str]:
    """`const NAME: T = VALUE;` of the schema's sources (MAX_CPUS, MIN_LINE_RATE_GBPS, …)."""
    out = {}
    for m in re.finditer(r"const ([A-Z_][A-Z0-9_]*): [^=]+= ([^;]+);", src):
        out[m.group(1)] = m.group(2).strip().replace("_", "")
    return out


def checks(src: str | None = None, hw: str | None = None) -> dict[str, list[str]]:
    """What the loader expects of each key: the `expected …` message of every check naming it."""
    src = src if src is not None else "\n".join(p.read_text() for p in sorted(SCENARIO_DIR.glob("*.rs")))
    consts = _consts(src)
    out: dict[str, list[str]] = {}
    pat = r'check\(\s*(?:[^;]*?),\s*"([a-z_.0-9]+)",\s*(?:format!\(\s*)?"((?:[^"\\]|\\.)*)"'
    found = re.findall(pat, src, re.S)
    if hw is None:
        hw = "\n".join(p.read_text().split("#[cfg(test)]")[0] for p in sorted(HW_DIR.glob("*.rs")))
    # A driver's check names the key under platform.iommu: Err(("vtd.mamv", "expected …".into())).
    drv = r'Err\(\(\s*"([a-z_.0-9]+)",\s*(?:format!\(\s*)?"(expected (?:[^"\\]|\\.)*)"'
    found += [(f"platform.iommu.{k}", m) for k, m in re.findall(drv, hw, re.S)]
    # And the kernels it exists in (Driver::check_kernel): Err("expected …").
    for body in re.findall(r"fn check_kernel\(.*?\n    }\n", hw, re.S):
        found += [("os.kernel", m) for m in re.findall(r'Err\(\s*"(expected (?:[^"\\]|\\.)*)"', body, re.S)]
    for key, msg in found:
        msg = re.sub(r"\\\n\s*", "", msg).replace('\\"', '"')
        msg = re.sub(r"\{([A-Z_][A-Z0-9_]*)\}", lambda m: consts.get(m.group(1), m.group(0)), msg)
        msg = re.sub(r"\{[a-z_]*\}", "…", msg)
        msg = re.sub(r"^expected ", "", msg)
        out.setdefault(key, [])
        if msg not in out[key]:
            out[key].append(msg)
    return out


def _resolve(defs: dict, node: dict) -> tuple[dict, bool]:
    """The schema a property refers to, and whether it may be omitted (an Option)."""
    optional = False
    while True:
        if "$ref" in node:
            node = defs[node["$ref"].rsplit("/", 1)[-1]] | {k: v for k, v in node.items() if k != "$ref"}
            continue
        if "allOf" in node and len(node["allOf"]) == 1:
            node = {**node["allOf"][0], **{k: v for k, v in node.items() if k != "allOf"}}
            continue
        if "anyOf" in node:
            alts = [a for a in node["anyOf"] if a.get("type") != "null"]
            if len(alts) == 1 and len(node["anyOf"]) == 2:
                optional = True
                node = {**alts[0], **{k: v for k, v in node.items() if k != "anyOf"}}
                continue
        t = node.get("type")
        if isinstance(t, list) and "null" in t:
            optional = True
            node = {**node, "type": [x for x in t if x != "null"][0]}
            continue
        return node, optional


def _enum_values(node: dict) -> list[str] | None:
    if "enum" in node:
        return [str(v) for v in node["enum"]]
    if "oneOf" in node:
        vals = []
        for alt in node["oneOf"]:
            if "enum" in alt:
                vals += [str(v) for v in alt["enum"]]
            else:
                return None
        return vals
    return None


def _type(defs: dict, node: dict) -> str:
    node, _ = _resolve(defs, node)
    vals = _enum_values(node)
    if vals:
        return " \\| ".join(f"`{v}`" for v in vals)
    t = node.get("type")
    if t == "array":
        return "list of " + _type(defs, node.get("items", {}))
    if t == "object":
        return "table"
    if t == "integer":
        return "integer"
    if t == "number":
        return "number"
    return {"boolean": "bool", "string": "string"}.get(t, str(t))


def _is_table(defs: dict, node: dict) -> bool:
    node, _ = _resolve(defs, node)
    return node.get("type") == "object" and "properties" in node


def _default(node: dict, required: bool, optional: bool) -> str:
    if "default" in node and node["default"] is not None:
        d = node["default"]
        return "`" + (json.dumps(d) if not isinstance(d, str) else f'"{d}"') + "`"
    if required and not optional:
        return "required"
    return "omitted"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def rows(schema: dict) -> list[tuple[str, list[tuple[str, str, str, str, str]]]]:
    """(table, [(key, type, default, valid, meaning)]) for every table, depth first."""
    defs = schema["definitions"]
    expect = checks()
    out: list[tuple[str, list]] = []

    def table(path: str, node: dict) -> None:
        node, _ = _resolve(defs, node)
        keys, subs = [], []
        req = set(node.get("required", []))
        for k, prop in node["properties"].items():
            full = f"{path}.{k}" if path else k
            if _is_table(defs, prop):
                subs.append((full, prop))
                continue
            target, optional = _resolve(defs, prop)
            valid = "; ".join(expect.get(full, []))
            if not valid and target.get("type") == "integer":
                valid = "≥ 0" if target.get("minimum", -1) == 0 else ""
            desc = prop.get("description") or target.get("description") or ""
            keys.append((k, _type(defs, prop), _default(prop, k in req, optional), valid, desc))
        if keys:
            out.append((path, keys))
        for full, prop in subs:
            table(full, prop)

    top = schema
    for name in ORDER:
        prop = top["properties"].get(name)
        if prop is None:
            continue
        if _is_table(defs, prop):
            table(name, prop)
        else:
            t, _ = _resolve(defs, prop)
            desc = prop.get("description") or ""
            ap = t.get("additionalProperties")
            kind = "string" if isinstance(ap, dict) and ap.get("type") == "string" else "values"
            out.append((name, [("(keys)", f"table of {kind}", "empty", "", desc)]))
    rest = [k for k in top["properties"] if k not in ORDER]
    if rest:
        out.insert(0, ("", [(k, _type(defs, top["properties"][k]),
                             _default(top["properties"][k], k in top.get("required", []), False), "",
                             top["properties"][k].get("description", "")) for k in rest]))
    return out


def render(schema: dict) -> str:
    lines = ["# Scenario reference", "",
             "Every key a scenario (and a platform profile, whose tables are the scenario's `platform.*`) can hold:",
             "its type, its default (`required`: the scenario or its profile must give it; `omitted`: absent unless",
             "given), what the loader accepts, and what it means. Generated from the schema by",
             "`python tools/scenario_reference.py > docs/scenario-reference.md`; a test keeps it current. The",
             "format, with an example, and the output keys are in [scenarios.md](scenarios.md).", ""]
    for path, keys in rows(schema):
        lines += [f"## `[{path}]`" if path else "## top level", "",
                  "| key | type | default | valid | meaning |", "|---|---|---|---|---|"]
        for k, t, d, v, m in keys:
            lines.append(f"| `{k}` | {t} | {d} | {_cell(v)} | {_cell(m)} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    from iommulab import _core

    sys.stdout.write(render(json.loads(_core.scenario_schema())))


if __name__ == "__main__":
    main()
