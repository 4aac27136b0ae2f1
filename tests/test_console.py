"""`run`'s console (dspark_kit/progress.py): one line per stage, the stage's output in its log, the
log's last lines when a stage fails, plain lines (no redraws) when the console is not a terminal."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dspark_kit import progress
from dspark_kit.progress import STANDALONE, StageDisplay, StageLine, note


def test_plain_stage_shows_its_line_and_result_and_logs_the_noise(tmp_path):
    out, log = io.StringIO(), tmp_path / "logs" / "stage-x.log"
    with StageDisplay(out, terminal=False) as d:
        with d.stage("prepare", log):
            print("Map (num_proc=1): 100%|##########| 387/387")  # a library's progress bar on stdout
            print("INFO step 1 loss 2.3", file=sys.stderr)
            with d.reporter.bar("prepare", total=100, unit="conv") as bar:
                for _ in range(100):
                    bar.advance()
            d.reporter.note("prepare: 100 of 100 conversations used")
        d.result("prepare", "rows_out 140", 1.5)
    text = out.getvalue()
    assert text.splitlines() == ["> prepare", "  prepare: 100 of 100 conversations used",
                                 "- prepare in 0:01: rows_out 140"]
    assert "\r" not in text
    logged = log.read_text()
    assert "387/387" in logged and "step 1 loss" in logged and "100 of 100 conversations" in logged
    assert not d.reporter.echo_children  # run_training logs the trainer's output, never on the console


def test_only_the_reporter_handed_down_reaches_the_display(tmp_path, capsys):
    """No module-level "current display": a stage command's note inside a display's block goes to
    stderr as always, and only code handed `d.reporter` draws on the stage line."""
    out = io.StringIO()
    with StageDisplay(out, terminal=False):
        note("a stage command's note")
        STANDALONE.note("another")
    assert out.getvalue() == "" and "a stage command's note\nanother\n" == capsys.readouterr().err
    assert not hasattr(progress, "_active") and STANDALONE.echo_children


def test_a_failing_stage_shows_the_tail_of_its_logs(tmp_path):
    out, logs = io.StringIO(), tmp_path / "logs"
    logs.mkdir()
    (logs / "old.log").write_text("from an earlier run\n")
    import os
    import time

    os.utime(logs / "old.log", (time.time() - 3600, time.time() - 3600))
    with (StageDisplay(out, terminal=False) as d, pytest.raises(RuntimeError, match="boom"),
          d.stage("train", logs / "stage-train.log")):
        (logs / "train.log").write_text("".join(f"trainer line {i}\n" for i in range(50)))
        print("stage line", file=sys.stderr)
        raise RuntimeError("boom: speculators train exited with 2")
    text = out.getvalue()
    assert "x train failed after 0:00; the last lines of its logs:" in text
    assert f"last lines of {logs / 'train.log'}" in text and f"last lines of {logs / 'stage-train.log'}" in text
    assert "  | trainer line 49" in text and "  | trainer line 29" not in text  # the last 20 only
    assert "  | stage line" in text and "earlier run" not in text  # only logs this stage wrote


def test_an_interrupted_stage_is_one_line_without_log_tails(tmp_path):
    """Reproduced: Ctrl-C in training printed ~20 lines of trainer metrics; the user stopped it."""
    out, logs = io.StringIO(), tmp_path / "logs"
    logs.mkdir()
    with (StageDisplay(out, terminal=False) as d, pytest.raises(KeyboardInterrupt),
          d.stage("train", logs / "stage-train.log")):
        (logs / "train.log").write_text("".join(f"trainer line {i}\n" for i in range(50)))
        raise KeyboardInterrupt
    lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
    assert lines[-1] == "x train interrupted after 0:00" and not any("trainer line" in ln for ln in lines)


def test_verbose_streams_everything_as_the_stage_commands_do(tmp_path):
    out, log = io.StringIO(), tmp_path / "stage.log"
    with StageDisplay(out, verbose=True, terminal=False) as d, d.stage("train", log):
        assert d.reporter is STANDALONE and d.reporter.echo_children
        print("INFO step 7", file=sys.stderr)
    assert "==> train" in out.getvalue()
    assert "INFO step 7" in log.read_text()  # tee: the log keeps it as before


def test_stage_line_reports_progress_rate_and_eta():
    now = [100.0]
    line = StageLine("hidden-states", clock=lambda: now[0])
    line.total, line.unit, line.detail = 400, "row", ""
    line._since, line.count = 100.0, 0
    now[0] = 110.0
    line.count = 100
    assert line.text() == "hidden-states  100/400 row  10.0 row/s  eta 0:30  0:10"


def test_slow_units_show_a_rate_per_minute_counted_from_the_first_unit():
    now = [0.0]
    line = StageLine("train", clock=lambda: now[0])
    line.total, line.unit = 8, "epoch"
    line.start_counting()  # epoch 1 starts (after model loading)
    now[0] = 120.0
    line.count = 2
    assert line.text() == "train  2/8 epoch  1.0 epoch/min  eta 6:00  2:00"


def test_the_train_line_follows_the_trainers_records():
    from dspark_kit.stages.training.train import TrainProgress

    class Bar:
        def __init__(self):
            self.calls = []

        def advance(self, n=1):
            self.calls.append(("advance", n))

        def total(self, t):
            self.calls.append(("total", t))

        def describe(self, text):
            self.calls.append(("describe", text))

    bar = Bar()
    feed = TrainProgress(bar).feed
    for line in ["[15:07:45] INFO     Training epoch 1/8 started          trainer.py:737",
                 "                    epoch=0, lr=0.003, global_step=0",
                 "                    epoch=0, lr=0.003, global_step=1",
                 "[15:09:02] INFO     Training epoch 1/8 completed        trainer.py:739",
                 "Epoch 0: 100%|##########| 2/2 [00:30<00:00]",
                 "[15:09:03] INFO     Training epoch 2/8 started          trainer.py:737",
                 "                    epoch=1, lr=0.003, global_step=2"]:
        feed(line)
    # the bar counts steps; its total (and so an ETA) once an epoch's steps are known
    assert bar.calls == [("describe", "epoch 1/8"), ("advance", 1), ("describe", "epoch 1/8"), ("advance", 1),
                         ("describe", "epoch 1/8"), ("total", 16), ("describe", "epoch 1/8"),
                         ("describe", "epoch 2/8"), ("advance", 1), ("describe", "epoch 2/8")]


def test_a_resumed_trainings_steps_per_epoch_come_from_the_global_step_not_its_partial_first_epoch():
    """Resumed 84 steps into epoch 4 of 10 (878 steps each): the first epoch completed here ran 794 steps,
    and the bar's total read 7,940 while the count passed 8,400."""
    from dspark_kit.stages.training.train import TrainProgress

    class Bar:
        total_set = None

        def advance(self, n=1):
            pass

        def total(self, t):
            self.total_set = t

        def describe(self, text):
            pass

    bar = Bar()
    feed = TrainProgress(bar).feed
    for line in ["INFO     Resuming mid-epoch from epoch=3 local_step=84", "INFO     Training epoch 4/10 started",
                 "epoch=3, lr=0.001, global_step=2718", "epoch=3, lr=0.001, global_step=3511",
                 "INFO     Training epoch 4/10 completed"]:
        feed(line)
    assert bar.total_set == 8780


def test_the_train_eta_comes_from_steps_and_holds_steady_between_epochs():
    """Before: completed epochs / time, so the ETA grew every second no epoch completed."""
    from dspark_kit.stages.training.train import TrainProgress

    now = [0.0]
    line = StageLine("train", clock=lambda: now[0])
    display = StageDisplay(io.StringIO(), terminal=True)
    display._line = line
    progress = TrainProgress(display.line_bar("train", None, "step"))
    progress.feed("Epoch 0: 10%|#| 1/10 [00:01<00:09]")  # the trainer's own bar gives the epoch's steps
    progress.feed("Training epoch 1/4 started")
    etas = []
    for step in range(12):
        now[0] = 10.0 * (step + 1)
        progress.feed(f"epoch=0, lr=0.003, global_step={step}")
        now[0] += 5.0  # halfway to the next step
        etas.append(line.text().split("eta ")[1].split()[0] if "eta " in line.text() else None)
    assert etas[0] == "6:25", etas  # counted from the epoch's start: 39 steps left at 10 s, less 5 s
    assert etas == sorted(etas, reverse=True) and len(set(etas)) == len(etas), etas  # never grows
    assert etas[-1] == "4:35", etas  # 28 steps left at 10 s a step, less the 5 s since the last one
    now[0] += 4.0
    assert "eta 4:31" in line.text()  # between steps it counts down


def test_plain_progress_lines_are_rate_limited(tmp_path):
    out = io.StringIO()
    with (StageDisplay(out, terminal=False, plain_every_s=0.0) as d, d.stage("regen", tmp_path / "s.log"),
          d.reporter.bar("regen", total=3, unit="row") as bar):
        for _ in range(3):
            bar.advance()
    assert sum("regen  " in ln and "/3 row" in ln for ln in out.getvalue().splitlines()) == 3
    out = io.StringIO()
    with (StageDisplay(out, terminal=False) as d, d.stage("regen", tmp_path / "s.log"),  # one line per 30 s at most
          d.reporter.bar("regen", total=300, unit="row") as bar):
        for _ in range(300):
            bar.advance()
    assert out.getvalue().splitlines() == ["> regen"]


@pytest.mark.slow  # starts a process
def test_descriptor_level_capture_catches_c_code_and_child_processes(tmp_path):
    """What a plain Python redirect misses: writes to fd 2 and a child process's inherited stdout."""
    log = tmp_path / "stage.log"
    script = textwrap.dedent(f"""
        import os, subprocess, sys
        from dspark_kit.progress import StageDisplay
        with StageDisplay(sys.stderr, terminal=False) as d:
            with d.stage("hidden-states", {str(log)!r}):
                os.write(2, b"written to fd 2\\n")
                subprocess.run([sys.executable, "-c", "print('child says hi')"], check=True)
            d.result("hidden-states", "generated 3", 0.2)
        print("stdout after the stage")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == ["> hidden-states", "- hidden-states in 0:00: generated 3"]
    assert proc.stdout == "stdout after the stage\n"
    logged = Path(log).read_text()
    assert "written to fd 2" in logged and "child says hi" in logged


# ---- the real `run`, piped --------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent
SMALL = ["--set", "data.limit=16", "--set", "train.epochs=1", "--set", "train.max_anchors=32",
         "--set", "eval.num_prompts=2", "--set", "bench.num_prompts=2"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dspark_kit", "run", str(REPO / "recipes" / "tiny-cpu.yaml"), *args],
                          capture_output=True, text=True, timeout=1800, check=False)


@pytest.mark.slow
def test_a_piped_run_is_short_and_plain_and_ends_with_the_table(tmp_path, tiny_verifier):
    wd = tmp_path / "run"
    proc = run_cli("-w", str(wd), *SMALL)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    lines = out.splitlines()
    assert len(lines) < 60, out
    assert "\r" not in out and "\x1b[" not in out  # no redraws, no terminal codes in a pipe
    assert "global_step" not in out and "INFO" not in out  # the trainer's records stay in its log
    for stage in ("regen", "prepare", "hidden-states", "train", "eval", "serve", "bench", "report"):
        assert f"> {stage}" in lines and any(ln.startswith(f"- {stage} in ") for ln in lines), stage
    table = next(i for i, ln in enumerate(lines) if "dspark-kit run" in ln)
    assert all(not ln.startswith(("> ", "- ")) for ln in lines[table:])  # the table and where things are, last
    tail = proc.stderr.splitlines()  # the run ends with acceptance per task template (eval.categories [tiny])
    heading = tail.index("eval: acceptance per category, temperature 0 (greedy)")  # names what it measured at
    assert tail[heading + 1].startswith("| category | prompts | acceptance length | pos0 |")
    assert len(tail) - heading - 3 >= 4 and all(ln.startswith("| tiny/") for ln in tail[heading + 3:])
    logs = wd / "logs"
    assert "global_step" in (logs / "train.log").read_text()  # in full, in the run folder
    assert (logs / "stage-prepare.log").stat().st_size > 0 and (logs / "spec-server.log").is_file()


@pytest.mark.slow
def test_a_failing_stage_shows_its_log_tail_and_verbose_streams(tmp_path, tiny_verifier):
    wd = tmp_path / "run"
    bad = ["--stages", "prepare,hidden-states,train", "--set", "regen.enabled=false", "--set", "data.limit=8",
           "--set", "train.extra_args=[--no-such-flag]"]
    proc = run_cli("-w", str(wd), *bad)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "x train failed after" in out and f"last lines of {wd / 'logs' / 'train.log'}" in out
    assert "--no-such-flag" in out.split("x train failed", 1)[1]  # the trainer's own complaint, from its log
    assert out.splitlines()[-1].startswith("error:")
    assert len(out.splitlines()) < 60, out

    streamed = run_cli("-w", str(wd), *bad, "-v")  # prepare and hidden states are done: only train runs
    assert streamed.returncode == 1
    assert "==> train" in streamed.stderr and "--no-such-flag" in streamed.stderr.split("==> train", 1)[1]


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_in_run_ends_with_the_line_that_resumes(tmp_path, monkeypatch, stop):
    """SIGTERM (scancel, a preemption, `timeout`) stops a run as Ctrl-C does: resumable, not failed."""
    import signal

    from typer.testing import CliRunner

    from dspark_kit.cli import app
    from dspark_kit.processes import SignalStopped
    from dspark_kit.stages import pipeline

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt if stop == "ctrl-c" else SignalStopped(signal.SIGTERM)

    monkeypatch.setattr(pipeline, "run_pipeline", interrupted)
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-cpu.yaml"
    res = CliRunner().invoke(app, ["run", str(recipe), "-w", str(tmp_path), "--set", "train.epochs=2"])
    assert res.exit_code == (130 if stop == "ctrl-c" else 143)
    [line] = [ln for ln in res.stderr.splitlines() if ln.strip()]
    how = "interrupted" if stop == "ctrl-c" else "stopped by SIGTERM"
    assert line.startswith(f"error: {how}: `dspark-kit run ") and "--set train.epochs=2" in line
    assert f"-w {tmp_path}`" in line and "resumes" in line


@pytest.mark.slow  # a python process (about a second): the kit's handler on a real signal
def test_sigterm_to_the_kit_stops_its_stage_in_one_line(tmp_path):
    """Reproduced: a regen stopped with SIGTERM after an hour said 'x regen failed' and printed the
    chat server's last 20 lines, its rows all kept and resumable. The kit's own handler, a real signal."""
    logs = tmp_path / "logs"
    logs.mkdir()
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        from pathlib import Path
        from dspark_kit.processes import install_signal_handlers
        from dspark_kit.progress import StageDisplay
        install_signal_handlers()
        logs = Path({str(logs)!r})
        with StageDisplay(sys.stdout, terminal=False) as d, d.stage("regen", logs / "stage-regen.log"):
            (logs / "chat-server.log").write_text("server line\\n" * 30)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
    """)
    r = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 143, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert lines[-1] == "x regen stopped by SIGTERM after 0:00" and "server line" not in r.stdout


def test_a_silent_stage_still_says_what_it_does_in_a_pipe(tmp_path):
    """A model loading or a server starting moves no bar: the heartbeat prints the stage's line
    whenever the console has been silent for plain_every_s (20 s by default)."""
    import time as _time

    out = io.StringIO()
    beat = "  eval  loading the verifier  0:"
    t0 = _time.monotonic()
    with StageDisplay(out, terminal=False, plain_every_s=0.2) as d, d.stage("eval", tmp_path / "s.log"):
        d.reporter.note("loading the verifier")
        with d.reporter.bar("eval", total=None, unit="prompt") as bar:
            bar.describe("loading the verifier")
            while out.getvalue().count(beat) < 2:  # the display's own lines, not wall time (a busy machine)
                assert _time.monotonic() < t0 + 30, out.getvalue()
                _time.sleep(0.01)
    elapsed = _time.monotonic() - t0
    lines = out.getvalue().splitlines()
    beats = [ln for ln in lines if ln.startswith(beat)]
    assert lines[:2] == ["> eval", "  loading the verifier"], lines
    assert 2 <= len(beats) <= elapsed / 0.2 + 1, lines  # one per 0.2 s of silence at most
    quiet = io.StringIO()
    with StageDisplay(quiet, terminal=False) as d, d.stage("eval", tmp_path / "t.log"):
        _time.sleep(0.3)
    assert quiet.getvalue().splitlines() == ["> eval"]  # the default: a line only after 20 s of silence


def test_regen_row_progress_moves_a_progress_bar_with_its_stats():
    """regen's per-row stats (rows/min, tok/s, errors, rows per endpoint) go through progress.py's
    bar, like every stage's; the CLI holds no bar of its own."""
    from dspark_kit.stages.dataset.regen import RowProgress

    class Bar:
        def __init__(self):
            self.count, self.text = 0, ""

        def advance(self, n=1):
            self.count += n

        def describe(self, text):
            self.text = text

    now = iter([0.0, 30.0, 60.0])
    bar = Bar()
    rows = RowProgress(bar, clock=lambda: next(now))
    rows({"idx": 0, "metadata": {"usage": {"completion_tokens": 300}, "endpoint": "http://h1:8000/v1"}})
    rows({"idx": 1, "error": "timeout", "endpoint": "http://h2:8000/v1"})
    assert bar.count == 2
    assert bar.text == "regen 1 rows/min 5 tok/s err 1 | h1:8000/v1:1"


def test_a_disabled_progress_bar_draws_nothing(capsys):
    with progress.progress_bar("regen", 3, unit="row", enabled=False) as bar:
        bar.advance()
        bar.describe("regen 1 rows/min")
    assert capsys.readouterr() == ("", "")
