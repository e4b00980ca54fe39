"""Runs a program that dies when the process that started it dies, even by SIGKILL.

    python -m grpo_jax.die_with_parent PARENT_PID PROGRAM [ARGS...]

sets the kernel's parent-death signal (prctl PR_SET_PDEATHSIG, SIGKILL) and then execs
PROGRAM in the same process, which keeps the signal. The sweep runner starts every run this
way (grpo_jax/sweep_runner.py): a sweep that is SIGKILLed, or crashes, leaves no run behind to
write into a directory that a rerun of the sweep would start again. SIGKILL, not SIGTERM: a run
stuck in a compile would outlive its sweep for minutes; what it loses is the steps since its
last checkpoint, which the rerun redoes. PARENT_PID closes the race where the parent died
before the signal was set (the program would then never get it): the program is not started.
"""
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
  if len(argv) < 3 or not argv[1].isdigit():
    sys.exit("usage: python -m grpo_jax.die_with_parent PARENT_PID PROGRAM [ARGS...]")
  parent, program = int(argv[1]), argv[2:]
  libc = ctypes.CDLL(None, use_errno=True)
  if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
    err = ctypes.get_errno()
    sys.exit(f"grpo_jax.die_with_parent: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
  if os.getppid() != parent:
    sys.exit(f"grpo_jax.die_with_parent: the parent {parent} is gone; not starting {program[0]}")
  os.execvp(program[0], program)


if __name__ == "__main__":
  main(sys.argv)
