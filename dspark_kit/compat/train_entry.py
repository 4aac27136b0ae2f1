"""Entry point every training process runs (torchrun workers included).

Applies the device layer and the speculators patches in *this* process, then
hands the remaining argv to speculators' own train main -- so the trainer is
always the real one, and patches are never forgotten on a worker.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    device = "auto"
    if "--dspark-device" in argv:
        i = argv.index("--dspark-device")
        device = argv[i + 1]
        del argv[i : i + 2]
    from dspark_kit.compat.patches import apply_for_training
    from dspark_kit.devices import detect_device

    applied = apply_for_training(detect_device(device))
    if applied:
        print(f"dspark-kit: applied patches {applied}", file=sys.stderr)
    from speculators.train.cli import main as speculators_main
    from speculators.train.config import TrainConfig

    speculators_main(TrainConfig.resolve(argv))


if __name__ == "__main__":
    main()
