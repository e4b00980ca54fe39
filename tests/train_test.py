"""The training program end to end: the real GSM8K files through the whole data path,
preemption (SIGKILL, SIGTERM) followed by a resume that equals an uninterrupted run bit for bit,
and damaged checkpoints (resume from the last good one, or stop with a clear error)."""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import cli
import fixtures
from configs import gsm8k
from grpo_jax import (data, interrupts, logging_io, members as members_lib, plots, prepare, rollout,
                      runs as runs_lib, sampler as sampler_lib, sft, tokenizer as tokenizer_lib,
                      train, trainer as trainer_lib, workdir_lock)
from grpo_jax.models import qwen, weights
from grpo_jax.rewards import Reward

REPO = cli.REPO


def _gold(answer: str) -> str:
  return answer.rsplit("####", 1)[1].strip().replace(",", "")


@pytest.fixture(scope="module")
def gsm8k_run(tmp_path_factory):
  """(config, workdir, summary) of a two-step tiny run on the real GSM8K files."""
  config = gsm8k.get_config("tiny")
  config.data.source = str(fixtures.GSM8K)
  config.data.prompt_buckets = (160, 320)
  config.sampling.num_generations = 2
  config.sampling.max_new_tokens = 6
  config.sft.steps = 0
  # A random tied head makes greedy decoding repeat the prompt's last token ('\n') forever;
  # an untied one gives varied continuations for the final_model generate comparison.
  config.model.tiny.tie_word_embeddings = False
  # One sampling round per step, so the prompts follow the documented data order exactly.
  config.train.update(steps=2, prompts_per_step=2, eval_examples=4, eval_batch_size=4,
                      eval_every=1, checkpoint_every=1, samples_per_step=2, tensorboard=False,
                      dynamic_sampling=False)
  workdir = tmp_path_factory.mktemp("gsm8k_run")
  return config, workdir, train.run(config, str(workdir))


def test_real_gsm8k_through_the_whole_data_path(gsm8k_run):
  config, tmp_path, summary = gsm8k_run

  train_rows = [json.loads(line) for line in open(fixtures.GSM8K / "train.jsonl")]
  assert len(train_rows) == 7473
  records = logging_io.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert [r["step"] for r in records] == [0, 1, 2]
  assert all(0.0 <= r["eval/accuracy"] <= 1.0 for r in records)
  assert summary["end_step"] == 2
  for r in records[1:]:
    assert r["reward/math_accuracy/missing_frac"] == 0.0
    assert 0.0 <= r["reward/math_accuracy/mean"] <= 1.0
  # The prompts are the real questions, in the documented order: a permutation seeded by
  # (seed, epoch); each sample carries its row's gold answer.
  order = np.random.default_rng([config.seed, 0]).permutation(len(train_rows))
  samples = logging_io.read_jsonl(str(tmp_path / "samples.jsonl"))
  expected = [train_rows[i] for i in order[:4]]
  assert len(samples) == 4
  for sample, row in zip(samples, expected):
    assert row["question"] in sample["prompt"]
    assert sample["gold"] == _gold(row["answer"])
    assert set(sample["rewards"]) == {"math_accuracy"}
  assert (tmp_path / "metrics.png").is_file()
  # The plots draw keys the trainer really logs; the tiny preset's beta is 0: no KL panel.
  assert set(plots.PLOTTED_KEYS) <= set(records[-1])
  assert plots.config_beta(str(tmp_path)) == config.loss.beta == 0.0
  assert [p.title for p in plots.panels(records, plots.config_beta(str(tmp_path)))] == [
      "Reward: total", "Reward: math_accuracy", "Held-out accuracy (greedy)", "Policy loss",
      "Entropy (nats/token)", "Gradient norm", "Completion length (tokens)",
      "Rollout/train drift: mean |Δ log p|"]
  assert (tmp_path / "final_model" / "config.json").is_file()
  # The rollout/train drift, every step. The tiny preset computes in float32, where the
  # sampler's decode (one token at a time, against its KV cache) and the train step's forward
  # (the whole sequence at once) differ only in the order they sum in: a few float32 ulps of
  # logits of order 1 (2^-23 ≈ 1.2e-7 each) through two layers: measured |Δ log p| max 7e-6,
  # mean 1.5e-6, KL 2e-12. 1e-4 is 15 times that max and 300 times under bfloat16's max
  # (3e-2 to 9e-2; docs/loss.md, 'Rollout/train drift'), so a real mismatch cannot pass.
  for r in records[1:]:
    drift = {k: v for k, v in r.items() if k.startswith("drift/")}
    assert set(drift) == {"drift/logp_diff_mean", "drift/logp_diff_max", "drift/kl",
                          "drift/is_clipped_frac"}
    assert all(isinstance(v, float) and np.isfinite(v) for v in drift.values()), drift
    assert 0 <= drift["drift/logp_diff_mean"] <= drift["drift/logp_diff_max"] < 1e-4
    assert 0 <= drift["drift/kl"] < 1e-8 and drift["drift/is_clipped_frac"] == 0.0


def test_final_model_loads_in_transformers_and_generates_like_the_sampler(gsm8k_run):
  """final_model/ alone is a complete checkpoint: AutoTokenizer and AutoModelForCausalLM load
  it, and transformers' greedy generate from it equals grpo_jax's greedy sampler token for
  token on the run's chat-templated prompts."""
  import transformers

  config, workdir, _ = gsm8k_run
  final = workdir / "final_model"
  tok = transformers.AutoTokenizer.from_pretrained(final)
  run_tok = tokenizer_lib.load_tokenizer(str(workdir / "tokenizer"))  # what the run trained with
  assert tok.chat_template == run_tok.chat_template and tok.get_vocab() == run_tok.get_vocab()
  hf = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()

  questions = [json.loads(line)["question"] for line in open(fixtures.GSM8K / "test.jsonl")][:4]
  texts = [data.build_prompt(tok, q, config.data.system_prompt, config.data.user_template)
           for q in questions]
  assert texts[0].startswith("<|im_start|>user\n") and texts[0].endswith("<|im_start|>assistant\n")
  ids = data.encode_prompts(tok, texts)
  assert ids == data.encode_prompts(run_tok, texts)
  new_tokens = 16
  stop = hf.generation_config.eos_token_id  # from final_model/generation_config.json
  assert sorted(stop) == sorted(tokenizer_lib.stop_ids(run_tok, str(workdir / "tokenizer")))

  tokens_BP, mask_BP = data.pad_to_bucket(ids, config.data.prompt_buckets, tok.pad_token_id)
  with torch.no_grad():
    ref = hf.generate(input_ids=torch.tensor(tokens_BP, dtype=torch.long),
                      attention_mask=torch.tensor(mask_BP, dtype=torch.long), do_sample=False,
                      max_new_tokens=new_tokens, pad_token_id=tok.pad_token_id)
  ref = ref[:, tokens_BP.shape[1]:].numpy()

  params, cfg = weights.load_checkpoint(final)
  sampler = sampler_lib.Sampler(qwen.Qwen(cfg), max_new_tokens=new_tokens, stop_ids=stop,
                                buckets=config.data.prompt_buckets, greedy=True,
                                valid_vocab_size=tokenizer_lib.valid_vocab_size(tok),
                                pad_id=tok.pad_token_id)
  out = sampler({"params": params}, ids)
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  for b in range(len(ids)):
    is_stop = np.isin(ref[b], stop)
    n = int(is_stop.argmax()) + 1 if is_stop.any() else new_tokens  # the stop id included
    assert lengths[b] == n, (b, lengths[b], ref[b])
    np.testing.assert_array_equal(tokens[b, :n], ref[b, :n], err_msg=f"prompt {b}")
  assert len(np.unique(tokens)) > 8  # varied continuations, not one repeated token


def test_summary_reports_a_gain_only_for_a_completed_run(tmp_path, capsys):
  rows = [{"step": 0, "eval/accuracy": 0.25}, {"step": 1, "loss": 0.5},
          {"step": 2, "eval/accuracy": 0.5}, {"step": 3, "loss": 0.4}]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  stopped = logging_io.write_summary(str(tmp_path), stopped_at=3)
  assert stopped == {"stopped_early": True, "stopped_at_step": 3, "eval_accuracy_start": 0.25,
                     "start_step": 0, "eval_accuracy_latest": 0.5, "latest_eval_step": 2}
  assert json.loads((tmp_path / "summary.json").read_text()) == stopped
  line = capsys.readouterr().out
  assert "stopped early at step 3" in line and "50.0% at step 2" in line and "points" not in line

  done = logging_io.write_summary(str(tmp_path))
  assert done == {"eval_accuracy_start": 0.25, "start_step": 0, "eval_accuracy_end": 0.5,
                  "end_step": 2, "eval_accuracy_gain_points": 25.0}
  assert "25.0% (step 0) -> 50.0% (step 2): +25.0 points" in capsys.readouterr().out
  # The eval count, when the trainer passes it, travels with the accuracies (report's Wilson).
  with_n = logging_io.write_summary(str(tmp_path), eval_examples=512)
  assert with_n == {**done, "eval_examples": 512}


TINY_FLAGS = ["--config.sft.steps=10", "--config.train.steps=6", "--config.train.checkpoint_every=2",
              "--config.train.prompts_per_step=4", "--config.train.eval_examples=8",
              "--config.train.eval_every=0", "--config.train.tensorboard=False",
              "--config.data.synthetic_train=400", "--config.data.synthetic_test=40"]


def _command(workdir, *extra_flags):
  return [sys.executable, "-m", "grpo_jax.main", "--config=configs/gsm8k.py:tiny",
          f"--workdir={workdir}", *TINY_FLAGS, *extra_flags]


def _run(workdir, *extra_flags):
  done = subprocess.run(_command(workdir, *extra_flags), cwd=REPO, env=cli.env(),
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return done


def _start_and_signal(workdir, at_step, sig, *extra_flags):
  """Starts a run and sends `sig` once the checkpoint of `at_step` is on disk."""
  proc = subprocess.Popen(_command(workdir, *extra_flags), cwd=REPO, env=cli.env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  # Its checksums are the last file a save writes (a step without them is not resumed from).
  target = Path(workdir) / "checkpoints" / str(at_step) / "SHA256SUMS"
  deadline = time.time() + 600
  while not target.is_file() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  assert proc.poll() is None, f"the run ended before step {at_step}: {proc.stdout.read()[-3000:]}"
  proc.send_signal(sig)
  out, _ = proc.communicate(timeout=300)
  return proc.returncode, out


def _final_params(workdir):
  return load_file(str(Path(workdir) / "final_model" / "model.safetensors"))


def test_preempted_runs_resume_to_the_same_params_bit_for_bit(tmp_path):
  straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
  # Steps after the signal's checkpoint to spare: under load orbax commits a checkpoint (and so
  # the signal comes) a few steps after it was started; the run must not have finished by then.
  steps = "--config.train.steps=10"
  _run(straight, steps)

  code, _ = _start_and_signal(interrupted, 2, signal.SIGKILL, steps)
  assert code == -signal.SIGKILL
  assert not (interrupted / "final_model").exists()
  # The killed run could not release its workdir's lock: the next run takes it over, warning.
  killed = json.loads((interrupted / workdir_lock.LOCK_FILE).read_text())["pid"]
  code, out = _start_and_signal(interrupted, 4, signal.SIGTERM, steps)
  assert code == 128 + signal.SIGTERM, out[-3000:]  # 143: stopped by SIGTERM, resumable
  assert f"grpo_jax: warning: {interrupted}: taking over the lock left by PID {killed}" in out
  assert not (interrupted / workdir_lock.LOCK_FILE).exists()  # released after the SIGTERM
  assert "resumed from step 2" in out or "resumed from step 4" in out
  stopped = int(re.search(r"grpo_jax: interrupted \(SIGTERM\) in GRPO step (\d+) of 10: saved "
                          r"step \1 to \S+/checkpoints/\1; run the same command to resume",
                          out).group(1))
  assert 4 <= stopped < 10, out[-3000:]
  summary = json.loads((interrupted / "summary.json").read_text())
  assert summary["stopped_early"] is True and summary["stopped_at_step"] == stopped
  assert summary["start_step"] == 0 and "eval_accuracy_start" in summary
  assert "eval_accuracy_gain_points" not in summary and "eval_accuracy_end" not in summary
  # No gain ("... +1.2 points"); (the interrupt's line names <workdir>/checkpoints).
  assert f"stopped early at step {stopped}" in out and " points" not in out
  out = _run(interrupted, steps).stdout
  assert "resumed from step" in out
  summary = json.loads((interrupted / "summary.json").read_text())
  assert "stopped_early" not in summary and summary["end_step"] == 10
  assert "eval_accuracy_gain_points" in summary
  assert summary["eval_examples"] == 8  # --config.train.eval_examples=8 of the 40

  a, b = _final_params(straight), _final_params(interrupted)
  assert a.keys() == b.keys()
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)
  # The metrics of the interrupted run, once resumed, are those of the straight run.
  ma = logging_io.read_jsonl(str(straight / "metrics.jsonl"))
  mb = logging_io.read_jsonl(str(interrupted / "metrics.jsonl"))
  assert [r["step"] for r in mb] == [r["step"] for r in ma] == list(range(11))
  timing = set(logging_io.TIMING_METRICS)
  for ra, rb in zip(ma, mb):
    same = lambda r: {k: v for k, v in r.items() if k not in timing}
    assert same(ra) == same(rb), (ra, rb)
  # And so are the completions they sampled, with their rewards and advantages.
  sa, sb = (logging_io.read_jsonl(str(d / "samples.jsonl")) for d in (straight, interrupted))
  assert sa and sa == sb


def _checkpoint_train_state(workdir, step):
  """The train state a run's checkpoint of `step` holds, as NumPy arrays (read as orbax wrote
  it, without the run's code)."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  state = ocp.PyTreeCheckpointer().restore(str(Path(workdir) / "checkpoints" / str(step) / "state"))
  return jax.tree.map(np.asarray, state["train"])


def test_train_state_controllers_are_checkpointed_and_resume_bit_for_bit(tmp_path):
  """loss.use_adaptive_entropy: the coefficient is train state; so is the reference with
  loss.sync_ref_model (β > 0). A run stopped by SIGTERM after a checkpoint and resumed logs the
  same coefficients, metrics and final params as one that ran straight; the logged coefficient
  follows the controller's rule (with the target above any entropy: up by delta every update,
  applied from the second update on), and each checkpoint's reference is α·params + (1 − α)·
  the previous one's (synced every 2 updates: at each checkpoint)."""
  flags = ("--config.train.steps=6", "--config.loss.use_adaptive_entropy=True",
           "--config.loss.entropy_target=100.0", "--config.loss.entropy_coef_delta=0.01",
           "--config.loss.entropy_coef_max=0.035", "--config.loss.beta=0.01",
           "--config.loss.sync_ref_model=True", "--config.loss.ref_model_sync_steps=2",
           "--config.loss.ref_model_mixup_alpha=0.6")
  straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
  _run(straight, *flags)
  code, out = _start_and_signal(interrupted, 2, signal.SIGTERM, *flags)
  assert code == 128 + signal.SIGTERM, out[-3000:]
  assert "resumed from step" in _run(interrupted, *flags).stdout
  ma = logging_io.read_jsonl(str(straight / "metrics.jsonl"))
  mb = logging_io.read_jsonl(str(interrupted / "metrics.jsonl"))
  timing = set(logging_io.TIMING_METRICS)
  same = lambda r: {k: v for k, v in r.items() if k not in timing}
  assert [same(r) for r in ma] == [same(r) for r in mb]
  steps = [r for r in ma if "entropy_coef" in r]
  assert [r["step"] for r in steps] == list(range(1, 7))
  want = [min(0.01 * t, 0.035) for t in range(1, 7)]
  np.testing.assert_allclose([r["entropy_coef"] for r in steps], want, rtol=1e-6)
  np.testing.assert_allclose([r["entropy_coef/applied"] for r in steps], [0.0] + want[:-1],
                             rtol=1e-6)
  a, b = _final_params(straight), _final_params(interrupted)
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)
  # The KL is taken against the reference: 0 while the policy is it (the warm-up's first update
  # runs at lr 0), then > 0.
  assert [r["kl"] for r in steps[:2]] == [0.0, 0.0] and all(r["kl"] > 0 for r in steps[2:])
  states = {n: _checkpoint_train_state(straight, n) for n in (2, 4, 6)}
  for n in (4, 6):
    want = jax.tree.map(lambda r, p: r * np.float32(0.4) + p * np.float32(0.6),
                        states[n - 2]["ref"], states[n]["params"])
    for x, y in zip(jax.tree.leaves(states[n]["ref"]), jax.tree.leaves(want)):
      np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-9)
    for x, y in zip(jax.tree.leaves(states[n]["ref"]),
                    jax.tree.leaves(_checkpoint_train_state(interrupted, n)["ref"])):
      np.testing.assert_array_equal(x, y)


def test_warm_start_stops_at_the_first_check_reaching_its_target(tmp_path, monkeypatch, capsys):
  config = gsm8k.get_config("tiny")
  config.data.update(synthetic_train=400, synthetic_test=40)
  config.sft.update(steps=40, eval_every=10, target_accuracy=0.3, eval_examples=32, batch_size=8)
  config.train.update(steps=0, eval_examples=8, eval_batch_size=8, tensorboard=False)
  validation, trained = [], set()
  real_evaluate, real_reference = rollout.evaluate, sft.reference_completion

  def scripted_evaluate(config, sampler, tokenizer, params, rows, reward=None):
    if len(rows) != 32:  # the held-out eval at GRPO step 0: really measured
      return real_evaluate(config, sampler, tokenizer, params, rows, reward)
    validation.append([r["answer"] for r in rows])
    return (0.1, 0.25, 0.31, 0.9)[len(validation) - 1]

  def recording_reference(answer):
    trained.add(answer)
    return real_reference(answer)

  monkeypatch.setattr(rollout, "evaluate", scripted_evaluate)
  monkeypatch.setattr(sft, "reference_completion", recording_reference)
  train.run(config, str(tmp_path))
  out, err = capsys.readouterr()
  assert "warm start reached 31.0% on 32 validation problems (target 30%) after 30 steps" in out
  # Its progress ends at the real count (grpo_jax.progress off a terminal).
  assert ("grpo_jax: sft warm start 30/30 steps (stopped at 30 of at most 40: target reached), "
          "done in ") in err
  assert len(validation) == 3
  # The validation problems are the last 32 training problems, and the warm start never saw them.
  rows = [json.loads(line) for line in open(tmp_path / "data" / "train.jsonl")]
  assert validation[0] == [r["answer"] for r in rows[-32:]]
  assert len(trained) == 30 * 8  # 30 steps of 8 distinct rows: it stopped at the third check
  assert not trained & set(validation[0])


def test_warm_start_goes_back_when_a_check_overshoots_its_target(tmp_path, monkeypatch, capsys):
  """Checks every 10 steps at 10%, 15%, then 90% (> sft.overshoot_accuracy 50%): the warm start
  returns to step 20's params, optimizer state and data position, checks after every step, and
  stops at the first check reaching 30% (step 23). The steps it keeps are those a straight run
  takes: the rows of steps 21-23 are the rows it trained on the first time."""
  config = gsm8k.get_config("tiny")
  config.data.update(synthetic_train=400, synthetic_test=40)
  config.sft.update(steps=40, eval_every=10, target_accuracy=0.3, overshoot_accuracy=0.5,
                    eval_examples=32, batch_size=8)
  config.train.update(steps=0, eval_examples=8, eval_batch_size=8, tensorboard=False)
  scripted = [0.1, 0.15, 0.9, 0.2, 0.25, 0.35, 0.99]
  checked, batches = [], []
  real_evaluate, real_examples = rollout.evaluate, rollout.SingleTurn.sft_examples

  def scripted_evaluate(config, sampler, tokenizer, params, rows, reward=None):
    if len(rows) != 32:  # the held-out eval at GRPO step 0: really measured
      return real_evaluate(config, sampler, tokenizer, params, rows, reward)
    checked.append((len(batches), jax.tree.map(np.asarray, params)))
    return scripted[len(checked) - 1]

  def recording_examples(self, rows):
    batches.append(tuple(r["question"] for r in rows))
    return real_examples(self, rows)

  monkeypatch.setattr(rollout, "evaluate", scripted_evaluate)
  monkeypatch.setattr(rollout.SingleTurn, "sft_examples", recording_examples)
  train.run(config, str(tmp_path))
  out, err = capsys.readouterr()
  assert "90.0% is past sft.overshoot_accuracy 50%; going back to step 20" in out
  assert "grpo_jax: sft warm start 23/23 steps (stopped at 23 of at most 40: target reached)" in err
  assert "warm start reached 35.0% on 32 validation problems (target 30%) after 23 steps" in out
  # Checks after steps 10, 20, 30 (overshoot), then 21, 22, 23.
  assert [n for n, _ in checked] == [10, 20, 30, 31, 32, 33]
  assert batches[30:33] == batches[20:23]  # the data order went back with the params
  # The params at the retaken step 21 differ from step 30's and equal a straight run's step 21:
  # the second check's params (step 20) plus one step from the restored optimizer state.
  straight = _straight_sft_params(config, tmp_path / "straight", steps=21)
  for a, b in zip(jax.tree.leaves(checked[3][1]), jax.tree.leaves(straight)):
    np.testing.assert_array_equal(a, b)
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(checked[3][1]),
                                                     jax.tree.leaves(checked[2][1])))


def test_a_warm_start_interrupted_before_an_overshoot_goes_back_to_its_saved_check(
    tmp_path, monkeypatch):
  """Checks after steps 2, 4 (10%, 15%), 6 (90% > sft.overshoot_accuracy: back to step 4),
  5, 6 (35% reaches the target). A SIGINT during the step-4 check saves the warm start at step
  4, the check it would go back to included; the resumed warm start overshoots at step 6, goes
  back to the saved step 4 (params, optimizer state, data position) and stops where an
  uninterrupted one stops, with its params to the bit."""
  config = gsm8k.get_config("tiny")
  config.data.update(synthetic_train=400, synthetic_test=40)
  config.sft.update(steps=12, eval_every=2, target_accuracy=0.3, overshoot_accuracy=0.5,
                    eval_examples=32, batch_size=8)
  config.train.update(steps=0, eval_examples=8, eval_batch_size=8, tensorboard=False)
  real_evaluate = rollout.evaluate
  checks = {"n": 0, "interrupt_at": None}

  def scripted_evaluate(config, sampler, tokenizer, params, rows, reward=None):
    if len(rows) != 32:  # the held-out eval at GRPO step 0: really measured
      return real_evaluate(config, sampler, tokenizer, params, rows, reward)
    checks["n"] += 1
    if checks["n"] == checks["interrupt_at"]:
      os.kill(os.getpid(), signal.SIGINT)  # the run's handler records it
    return (0.1, 0.15, 0.9, 0.2, 0.35)[checks["n"] - 1]

  monkeypatch.setattr(rollout, "evaluate", scripted_evaluate)
  train.run(config, str(tmp_path / "straight"))
  assert checks["n"] == 5
  checks.update(n=0, interrupt_at=2)
  with pytest.raises(interrupts.Stopped) as stopped:
    train.run(config, str(tmp_path / "resumed"))
  assert stopped.value.code == 130
  assert str(stopped.value).startswith(
      "interrupted (SIGINT) in the warm start at step 4 of at most 12: saved it to")
  assert sft.has_checkpoint(str(tmp_path / "resumed"))
  train.run(config, str(tmp_path / "resumed"))  # its checks: the script's 3rd to 5th
  assert checks["n"] == 5 and not sft.has_checkpoint(str(tmp_path / "resumed"))
  a, b = (_final_params(tmp_path / d) for d in ("straight", "resumed"))
  assert a.keys() == b.keys()
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def _straight_sft_params(config, workdir, steps):
  """The params after `steps` warm-start steps of `config` with no check in between (the same
  training rows: the validation split is still taken off, but never evaluated)."""
  captured = {}
  straight = config.copy_and_resolve_references()
  straight.sft.update(steps=steps, eval_every=steps + 1, overshoot_accuracy=0.0)
  real = sft.run_sft

  def capture(*args, **kwargs):
    captured["params"] = jax.tree.map(np.asarray, real(*args, **kwargs))
    return captured["params"]

  with pytest.MonkeyPatch.context() as m:
    m.setattr(sft, "run_sft", capture)
    train.run(straight, str(workdir))
  return captured["params"]


def _informs(question: str) -> bool:
  return int(hashlib.sha256(question.encode()).hexdigest(), 16) % 7 < 3


def test_dynamic_sampling_trains_on_informative_groups_first(tmp_path, monkeypatch):
  # A scripted reward: in 3/7 of the groups (by a hash of the question) the first completion
  # scores 1 and the others 0; every other group is constant. Which prompts each step trains on
  # is then known in advance from the data order, independently of what the model samples.
  # With this data the 5 steps take 2 or 3 rounds, and one step is short and filled.
  def scripted(prompts, completions, group_size, question, **_):
    return [float(_informs(q) and i % group_size == 0) for i, q in enumerate(question)]

  monkeypatch.setattr(prepare, "build_rewards",
                      lambda *a, **k: [Reward("scripted", 1.0, scripted)])
  config = gsm8k.get_config("tiny")
  config.data.update(synthetic_train=400, synthetic_test=40)
  config.sampling.update(num_generations=4, max_new_tokens=4)
  config.sft.steps = 0
  config.train.update(steps=5, prompts_per_step=4, eval_examples=8, eval_batch_size=8,
                      samples_per_step=4, tensorboard=False, dynamic_sampling=True,
                      max_sampling_rounds=3)
  train.run(config, str(tmp_path))

  rows = [json.loads(line) for line in open(tmp_path / "data" / "train.jsonl")]
  order = data.PromptIterator(len(rows), 4, config.seed)
  records = logging_io.read_jsonl(str(tmp_path / "metrics.jsonl"))[1:]
  assert {r["sampling/rounds"] for r in records} == {2, 3}
  assert {r["sampling/filled_groups"] for r in records} == {0, 1}
  samples = logging_io.read_jsonl(str(tmp_path / "samples.jsonl"))
  for step, record in enumerate(records, 1):
    seen = []
    for _ in range(3):
      seen += [rows[i] for i in order.next_indices()]
      if sum(map(_informs, (r["question"] for r in seen))) >= 4:
        break
    chosen = ([r for r in seen if _informs(r["question"])]
              + [r for r in seen if not _informs(r["question"])])[:4]
    assert record["sampling/rounds"] == len(seen) // 4
    assert record["sampling/filled_groups"] == sum(not _informs(r["question"]) for r in chosen)
    assert record["advantages/frac_reward_zero_std"] == record["sampling/filled_groups"] / 4
    step_samples = [s for s in samples if s["step"] == step]
    assert [s["gold"] for s in step_samples] == [data.gold_answer(r["answer"]) for r in chosen]
    for s, r in zip(step_samples, chosen):
      assert r["question"] in s["prompt"]
      assert s["advantage"] > 0 if _informs(r["question"]) else s["advantage"] == 0


def test_the_first_steps_compile_ahead_layout_is_the_batch_at_max_new_tokens():
  """rollout.batch_layout (what the first step compiles while it samples) is the layout of the
  real train batch whose longest completion reaches max_new_tokens, and only of that one."""
  config = gsm8k.get_config()
  config.sampling.update(max_new_tokens=40, num_generations=4)
  config.loss.mask_truncated_completions = True
  tok = tokenizer_lib.load_tokenizer(str(fixtures.REAL_TOKENIZER))
  long_question = "Tom has 3 apples and buys 4 more bags of 6 apples. " * 3
  rows = [{"question": "What is 2 + 3?", "answer": "#### 5"},
          {"question": long_question, "answer": "#### 27"}]
  layout = rollout.batch_layout(config, tok, rows, num_rewards=2)
  prompts = rollout.encode(config, tok, rows)
  rng = np.random.default_rng(0)

  def real(lengths_B):
    r = rollout.Rollouts(rows, prompts.texts, prompts.ids, rng.integers(0, 100, (8, 40)),
                         lengths_B, lengths_B == 40, [""] * 8, rng.normal(size=(8, 2)),
                         sampler_logp_BC=-rng.random((8, 40)))
    return {k: (v.shape, v.dtype) for k, v in r.train_batch(config, tok.pad_token_id).items()}
  lengths_B = np.array([3, 40, 17, 8, 1, 39, 22, 5])
  assert real(lengths_B) == {k: (v.shape, v.dtype) for k, v in layout.items()}
  longest = max(map(len, prompts.ids))
  bucket = min(b for b in config.data.prompt_buckets if b >= longest)
  assert layout["prompt_NP"].shape == (8 // config.sampling.num_generations, bucket)
  assert real(np.minimum(lengths_B, 30))["completion_BC"][0] == (8, 32)


def _flip_a_bit(step_dir: Path):
  """Flips one bit in the middle of the step's largest file (an array data file), as bit rot."""
  path = max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
             key=lambda p: p.stat().st_size)
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 1
  path.write_bytes(data)


def test_damaged_checkpoints_resume_from_the_last_good_one_or_stop_clearly(tmp_path):
  workdir, no_sft = tmp_path / "run", "--config.sft.steps=0"  # the warm start is beside the point
  ckpts = workdir / "checkpoints"
  _run(workdir, no_sft)
  assert sorted(int(p.name) for p in ckpts.iterdir()) == [2, 4, 6]
  final = _final_params(workdir)

  _flip_a_bit(ckpts / "6")
  done = _run(workdir, no_sft)
  assert "checkpoint step 6" in done.stderr and "does not match its checksum" in done.stderr
  assert "resumed from step 4" in done.stdout
  # Steps 5 and 6 were recomputed from step 4's intact values: the same final params as before.
  again = _final_params(workdir)
  assert again.keys() == final.keys()
  for name in final:
    np.testing.assert_array_equal(again[name], final[name], err_msg=name)
  records = logging_io.read_jsonl(str(workdir / "metrics.jsonl"))
  assert [r["step"] for r in records] == list(range(7))

  for step_dir in ckpts.iterdir():
    _flip_a_bit(step_dir)
  failed = subprocess.run(_command(workdir, no_sft), cwd=REPO, env=cli.env(), capture_output=True,
                          text=True, timeout=600)
  message = cli.assert_user_error(failed, f"no usable checkpoint in {ckpts}")
  assert message.startswith(f"grpo_jax: error: no usable checkpoint in {ckpts}")
  assert "resumed" not in failed.stdout and not (workdir / "checkpoints" / "0").exists()


def _fails(workdir, *extra_flags):
  return subprocess.run(_command(workdir, *extra_flags), cwd=REPO, env=cli.env(),
                        capture_output=True, text=True, timeout=600)


def test_a_resume_with_another_config_stops_clearly_or_says_what_changed(tmp_path):
  workdir, no_sft = tmp_path / "run", "--config.sft.steps=0"
  _run(workdir, no_sft, "--config.train.steps=2")
  step_2 = f"{workdir / 'checkpoints'}/2"
  # A run cannot be made shorter than its workdir's: stop, rather than report step 2 as step 1's.
  cli.assert_user_error(_fails(workdir, no_sft, "--config.train.steps=1"), step_2,
                        "past train.steps=1")
  assert json.loads((workdir / "summary.json").read_text())["end_step"] == 2
  # Another seed deals the prompts in another order than the checkpoint's data position says.
  cli.assert_user_error(_fails(workdir, no_sft, "--config.train.steps=2", "--config.seed=5"),
                        step_2, "seed")
  # Refused, they leave the config of the run that made the checkpoints.
  config = json.loads((workdir / "config.json").read_text())
  assert config["seed"] == 0 and config["train"]["steps"] == 2
  # Extended, with another rate and warm-up: it goes on from step 2, and says what changed, with
  # the cosine's length that follows train.steps (max(steps, warm-up + 1): 51 before, 3 now).
  done = _run(workdir, no_sft, "--config.train.steps=3", "--config.optim.lr=0.0001",
              "--config.optim.warmup_steps=1")
  assert "resumed from step 2" in done.stdout
  warning = [line for line in done.stderr.splitlines() if "settings changed" in line]
  assert len(warning) == 1, done.stderr[-3000:]
  for change in ("optim.lr: 0.0003 -> 0.0001", "optim.warmup_steps: 50 -> 1",
                 "train.steps: 2 -> 3", "the cosine schedule's length", "51 -> 3 updates"):
    assert change in warning[0], warning[0]
  assert "seed" not in warning[0] and "compilation_cache" not in warning[0]
  # The same command again (the run is finished): nothing changed, nothing said.
  assert "settings changed" not in _run(workdir, no_sft, "--config.train.steps=3",
                                        "--config.optim.lr=0.0001",
                                        "--config.optim.warmup_steps=1").stderr


def test_a_resumed_run_stops_on_non_finite_steps_where_an_uninterrupted_one_does(tmp_path,
                                                                                monkeypatch):
  """NaN reward weights in the train step's settings (validate refuses them in a config, so
  they enter through Trainer.hparams): every loss is NaN, every update skipped."""
  real_hparams = trainer_lib.Trainer.hparams
  monkeypatch.setattr(trainer_lib.Trainer, "hparams", lambda self, config: dict(
      real_hparams(self, config),
      reward_weights=np.full_like(real_hparams(self, config)["reward_weights"], np.nan)))

  def config(steps):
    c = gsm8k.get_config("tiny")
    c.data.update(synthetic_train=400, synthetic_test=40)
    c.sft.steps = 0
    c.train.update(steps=steps, max_bad_steps=3, checkpoint_every=2, prompts_per_step=4,
                   eval_examples=8, eval_every=0, tensorboard=False)
    return c

  with pytest.raises(runs_lib.TooManyBadSteps, match="3 consecutive non-finite steps up to step 3"):
    train.run(config(6), str(tmp_path / "straight"))
  # Two bad steps, the run's end, then the same run extended: its third bad step stops it.
  train.run(config(2), str(tmp_path / "resumed"))
  with pytest.raises(runs_lib.TooManyBadSteps, match="3 consecutive non-finite steps up to step 3"):
    train.run(config(6), str(tmp_path / "resumed"))


def test_a_sigterm_during_the_step_0_eval_stops_before_a_step(tmp_path, monkeypatch):
  config = gsm8k.get_config("tiny")
  config.data.update(synthetic_train=400, synthetic_test=40)
  config.sft.steps = 0
  config.train.update(steps=3, eval_examples=8, eval_batch_size=8, tensorboard=False)
  real = members_lib.evaluate

  def evaluate_then_preempted(*args):
    os.kill(os.getpid(), signal.SIGTERM)  # the run's handler only records it
    return real(*args)

  monkeypatch.setattr(members_lib, "evaluate", evaluate_then_preempted)
  with pytest.raises(interrupts.Stopped) as stopped:
    train.run(config, str(tmp_path))
  assert stopped.value.code == 143
  assert str(stopped.value) == (f"interrupted (SIGTERM) in the step-0 evaluation: saved step 0 "
                                f"to {tmp_path}/checkpoints/0; run the same command to resume")
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["stopped_early"] and summary["stopped_at_step"] == 0, summary
  assert [r["step"] for r in logging_io.read_jsonl(str(tmp_path / "metrics.jsonl"))] == [0]
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["0"]


def test_a_fresh_run_queues_its_first_steps_train_program_before_the_step_0_eval(tmp_path,
                                                                                  monkeypatch):
  """A run warm-started here evaluates step 0 before its first step: the first step's train
  program is handed to the compile thread before that eval starts (members.compile_ahead), for
  the prompts the first step then samples, so the compile overlaps the eval."""
  config = gsm8k.get_config("tiny")
  config.data.update(synthetic_train=400, synthetic_test=40)
  config.sft.steps = 0
  config.train.update(steps=1, prompts_per_step=4, eval_examples=8, eval_batch_size=8,
                      samples_per_step=4, tensorboard=False,
                      dynamic_sampling=False)  # one round: the first rows are the step's rows
  events = []
  real_ahead, real_eval = members_lib.compile_ahead, members_lib.evaluate

  def ahead(trainers, group, rows_K, num_rewards, **kwargs):
    events.append(("compile_ahead", [r["question"] for r in rows_K[0]]))
    return real_ahead(trainers, group, rows_K, num_rewards, **kwargs)

  def evaluate(*args):
    events.append(("eval",))
    return real_eval(*args)
  monkeypatch.setattr(members_lib, "compile_ahead", ahead)
  monkeypatch.setattr(members_lib, "evaluate", evaluate)
  train.run(config, str(tmp_path))
  assert [e[0] for e in events[:2]] == ["compile_ahead", "eval"], events
  questions = events[0][1]
  # The samples file has each of the step's prompts, in the order the step drew them.
  prompts = [s["prompt"] for s in logging_io.read_jsonl(str(tmp_path / "samples.jsonl"))
             if s["step"] == 1]
  assert len(prompts) == len(questions) == 4
  for q, p in zip(questions, prompts):
    assert q in p, (q, p)
