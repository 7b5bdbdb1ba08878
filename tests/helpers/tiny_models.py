"""Tiny random-weight decoder models of several architectures, for cache tests."""

import torch


def tiny_model(arch: str, head_dim: int = 64, dtype=torch.float32, seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=96, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=1024,
                  initializer_range=0.1)
    if arch == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif arch == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    elif arch == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**{**common, "num_attention_heads": 8, "num_key_value_heads": 1, "hidden_size": 128, "sliding_window": None}))
    elif arch == "gemma3":
        cfg = tf.Gemma3TextConfig(**{**common, "num_hidden_layers": 4, "num_attention_heads": 4,
                                     "num_key_value_heads": 1},
                                  sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2)
        model = tf.Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    return model.to(dtype).eval()


def patched_model(arch: str, **kw):
    """:func:`tiny_model` switched to the "qjl" attention (``qjl.patch_attention``)."""
    import qjl

    model = tiny_model(arch, **kw)
    qjl.patch_attention(model)
    return model


def random_prompt(n: int = 40, batch: int = 1, seed: int = 1) -> torch.Tensor:
    """Token ids [batch, n] in 3..95 (inside every tiny model's vocabulary), reproducible by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (batch, n), generator=g)
