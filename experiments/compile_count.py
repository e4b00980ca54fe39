"""A pytest plugin: each test's wall time, its XLA compiles (count and seconds) and its
persistent-cache hits, in the test process (not in the subprocesses a test starts), from
jax.monitoring's events. Where a test's time goes to compiling, and how much of the suite's:

    PYTHONPATH=.:experiments COMPILE_COUNT=/tmp/compiles python3 -m pytest -q -n 2 \\
        -p compile_count tests
    python3 experiments/compile_count.py /tmp/compiles      # the totals and the top tests

Each pytest process (every pytest-xdist worker) writes COMPILE_COUNT.<worker>.json.
"""
import glob
import json
import os
import sys
import time

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_stats, _now = {}, {"compiles": 0, "compile_s": 0.0, "cache_hits": 0}


def _on_duration(name, secs, **_):
  if name == _BACKEND_COMPILE:
    _now["compiles"] += 1
    _now["compile_s"] += secs


def _on_event(name, **_):
  if name == _CACHE_HIT:
    _now["cache_hits"] += 1


def pytest_configure(config):
  import jax  # pylint: disable=import-outside-toplevel
  jax.monitoring.register_event_duration_secs_listener(_on_duration)
  jax.monitoring.register_event_listener(_on_event)


def pytest_runtest_protocol(item, nextitem):  # pylint: disable=unused-argument
  _now.update(compiles=0, compile_s=0.0, cache_hits=0, start=time.perf_counter())


def pytest_runtest_logfinish(nodeid, location):  # pylint: disable=unused-argument
  start = _now.pop("start", None)
  if start is not None:
    _stats[nodeid] = dict(_now, wall_s=time.perf_counter() - start)


def pytest_sessionfinish(session):  # pylint: disable=unused-argument
  out = os.environ.get("COMPILE_COUNT", "compile_count")
  with open(f"{out}.{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.json", "w") as f:
    json.dump(_stats, f, indent=1)


def report(prefix: str, top: int = 25) -> None:
  stats = {}
  for path in glob.glob(f"{prefix}.*.json"):
    with open(path) as f:
      stats.update(json.load(f))
  total = lambda key: sum(s[key] for s in stats.values())
  print(f"{len(stats)} tests: {total('wall_s'):.0f} s in all, of which {total('compile_s'):.0f} s "
        f"in {total('compiles')} compiles; {total('cache_hits')} persistent-cache hits")
  print("  wall s  compile s  compiles  hits  test")
  for name, s in sorted(stats.items(), key=lambda kv: -kv[1]["wall_s"])[:top]:
    print(f"{s['wall_s']:8.1f} {s['compile_s']:10.1f} {s['compiles']:9d} {s['cache_hits']:5d}  "
          f"{name}")


if __name__ == "__main__":
  report(sys.argv[1])
