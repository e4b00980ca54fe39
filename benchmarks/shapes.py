"""The Qwen2.5 instruct checkpoints' shapes (their config.json), for the benchmarks that build
abstract models without the hub: benchmarks/memory.py, lora_memory.py, lora_decode.py."""

MODELS = {
    "Qwen2.5-0.5B": dict(vocab_size=151_936, hidden_size=896, intermediate_size=4864,
                         num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                         tie_word_embeddings=True),
    "Qwen2.5-1.5B": dict(vocab_size=151_936, hidden_size=1536, intermediate_size=8960,
                         num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                         tie_word_embeddings=True),
    "Qwen2.5-3B": dict(vocab_size=151_936, hidden_size=2048, intermediate_size=11008,
                       num_layers=36, num_heads=16, num_kv_heads=2, head_dim=128,
                       tie_word_embeddings=True),
    "Qwen2.5-7B": dict(vocab_size=152_064, hidden_size=3584, intermediate_size=18944,
                       num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                       tie_word_embeddings=False),  # 7B has its own LM head
}
VALID_VOCAB = 151_665  # len(tokenizer) of Qwen2.5: ids the sampler may draw
