"""`python -m grpo_jax.main` whose final export is interrupted while it writes final_model/:
once weights.save_checkpoint has written the model's files, the process sends itself SIGINT
(a Ctrl-C in the middle of the export), before the directory is complete.

    PYTHONPATH=tests python -m export_interrupted_main --config=... --workdir=DIR [flags]
"""
import os
import signal
import time

from grpo_jax import main
from grpo_jax.models import weights

_real_save = weights.save_checkpoint


def _save_then_interrupted(*args, **kwargs):
  _real_save(*args, **kwargs)
  os.kill(os.getpid(), signal.SIGINT)
  time.sleep(60)  # the run's handler raises here; a run that ignores it times the test out
  raise AssertionError("the SIGINT during the export did not stop the run")


weights.save_checkpoint = _save_then_interrupted  # grpo_jax.export._finish calls it through the module

if __name__ == "__main__":
  main.run()
