"""Entry point every training process runs (torchrun workers included).

Applies the device layer and the speculators patches in *this* process, then
hands the remaining argv to speculators' own train main -- so the trainer is
always the real one, and patches are never forgotten on a worker.

A crashed fix probe stops the process before speculators runs: one line
`dspark-kit: refusing to train: speculators fix NAME: probe failed: ...` on
stderr and exit code PROBE_FAILED_EXIT (dspark_kit.stages.training.train.training_failure
turns that line into the train stage's error).
"""

from __future__ import annotations

import sys

PROBE_FAILED_EXIT = 3
REFUSAL_PREFIX = "dspark-kit: refusing to train: "


def eager_on_cpu() -> bool:
    """CPU training on a host that has CUDA: keep torch.compile off in this process.

    speculators compiles DSpark's forward whenever CUDA is available, whatever
    device the tensors are on; CPU tensors would go through Inductor's C++ build
    (minutes, or a hang). On a CPU-only host speculators never compiles, so
    this keeps CPU training the same everywhere. Returns whether it switched.
    """
    import torch

    if not torch.cuda.is_available():
        return False
    torch.compiler.set_stance("force_eager")
    return True


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
    from dspark_kit.specdec.checkpoints import set_aside_incomplete_checkpoints

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
    from dspark_kit.compat.patches import ProbeFailed, apply_for_training
    from dspark_kit.devices import detect_device

    resolved = detect_device(device)
    if resolved == "cpu":
        eager_on_cpu()
    try:
        applied = apply_for_training(resolved)
    except ProbeFailed as e:
        print(f"{REFUSAL_PREFIX}{e}", file=sys.stderr, flush=True)
        raise SystemExit(PROBE_FAILED_EXIT) from None
    if applied:
        print(f"dspark-kit: applied patches {applied}", file=sys.stderr)
    from speculators.train.cli import main as speculators_main
    from speculators.train.config import TrainConfig

    speculators_main(TrainConfig.resolve(argv))


if __name__ == "__main__":
    main()
