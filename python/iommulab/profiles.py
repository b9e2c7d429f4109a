"""``iommulab profiles NAME``: a platform profile as a reader wants it, each constant with its value, its range
and where both come from (``--toml``: the file as it is, to copy and edit)."""

from __future__ import annotations

import json
import tomllib
from typing import Any, Mapping

from .report import wrap


def _leaves(t: Mapping[str, Any], prefix: str = "") -> list[tuple[str, str, Any]]:
    """(section, key, value) of every setting, section by section in the file's order."""
    out, subs = [], []
    for k, v in t.items():
        if k in ("sources", "ranges") and not prefix:
            continue
        if isinstance(v, Mapping):
            subs.append((k, v))
        elif prefix:
            out.append((prefix, k, v))
    for k, v in subs:
        out += _leaves(v, f"{prefix}.{k}" if prefix else k)
    return out


def range_text(value: Any, r: Mapping[str, Any] | None) -> str:
    """A constant's range as `low – high` in its unit, `×a – ×b` for a factor, `exact`."""
    if not r:
        return ""
    if "factor" in r:
        a, b = r["factor"]
        return "exact" if a == b == 1 else f"×{a:g} – ×{b:g}"
    lo, hi = r["low"], r["high"]
    return "exact" if lo == hi else f"{lo:g} – {hi:g}"


def format_profile(name: str, text: str) -> str:
    d = tomllib.loads(text)
    sources, ranges = d.get("sources") or {}, d.get("ranges") or {}
    lines = wrap(f"{name}: {d.get('description', '')}", "  ")
    lines += [f"vendor {d.get('vendor', '?')} · each constant: value, range; then its source and the range's "
              "reason", "(--toml: the file as it is)"]
    section = None
    for sec, k, v in _leaves(d):
        if sec != section:
            section = sec
            lines += ["", f"[{sec}]"]
        key = f"{sec}.{k}"
        shown = json.dumps(v) if isinstance(v, (bool, list, str)) else f"{v:g}" if isinstance(v, float) else str(v)
        rng = range_text(v, ranges.get(key))
        lines.append(f"{k} = {shown}" + (f"    range {rng}" if rng else ""))
        if key in sources:
            lines += wrap(f"source: {sources[key]}", "      ", "    ")
        if key in ranges:
            lines += wrap(f"range: {ranges[key]['why']}", "      ", "    ")
    return "\n".join(lines) + "\n"
