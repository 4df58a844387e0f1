"""The base-model manifest as data: what a site reports at discovery and how two compare.

Torch-free (plain dicts, JSON-ready), so that the coordinator's check (federation/coordinator/
manifest_check.py) needs no model. `layout.Layout.manifest` makes one from a model.
"""

from __future__ import annotations

MANIFEST_VERSION = 1


def manifest_mismatch(expected: dict, got: dict) -> str | None:
    """Why a site's manifest cannot join the coordinator's (None when it can): for the federation's
    first-round check. Names the first differing tensor or the frozen-weights fingerprints, and the fix."""
    if got.get("version") != expected.get("version"):
        return (f"manifest version {got.get('version')!r}, the coordinator's is {expected.get('version')!r}: "
                "run the same sovereign-fl version on the site as on the coordinator")
    want = {n: (d, tuple(s)) for n, d, s, _ in expected.get("exchanged", [])}
    have = {n: (d, tuple(s)) for n, d, s, _ in got.get("exchanged", [])}
    fix = ("; start the site with the coordinator's workload (the same model architecture, dtype and LoRA "
           "options)")
    if want != have:
        missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
        if missing or extra:
            return f"exchanged tensors differ: missing {missing[:5]}, unexpected {extra[:5]}{fix}"
        name = next(n for n in want if want[n] != have[n])
        return (f"exchanged tensor {name}: site has {have[name][0]}{list(have[name][1])}, "
                f"coordinator {want[name][0]}{list(want[name][1])}{fix}")
    fw, fg = expected.get("frozen", {}), got.get("frozen", {})
    if fw.get("sha256") != fg.get("sha256"):
        return (f"frozen base weights differ: site {fg.get('tensors')} tensor(s), {fg.get('numel')} values, sha256 "
                f"{str(fg.get('sha256'))[:16]}; coordinator {fw.get('tensors')} tensor(s), {fw.get('numel')} values, "
                f"sha256 {str(fw.get('sha256'))[:16]}: start the site from the coordinator's base model")
    return None
