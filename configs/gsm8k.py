"""GRPO on GSM8K. Presets are chosen after a colon; single fields with --config.a.b=value.

default — Qwen2.5-1.5B-Instruct on openai/gsm8k, the reference GSM8K GRPO recipe
  (G = 8, 96 prompts per step, lr 1e-5 constant, clip 0.2, k3 KL with beta = 0.001,
  temperature 1.0, up to 1,024 new tokens, rewards math_accuracy + format):
    python -m grpo_jax.main --config=configs/gsm8k.py --workdir=runs/gsm8k_1.5b
  Needs the hub (or a local copy: --config.model.checkpoint=/path --config.data.source=/path)
  and an accelerator: one 8-chip TPU v5e host or 8 × 80 GB GPUs (mesh fsdp = 8). About 20 s of
  generation + 4 s of training per step on 8 × H100 (estimated from the token counts, not
  measured here); 500 steps ≈ 3.5 h. Expected: GSM8K test pass@1 from ~62% (the instruct
  model's own greedy score with this prompt) to ~70-75% (the range published GRPO runs on
  Qwen2.5-1.5B-Instruct report; not reproduced here, no accelerator was available).

0.5b — Qwen2.5-0.5B-Instruct, same recipe, 48 prompts per step, up to 512 new tokens:
    python -m grpo_jax.main --config=configs/gsm8k.py:0.5b --workdir=runs/gsm8k_0.5b
  Fits one 24 GB GPU (mesh 1×1×1). Expected pass@1 from ~30% to ~45-50% (published range).

tiny — offline, CPU, minutes: a 2-layer 128-wide Qwen2 with random weights, the byte-level
  tiny tokenizer and synthetic two-digit addition word problems in GSM8K's schema, generated
  by code with disjoint train and held-out splits. A short supervised warm start (cold start)
  brings held-out greedy accuracy to ~20-35%; GRPO then has to lift it:
    python -m grpo_jax.main --config=configs/gsm8k.py:tiny --workdir=runs/tiny
  Measured on the 2-core CPU (2026-11-22, fresh clone): 6.5 minutes in all (warm start 1.5,
  GRPO 400 steps 4.6; 9.5 minutes when other work shared the CPU); held-out greedy accuracy
  21.5% after the warm start -> 52.3% after GRPO, +30.9 points (42.8 / 43.9 / 48.6 at steps
  100 / 200 / 300). The learning-rate sweep: experiments/tiny_lr_sweep.md.
"""

from ml_collections import config_dict

from grpo_jax import grpo, train_step
from grpo_jax.rewards import default_rewards_config


def get_config(preset: str = "default") -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.preset = preset or "default"
  c.seed = 0

  c.model = config_dict.ConfigDict(dict(
      checkpoint="Qwen/Qwen2.5-1.5B-Instruct",  # local directory or hub id
      tokenizer="",                 # '' = the checkpoint's tokenizer
      random_init=False,            # True: no checkpoint, build `tiny` below with random weights
      # Used only when random_init: a Qwen2 architecture of this size.
      tiny=config_dict.ConfigDict(dict(
          hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2,
          head_dim=32, rope_theta=10000.0, tie_word_embeddings=True,
          vocab_size=512)),            # for tokenizer='tiny': BPE vocabulary learnt offline
  ))

  c.data = config_dict.ConfigDict(dict(
      source="openai/gsm8k",       # hub id, a directory of {train,test}.jsonl, or 'synthetic'
      config_name="main",          # the hub dataset's config
      train_split="train",
      eval_split="test",
      question_field="question",
      answer_field="answer",
      system_prompt=config_dict.placeholder(str),  # None: the chat template's default
      user_template=(
          "{question}\nThink step by step inside <think> </think>, then give the final number "
          "inside <answer> </answer>."),
      prompt_buckets=(256, 384, 512),
      # For source='synthetic' (see grpo_jax/synthetic.py).
      synthetic_train=7000,
      synthetic_test=500,
      synthetic_digits=2,
      synthetic_operands=2,
  ))

  c.sampling = config_dict.ConfigDict(dict(
      num_generations=8,            # G completions per prompt
      max_new_tokens=1024,
      temperature=1.0,
      top_k=0,                      # 0 = off
      top_p=1.0,
      min_p=0.0,
  ))

  c.rewards = default_rewards_config()
  c.rewards.names = ("math_accuracy", "format")
  c.rewards.weights = (1.0, 1.0)

  c.loss = grpo.default_loss_config()
  c.loss.loss_type = "grpo"
  c.loss.beta = 0.001
  c.loss.kl_estimator = "k3"
  c.loss.epsilon = 0.2
  c.loss.epsilon_high = 0.2
  c.loss.temperature = c.sampling.get_ref("temperature")

  c.optim = train_step.default_optim_config()  # also param/compute dtypes and remat
  c.optim.lr = 1e-5
  c.optim.schedule = "constant"
  c.optim.grad_accum_steps = 4

  c.train = config_dict.ConfigDict(dict(
      steps=500,                    # GRPO steps (each: sample, reward, num_iterations updates)
      prompts_per_step=96,
      eval_every=50,                # greedy pass@1 on the eval split; 0 = only at start and end
      eval_examples=0,              # 0 = the whole eval split
      eval_batch_size=64,
      checkpoint_every=50,
      keep_checkpoints=3,
      samples_per_step=4,           # completions written to samples.md per step
      max_bad_steps=5,              # consecutive non-finite steps before the run stops
      # DAPO's dynamic sampling: set aside groups whose G rewards are all equal (they teach
      # nothing) and sample more prompts, up to max_sampling_rounds rounds per step.
      dynamic_sampling=False,
      max_sampling_rounds=3,
      # Consecutive steps with a reward missing on >= 50% of completions (scorer down, judge
      # replies that do not parse) before the run saves a checkpoint and stops; 0 = warn only.
      max_missing_reward_steps=3,
      tensorboard=True,
      wandb=False,
  ))

  # Supervised warm start (cold start) on the training answers before GRPO; 0 = off.
  # The targets are the dataset's answers without GSM8K's <<calculator>> annotations.
  # target_accuracy > 0: stop at the first check (every eval_every steps) whose greedy accuracy
  # on eval_examples training problems, held out of both phases, reaches it; steps is the most.
  c.sft = config_dict.ConfigDict(dict(steps=0, batch_size=32, lr=1e-3, target_accuracy=0.0,
                                      eval_every=50, eval_examples=256))

  c.mesh = (1, -1, 1)               # (data, fsdp, tensor); -1 takes the remaining devices

  if c.preset == "default":
    pass
  elif c.preset == "0.5b":
    c.model.checkpoint = "Qwen/Qwen2.5-0.5B-Instruct"
    c.train.prompts_per_step = 48
    c.sampling.max_new_tokens = 512
  elif c.preset == "tiny":
    _tiny(c)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/gsm8k.py; use default, 0.5b or tiny")
  return c


def _tiny(c: config_dict.ConfigDict) -> None:
  c.model.random_init = True
  c.model.checkpoint = ""
  c.model.tokenizer = "tiny"        # built offline into <workdir>/tokenizer
  c.optim.compute_dtype = "float32"
  c.optim.remat = False
  c.data.source = "synthetic"
  c.data.system_prompt = None       # the tiny template adds no system turn: short prompts
  c.data.user_template = "{question}"
  c.data.prompt_buckets = (48, 64)
  c.sampling.max_new_tokens = 20
  c.data.synthetic_test = 512
  c.rewards.names = ("math_accuracy",)
  c.rewards.weights = (1.0,)
  c.loss.loss_type = "grpo"
  c.loss.beta = 0.0
  c.optim.lr = 3e-5                 # 1e-4 plateaued lower (+13 points at step 200); see README
  c.optim.b2 = 0.99
  c.optim.grad_accum_steps = 1
  c.optim.max_grad_norm = 1.0
  c.train.steps = 400
  c.train.prompts_per_step = 16
  c.train.dynamic_sampling = True   # sampling is ~15% of a step here; zero-spread groups are not
  c.train.eval_every = 100
  c.train.eval_examples = 0         # all 512 held-out problems
  c.train.eval_batch_size = 128
  c.train.checkpoint_every = 50
  c.train.samples_per_step = 2
  c.train.tensorboard = True
  # Stop the warm start on validation accuracy, not a step count: it climbs from ~5% to ~70%
  # within ~100 steps, and where that happens depends on the seed (experiments/tiny_seeds.md).
  c.sft.steps = 600
  c.sft.target_accuracy = 0.2
  c.sft.eval_every = 10
  c.sft.eval_examples = 256
  c.sft.batch_size = 64
  c.sft.lr = 1e-3
  c.mesh = (1, 1, 1)
