"""Entry point every training process runs (torchrun workers included).

Applies the device layer and the speculators patches in *this* process, then
hands the remaining argv to speculators' own train main -- so the trainer is
always the real one, and patches are never forgotten on a worker.
"""

from __future__ import annotations

import sys


def _set_aside_half_written(argv: list[str]) -> None:
    """Global rank 0, before the process group starts: a torchrun restart resumes from a whole epoch.

    `dspark-kit train` does this before launching; a worker restarted by
    torchrun (train.max_restarts) comes back here without it. Other ranks scan
    the checkpoints only after init_process_group, which waits for rank 0.
    """
    import os
    from pathlib import Path

    if os.environ.get("RANK", "0") != "0" or "--save-path" not in argv:
        return
    from dspark_kit.train import set_aside_incomplete_checkpoints

    save = Path(argv[argv.index("--save-path") + 1])
    if save.is_dir():
        for d in set_aside_incomplete_checkpoints(save):
            print(f"dspark-kit: {d.name} was cut off mid-save; resuming from the last whole epoch", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    device = "auto"
    if "--dspark-device" in argv:
        i = argv.index("--dspark-device")
        device = argv[i + 1]
        del argv[i : i + 2]
    _set_aside_half_written(argv)
    from dspark_kit.devices import detect_device
    from dspark_kit.patches import apply_for_training

    applied = apply_for_training(detect_device(device))
    if applied:
        print(f"dspark-kit: applied patches {applied}", file=sys.stderr)
    from speculators.train.cli import main as speculators_main
    from speculators.train.config import TrainConfig

    speculators_main(TrainConfig.resolve(argv))


if __name__ == "__main__":
    main()
