"""OpenAI's string_check and text_similarity graders."""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping

from engine.rewards.base import Grader, check_fields, get_number, get_str, grader_name
from engine.rewards.templates import Template

STRING_OPS = ("eq", "ne", "like", "ilike")
ROUGE_TYPES = {"rouge_1": "rouge1", "rouge_2": "rouge2", "rouge_3": "rouge3", "rouge_4": "rouge4",
               "rouge_5": "rouge5", "rouge_l": "rougeL"}
SIMILARITY_METRICS = ("fuzzy_match", "bleu", "gleu", "meteor", *ROUGE_TYPES)
WORD = re.compile(r"\w+|[^\w\s]")  # bleu, gleu and meteor's tokens: runs of word characters, single punctuation


class StringCheck(Grader):
    """1.0 when ``input <operation> reference`` holds: eq, ne, like (contains), ilike (contains, any case)."""

    type = "string_check"

    def __init__(self, cfg: dict, path: str) -> None:
        check_fields(cfg, path, required=("input", "reference", "operation"))
        super().__init__(grader_name(cfg, path))
        self.input = Template(cfg["input"], f"{path}.input")
        self.reference = Template(cfg["reference"], f"{path}.reference")
        self.operation = get_str(cfg, "operation", path, choices=STRING_OPS)
        self.item_fields = self.input.item_fields | self.reference.item_fields

    def score(self, sample_text: str, item: Mapping[str, Any]) -> float:
        a, b = self.input.render(sample_text, item), self.reference.render(sample_text, item)
        if self.operation == "eq":
            ok = a == b
        elif self.operation == "ne":
            ok = a != b
        elif self.operation == "like":
            ok = b in a
        else:
            ok = b.lower() in a.lower()
        return 1.0 if ok else 0.0


class TextSimilarity(Grader):
    """Similarity in [0, 1] of input and reference.

    fuzzy_match: 2 * LCS / (len(a) + len(b)) over characters, the normalised Indel similarity
    (what rapidfuzz's ``fuzz.ratio`` computes). The others score 1.0 when both texts are blank
    and 0.0 when one is. bleu, gleu and meteor are nltk's sentence scores over the lowercased
    texts cut into runs of word characters and single punctuation marks (``WORD``): bleu with
    uniform weights up to 4-grams, re-weighted to the input's length when it has fewer than 4
    words, and Chen & Cherry's smoothing method 1 (a count of 0.1 for an n-gram order with no
    match), so a short text is not scored 0 for lacking 4-grams; meteor matches exact words and
    Porter stems only, no WordNet synonyms (qerl ships no nltk data), and its fragmentation
    penalty leaves identical n-word texts at 1 - 0.5 / n**3. rouge_1..rouge_5 and rouge_l are
    rouge-score's F-measure with its own tokenizer (lowercased ASCII letters and digits), no
    stemming: texts of fewer than n such words score 0 on rouge_n. cosine needs an embedding
    model and is refused. ``pass_threshold`` is kept for pass-rate reporting (``passed``); the
    reward is the similarity itself, as in OpenAI's graders."""

    type = "text_similarity"

    def __init__(self, cfg: dict, path: str) -> None:
        check_fields(cfg, path, required=("input", "reference", "evaluation_metric"), optional=("pass_threshold",))
        super().__init__(grader_name(cfg, path))
        self.input = Template(cfg["input"], f"{path}.input")
        self.reference = Template(cfg["reference"], f"{path}.reference")
        if cfg["evaluation_metric"] == "cosine":
            raise ValueError(f"{path}.evaluation_metric 'cosine' is not available: it needs an embedding model, "
                             f"which qerl does not have; use one of {', '.join(SIMILARITY_METRICS)}")
        self.metric = get_str(cfg, "evaluation_metric", path, choices=SIMILARITY_METRICS)
        self.pass_threshold = get_number(cfg, "pass_threshold", path)
        if self.pass_threshold is not None and not 0.0 <= self.pass_threshold <= 1.0:
            raise ValueError(f"{path}.pass_threshold must be in [0, 1]; got {self.pass_threshold}")
        self.item_fields = self.input.item_fields | self.reference.item_fields
        self._similarity: Callable[[str, str], float] | None = None  # built on the first score: imports nltk

    def score(self, sample_text: str, item: Mapping[str, Any]) -> float:
        a, b = self.input.render(sample_text, item), self.reference.render(sample_text, item)
        if self.metric == "fuzzy_match":
            return fuzzy_ratio(a, b)
        if not a.strip() or not b.strip():
            return float(not a.strip() and not b.strip())
        if self._similarity is None:
            self._similarity = similarity(self.metric)
        return min(1.0, max(0.0, float(self._similarity(a, b))))

    def passed(self, score: float) -> bool:
        return self.pass_threshold is None or score >= self.pass_threshold


class NoSynonyms:
    """Stands in for nltk's WordNet corpus in METEOR: no word has synonyms, so nothing is downloaded."""

    @staticmethod
    def synsets(*args: Any, **kwargs: Any) -> list:
        return []


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def similarity(metric: str) -> Callable[[str, str], float]:
    """``f(input, reference)`` for a metric other than fuzzy_match, both texts non-blank."""
    if metric in ROUGE_TYPES:
        from rouge_score.rouge_scorer import RougeScorer

        kind, scorer = ROUGE_TYPES[metric], RougeScorer([ROUGE_TYPES[metric]])
        return lambda a, b: scorer.score(b, a)[kind].fmeasure
    if metric == "bleu":
        from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

        smooth = SmoothingFunction().method1
        return lambda a, b: sentence_bleu([words(b)], words(a), smoothing_function=smooth, auto_reweigh=True)
    if metric == "gleu":
        from nltk.translate.gleu_score import sentence_gleu

        return lambda a, b: sentence_gleu([words(b)], words(a))
    from nltk.stem.porter import PorterStemmer
    from nltk.translate.meteor_score import meteor_score

    stemmer = PorterStemmer()
    return lambda a, b: meteor_score([words(b)], words(a), stemmer=stemmer, wordnet=NoSynonyms)


def fuzzy_ratio(a: str, b: str) -> float:
    if not a and not b:
        return 1.0
    return 2.0 * lcs_length(a, b) / (len(a) + len(b))


def lcs_length(a: str, b: str) -> int:
    """Longest common subsequence length, bit-parallel (Allison-Dix / Hyyro): O(len(a) * len(b) / word)."""
    if len(a) < len(b):
        a, b = b, a
    if not b:
        return 0
    masks: dict[str, int] = {}
    for i, ch in enumerate(a):
        masks[ch] = masks.get(ch, 0) | (1 << i)
    full = (1 << len(a)) - 1
    v = full
    for ch in b:
        u = v & masks.get(ch, 0)
        v = ((v + u) | (v - u)) & full
    return len(a) - bin(v).count("1")
