"""The tiny model's tokenizer: a byte-level BPE trained with `tokenizers` in Qwen2's own shape.

Same pre-tokenizer regex, byte-level decoder, so that transformers' `Qwen2Tokenizer`, which AutoTokenizer and vLLM
pick for `model_type=qwen2` whatever the folder says, tokenizes exactly like the tokenizer we trained. It learns its
pieces from the task's own text (a recipe gives it, `tiny.recipe`), else from generated additions.
"""

from __future__ import annotations

import random

from app.tasks.problems import arithmetic_prompt
from core.chat_templates import CHAT_TEMPLATE, END_OF_TURN, EOS, TOOL_CHAT_TEMPLATE

# Problems of a task with reference answers whose text the tokenizer learns its pieces from.
CORPUS_PROBLEMS = 2000
SPECIAL_TOKENS = [EOS, "<|im_start|>", END_OF_TURN]
# Qwen2's pre-tokenizer: digits split one by one, so numbers are sequences of digit tokens.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _tokenizer_corpus(rng: random.Random, digits: int, texts: list[str] | None = None) -> list[str]:
    """The task's text (generated additions unless `texts` gives it), then a few words of chat and instructions."""
    if texts is None:
        limit = 10**digits
        texts = [
            arithmetic_prompt(rng.randrange(limit), rng.randrange(limit)) + str(rng.randrange(2 * limit))
            for _ in range(2000)
        ]
    texts = list(texts) + [
        "The quick brown fox jumps over the lazy dog. What is the answer? Let us think step by step.",
        "user assistant system You are a helpful assistant. Please reason and put the answer in \\boxed{}.",
    ]
    return texts


def build_tokenizer(digits: int, seed: int, vocab_size: int = 384, texts: list[str] | None = None, tools: bool = False):
    """A byte-level BPE tokenizer in Qwen2's shape, trained on the task's text: `texts` (its prompts and reference
    completions) or, without them, generated additions (another `vocab_size` merges another set of pieces: a
    tokenizer that gives other ids, as a teacher must not). With `tools`, the tool chat template, `<|im_end|>` as
    its end of sequence and TRL's Qwen response template, that parses its turns (`core.chat_templates`)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(random.Random(seed), digits, texts), trainer)
    chat = {"eos_token": EOS, "pad_token": EOS, "chat_template": CHAT_TEMPLATE}
    if tools:
        from trl.chat_template_utils import qwen3_template

        chat = {
            "eos_token": END_OF_TURN,
            "pad_token": END_OF_TURN,
            "chat_template": TOOL_CHAT_TEMPLATE,
            "response_template": qwen3_template,
        }
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, model_max_length=4096, clean_up_tokenization_spaces=False, **chat
    )
