"""grpo_jax.progress off a terminal: plain lines at the configured cadence, on a fake clock."""

import io
import os
import re
import subprocess
import sys

import cli
import train_test
from grpo_jax import logging_io, progress


class Clock:
  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


def _lines(stream):
  text = stream.getvalue()
  assert "\r" not in text
  return text.splitlines()


def test_a_line_after_the_first_step_then_every_every_s_seconds_and_a_last_one():
  clock, out = Clock(), io.StringIO()
  bar = progress.Bar(range(10), total=10, desc="grpo", every_s=30.0, stream=out, clock=clock)
  printed_at = []
  for step in bar:
    clock.now += 12.0  # each step takes 12 s
    bar.set_postfix({"reward": f"{step / 10:.3f}"})
    printed_at.append(len(_lines(out)))
  lines = _lines(out)
  # Lines when step 1 (first), 4 (36 s after it), 7 and 10 are counted; then the last line.
  assert [line.split(",")[0] for line in lines] == [
      "grpo_jax: grpo 1/10 steps", "grpo_jax: grpo 4/10 steps", "grpo_jax: grpo 7/10 steps",
      "grpo_jax: grpo 10/10 steps", "grpo_jax: grpo 10/10 steps"]
  assert lines[0] == "grpo_jax: grpo 1/10 steps, 12s elapsed, reward=0.000"
  assert lines[1] == "grpo_jax: grpo 4/10 steps, 48s elapsed, 12.0s/step, reward=0.300"
  assert lines[-1] == "grpo_jax: grpo 10/10 steps, done in 2m00s, 12.0s/step, reward=0.900"
  # Each line is printed when its step is counted (the next one asked for), not later.
  assert printed_at == [0, 1, 1, 1, 2, 2, 2, 3, 3, 3]


def test_every_s_zero_prints_every_step_and_a_resumed_bar_counts_from_its_start():
  clock, out = Clock(), io.StringIO()
  bar = progress.Bar(range(4, 6), initial=4, total=6, desc="grpo", every_s=0, stream=out,
                     clock=clock)
  for _ in bar:
    clock.now += 2.0
  assert _lines(out) == ["grpo_jax: grpo 5/6 steps, 2s elapsed",
                         "grpo_jax: grpo 6/6 steps, 4s elapsed, 2.0s/step",
                         "grpo_jax: grpo 6/6 steps, done in 4s, 2.0s/step"]


def test_a_loop_that_breaks_after_finishing_a_step_counts_it():
  clock, out = Clock(), io.StringIO()
  bar = progress.Bar(range(10), total=10, desc="grpo", every_s=1000, stream=out, clock=clock)
  for step in bar:
    clock.now += 1.0
    if step == 4:  # interrupted before this step finished: not counted
      break
    bar.set_postfix(reward="0.5")
  assert _lines(out)[-1] == "grpo_jax: grpo 4/10 steps, 5s elapsed, 1.2s/step, reward=0.5"
  out = io.StringIO()
  bar = progress.Bar(range(10), total=10, desc="grpo", stream=out, clock=clock)
  for step in bar:
    bar.set_postfix(reward="0.5")
    if step == 2:  # a SIGTERM after step 2's metrics: done
      break
  assert _lines(out)[-1].startswith("grpo_jax: grpo 3/10 steps, ")


def test_an_early_stop_ends_at_the_real_count_and_says_why():
  clock, out = Clock(), io.StringIO()
  bar = progress.Bar(total=1000, desc="sft warm start", every_s=30, stream=out, clock=clock)
  for i in range(330):
    clock.now += 0.5
    bar.set_postfix(loss=f"{1 / (i + 1):.3f}")
    bar.update(1)
  bar.close(stopped="target reached")
  bar.close()  # closing twice prints nothing more
  lines = _lines(out)
  # The first step, one 30 s after the last line (60 steps of 0.5 s), the last line.
  assert [line.split(" steps")[0][len("grpo_jax: sft warm start "):] for line in lines] == [
      "1/1000", "61/1000", "121/1000", "181/1000", "241/1000", "301/1000", "330/330"]
  assert lines[-1] == ("grpo_jax: sft warm start 330/330 steps (stopped at 330 of at most 1000: "
                       "target reached), done in 2m45s, 0.5s/step, loss=0.003")
  assert "/1000 steps" in lines[-2]


def test_going_back_sets_the_count_and_write_goes_to_stdout(capsys):
  clock, out = Clock(), io.StringIO()
  bar = progress.Bar(total=20, desc="sft warm start", every_s=0, stream=out, clock=clock)
  bar.update(10)
  bar.set_count(5)
  bar.write("grpo_jax: warm start: going back to step 5")
  bar.update(1)
  bar.close()
  assert [line.split(",")[0] for line in _lines(out)] == [
      "grpo_jax: sft warm start 10/20 steps", "grpo_jax: sft warm start 6/20 steps",
      "grpo_jax: sft warm start 6/20 steps"]
  assert capsys.readouterr().out == "grpo_jax: warm start: going back to step 5\n"


def test_a_disabled_bar_prints_nothing_and_a_terminal_gets_tqdm(capsys):
  out = io.StringIO()
  bar = progress.Bar(range(3), total=3, desc="grpo", disable=True, stream=out)
  assert list(bar) == [0, 1, 2] and out.getvalue() == ""
  assert not progress.interactive(io.StringIO())
  tty = progress.Bar(range(3), total=3, desc="grpo", stream=out, tty=True)
  list(tty)
  assert "\r" in out.getvalue() and "3/3" in out.getvalue()  # tqdm's redrawn frames


def test_a_run_with_its_output_in_a_pipe_prints_plain_progress_lines(tmp_path):
  """The tiny preset, shortened, its stdout and stderr in one pipe (a log file, CI): no `\\r`
  anywhere (no bar frames, no datasets bars), one line per step at progress_every_s=0 and a
  last one per phase, whose rewards are the ones metrics.jsonl holds for those steps."""
  workdir = tmp_path / "run"
  proc = subprocess.run(
      [sys.executable, "-m", "grpo_jax.main", "--config=configs/gsm8k.py:tiny",
       f"--workdir={workdir}", *train_test.TINY_FLAGS, "--config.train.progress_every_s=0"],
      cwd=cli.REPO, env=cli.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:]
  assert "\r" not in proc.stdout
  sft = re.findall(r"^grpo_jax: sft warm start (\d+)/(\d+) steps, (done in )?", proc.stdout, re.M)
  assert sft == [(str(i), "10", "") for i in range(1, 11)] + [("10", "10", "done in ")]
  grpo = re.findall(r"^grpo_jax: grpo (\d+)/6 steps, (done in )?.*reward=([\d.]+) acc=([\d.]+)",
                    proc.stdout, re.M)
  assert [(n, done) for n, done, _, _ in grpo] == [
      (str(i), "") for i in range(1, 7)] + [("6", "done in ")]
  metrics = {r["step"]: r for r in logging_io.read_jsonl(str(workdir / "metrics.jsonl"))}
  for n, _, reward, acc in grpo:
    assert reward == f"{metrics[int(n)]['reward/total/mean']:.3f}"
    assert acc == f"{metrics[int(n)]['reward/math_accuracy/mean']:.2f}"
  assert re.search(r"^grpo_jax: grpo 6/6 steps, done in .* eval=0\.\d{3}$", proc.stdout, re.M)


def test_library_bars_are_turned_off_when_the_libraries_were_imported_first():
  """huggingface_hub loads its `utils` lazily: the call must import it, not read an attribute
  the package does not have yet (an AttributeError stopped every run that imported it first)."""
  code = ("import io, huggingface_hub; from grpo_jax import progress; "
          "progress.quiet_library_bars(io.StringIO()); "
          "from huggingface_hub.utils import are_progress_bars_disabled; "
          "import datasets; print(are_progress_bars_disabled(), "
          "datasets.is_progress_bar_enabled())")
  out = subprocess.run([sys.executable, "-c", code], cwd=cli.REPO, capture_output=True, text=True,
                       env={k: v for k, v in os.environ.items() if "PROGRESS_BARS" not in k},
                       timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split() == ["True", "False"], out.stdout
