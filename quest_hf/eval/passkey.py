"""Passkey retrieval (the Quest paper's protocol): a number hidden at some depth of filler text.

All but the question tail is prefilled densely; the tail is decoded token by token through the
(patched) decode path, then the answer is generated greedily and scored by its digits.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

from .decode import feed, greedy_continue, prefill

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important info there.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass
class PasskeyCase:
    prefix: torch.Tensor  # [1, n] prefilled densely
    tail: torch.Tensor  # [1, m] decoded token by token
    key: str
    depth: float
    num_tokens: int


def make_case(tokenizer, num_tokens: int, depth: float, seed: int = 0, device="cpu") -> PasskeyCase:
    """A prompt of about `num_tokens` tokens with a 5-digit key at `depth` (0 = start, 1 = end)."""
    key = str(random.Random(seed).randint(10000, 99999))
    enc = lambda s: tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    fixed = len(enc(INTRO)) + len(enc(NEEDLE.format(key=key))) + len(enc(QUESTION))
    per = len(enc(FILLER))
    n_fill = max(1, (num_tokens - fixed) // per)
    before = int(round(n_fill * depth))
    text = INTRO + FILLER * before + NEEDLE.format(key=key) + FILLER * (n_fill - before)
    prefix, tail = enc(text), enc(QUESTION)
    return PasskeyCase(torch.tensor([prefix], device=device), torch.tensor([tail], device=device), key, depth,
                       len(prefix) + len(tail))


def answer_digits(text: str) -> str:
    m = re.search(r"\d+", text)
    return m.group(0) if m else ""


def run_case(model, tokenizer, case: PasskeyCase, max_new_tokens: int = 8, cache=None) -> tuple[bool, str]:
    """(correct, answer text) for one case under the model's current attention (patched or dense).

    `cache`: a cache already holding `case.prefix` (e.g. `QuestCache.copy(config)` of one prefill).
    """
    if cache is None:
        cache, _ = prefill(model, case.prefix)
    logits = feed(model, cache, case.tail)
    tokens = greedy_continue(model, cache, logits, max_new_tokens, tokenizer.eos_token_id)
    text = tokenizer.decode(tokens)
    return answer_digits(text) == case.key, text
