"""Baseline for bench_train.py: plain `speculators train` plus only the CPU device patches.

    .venv/bin/python benchmarks/plain_speculators_train.py SPECULATORS_TRAIN_FLAGS...

speculators 0.9.0 cannot train on a CPU as shipped (it moves the model to a CUDA
rank, autocasts and seeds CUDA), so the baseline applies dspark-kit's device
patches directly -- no probes, no device detection, no launcher, no log tee -- and
then calls speculators' own train main, exactly what `speculators train` runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    from dspark_kit.compat.patches import FIXES, _replace

    for fix in FIXES:
        if fix.name.startswith("device-") and "cpu" in fix.devices:
            for owner, attr, value in fix.patch("cpu"):
                _replace(owner, attr, value)
    from speculators.train.cli import main as speculators_main
    from speculators.train.config import TrainConfig

    speculators_main(TrainConfig.resolve(sys.argv[1:]))


if __name__ == "__main__":
    main()
