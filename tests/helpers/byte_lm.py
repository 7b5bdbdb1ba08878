"""A byte-level tokenizer (built in memory, no files) and a tiny random Llama over its vocabulary: a complete
(model, tokenizer) pair for tests of the evaluation tools and the lm-eval model, without the embedded model."""

import torch


def byte_tokenizer():
    """A ``PreTrainedTokenizerFast``: one token per byte (256) + <s>, </s>, <pad>; a minimal chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for special in ("<s>", "</s>", "<pad>"):
        vocab[special] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    return tok


def byte_llama(seed: int = 0, layers: int = 2):
    """A tiny random-weight Llama (head_dim 64, 6 query / 2 KV heads) over :func:`byte_tokenizer`'s vocabulary."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=259, hidden_size=96, intermediate_size=192, num_hidden_layers=layers,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                         initializer_range=0.1, bos_token_id=256, eos_token_id=257, pad_token_id=258)
    return tf.LlamaForCausalLM(cfg).eval()
