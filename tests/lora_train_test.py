"""LoRA in the train step and the loop: adapter gradients against the chain rule through the
full-weight step, the reference as the base with the adapters off, the frozen base untouched,
K members on one shared base against separate steps, sharded against one device, and a tiny
LoRA run that resumes bit for bit and exports an adapter that PEFT loads."""
import functools
import json
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import cli
from grpo_jax import config as config_lib, grpo, members, policy as policy_lib, sharding, train_step
from grpo_jax.models import lora, qwen

MODEL = qwen.QwenConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10_000.0,
                        tie_word_embeddings=True, qkv_bias=True)
B, P, C, G = 16, 6, 8, 4
EOS = MODEL.vocab_size - 1
LCFG = lora.LoraConfig(rank=4, alpha=8.0)
LORA = policy_lib.Lora(LCFG)


def loss_config(**kw):
  cfg = config_lib.loss()
  cfg.update(loss_type="grpo", beta=0.0, kl_estimator="k3", num_iterations=1,
             mask_truncated_completions=False)
  cfg.update(**kw)
  return cfg


def optim_config(**kw):
  cfg = config_lib.optim()
  # max_grad_norm 0 and no decay: AdamW's first moment after one step is (1 − b1)·grad.
  cfg.update(lr=1e-2, weight_decay=0.0, max_grad_norm=0.0, grad_accum_steps=2,
             compute_dtype="float32", remat=False)
  cfg.update(**kw)
  return cfg


@pytest.fixture(scope="module")
def base():
  # At qwen's own initialisation. (Params scaled ×5 make the fp32 forward ill-conditioned
  # enough that merged and unmerged weights round apart: the chain-rule comparison below then
  # differs by 9e-4 of its scale, against 6e-6 here; in both it shrinks with the adapters.)
  return qwen.init_params(MODEL, jax.random.key(0))


def adapters_like_trained(key, scale=0.3):
  """Adapters with b != 0 (a trained adapter), so every path through them carries signal."""
  a = lora.init(key, MODEL, LCFG)
  leaves, tree = jax.tree.flatten(a)
  keys = jax.random.split(jax.random.fold_in(key, 1), len(leaves))
  return jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape)
                                   for x, k in zip(leaves, keys)])


def train_batch(seed=0):
  rng = np.random.default_rng(seed)
  tokens = np.zeros((B, P + C), np.int32)
  attn = np.zeros((B, P + C), np.int32)
  cmask = np.zeros((B, C), np.int32)
  for b in range(B):
    plen, clen = rng.integers(2, P + 1), rng.integers(1, C + 1)
    tokens[b, P - plen:P] = rng.integers(1, EOS, plen)
    tokens[b, P:P + clen] = rng.integers(1, EOS, clen)
    attn[b, P - plen:P + clen] = 1
    cmask[b, :clen] = 1
  adv, _ = grpo.group_advantages(rng.normal(size=(B, 1)), G)
  return {"tokens_BS": tokens, "attn_mask_BS": attn, "completion_mask_BC": cmask,
          "advantages_B": np.asarray(adv, np.float32)}


def first_moment(state):
  found = [s.mu for s in jax.tree.leaves(state["opt_state"], is_leaf=lambda s: hasattr(s, "mu"))
           if hasattr(s, "mu")]
  return found[0]


def _flat2(x, n_in):
  """[*in, *out] → [prod(in), prod(out)]."""
  return x.reshape(int(np.prod(x.shape[:n_in])), -1)


def test_adapter_gradients_are_the_chain_rule_of_the_full_weight_gradient(base):
  """W' = W + s·a·b, so dL/da = s·dL/dW'·bᵀ and dL/db = s·aᵀ·dL/dW', with dL/dW' the
  full-weight step's gradient at the merged weights (a path tested against finite differences
  in train_step_test)."""
  mesh = sharding.make_mesh((1, 1, 1))
  batch = train_batch()
  adapters = adapters_like_trained(jax.random.key(3))
  lora_grad = train_step.make_grad_fn(MODEL, loss_config(), optim_config(), mesh, batch,
                                      group_size=G, policy=LORA)
  full_grad = train_step.make_grad_fn(MODEL, loss_config(), optim_config(), mesh, batch,
                                      group_size=G)
  loss_l, g_ad = lora_grad(adapters, batch, base)
  merged = lora.merge(base, adapters, LCFG)
  loss_f, g_w = full_grad(merged, batch)
  np.testing.assert_allclose(loss_l, loss_f, rtol=1e-5)
  s = LCFG.scale
  for t, (parent, n_in) in lora.TARGETS.items():
    gw = np.asarray(g_w["layers"][parent][t]["kernel"], np.float64)
    a = np.asarray(adapters["layers"][parent][t]["lora_a"], np.float64)
    b = np.asarray(adapters["layers"][parent][t]["lora_b"], np.float64)
    ga = np.asarray(g_ad["layers"][parent][t]["lora_a"])
    gb = np.asarray(g_ad["layers"][parent][t]["lora_b"])
    for layer in range(MODEL.num_layers):
      gw2 = _flat2(gw[layer], n_in)                     # [in, out]
      a2 = a[layer].reshape(gw2.shape[0], -1)           # [in, r]
      b2 = b[layer].reshape(-1, gw2.shape[1])           # [r, out]
      want_a = s * gw2 @ b2.T
      want_b = s * a2.T @ gw2
      scale_a, scale_b = np.abs(want_a).max(), np.abs(want_b).max()
      assert scale_a > 1e-6 and scale_b > 1e-6, t  # signal, not two zeros compared
      np.testing.assert_allclose(ga[layer].reshape(want_a.shape), want_a, atol=2e-5 * scale_a,
                                 err_msg=f"{t} lora_a layer {layer}")
      np.testing.assert_allclose(gb[layer].reshape(want_b.shape), want_b, atol=2e-5 * scale_b,
                                 err_msg=f"{t} lora_b layer {layer}")


def test_reference_is_the_base_with_adapters_off_and_the_base_stays_frozen(base):
  """β > 0: the step's own reference forward gives the metrics that the base model's
  log-probs (the full-weight log-prob function on the base params) give as ref_logp_BC; with
  fresh adapters (b = 0) the KL is exactly 0. The base is not donated and not changed, and
  the state holds the adapters alone."""
  mesh = sharding.make_mesh((1, 1, 1))
  loss_cfg, optim = loss_config(beta=0.1), optim_config()
  step = train_step.TrainStep(MODEL, loss_cfg, optim, mesh, group_size=G, policy=LORA)
  frozen = train_step.reference_params(base, MODEL, optim, mesh, LORA)
  before = jax.tree.map(np.asarray, frozen)
  batch = train_batch(1)
  adapters = adapters_like_trained(jax.random.key(4))
  logp_fn = train_step.make_logprob_fn(MODEL, optim, mesh)
  ref_logp = np.asarray(logp_fn(base, batch["tokens_BS"], batch["attn_mask_BS"], C))

  got, got_m, _ = step(train_step.create_train_state(adapters, MODEL, optim, mesh, LORA),
                       batch, frozen)
  want, want_m, _ = step(train_step.create_train_state(adapters, MODEL, optim, mesh, LORA),
                         dict(batch, ref_logp_BC=ref_logp), frozen)
  assert got_m["loss/kl"] > 1e-6
  np.testing.assert_allclose(got_m["loss/kl"], want_m["loss/kl"], rtol=1e-5)
  np.testing.assert_allclose(got_m["loss"], want_m["loss"], rtol=1e-5, atol=1e-7)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7),
               jax.device_get(got["params"]), jax.device_get(want["params"]))
  assert jax.tree.structure(got["params"]) == jax.tree.structure(adapters)
  jax.tree.map(np.testing.assert_array_equal, before, jax.device_get(frozen))

  fresh = lora.init(jax.random.key(5), MODEL, LCFG)
  _, fresh_m, _ = step(train_step.create_train_state(fresh, MODEL, optim, mesh, LORA), batch,
                       frozen)
  assert fresh_m["loss/kl"] == 0.0


def test_a_lora_step_without_its_base_is_refused(base):
  mesh = sharding.make_mesh((1, 1, 1))
  step = train_step.TrainStep(MODEL, loss_config(), optim_config(), mesh, group_size=G,
                              policy=LORA)
  state = train_step.create_train_state(lora.init(jax.random.key(0), MODEL, LCFG), MODEL,
                                        optim_config(), mesh, LORA)
  with pytest.raises(ValueError, match="frozen base"):
    step(state, train_batch())


@pytest.mark.parametrize("batched", [True, False])
def test_members_share_one_base_and_match_separate_steps(base, batched):
  """K = 2 LoRA members with different lr and β: the members' program (vmapped, or each
  member's step in turn) takes the base once (unstacked) and gives each member what its own
  step gives."""
  mesh = sharding.make_mesh((1, 1, 1))
  optim = optim_config()
  cfgs = [(loss_config(beta=0.05), 1e-2), (loss_config(beta=0.2), 3e-3)]
  step = train_step.TrainStep(MODEL, cfgs[0][0], optim, mesh, group_size=G, policy=LORA)
  frozen = train_step.reference_params(base, MODEL, optim, mesh, LORA)
  adapters = [adapters_like_trained(jax.random.key(10 + k)) for k in range(2)]
  batches = [train_batch(20 + k) for k in range(2)]
  hps = [train_step.hparams(lc, optim_config(lr=lr), (), LORA) for lc, lr in cfgs]
  want = [step(train_step.create_train_state(a, MODEL, optim, mesh, LORA), b, frozen, hp)
          for a, b, hp in zip(adapters, batches, hps)]
  stack = lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
  state_K = stack([train_step.create_train_state(a, MODEL, optim, mesh, LORA)
                   for a in adapters])
  got, got_m, _ = members.train(step, state_K, batches, stack(hps), frozen, batched=batched)
  for k in range(2):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x[k], y, rtol=2e-5, atol=1e-7),
                 jax.device_get(got["params"]), jax.device_get(want[k][0]["params"]))
    for name in ("loss", "loss/kl", "grad_norm"):
      np.testing.assert_allclose(got_m[name][k], want[k][1][name], rtol=2e-5, atol=1e-7)
  # The base entered once, unstacked (vmapped over a K axis it would not have run at all: its
  # leaves' leading sizes differ).
  assert frozen["embed_tokens"]["embedding"].shape == (MODEL.vocab_size, MODEL.hidden_size)


@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (1, 2, 4)])
def test_sharded_lora_step_equals_one_device(base, mesh_shape):
  optim = optim_config()
  batch = train_batch(7)
  adapters = adapters_like_trained(jax.random.key(7))
  results = []
  for shape in ((1, 1, 1), mesh_shape):
    mesh = sharding.make_mesh(shape)
    step = train_step.TrainStep(MODEL, loss_config(beta=0.05), optim, mesh, group_size=G,
                                policy=LORA)
    frozen = train_step.reference_params(base, MODEL, optim, mesh, LORA)
    state, m, _ = step(train_step.create_train_state(adapters, MODEL, optim, mesh, LORA),
                       batch, frozen)
    results.append((jax.device_get(state["params"]), jax.device_get(first_moment(state)), m))
  (p1, mu1, m1), (p2, mu2, m2) = results
  # Gradients (AdamW's first moment) to 5e-5 of their scale: the advantage-weighted sum
  # cancels, so summation order shows there. On one device, 1 against 2 micro-batches already
  # differ by 1.5e-5 of the scale, and these meshes by 2.3-2.6e-5; a wrong split is off by O(1).
  scale = max(np.abs(x).max() for x in jax.tree.leaves(mu1))
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=5e-5 * scale), mu1, mu2)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), p1, p2)
  np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-5, atol=1e-7)


LORA_FLAGS = ["--config=configs/gsm8k.py:tiny_lora", "--config.sft.steps=200",
              "--config.sft.target_accuracy=0.0", "--config.train.steps=8",
              "--config.train.checkpoint_every=2", "--config.train.prompts_per_step=4",
              "--config.train.eval_examples=8", "--config.train.eval_every=0",
              "--config.train.tensorboard=False",
              "--config.data.synthetic_train=400", "--config.data.synthetic_test=40"]


def _lora_run(workdir, stop_at=None):
  """A shortened tiny_lora run; stop_at: SIGTERM once that step's checkpoint is written."""
  import time
  from pathlib import Path
  cmd = [sys.executable, "-m", "grpo_jax.main", f"--workdir={workdir}", *LORA_FLAGS]
  proc = subprocess.Popen(cmd, cwd=cli.REPO, env=cli.env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  if stop_at is not None:
    target = Path(workdir) / "checkpoints" / str(stop_at) / "SHA256SUMS"
    deadline = time.time() + 600
    while not target.is_file() and proc.poll() is None and time.time() < deadline:
      time.sleep(0.05)
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == (0 if stop_at is None else 128 + signal.SIGTERM), out[-3000:]
  return out


def _dir_bytes(d):
  return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def test_a_tiny_lora_run_resumes_bit_for_bit_and_exports_what_peft_loads(tmp_path):
  """The loop with model.lora: small checkpoints (adapters and their moments, no base), the
  warm-started base written once, a SIGTERM-and-resume run equal to a straight one to the bit,
  and at the end a PEFT adapter that peft loads onto that base with the merged export's
  logits and greedy tokens.

  The warm start runs once, in the first leg of the interrupted run: its steps 1-2 train on the
  base in memory. The other run starts from that leg's step-0 checkpoint and written base, as a
  sweep's members start from their prefix, and trains steps 1-8 on the base read back (as the
  second leg does for steps 3-8): equal adapters at the end also show that the written base is
  the one in memory, to the bit."""
  import peft
  import torch
  import fixtures
  from grpo_jax import sweep_runner
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  out = _lora_run(resumed, stop_at=2)
  assert "grpo_jax: interrupted (SIGTERM) in GRPO step" in out
  assert sweep_runner.start_from_prefix(str(resumed), str(straight))
  out = _lora_run(straight)
  assert "resumed from step 0" in out
  out = _lora_run(resumed)
  assert "resumed from step" in out
  for d in (straight, resumed):
    assert (d / "final_adapter" / "adapter_config.json").is_file()
  a = load_file(str(straight / "final_adapter" / "adapter_model.safetensors"))
  b = load_file(str(resumed / "final_adapter" / "adapter_model.safetensors"))
  assert a.keys() == b.keys() and len(a) == 2 * 7 * 2  # A and B, 7 targets, 2 layers
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)
  assert any(np.abs(v).max() > 0 for k, v in a.items() if "lora_B" in k)  # GRPO moved b

  # Checkpoints: the adapters with two AdamW moments, in fp32, and small scalars; no base.
  adapter_bytes = sum(v.size * 4 for v in a.values())
  base_bytes = _dir_bytes(straight / "base_model")
  ckpt = _dir_bytes(straight / "checkpoints" / "8")
  assert 3 * adapter_bytes <= ckpt < 3 * adapter_bytes + 200_000 < base_bytes, (
      ckpt, adapter_bytes, base_bytes)

  # PEFT onto the warm-started base against the merged final model, in transformers.
  config = json.loads((straight / "final_adapter" / "adapter_config.json").read_text())
  assert config["base_model_name_or_path"] == str(straight / "base_model")
  model = peft.PeftModel.from_pretrained(fixtures.hf_model(straight / "base_model"),
                                         straight / "final_adapter").eval()
  merged = fixtures.hf_model(straight / "final_model")
  rng = np.random.default_rng(0)
  vocab = json.loads((straight / "base_model" / "config.json").read_text())["vocab_size"]
  tokens = torch.tensor(rng.integers(1, vocab, (2, 12)))
  with torch.no_grad():
    got = model(input_ids=tokens).logits.numpy()
    want = merged(input_ids=tokens).logits.numpy()
    assert np.abs(got - want).max() <= 1e-4
    model.generation_config.eos_token_id = None
    merged.generation_config.eos_token_id = None
    kw = dict(do_sample=False, max_new_tokens=10, pad_token_id=0)
    np.testing.assert_array_equal(model.generate(input_ids=tokens, **kw).numpy(),
                                  merged.generate(input_ids=tokens, **kw).numpy())


def test_vmapped_lora_members_share_one_base_and_match_their_separate_runs(tmp_path):
  """Two tiny_lora runs (two learning rates, one seed) as one vmapped group from a shared warm
  start, as `sweep --vmap` runs them: the prefix's base is handed over with its checkpoint, the
  group holds one copy of it, and the member with the separate run's settings ends where that
  run ends (tolerances of vmapped_test)."""
  import os
  from safetensors.numpy import load_file as load
  from grpo_jax import logging_io, members as members_lib, sweep, sweep_runner, train

  fixed = {"sft.steps": 200, "sft.target_accuracy": 0.0, "train.steps": 3,
           "train.eval_examples": 8, "train.eval_every": 0, "train.checkpoint_every": 3,
           "train.tensorboard": False, "train.prompts_per_step": 4,
           "data.synthetic_train": 400, "data.synthetic_test": 40,
           "optim.warmup_steps": 0}  # each member's own rate from step 1 (checked below)

  def config(lr):
    c = sweep.load_config("configs/gsm8k.py:tiny_lora")
    sweep.apply_overrides(c, {**fixed, "optim.lr": lr})
    return c
  sep, a, b = (str(tmp_path / n) for n in ("separate", "other", "member"))
  train.run(config(3e-3), sep)
  for d in (a, b):
    os.makedirs(d)
    sweep_runner.start_from_prefix(sep, d)
    assert os.path.isfile(os.path.join(d, "base_model", "model.safetensors"))
  seen = {}
  original = members_lib.Group.of

  def spy(states, refs, hparams, shared_ref=False):
    group = original(states, refs, hparams, shared_ref)
    seen.update(shared=shared_ref, ref=group.ref)
    return group
  members_lib.Group.of = spy
  try:
    train.run_group([config(1e-3), config(3e-3)], [a, b])
  finally:
    members_lib.Group.of = original
  emb = seen["ref"]["embed_tokens"]["embedding"]
  assert seen["shared"] and emb.ndim == 2  # one base, no K axis

  want, got = (logging_io.read_jsonl(os.path.join(d, "metrics.jsonl")) for d in (sep, b))
  assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 1, 2, 3]
  for w, g in zip(want, got):
    for k in set(w) - set(logging_io.TIMING_METRICS):
      # drift/* measure float32 rounding between the sampler and the train step (~1e-6 here),
      # which two differently compiled programs do not share: compared at their noise bound
      # (train_test's 1e-4), not as if they were a signal.
      tol = dict(abs=1e-4) if k.startswith("drift/") else dict(rel=2e-3, abs=1e-6)
      assert g[k] == pytest.approx(w[k], **tol), (w["step"], k)
  p_sep, p_b = (load(os.path.join(d, "final_adapter", "adapter_model.safetensors"))
                for d in (sep, b))
  assert max(float(np.abs(p_sep[k] - p_b[k]).max()) for k in p_sep) <= 2 * 3e-3 * 3
  other = logging_io.read_jsonl(os.path.join(a, "metrics.jsonl"))
  assert other[1]["lr"] == pytest.approx(1e-3) and got[1]["lr"] == pytest.approx(3e-3)


def test_lora_members_with_different_bases_are_refused():
  """A group's LoRA members share one base: a member whose base differs (a seed-dependent warm
  start or random initialisation) stops the group with a line naming both workdirs."""
  import types
  from grpo_jax import members as members_lib
  members = [types.SimpleNamespace(workdir="runs/a"), types.SimpleNamespace(workdir="runs/b")]
  base = {"w": jnp.ones(3), "v": jnp.arange(4.0)}
  same = {"w": jnp.ones(3), "v": jnp.arange(4.0)}
  assert members_lib.shared_base(members, [base], members[1], same) is base
  with pytest.raises(members_lib.VmapError, match="runs/b and runs/a have different frozen bases"):
    members_lib.shared_base(members, [base], members[1], {"w": jnp.ones(3), "v": -jnp.arange(4.0)})


def test_an_int8_base_qlora_step_equals_the_step_on_its_dequantized_base(base):
  """model.lora.quantize='int8': the frozen base keeps int8 kernels (with per-channel scales)
  and the step reads them through qwen's dequantization; it computes what the same step
  computes on the dequantized fp32 base (quant_test bounds the rounding itself)."""
  from grpo_jax.models import quant
  mesh = sharding.make_mesh((1, 1, 1))
  optim = optim_config()
  q8 = lora.LoraConfig(rank=4, alpha=8.0, quantize="int8")
  frozen = train_step.reference_params(base, MODEL, optim, mesh, policy_lib.Lora(q8))
  assert quant.is_quantized(frozen)
  assert frozen["layers"]["mlp"]["up_proj"]["kernel_q"].dtype == jnp.int8
  batch = train_batch(3)
  adapters = adapters_like_trained(jax.random.key(8))
  results = []
  for lcfg, fr in ((q8, frozen), (LCFG, jax.jit(quant.dequantize)(frozen))):
    step = train_step.TrainStep(MODEL, loss_config(beta=0.05), optim, mesh, group_size=G,
                                policy=policy_lib.Lora(lcfg))
    state, m, _ = step(train_step.create_train_state(adapters, MODEL, optim, mesh,
                                                       policy_lib.Lora(lcfg)),
                       batch, fr)
    results.append((jax.device_get(state["params"]), m))
  (p1, m1), (p2, m2) = results
  for name in ("loss", "loss/kl", "grad_norm"):
    np.testing.assert_allclose(m1[name], m2[name], rtol=1e-6, atol=1e-8, err_msg=name)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-8), p1, p2)


# --- model.lora.init_from: a run that starts from a PEFT adapter --------------------------------

INIT_RANK, INIT_ALPHA = 8, 16.0  # tiny_lora's model.lora


def _peft_adapter(ckpt, out, seed=0, **lora_kw):
  """A PEFT adapter on the checkpoint at ckpt, b moved off 0 as training would, saved to out;
  returns the PeftModel (eval mode)."""
  import peft
  import torch
  import fixtures
  torch.manual_seed(seed)
  kw = dict(r=INIT_RANK, lora_alpha=INIT_ALPHA, target_modules=list(lora.TARGETS))
  kw.update(lora_kw)
  model = peft.get_peft_model(fixtures.hf_model(ckpt), peft.LoraConfig(**kw))
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "lora_B" in name:
        p.normal_(0, 0.2)
  model.save_pretrained(out)
  return model.eval()


@pytest.fixture(scope="module")
def init_from(tmp_path_factory):
  """A tiny transformers Qwen2 with the tiny tokenizer's vocabulary (512) and a PEFT adapter of
  tiny_lora's rank and alpha on it."""
  import fixtures
  root = tmp_path_factory.mktemp("init_from")
  ckpt = fixtures.make_checkpoint(root, "qwen2_untied", vocab_size=512)
  model = _peft_adapter(ckpt, root / "adapter")
  return ckpt, root / "adapter", model


def _peft_logits(model, tokens):
  import torch
  with torch.no_grad():
    return model(input_ids=torch.tensor(tokens)).logits.numpy()


def test_init_from_gives_a_step_0_policy_with_peft_logits(init_from):
  """What the run's train state starts from (policy.Lora.init_trainable with init_from): on
  the checkpoint, its logits are peft's for the loaded adapter."""
  from grpo_jax.models import weights
  ckpt, adapter, model = init_from
  params, cfg = weights.load_checkpoint(ckpt)
  lcfg = lora.LoraConfig(rank=INIT_RANK, alpha=INIT_ALPHA, init_from=str(adapter))
  adapters = policy_lib.Lora(lcfg).init_trainable(params, cfg, 0, jnp.float32)
  tokens = np.random.default_rng(0).integers(1, 512, (2, 11))
  f = jax.jit(lambda p, a, t: qwen.Qwen(cfg).apply(
      lora.variables(p, a, lcfg), qwen.Qwen(cfg).apply(
          lora.variables(p, a, lcfg), t, qwen.positions_from_mask(jnp.ones_like(t)),
          jnp.ones_like(t))[0], method=qwen.Qwen.logits))
  ours = np.asarray(f(params, adapters, jnp.asarray(tokens)))
  base = np.asarray(f(params, None, jnp.asarray(tokens)))
  assert np.abs(ours - base).max() > 0.05  # the adapter matters
  assert np.abs(ours - _peft_logits(model, tokens)).max() <= 1e-4


def _init_from_flags(ckpt, adapter, *extra):
  return ["--config=configs/gsm8k.py:tiny_lora", "--config.model.random_init=False",
          f"--config.model.checkpoint={ckpt}", "--config.sft.steps=0",
          f"--config.model.lora.init_from={adapter}", "--config.train.steps=2",
          "--config.train.prompts_per_step=4", "--config.train.eval_examples=8",
          "--config.train.eval_every=0", "--config.train.tensorboard=False",
          "--config.data.synthetic_train=400", "--config.data.synthetic_test=40", *extra]


def test_init_from_trains_the_adapter_further_and_exports_what_peft_loads(init_from, tmp_path):
  """peft adapter -> a 2-step grpo_jax run from it -> final_adapter/ -> peft: the run started
  from the adapter (step 1's KL to the base is > 0, where fresh adapters give exactly 0; the
  trained factors are within the 2 AdamW steps' reach of the loaded ones), trained it (they
  moved), and peft loads the export with the logits of the merged final_model/."""
  import peft
  import fixtures
  from grpo_jax import logging_io
  ckpt, adapter, _ = init_from
  proc = subprocess.run([sys.executable, "-m", "grpo_jax.main", f"--workdir={tmp_path}/run",
                         *_init_from_flags(ckpt, adapter)], cwd=cli.REPO, env=cli.env(),
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  run = tmp_path / "run"
  rows = logging_io.read_jsonl(str(run / "metrics.jsonl"))
  assert rows[1]["step"] == 1 and rows[1]["loss/kl"] > 1e-6
  loaded = load_file(str(adapter / lora.WEIGHTS_FILE))
  trained = load_file(str(run / "final_adapter" / lora.WEIGHTS_FILE))
  assert sorted(trained) == sorted(loaded)
  moved = max(float(np.abs(trained[k] - loaded[k]).max()) for k in loaded)
  # AdamW moves each entry by at most about lr per step (3e-3 × 2, with decay on top).
  assert 0 < moved <= 2 * 3e-3 * 1.5, moved
  model = peft.PeftModel.from_pretrained(fixtures.hf_model(ckpt), run / "final_adapter").eval()
  tokens = np.random.default_rng(1).integers(1, 512, (2, 12))
  merged = fixtures.hf_model(run / "final_model")
  assert np.abs(_peft_logits(model, tokens) - _peft_logits(merged, tokens)).max() <= 1e-4


def test_a_mismatched_init_from_adapter_stops_the_run_with_one_line(init_from, tmp_path):
  """An adapter of rank 4 where model.lora says 8: one line naming the field, the adapter's
  adapter_config.json and the first module that differs, before anything compiles (the failed
  first start leaves no workdir)."""
  ckpt, _, _ = init_from
  other = tmp_path / "rank4"
  _peft_adapter(ckpt, other, r=4)
  proc = subprocess.run([sys.executable, "-m", "grpo_jax.main", f"--workdir={tmp_path}/run",
                         *_init_from_flags(ckpt, other)], cwd=cli.REPO, env=cli.env(),
                        capture_output=True, text=True, timeout=600)
  line = cli.assert_user_error(proc, "config.model.lora.init_from", f"{other}/adapter_config.json",
                               "model.layers.0.self_attn.q_proj rank 4", "rank=4")
  assert "compil" not in proc.stdout.lower()
  assert not (tmp_path / "run").exists(), line


@pytest.mark.parametrize("kind,lora_kw,named", [
    ("qwen2_untied", dict(target_modules=["q_proj", "v_proj"]),
     "the adapter gives model.layers.0.self_attn.k_proj rank 0 and scale 0, model.lora gives it "
     "rank 8 and scale 2"),
    ("qwen2_untied", dict(lora_alpha=8.0), "q_proj rank 8 and scale 1, model.lora gives it rank "
     "8 and scale 2"),
    ("qwen3", {}, "layers.0.self_attn.k_proj.lora_B.weight' has shape (48, 8)"),  # other shapes
])
def test_init_from_refuses_an_adapter_of_other_targets_scale_or_base(init_from, tmp_path, kind,
                                                                     lora_kw, named):
  """Other targets, another alpha, or an adapter trained on a base of other shapes: one line
  naming config.model.lora.init_from and the file, before any base weight is read."""
  import fixtures
  from grpo_jax.models import weights
  ckpt, _, _ = init_from
  source = ckpt if kind == "qwen2_untied" else fixtures.make_checkpoint(tmp_path, kind, 512)
  _peft_adapter(source, tmp_path / "adapter", **lora_kw)
  lcfg = lora.LoraConfig(rank=INIT_RANK, alpha=INIT_ALPHA, init_from=str(tmp_path / "adapter"))
  with pytest.raises(weights.CheckpointError) as e:
    lora.start_adapters(lcfg, weights.read_config(ckpt))
  message = str(e.value)
  assert "\n" not in message and message.startswith("config.model.lora.init_from: "), message
  assert str(tmp_path / "adapter") in message and named in message, message


def test_modules_to_save_copies_get_the_full_weight_gradients_and_train():
  """model.lora.modules_to_save on an untied model: the step's gradients of the embedding and
  LM head copies are the full-weight step's at the merged weights (the copies in place), and a
  TrainStep trains them (its state holds them, moved; the frozen base keeps its own)."""
  import dataclasses
  model = dataclasses.replace(MODEL, tie_word_embeddings=False)
  base = qwen.init_params(model, jax.random.key(1))
  lcfg = lora.LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "down_proj"),
                         modules_to_save=("embed_tokens", "lm_head"))
  pol = policy_lib.Lora(lcfg)
  mesh = sharding.make_mesh((1, 1, 1))
  batch = train_batch(5)
  adapters = pol.init_trainable(base, model, 0, jnp.float32)
  adapters["layers"] = jax.tree.map(lambda x: x + 0.3, adapters["layers"])  # b off 0
  lora_grad = train_step.make_grad_fn(model, loss_config(), optim_config(), mesh, batch,
                                      group_size=G, policy=pol)
  full_grad = train_step.make_grad_fn(model, loss_config(), optim_config(), mesh, batch,
                                      group_size=G)
  loss_l, g = lora_grad(adapters, batch, base)
  loss_f, g_w = full_grad(lora.merge(base, adapters, lcfg), batch)
  np.testing.assert_allclose(loss_l, loss_f, rtol=1e-5)
  for m in ("embed_tokens", "lm_head"):
    for got, want in zip(jax.tree.leaves(g[m]), jax.tree.leaves(g_w[m])):
      scale = float(np.abs(want).max())
      assert scale > 1e-6, m
      np.testing.assert_allclose(got, want, atol=2e-5 * scale, err_msg=m)
  step = train_step.TrainStep(model, loss_config(beta=0.05), optim_config(), mesh, group_size=G,
                              policy=pol)
  frozen = train_step.reference_params(base, model, optim_config(), mesh, pol)
  state, metrics, _ = step(train_step.create_train_state(adapters, model, optim_config(), mesh,
                                                         pol), batch, frozen)
  new = jax.device_get(state["params"])
  assert np.abs(new["lm_head"] - np.asarray(adapters["lm_head"])).max() > 1e-4
  np.testing.assert_array_equal(jax.device_get(frozen["lm_head"]), np.asarray(base["lm_head"]))
  assert metrics["loss/kl"] > 0


def test_a_vmapped_group_refuses_modules_to_save():
  configs = [config_lib.defaults() for _ in range(2)]
  for c in configs:
    c.model.lora.update(rank=4, modules_to_save=("lm_head",))
  with pytest.raises(members.VmapError, match="config.model.lora.modules_to_save"):
    members.check_vmappable(configs)
