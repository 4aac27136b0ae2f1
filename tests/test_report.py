"""Run report from tensorboard events written by speculators' own logger, plus eval/bench files."""

from __future__ import annotations

import json
import logging
import os
import re

import pytest
import typer
from typer.testing import CliRunner

from dspark_kit.measure.bench_tables import compare
from dspark_kit.stages.reporting.report import build_report, read_scalars, val_by_epoch

# per-epoch validation values (the reference Ascend run's numbers, docs/CONCEPTS.md#long-context) and per-position accuracies
VAL = {
    0: {"loss_epoch": 1.52, "accept_len_epoch": 1.834, "accept_rate_epoch": 0.277, "full_acc_epoch": 0.336,
        "position_0_acc_epoch": 0.494, "position_1_acc_epoch": 0.402},
    1: {"loss_epoch": 1.366, "accept_len_epoch": 2.067, "accept_rate_epoch": 0.328, "full_acc_epoch": 0.404,
        "position_0_acc_epoch": 0.575, "position_1_acc_epoch": 0.481},
}
STEPS_PER_EPOCH = 5


def _log_like_trainer(log):
    """The Trainer's logging sequence (speculators 0.9.0 train/trainer.py) through `log(dict, step)`."""
    step = 0
    for epoch, val in VAL.items():
        for _ in range(STEPS_PER_EPOCH):
            log({"train": {"loss": 3.0 - 0.1 * step, "accept_len": 1.5}, "epoch": epoch, "lr": 3e-4,
                 "global_step": step}, step)
            step += 1
        log({"val": val, "epoch": epoch}, step)


def _write_speculators_logs(log_dir):
    """Event files from speculators' real TensorBoardHandler (slow: imports speculators)."""
    from speculators.train.logger import TensorBoardHandler

    handler = TensorBoardHandler(log_dir=log_dir, run_name="run0")
    logger = logging.getLogger("test_report.metrics")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.addHandler(handler)
    try:
        _log_like_trainer(lambda d, step: logger.info(d, extra={"step": step}))
    finally:
        handler.close()
        logger.removeHandler(handler)


def _write_logs(log_dir):
    """The same tags written with SummaryWriter directly (the handler flattens with '/')."""
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(log_dir=str(log_dir / "run0"))

    def log(d, step, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                log(v, step, f"{prefix}{k}/")
            else:
                w.add_scalar(prefix + k, v, global_step=step)

    _log_like_trainer(log)
    w.close()


@pytest.mark.slow
def test_scalars_from_real_speculators_logger(tmp_path):
    _write_speculators_logs(tmp_path / "logs")
    scalars = read_scalars(tmp_path / "logs")
    assert "val/accept_len_epoch" in scalars and "train/loss" in scalars
    assert len(scalars["train/loss"]) == STEPS_PER_EPOCH * len(VAL)
    epochs = val_by_epoch(tmp_path, scalars)
    assert sorted(epochs) == [0, 1]
    assert epochs[1]["accept_len_epoch"] == pytest.approx(2.067, rel=1e-6)
    assert epochs[0]["position_1_acc_epoch"] == pytest.approx(0.402, rel=1e-6)


def test_full_report(tmp_path):
    run = tmp_path / "run"
    _write_logs(run / "logs")
    ck = run / "checkpoints"
    (ck / "1").mkdir(parents=True)
    override = dict(VAL[1], accept_len_epoch=2.5)  # the checkpoint's own json wins over the log
    (ck / "1" / "val_metrics.json").write_text(json.dumps(override))
    os.symlink("1", ck / "checkpoint_best")
    os.symlink("1", ck / "epoch1_end")  # symlinks are not extra epochs
    (run / "eval").mkdir()
    (run / "eval" / "ctx.json").write_text(json.dumps(
        {"results": [{"context_length": 512, "acceptance_length": 3.25, "per_position_acceptance": [0.9, 0.7]}]}))
    (run / "bench").mkdir()
    (run / "bench" / "vllm_ckpt1.json").write_text(json.dumps({
        "output_throughput": 95.6, "mean_tpot_ms": 94.2, "max_concurrency": 10, "completed": 10, "failed": 0,
        "spec_decode_num_drafts": 10832, "spec_decode_accepted_tokens": 9647, "spec_decode_draft_tokens": 75824,
        "spec_decode_acceptance_rate": 12.72, "spec_decode_acceptance_length": 1.891,
        "spec_decode_per_position_acceptance_rates": [0.493, 0.227, 0.098]}))
    (run / "bench" / "broken.json").write_text("{")

    md_path = build_report(run)
    assert md_path == run / "report" / "report.md"
    md = md_path.read_text()
    rows: dict[str, list[str]] = {}
    for line in md.splitlines():
        if line.startswith("| "):  # first table's header wins ("metric" heads two tables)
            rows.setdefault(line.split("|")[1].strip(), [c.strip() for c in line.split("|")[2:-1]])
    assert rows["metric"][:2] == ["epoch 0", "epoch 1 (best)"]
    assert rows["accept_len"] == ["1.834", "2.500"]
    assert rows["pos1 acc"] == ["0.402", "0.481"]
    assert rows["acceptance length"] == ["1.891"]
    assert rows["acceptance rate (%)"] == ["12.72"]
    assert rows["pos2 rate"] == ["0.0980"]
    assert rows["drafts / accepted"] == ["10832 / 9647"]
    assert rows["ctx @ 512"][0] == "3.250"
    assert "skipped:" in md and "broken.json" in md
    for img in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md):
        assert (md_path.parent / img).stat().st_size > 1000
    assert len(re.findall(r"!\[", md)) == 3  # train loss, val accept_len, per-position bars


def test_empty_run_reports_not_run(tmp_path):
    md = build_report(tmp_path).read_text()
    assert md.count("not run") == 3
    with pytest.raises(FileNotFoundError, match="RUN_DIR"):
        build_report(tmp_path / "nope")


def test_report_cli_out_file(tmp_path):
    from dspark_kit.cli import report as report_cli

    _write_logs(tmp_path / "run" / "logs")
    app = typer.Typer()
    report_cli.register(app)
    app.command("noop")(lambda: None)
    out = tmp_path / "elsewhere" / "r.md"
    res = CliRunner().invoke(app, ["report", str(tmp_path / "run"), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == str(out)
    for img in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", out.read_text()):  # links resolve from the md
        assert (out.parent / img).is_file()


def test_compare_labels_and_missing_spec(tmp_path):
    ours = {"schema": "dspark-kit.bench/1", "label": "x", "output_throughput": 50.0, "spec_decode": None,
            "streamed": False}
    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text(json.dumps(ours))
    md, written = compare([tmp_path / "a.json", tmp_path / "b.json"])
    assert written == []
    assert md.splitlines()[0] == "| metric | x | x#2 |"
    assert "no speculative drafts" in md and "did not stream" in md


def test_report_plots_acceptance_vs_context_with_and_without_window(tmp_path):
    """window tune's measurements (and eval.json runs) become one line per window setting."""
    from dspark_kit.stages.reporting.report import context_series

    (tmp_path / "eval").mkdir()
    meas = [{"window": w, "k": 4, "context_length": c, "acceptance_length": al}
            for w, c, al in [(None, 0, 3.5), (None, 1024, 1.8), (None, 2048, 1.6),
                             (256, 0, 3.5), (256, 1024, 2.5), (256, 2048, 1.9)]]
    (tmp_path / "eval" / "window_tune.json").write_text(json.dumps(
        {"recommended_window": 256, "measurements": meas, "acceptance_length": {}}))
    (tmp_path / "eval" / "eval.json").write_text(json.dumps(
        {"runs": [{"context_length": 0, "window": None, "acceptance_length": 3.4},
                  {"context_length": 512, "window": None, "acceptance_length": 2.4}]}))
    series = context_series(tmp_path)
    assert series["window 256"] == {0: 3.5, 1024: 2.5, 2048: 1.9}
    assert series["no window"] == {0: 3.5, 512: 2.4, 1024: 1.8, 2048: 1.6}  # tune wins over eval at 0
    md = build_report(tmp_path).read_text()
    assert "![AL vs context](context_window.png)" in md
    assert (tmp_path / "report" / "context_window.png").stat().st_size > 0


def test_report_reads_older_window_tune_files(tmp_path):
    from dspark_kit.stages.reporting.report import context_series

    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "window_tune.json").write_text(json.dumps(
        {"recommended_window": None, "acceptance_length": {"off": {"0": 3.0, "512": 2.0}, "256": {"0": 3.0, "512": 2.2}}}))
    assert context_series(tmp_path) == {"no window": {0: 3.0, 512: 2.0}, "window 256": {0: 3.0, 512: 2.2}}


def test_report_eval_table_leaves_the_tune_result_out(tmp_path):
    """Before: eval/window_tune.json was read as an eval result and its nested AL table printed as a row."""
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "eval.json").write_text(json.dumps(
        {"acceptance_length": 3.25, "per_position_acceptance": [0.9, 0.7],
         "runs": [{"context_length": 0, "window": None, "acceptance_length": 3.25}]}))
    (tmp_path / "eval" / "window_tune.json").write_text(json.dumps(  # what `dspark-kit tune` writes
        {"recommended_window": 256, "recommended_k": 4, "acceptance_length": {"off": {"0": 3.0}, "256": {"0": 3.1}},
         "acceptance_length_by_k": {"4": {"off": {"0": 3.0}}},
         "measurements": [{"k": 4, "window": 256, "context_length": 0, "acceptance_length": 3.1}]}))
    md = build_report(tmp_path).read_text()
    section = md.split("## Offline eval")[1].split("## Serving benchmark")[0]
    table = [line for line in section.splitlines() if line.startswith("|")]
    assert table[2:] == ["| eval | 3.250 | 0.900, 0.700 |"], section  # after the header and its rule
    assert "{" not in section and "window_tune |" not in section
    assert "recommended K 4, draft window 256" in section


@pytest.mark.parametrize("status,whole,says", [
    ("failed", 2, "stopped after epoch 2 of 8"),  # Ctrl-C in run: the state says failed
    ("running", 0, "stopped after epoch 0 of 8"),  # killed before its first epoch ended
    (None, 3, "stopped after epoch 3 of 8"),  # `dspark-kit train` alone: no run state, fewer epochs
    ("done", 2, None),  # finished (max_steps or not): nothing to say
    (None, 8, None),
])
def test_report_says_where_an_unfinished_training_stopped(tmp_path, status, whole, says):
    import json

    from dspark_kit.rundir import RunDir
    from dspark_kit.stages.reporting.report import training_stopped_line

    run = RunDir.at(tmp_path)
    run.manifest.write_text(json.dumps({"recipe": {"train": {"epochs": 8, "max_steps": None}}}))
    if status:
        run.state.write_text(json.dumps({"train": {"status": status}}))
    for e in range(whole):
        (run.checkpoints / str(e)).mkdir(parents=True)
        (run.checkpoints / str(e) / "config.json").write_text("{}")
        (run.checkpoints / str(e) / "model.safetensors").write_bytes(b"")
    (run.checkpoints / str(whole)).mkdir(parents=True, exist_ok=True)  # the epoch it stopped in: partial
    line = training_stopped_line(run)
    if says is None:
        assert line is None
    else:
        assert says in line and f"dspark-kit run --replay {tmp_path}" in line
        assert says in build_report(tmp_path).read_text()


def test_report_reads_bench_files_from_before_the_figure_was_renamed(tmp_path):
    """bench json wrote per_position_acceptance_rates before issue 28; the report still shows it."""
    from dspark_kit.measure.bench_tables import bench_markdown

    counts = {"num_drafts": 10, "num_accepted_tokens": 5}
    old = {"label": "old", "spec_decode": {**counts, "acceptance_length": 1.5, "per_position_acceptance_rates": [0.4, 0.1]}}
    new = {"label": "new", "spec_decode": {**counts, "acceptance_length": 1.7, "per_position_acceptance": [0.5, 0.2]}}
    md = bench_markdown([old, new])
    assert "| pos0 rate | 0.4000 | 0.5000 |" in md and "| pos1 rate | 0.1000 | 0.2000 |" in md
