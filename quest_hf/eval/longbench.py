"""LongBench (THUDM, arXiv 2308.14508) on the six tasks of the Quest paper (arXiv 2406.10774), decoded through Quest.

Prompts, generation lengths, middle truncation and metrics follow LongBench's `pred.py` / `metrics.py` /
`config/*.json`; the question split follows Quest's `evaluation/LongBench/pred.py`: all but the question
tail (from the task's question marker, at most the last 100 characters) is prefilled densely, the tail is
decoded token by token through the (sparse) decode path, then the answer is generated greedily.
The prefill is shared: each example is prefilled once and every configuration decodes from a copy.

ROUGE-L uses the `rouge-score` package (LongBench's scorer uses `rouge`; values can differ slightly).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import string
from collections import Counter

import torch

from ..config import QuestConfig
from ..patch import patched
from .decode import greedy_continue
from .ppl import DENSE_BUDGET, fork_cache, prefill_cache, step_tokens

TASKS = ("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "gov_report", "triviaqa")

# LongBench config/dataset2prompt.json (the current file: "as concisely", the early "asconcisely" typo fixed).
PROMPTS = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the "
                   "question as concisely as you can, using a single phrase if possible. Do not provide any "
                   "explanation.\n\nStory: {context}\n\nNow, answer the question based on the story as concisely as "
                   "you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: "
                   "{input}\n\nAnswer:",
    "qasper": "You are given a scientific article and a question. Answer the question as concisely as you can, using a "
              "single phrase or sentence if possible. If the question cannot be answered based on the information in "
              "the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or "
              "\"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based "
              "on the above article as concisely as you can, using a single phrase or sentence if possible. If the "
              "question cannot be answered based on the information in the article, write \"unanswerable\". If the "
              "question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any "
              "explanation.\n\nQuestion: {input}\n\nAnswer:",
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question "
                       "based on the above text, only give me the answer and do not output any other words.\n\n"
                       "Question: {input}\nAnswer:",
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any other "
                "words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
                "passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n"
                  "{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other "
                "words. The following are some examples.\n\n{context}\n\n{input}",
}
# LongBench config/dataset2maxlen.json
MAX_NEW_TOKENS = {"narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32, "gov_report": 512,
                  "triviaqa": 32}
# Quest's pred.py: the decoded question starts at the last occurrence of the marker, at most 100 chars from the end.
QUESTION_MARKERS = {"qasper": "Question:", "hotpotqa": "Question:", "multifieldqa_en": "Now,", "gov_report": "Now,",
                    "triviaqa": "Answer the question", "narrativeqa": "Do not provide"}
MAX_QUESTION_CHARS = 100
# LongBench pred.py: chat models get no chat template on these (few-shot completion tasks).
NO_CHAT = {"triviaqa"}
# LongBench scorer: the first line of the prediction only.
FIRST_LINE = {"triviaqa"}
HUB_DATASET = "THUDM/LongBench"


# --- metrics (LongBench metrics.py) -------------------------------------------------------------------

def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace (SQuAD / LongBench)."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_score(prediction: list, ground_truth: list) -> float:
    common = Counter(prediction) & Counter(ground_truth)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str) -> float:
    """Token F1 of the normalized strings (LongBench's metric for the QA tasks)."""
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def rouge_l_score(prediction: str, ground_truth: str) -> float:
    """ROUGE-L F-measure (LongBench's metric for gov_report), through the `rouge-score` package."""
    try:
        from rouge_score import rouge_scorer
    except ImportError as e:
        raise ImportError("ROUGE-L (gov_report) needs the rouge-score package: pip install rouge-score") from e
    return rouge_scorer.RougeScorer(["rougeL"]).score(ground_truth, prediction)["rougeL"].fmeasure


METRICS = {t: qa_f1_score for t in TASKS} | {"gov_report": rouge_l_score}


def score_task(task: str, predictions: list[str], answers: list[list[str]]) -> float:
    """LongBench's `scorer`: per example the best score over its answers; the mean x 100, 2 decimals."""
    if not predictions:
        return float("nan")
    total = 0.0
    for pred, truths in zip(predictions, answers):
        if task in FIRST_LINE:
            pred = pred.lstrip("\n").split("\n")[0]
        total += max((METRICS[task](pred, t) for t in truths), default=0.0)
    return round(100 * total / len(predictions), 2)


# --- data and prompts --------------------------------------------------------------------------------

def load_task(task: str, data_dir: str | None = None, limit: int | None = None) -> list[dict]:
    """Examples of `task`: `{data_dir}/{task}.jsonl` (LongBench's data.zip layout) or the Hub's `THUDM/LongBench`."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; the Quest paper's tasks are {', '.join(TASKS)}")
    if data_dir is not None:
        path = os.path.join(data_dir, f"{task}.jsonl")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} not found: --data-dir needs one {task}.jsonl per task")
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        try:
            import datasets

            rows = list(datasets.load_dataset(HUB_DATASET, task, split="test"))
        except Exception as e:  # noqa: BLE001 - offline, script-based repo, ...: one clear message
            raise RuntimeError(
                f"could not load {HUB_DATASET} / {task} from the Hugging Face Hub ({type(e).__name__}: {e}). "
                f"Download https://huggingface.co/datasets/{HUB_DATASET}/resolve/main/data.zip, unzip it and pass "
                "--data-dir to the folder holding the .jsonl files."
            ) from e
    return rows[:limit] if limit is not None else rows


def truncate_middle(tokenizer, prompt: str, max_length: int) -> str:
    """LongBench's truncation: keep the first and last `max_length // 2` tokens of a longer prompt."""
    ids = tokenizer(prompt, truncation=False).input_ids
    if len(ids) <= max_length:
        return prompt
    half = max_length // 2
    return (tokenizer.decode(ids[:half], skip_special_tokens=True)
            + tokenizer.decode(ids[-half:], skip_special_tokens=True))


def build_inputs(tokenizer, task: str, example: dict, max_length: int, chat: bool | None = None,
                 device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(prefix `[1, n]`, question tail `[1, m]`) token ids of one example's prompt.

    `chat=None`: apply the tokenizer's chat template when it has one (never on triviaqa, as LongBench).
    """
    prompt = truncate_middle(tokenizer, PROMPTS[task].format(context=example["context"], input=example["input"]),
                             max_length)
    if chat is None:
        chat = getattr(tokenizer, "chat_template", None) is not None
    if chat and task not in NO_CHAT:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                               add_generation_prompt=True)
    q_pos = max(len(prompt) - MAX_QUESTION_CHARS, prompt.rfind(QUESTION_MARKERS[task]))
    prefix = tokenizer(prompt[:q_pos]).input_ids
    tail = tokenizer(prompt[q_pos:], add_special_tokens=False).input_ids
    return torch.tensor([prefix], device=device), torch.tensor([tail], device=device)


# --- evaluation --------------------------------------------------------------------------------------

def configs_for(budgets, *, dense: bool = True, page_size: int = 16, dense_layers: int = 2,
                gqa_mode: str = "union", policy: str = "quest", backend: str = "auto") -> dict[str, QuestConfig]:
    """`{"dense": ..., "quest 512": ...}`: the configurations to compare (dense = a budget covering everything)."""
    base = QuestConfig(budget=DENSE_BUDGET, page_size=page_size, dense_layers=dense_layers, gqa_mode=gqa_mode,
                       backend=backend)
    out = {"dense": base} if dense else {}
    out.update({f"{policy} {b}": dataclasses.replace(base, budget=b, policy=policy) for b in budgets})
    return out


def evaluate(model, tokenizer, tasks=TASKS, configs: dict[str, QuestConfig] | None = None, *,
             data_dir: str | None = None, limit: int | None = None, max_length: int = 7500,
             max_new_tokens: int | None = None, chat: bool | None = None, progress=None) -> dict:
    """Predict and score `tasks` under every configuration in `configs` (default: dense and budgets 512..4096).

    `max_new_tokens` caps LongBench's per-task generation length (None: LongBench's values).
    Returns `{"scores": {config: {task: score}}, "predictions": {config: {task: [...]}}, "answers": ...}`;
    `progress` is advanced once per (example, configuration).
    """
    configs = configs if configs is not None else configs_for((512, 1024, 2048, 4096))
    if not configs:
        raise ValueError("no configuration to evaluate")
    page_sizes = {c.page_size for c in configs.values()}
    if len(page_sizes) != 1:
        raise ValueError(f"configurations share one prefill and so one page_size, got {sorted(page_sizes)}")
    eos = tokenizer.eos_token_id
    device = next(model.parameters()).device
    preds = {name: {} for name in configs}
    answers, lengths = {}, {}
    with patched(model, config=next(iter(configs.values()))):
        for task in tasks:
            data = load_task(task, data_dir, limit)
            answers[task] = [ex["answers"] for ex in data]
            lengths[task] = []
            for name in configs:
                preds[name][task] = []
            gen = MAX_NEW_TOKENS[task] if max_new_tokens is None else min(max_new_tokens, MAX_NEW_TOKENS[task])
            for ex in data:
                prefix, tail = build_inputs(tokenizer, task, ex, max_length, chat, device)
                lengths[task].append(prefix.shape[1] + tail.shape[1])
                cache, _ = prefill_cache(model, prefix)
                for name, cfg in configs.items():
                    fork = fork_cache(cache, cfg)
                    tokens = greedy_continue(model, fork, step_tokens(model, fork, tail), gen, eos)
                    preds[name][task].append(tokenizer.decode(tokens, skip_special_tokens=True))
                    if progress is not None:
                        progress.update(1)
    scores = {name: {task: score_task(task, preds[name][task], answers[task]) for task in tasks} for name in configs}
    for s in scores.values():
        s["average"] = round(sum(s[t] for t in tasks) / len(tasks), 2)
    return dict(scores=scores, predictions=preds, answers=answers, prompt_tokens=lengths, max_length=max_length,
                tasks=list(tasks), configs={n: dataclasses.asdict(c) for n, c in configs.items()})
