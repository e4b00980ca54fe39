"""Every preset's resolved config as plain JSON: each leaf's path, type and value.

tests/config_test.py compares each preset of configs/gsm8k.py and configs/gsm8k_agent.py with
tests/testdata/preset_configs.json. That file was written by this module, run as a script on the
code before grpo_jax/config.py existed (presets built field by field in configs/*.py), so the
schema's move cannot have changed a preset:

    PYTHONPATH=$PWD python3 tests/config_snapshot.py > tests/testdata/preset_configs.json

Rewritten since for one deliberate change, which was the whole difference: the agent default's
rewards are math_accuracy alone (format asked for a <think> block its prompt never mentions).
And rewards.quality.fallback's declared type, NoneType -> float (a placeholder, so that
--config.rewards.quality.fallback=0.0 parses); its value is None as before.

A placeholder field (config_dict.placeholder(str)) is recorded with its declared type, so a
default that lost its type (None that no longer accepts a string override) shows as a change.
"""

import importlib.util
import json
import sys
from pathlib import Path

from ml_collections import config_dict

REPO = Path(__file__).resolve().parents[1]
PRESETS = {"configs/gsm8k.py": ("default", "0.5b", "tiny"),
           "configs/gsm8k_agent.py": ("default", "tiny")}
# Added beside the snapshot's making (docs/lora.md; docs/loss.md's options from TRL 1.16);
# their defaults are checked on their own (config_test).
NEW_LOSS_FIELDS = ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
                   "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "rollout_is_correction",
                   "rollout_is_mode", "rollout_is_clip_min", "rollout_is_clip_max",
                   "off_policy_mask_threshold", "use_bias_correction_kl", "top_entropy_quantile",
                   "entropy_coef", "use_adaptive_entropy", "entropy_target", "entropy_coef_min",
                   "entropy_coef_max", "entropy_coef_delta", "steps_per_generation",
                   "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps")
EXCLUDED = ("model.lora",) + tuple(f"loss.{k}" for k in NEW_LOSS_FIELDS)


def load(path: str):
  spec = importlib.util.spec_from_file_location(Path(path).stem + "_snapshot", REPO / path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def leaves(cfg, prefix=""):
  """{'a.b': [type name, JSON value]} for every leaf of a ConfigDict."""
  out = {}
  for key in sorted(cfg.keys()):
    path = prefix + key
    if path in EXCLUDED:
      continue
    raw = cfg._fields[key]  # pylint: disable=protected-access
    if isinstance(raw, config_dict.FieldReference):
      kind, value = raw.get_type().__name__, raw.get()
    else:
      kind, value = type(raw).__name__, raw
    if isinstance(value, config_dict.ConfigDict):
      out.update(leaves(value, path + "."))
    else:
      out[path] = [kind, json.loads(json.dumps(value))]
  return out


def snapshot() -> dict:
  return {f"{path}:{preset}": leaves(load(path).get_config(preset))
          for path, presets in PRESETS.items() for preset in presets}


def dump(snap: dict) -> str:
  """JSON with one line per leaf (readable diffs)."""
  presets = []
  for name in sorted(snap):
    rows = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(snap[name].items()))
    presets.append(f" {json.dumps(name)}: {{\n{rows}\n }}")
  return "{\n" + ",\n".join(presets) + "\n}"


if __name__ == "__main__":
  sys.path.insert(0, str(REPO))
  print(dump(snapshot()))
