"""Ask a running teacher stack again for slates that LATTICE traces recorded, and compare the scores.

    python scripts/replay_teacher_slates.py --url http://127.0.0.1:8000 \\
        --traces runs/teacher/lattice/hotpotqa/traces.jsonl [more traces.jsonl] --sample 32 [--gold] [--out FILE]

The LATTICE students learn the recorded scores, so a change of the stack that served the teacher (vLLM's JSON
grammar, the engine, the model's precision) is worth measuring on them before the traces are trusted or made again.
Each slate is asked as the traces job asked it: LLMSlateScorer with the settings recorded beside each traces file
(``traces.settings.json``). ``--sample N`` takes N slates spread evenly over the parsed ones; with ``--gold``, over
those holding both a child that leads to gold and one that does not. Prints (and writes to ``--out``) one JSON
object: the slates parsed both times, how many got identical scores and the same top candidate, the mean Spearman
correlation (over slates whose scores vary both times), the mean absolute score difference, and the tie-aware share
of slates whose best-scored candidate leads to gold, recorded against replayed, beside chance.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from overstory.retrieval.lattice.scorers import LLMSlateScorer, Slate
from overstory.serving.client import Client


def load_slates(paths: list[Path], gold: bool) -> list[tuple[dict, dict]]:
    """(trace row, its file's settings) for every parsed, unfailed slate; with ``gold``, only the slates that hold
    a gold-leading candidate and one that is not."""
    rows = []
    for path in paths:
        settings = json.loads(path.with_suffix(".settings.json").read_text())
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if not row["parsed"] or row["failure"]:
                continue
            leads = row.get("leads_to_gold") or []
            if gold and not (any(leads) and not all(leads)):
                continue
            rows.append((row, settings))
    return rows


def gold_first(scores: list[float], leads: list[bool]) -> float:
    """The chance that the best-scored candidate leads to gold, ties broken at random."""
    best = max(scores)
    tied = [i for i, score in enumerate(scores) if score == best]
    return sum(leads[i] for i in tied) / len(tied)


def replay(client: Client, picked: list[tuple[dict, dict]], concurrency: int) -> list:
    """Each picked slate asked again, grouped by the settings it was recorded under."""
    results: dict[int, object] = {}
    groups: dict[str, list[int]] = {}
    for i, (_, settings) in enumerate(picked):
        groups.setdefault(json.dumps(settings, sort_keys=True), []).append(i)
    for key, members in groups.items():
        settings = json.loads(key)
        scorer = LLMSlateScorer(client, role=settings["role"], max_tokens=settings["max_tokens"],
                                max_attempts=settings["max_attempts"], concurrency=concurrency,
                                max_candidate_chars=settings["max_candidate_chars"],
                                max_reasoning_chars=settings["max_reasoning_chars"])
        slates = [Slate(picked[i][0]["query_id"], picked[i][0]["query"], picked[i][0]["node_ids"],
                        picked[i][0]["texts"], picked[i][0]["leaf"]) for i in members]
        results.update(zip(members, scorer.score(slates)))
    return [results[i] for i in range(len(picked))]


def _mean(values: list[float]) -> float | None:
    return round(float(np.mean(values)), 4) if values else None


def compare(picked: list[tuple[dict, dict]], replies: list) -> dict:
    """The summary described in the module docstring."""
    both, identical, same_top, rho, diffs, recorded_hits, replayed_hits, chance = 0, 0, 0, [], [], [], [], []
    for (row, _), reply in zip(picked, replies):
        old = [float(score) for score in row["raw_scores"]]
        if not reply.parsed or len(reply.scores) != len(old):
            continue
        new = [float(reply.scores[i]) for i in range(len(old))]
        both += 1
        identical += old == new
        same_top += int(np.argmax(old) == np.argmax(new))
        diffs.append(float(np.mean(np.abs(np.subtract(old, new)))))
        if len(set(old)) > 1 and len(set(new)) > 1:
            rho.append(float(spearmanr(old, new).correlation))
        leads = row.get("leads_to_gold") or []
        if any(leads):
            recorded_hits.append(gold_first(old, leads))
            replayed_hits.append(gold_first(new, leads))
            chance.append(sum(leads) / len(leads))
    return {"slates": len(picked), "parsed_both_times": both, "identical_scores": identical,
            "same_top_candidate": same_top, "spearman_mean": _mean(rho), "spearman_slates": len(rho),
            "mean_abs_score_difference": _mean(diffs), "slates_with_gold": len(recorded_hits),
            "gold_first_recorded": _mean(recorded_hits), "gold_first_replayed": _mean(replayed_hits),
            "gold_first_by_chance": _mean(chance)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the teacher stack (its front door, or a stack.json)")
    parser.add_argument("--traces", type=Path, nargs="+", required=True, help="traces.jsonl files of lattice-traces")
    parser.add_argument("--sample", type=int, default=32, help="how many slates to ask again")
    parser.add_argument("--gold", action="store_true", help="only slates with gold-leading and other candidates")
    parser.add_argument("--concurrency", type=int, default=4, help="slates in flight")
    parser.add_argument("--out", type=Path, help="also write the summary here")
    args = parser.parse_args()
    rows = load_slates(args.traces, args.gold)
    if not rows:
        print("no slate to replay in " + ", ".join(map(str, args.traces)), file=sys.stderr)
        return 1
    picked = [rows[int(i)] for i in np.linspace(0, len(rows) - 1, min(args.sample, len(rows)))]
    client = Client.from_url(args.url, timeout_s=1800)  # a slate's reasoning takes minutes on a busy CPU stack
    # what answered: each served name with the checkpoint behind it, as the stack lists them
    served = {card["id"]: card.get("root", card["id"]) for response in client.backend.get("/v1/models")
              for card in response["data"]}
    summary = {"traces": [str(path) for path in args.traces], "gold_only": args.gold, "served": served,
               "recorded_with": sorted({json.dumps(s["served"]) for _, s in picked}),
               **compare(picked, replay(client, picked, args.concurrency))}
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
