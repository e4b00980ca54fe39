"""quality's local backend: batched greedy replies from the Flax sampler equal transformers' generate."""
import pytest
import torch

from fixtures import hf_model, make_checkpoint
from grpo_jax import tokenizer as tokenizer_lib
from grpo_jax.rewards import quality
from grpo_jax.rewards.options import LocalOptions, QualityOptions

# Skips only while grpo_jax/sampler.py is not in the checkout (it is being written alongside).
sampler = pytest.importorskip("grpo_jax.sampler")
from grpo_jax.rewards import model_rewards  # noqa: E402  (needs the sampler)

MAX_NEW = 8


@pytest.fixture(scope="module")
def scorer(tmp_path_factory):
  root = tmp_path_factory.mktemp("scorer")
  tok = tokenizer_lib.build_tiny_tokenizer(str(root / "tok"))
  ckpt = make_checkpoint(root, "qwen3", vocab_size=272, seed=3)
  opts = LocalOptions(checkpoint=str(ckpt), tokenizer=tok, dtype="float32", batch_size=3,
                      max_prompt_tokens=64, max_new_tokens=MAX_NEW)
  return ckpt, tok, opts


def test_local_replies_equal_transformers_greedy_generate(scorer):
  ckpt, tok, opts = scorer
  backend = model_rewards.LocalChatBackend(opts)
  # Conversations of different lengths (left padding inside a batch), one cut in the middle to
  # max_prompt_tokens; both batches fall in the 64-token bucket, so the sampler compiles once.
  convs = [[{"role": "user", "content": c}] for c in ("Grade: 4", "Grade this longer response: it is 72.",
                                                       "x", "long " * 100)]
  replies, counters = backend.complete(convs)  # 4 conversations in batches of 3
  ref = hf_model(ckpt)
  stop = tokenizer_lib.stop_ids(backend.tokenizer, tok)
  truncated = 0
  for conv, reply in zip(convs, replies):
    ids = backend.prompt_ids(conv)
    assert len(ids) <= opts.max_prompt_tokens
    with torch.no_grad():
      out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=stop, pad_token_id=stop[-1])
    new = out[0, len(ids):].tolist()
    assert reply == backend.tokenizer.decode(new, skip_special_tokens=True)
    truncated += len(new) == MAX_NEW and new[-1] not in stop
  assert len(set(replies)) > 1  # the prompts lead to different replies
  assert counters["local_truncated"] == truncated
  # A random tiny scorer writes no grade: every reply falls back, and is counted.
  reward = quality.QualityReward(QualityOptions(backend="local", local=opts, fallback=0.5,
                                                question_column=""), backend=backend.complete)
  assert reward(["q"] * 3, ["a", "b", "c"], group_size=3) == [0.5] * 3
  assert reward.last_metrics["parse_failures"] == 3


def test_sampled_replies_depend_on_the_seed_and_the_prompt_only(scorer):
  """At temperature > 0 a reply is a function of (seed, prompt): a fresh backend (a resumed
  process) gives the same reply to a prompt whatever it scored before and wherever the prompt
  sits in its batch; another seed gives other replies."""
  import dataclasses
  _, _, opts = scorer
  hot = dataclasses.replace(opts, temperature=1.0)
  convs = [[{"role": "user", "content": c}] for c in ("Grade: 4", "Grade: 5", "x", "y z")]
  first = model_rewards.LocalChatBackend(hot)
  replies, _ = first.complete(convs)
  again, _ = first.complete(convs)  # the same process, later: same draws
  resumed = model_rewards.LocalChatBackend(hot)
  late, _ = resumed.complete(convs[2:] + convs[:2])  # other order, other batches
  assert again == replies and late[2:] + late[:2] == replies
  other, _ = model_rewards.LocalChatBackend(dataclasses.replace(hot, seed=1)).complete(convs)
  assert other != replies


def test_local_backend_needs_a_checkpoint():
  with pytest.raises(ValueError, match="rewards.quality.local.checkpoint"):
    quality.QualityReward(QualityOptions(backend="local"))
  with pytest.raises(ValueError, match="max_prompt_tokens"):
    LocalOptions(max_prompt_tokens=4)
