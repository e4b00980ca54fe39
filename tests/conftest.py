"""Test session set-up: 8 fake CPU devices so sharding is exercised without accelerators, and
one persistent compilation cache for the whole session (grpo_jax.compile_cache).

The cache: the end-to-end tests start the tiny preset in many processes (runs, kills, resumes,
sweeps, two hosts), and each compiled the same programs again. They share one directory, made
fresh for the session, so nothing is carried over from an earlier one, and removed at its end.
Programs that compile in 0.5 s or more are written: the train steps, prefills, decode loops and
inits that the runs share. The eager operations (thousands of one-op programs, a few tens of
milliseconds each) are not: a process keeps its own in memory, and writing them cost more than
it saved. Each write under the cap scans the whole directory (JAX's LRU eviction reads every
entry's size and access time), so the suite's writes cost time quadratic in their number: with
every program written (about 3,000 entries by the middle of a run), five lora_train_test tests
took 79 s of CPU against 59 s with this threshold (the same pre-filled directory).
"""
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Made by the first process to load this file (the controller; its pytest-xdist workers and
# every subprocess inherit the variable) and removed by it at the end.
_OWNED = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWNED:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="grpo_jax_test_xla_")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# A cap makes JAX lock the directory around reads and writes (processes share it).
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))


def pytest_sessionfinish(session):
  if _OWNED and not hasattr(session.config, "workerinput"):
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


# The longest tests of command 2 (`--durations`, 2026-12-07), started first. pytest-xdist hands
# each worker a first chunk of consecutive tests and the rest as workers free up: with these at
# the front, the last minutes hold short tests the two workers share, not one long test that
# keeps one worker busy while the other waits. None uses a module-scoped fixture, so moving them
# sets nothing up twice.
SLOW_FIRST = (
    "multihost_test.py::test_two_processes_resume_and_train_as_one_process_on_8_devices",
    "notebook_test.py::test_notebook_runs_the_tiny_preset_and_shows_gain_plot_and_completions",
    "lora_train_test.py::test_a_tiny_lora_run_resumes_bit_for_bit_and_exports_what_peft_loads",
    "lora_train_test.py::test_vmapped_lora_members_share_one_base_and_match_their_separate_runs",
    "train_test.py::test_preempted_runs_resume_to_the_same_params_bit_for_bit",
    "gpu_step_test.py::test_smoke_run",
    "pipeline_test.py::test_a_pipelined_run_stopped_and_resumed_is_the_uninterrupted_one_bit_for_bit",
    "multihost_interrupt_test.py::test_sigterm_to_one_host_waiting_on_its_scorer_stops_both_at_the_same_step",
    "sweep_prefix_test.py::test_shared_warm_start_equals_own_warm_start",
    "train_test.py::test_a_resume_with_another_config_stops_clearly_or_says_what_changed",
    "vmapped_test.py::test_member_equals_its_separate_run",
    "gpu_decide_test.py::test_smoke_run_decides_and_writes_its_tables",
)


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(SLOW_FIRST)}
  def key(item):
    return rank.get(item.nodeid.split("/")[-1], len(rank))
  items.sort(key=key)  # stable: every other test keeps its place
