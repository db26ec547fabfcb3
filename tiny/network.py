"""The tiny model's network: a Qwen2 with random weights, in the shape `model.tiny` gives (~0.5M parameters)."""

from __future__ import annotations

import torch

from core.config import TinyModelConfig


def random_qwen2(*, vocab_size: int, eos_id: int = 0, seed: int = 0, **shape):
    """A Qwen2 with random weights, tied embeddings and `eos_id` as bos/eos/pad: the tiny model and test models alike.

    `shape` takes Qwen2Config's size fields (hidden_size, num_hidden_layers, max_position_embeddings, ...).
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        use_sliding_window=False,
        dtype="float32",
        **shape,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def build_model(tiny: TinyModelConfig, vocab_size: int, eos_id: int, max_len: int):
    return random_qwen2(
        vocab_size=vocab_size,
        eos_id=eos_id,
        seed=tiny.seed,
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        max_position_embeddings=max_len,
    )
