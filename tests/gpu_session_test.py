"""benchmarks/gpu_session.sh: every command of its plan names a script that exists and flags
that script accepts, with values it accepts, so that a GPU session does not spend its minutes on
a renamed flag. The plan is read from the script's own DRY=1 output."""
import argparse
import os
import re
import runpy
import shlex
import subprocess
import sys
from unittest import mock

import pytest

from configs import gsm8k

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_session.sh")


def plan(part: str) -> list[tuple[str, list[str]]]:
  out = subprocess.run(["bash", SCRIPT, part, "100000"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, DRY="1", TOKENIZER="T",
                                                        GSM8K="G"), check=True).stdout
  steps = re.findall(r"^== (\S+) \(limit \d+ s, [\d:]+\): (.*)$", out, re.M)
  assert re.search(rf"== part {part} done, \d+ s left\s*$", out), out
  return [(name, shlex.split(cmd)) for name, cmd in steps]


def python_args(argv: list[str]) -> tuple[str, list[str]]:
  """The script and arguments of `[env VAR=... ...] python3 SCRIPT ARGS`."""
  if argv[0] == "env":
    argv = [a for a in argv[1:] if not re.match(r"^[A-Z_]+=", a)]
  assert argv[0] == "python3", argv
  return argv[1], argv[2:]


class Parsed(Exception):
  pass


def parse(script: str, args: list[str]):
  """The namespace `python3 SCRIPT ARGS` parses its arguments into, without running the rest of
  the script (argparse exits with 2 on an unknown flag or a bad value)."""
  original = argparse.ArgumentParser.parse_args

  def parse_and_stop(self, argv=None, namespace=None):
    raise Parsed(original(self, argv, namespace))

  old_argv = sys.argv
  sys.argv = [script, *args]
  try:
    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_and_stop):
      runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
  except Parsed as parsed:
    return parsed.args[0]
  finally:
    sys.argv = old_argv
  raise AssertionError(f"{script} did not parse its arguments")


@pytest.mark.parametrize("part", ["1", "2"])
def test_every_planned_command_parses(part):
  steps = plan(part)
  # As many commands as the script's branch for this part calls run or step05.
  branch = re.search(rf"^  {part}\)\n(.*?)^    ;;", open(SCRIPT).read(), re.M | re.S).group(1)
  assert len(steps) == len(re.findall(r"^    (?:run|step05) ", branch, re.M)) > 0
  names = [n for n, _ in steps]
  assert len(set(names)) == len(names), names  # one log file each
  for name, argv in steps:
    script, args = python_args(argv)
    assert os.path.isfile(os.path.join(ROOT, script)), (name, script)
    ns = parse(script, args)
    for size in getattr(ns, "sizes", "").split(","):
      assert size in ("", "0.5b", "1.5b"), (name, size)
    if getattr(ns, "preset", None):
      assert gsm8k.get_config(ns.preset).model.checkpoint, (name, ns.preset)


def test_a_bad_part_is_refused():
  r = subprocess.run(["bash", SCRIPT, "3"], cwd=ROOT, capture_output=True, text=True,
                     timeout=60, env=dict(os.environ, DRY="1"))
  assert r.returncode == 2 and "PART is 1 or 2" in r.stdout
