"""How varied the stored prompts are, and how far they stay from the held-out prompts.

Numbers, not impressions: distinct n-grams (the share of word n-grams that are unique),
the spread of prompt and answer lengths, how often a prompt has a near-duplicate in the
store, and each held-out prompt's nearest stored neighbour (word-trigram similarity, the
same measure that keeps near-duplicates of held-out prompts out of generation).
"""

from __future__ import annotations

import random
import statistics
from collections import Counter, defaultdict

from answers.store import Answer
from training.prompts import HeldOut, shingles, similarity, words


def distinct_n(texts: list[str], n: int) -> float:
    grams = [tuple(w[i : i + n]) for w in map(words, texts) for i in range(len(w) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def spread(values: list[int]) -> dict:
    if not values:
        return {}
    q = statistics.quantiles(values, n=10) if len(values) > 1 else [values[0]] * 9
    return {"mean": round(statistics.fmean(values), 1), "p10": q[0], "p50": q[4], "p90": q[8], "max": max(values)}


class NearestIndex:
    """Word-trigram inverted index over texts: nearest neighbour without comparing every pair."""

    def __init__(self, texts: list[str]) -> None:
        self.sets = [shingles(t) for t in texts]
        self.postings: dict[tuple, list[int]] = defaultdict(list)
        for i, s in enumerate(self.sets):
            for g in s:
                self.postings[g].append(i)

    def nearest(self, text: str, skip: int = -1) -> tuple[float, int]:
        query = shingles(text)
        candidates = Counter(i for g in query for i in self.postings.get(g, ()) if i != skip)
        best = max(((similarity(query, self.sets[i]), i) for i in candidates), default=(0.0, -1))
        return best


def job_kind(job: str) -> str:
    """`starter-<crc>` for a starter prompt, `<seed>-<index>-<kind>` for a seeded job."""
    return "starter" if job.startswith("starter-") else job.rsplit("-", 1)[-1]


def answer_kind(answer: Answer) -> str:
    """The job's kind, and the turn's stage where it is not the job's plain answer ("ask/questions"):
    kinds differ far more than their mix suggests (a list of questions is easy to draft, a chat
    answer hard), so a score over a whole store says little about any one of them."""
    kind = job_kind(answer.job)
    return kind if answer.stage == "answer" else f"{kind}/{answer.stage}"


def report(answers: list[Answer], held_out: HeldOut | None = None, sample: int = 2000, seed: int = 0) -> dict:
    held_out = held_out if held_out is not None else HeldOut.load()
    prompts = [a.messages[-1][1] for a in answers]
    index = NearestIndex(prompts)
    rng = random.Random(seed)
    probe = rng.sample(range(len(prompts)), min(sample, len(prompts)))
    near_dups = sum(index.nearest(prompts[i], skip=i)[0] >= held_out.threshold for i in probe)
    nearest_to_held = []
    for p in held_out.prompts:
        score, i = index.nearest(p)
        nearest_to_held.append({"held_out": p, "similarity": round(score, 3), "nearest": prompts[i] if i >= 0 else ""})
    scores = [n["similarity"] for n in nearest_to_held]
    return {
        "answers": len(answers),
        "answer_tokens": sum(a.answer_tokens for a in answers),
        "distinct_prompts": len(set(prompts)),
        "multi_turn": sum(len([m for m in a.messages if m[0] == "user"]) > 1 for a in answers),
        "stages": dict(Counter(a.stage for a in answers).most_common()),
        "job_kinds": dict(Counter(job_kind(a.job) for a in answers).most_common()),
        "distinct_1": round(distinct_n(prompts, 1), 4),
        "distinct_2": round(distinct_n(prompts, 2), 4),
        "distinct_3": round(distinct_n(prompts, 3), 4),
        "prompt_words": spread([len(words(p)) for p in prompts]),
        "answer_tokens_each": spread([a.answer_tokens for a in answers]),
        "near_duplicate_rate": round(near_dups / len(probe), 4) if probe else 0.0,
        "held_out_nearest": {
            "mean": round(statistics.fmean(scores), 3) if scores else 0.0,
            "max": max(scores, default=0.0),
            "threshold": held_out.threshold,
            "closest": sorted(nearest_to_held, key=lambda n: -n["similarity"])[:5],
        },
    }
