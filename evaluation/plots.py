"""PNG plots for reports (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from overstory.core.plots import plt, save_figure
from overstory.core.records import LEVELS, Chunk


def plot_level_stats(chunks_by_corpus: Mapping[str, Sequence[Chunk]], path: str | Path) -> Path:
    """Two panels per corpus-level grid: chunk counts per level (log scale) and the token-length
    distribution per level (box plot), one colour per corpus."""
    fig, (ax_count, ax_tokens) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(chunks_by_corpus)
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        by_level = {level: [c.n_tokens for c in chunks_by_corpus[name] if c.level == level] for level in LEVELS}
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(LEVELS))]
        ax_count.bar(xs, [len(by_level[lv]) for lv in LEVELS], width=width, label=name)
        box = ax_tokens.boxplot([by_level[lv] or [0] for lv in LEVELS], positions=xs, widths=width * 0.9,
                                patch_artist=True, showfliers=False)
        colour = f"C{i}"
        for patch in box["boxes"]:
            patch.set_facecolor(colour)
            patch.set_alpha(0.6)
    for ax in (ax_count, ax_tokens):
        ax.set_xticks(range(len(LEVELS)))
        ax.set_xticklabels(LEVELS)
        ax.set_yscale("log")
    ax_count.set_title("chunks per level")
    ax_count.set_ylabel("count")
    ax_count.legend()
    ax_tokens.set_title("tokens per chunk (box: quartiles, whiskers: 1.5 IQR)")
    ax_tokens.set_ylabel("tokens")
    return save_figure(fig, path)


def plot_recall_vs_cost(results: Mapping[str, Mapping], k: int, path: str | Path) -> Path:
    """recall@k (with its 95% interval where the report has one) against the seconds spent embedding the upper
    levels, one point per method (log x); a method whose time is unknown (recorded summaries without their job's
    record) has no place on the axis and is left out."""
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for method, row in results.items():
        recall = row.get(f"recall@{k}")
        if recall is None or row["seconds"] is None:
            continue
        interval = row.get(f"recall@{k}_ci95")
        error = [[recall - interval[0]], [interval[1] - recall]] if interval else None
        ax.errorbar(max(row["seconds"], 1e-4), recall, yerr=error, fmt="o", markersize=8, capsize=4)
        ax.annotate(method, (max(row["seconds"], 1e-4), recall), textcoords="offset points", xytext=(6, 4))
    ax.set_xscale("log")
    ax.set_xlabel("seconds to embed the upper levels (log scale)")
    ax.set_ylabel(f"recall@{k}")
    ax.set_title("upper-level embeddings: quality against build cost")
    return save_figure(fig, path)


PLANNER_BARS = (("accuracy", "accuracy (pseudo-label)"), ("accuracy_gold", "accuracy (gold levels)"),
                ("within_one_level", "within one level"), ("format_valid", "format valid"),
                ("qa_accuracy", "QA accuracy"))


def plot_planner_comparison(variants: Mapping[str, Mapping], path: str | Path,
                            majority_accuracy: float | None = None) -> Path:
    """Grouped bars: each planner variant's accuracy, format and QA rates on the same questions; a dotted
    line marks the accuracy of always answering the most common training label."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    if majority_accuracy is not None:
        ax.axhline(majority_accuracy, color="grey", linestyle=":", label="majority label (accuracy)")
    names = list(variants)
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(PLANNER_BARS))]
        ax.bar(xs, [variants[name].get(key) or 0.0 for key, _ in PLANNER_BARS], width=width, label=name)
    ax.set_xticks(range(len(PLANNER_BARS)))
    ax.set_xticklabels([label for _, label in PLANNER_BARS], fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_title("planner variants, same held-out questions")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def qa_reward_mean(row: Mapping) -> float | None:
    """A step's mean R_QA: TRL's logged column (GRPO) or STITCH's per-reward means; None when R_QA was off.

    >>> qa_reward_mean({"rewards/qa_reward/mean": 0.5}), qa_reward_mean({"rewards": {"qa_reward": 0.25}})
    (0.5, 0.25)
    """
    value = row.get("rewards/qa_reward/mean")
    return value if value is not None else (row.get("rewards") or {}).get("qa_reward")


def plot_training_curves(histories: Mapping[str, Sequence[Mapping]], path: str | Path) -> Path:
    """Reward (GRPO, STITCH) with its R_QA part when R_QA was on, and training loss / solve rate over steps;
    vertical lines mark SFT injections."""
    fig, (ax_reward, ax_other) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, rows) in enumerate(histories.items()):
        colour = f"C{i}"
        rewards = [(r["step"], r["reward"]) for r in rows if r.get("reward") is not None]
        if rewards:
            ax_reward.plot(*zip(*rewards), "o-", color=colour, label=name, markersize=3)
        qa = [(r["step"], mean) for r in rows if (mean := qa_reward_mean(r)) is not None]
        if qa:
            ax_reward.plot(*zip(*qa), "^:", color=colour, label=f"{name}: R_QA (mean, unweighted)", markersize=3)
        solve = [(r["step"], r["success_rate"]) for r in rows if "success_rate" in r]
        losses = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
        if solve:
            ax_other.plot(*zip(*solve), "o-", color=colour, label=f"{name}: solve rate (running)", markersize=3)
        if losses:
            ax_other.plot(*zip(*losses), "s--", color=colour, label=f"{name}: training loss", markersize=3)
        for r in rows:
            if r.get("sft_injection"):
                for ax in (ax_reward, ax_other):
                    ax.axvline(r["step"], color=colour, linestyle=":", alpha=0.6)
    ax_reward.set_title("reward per step (vertical lines: SFT injections)")
    ax_other.set_title("solve rate / training loss per step")
    for ax in (ax_reward, ax_other):
        ax.set_xlabel("step")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_chunk_size_by_dataset(report: Mapping, path: str | Path) -> Path:
    """The mean size (tokens) of the chunks the runtime read for each variant's plans, per dataset, with 95%
    bootstrap intervals as error bars (the SmartChunk paper's Figure 4b), beside the best fixed range's."""
    series = {name: metrics["by_dataset"] for name, metrics in report["variants"].items()}
    best = report.get("fixed_ranges", {}).get("best")
    if best:
        series[f"fixed {best['range']}"] = best["by_dataset"]
    datasets = list(dict.fromkeys(d for by in series.values() for d in by))
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(datasets) + 2), 4.5))
    width = 0.8 / max(len(series), 1)
    for i, (name, by) in enumerate(series.items()):
        xs, heights, errors = [], [], [[], []]
        for j, dataset in enumerate(datasets):
            summary = by.get(dataset, {})
            value, interval = summary.get("chunk_tokens"), summary.get("ci95", {}).get("chunk_tokens")
            if value is None:
                continue
            xs.append(j + (i - (len(series) - 1) / 2) * width)
            heights.append(value)
            errors[0].append(value - interval[0] if interval else 0.0)
            errors[1].append(interval[1] - value if interval else 0.0)
        ax.bar(xs, heights, width=width, yerr=errors, capsize=3, label=name)
    ax.set_xticks(range(len(datasets)))
    ax.set_xticklabels(datasets)
    ax.set_ylabel("mean tokens per chunk read")
    ax.set_title("chunk size the plans select, per dataset (95% bootstrap intervals)")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_quality_vs_cost(systems: Mapping[str, Mapping], path: str | Path, quality: str = "ndcg@10",
                         cost: str = "seconds", cost_label: str = "seconds per question",
                         title: str = "tree search and flat retrieval: quality against cost per question") -> Path:
    """``quality`` (with its 95% interval) against the ``cost`` per question, one point per system (log x);
    a system's LLM calls per question are written beside its name."""
    fig, ax = plt.subplots(figsize=(7.0, 4.8))
    for name, row in systems.items():
        value, interval = row.get(quality), row.get(f"{quality}_ci95")
        if value is None:
            continue
        x = max(row[cost], 1e-4)
        error = [[value - interval[0]], [interval[1] - value]] if interval else None
        ax.errorbar(x, value, yerr=error, fmt="o", markersize=7, capsize=4)
        calls = f", {row['llm_calls']:g} calls" if row.get("llm_calls") else ""
        ax.annotate(f"{name}{calls}", (x, value), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel(f"{cost_label} (log scale)")
    ax.set_ylabel(quality)
    ax.set_title(title)
    return save_figure(fig, path)


def plot_qa_vs_tokens_by_dataset(report: Mapping, path: str | Path) -> Path:
    """The trade-off the SmartChunk paper claims, one panel per dataset: QA score (95% interval) against the tokens
    the generator was given per question (log scale; the tokens retrieved in a report that predates that figure) for
    every fixed range (grey, labelled, the one chosen on training questions ringed) and every planner (coloured): a
    planner worth training sits above and to the left of the fixed ranges."""
    fixed = report.get("fixed_ranges", {})
    series = {f"fixed {name}": metrics.get("by_dataset", {}) for name, metrics in fixed.get("ranges", {}).items()}
    planners = {name: metrics.get("by_dataset", {}) for name, metrics in report["variants"].items()}
    datasets = list(dict.fromkeys(d for by in [*series.values(), *planners.values()] for d in by))
    fig, axes = plt.subplots(1, max(len(datasets), 1), figsize=(5.2 * max(len(datasets), 1), 4.6), squeeze=False)
    best = f"fixed {fixed['best']['range']}" if "best" in fixed else None
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def point(ax, summary: Mapping, **style) -> tuple[float, float] | None:
        value, tokens = summary.get("qa_accuracy"), summary.get("tokens_given", summary.get("tokens_read"))
        if value is None or not tokens:
            return None
        interval = summary.get("ci95", {}).get("qa_accuracy")
        error = [[value - interval[0]], [interval[1] - value]] if interval else None
        ax.errorbar(tokens, value, yerr=error, capsize=3, **style)
        return tokens, value

    for ax, dataset in zip(axes[0], datasets):
        for name, by in series.items():
            at = point(ax, by.get(dataset, {}), fmt="o", color="0.6", markersize=5,
                       markeredgecolor="black" if name == best else "0.6", markeredgewidth=2 if name == best else 1)
            if at:
                ax.annotate(name.removeprefix("fixed "), at, textcoords="offset points", xytext=(4, 3), fontsize=6,
                            color="0.35")
        for i, (name, by) in enumerate(planners.items()):
            point(ax, by.get(dataset, {}), fmt="D", color=colours[i % len(colours)], markersize=8, label=name)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("tokens given to the generator per question (log scale)")
        ax.set_ylabel("QA score")
        ax.set_title(dataset)
    axes[0][0].legend(fontsize=8, title=f"planners; grey: fixed ranges{' (ringed: chosen)' if best else ''}",
                      title_fontsize=7)
    fig.suptitle("QA score against tokens given: planners and every fixed range (95% bootstrap intervals)")
    return save_figure(fig, path)


def plot_paired_planners(paired: Mapping, path: str | Path) -> Path:
    """eval planner's question-by-question comparisons, one panel per dataset and one for all questions: each
    comparison's mean QA difference (the planner's minus the other's) with its 95% paired interval; a bar clear of
    the zero line is a difference the questions show, one across it is not."""
    comparisons = paired["comparisons"]
    panels = [*dict.fromkeys(d for c in comparisons for d in c["by_dataset"]), "all"]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 0.45 * len(comparisons) + 1.6),
                             sharey=True, squeeze=False)
    names = [f"{c['planner']} - {c['against']}" for c in comparisons]
    for ax, panel in zip(axes[0], panels):
        for row, comparison in enumerate(comparisons):
            cell = comparison["overall"] if panel == "all" else comparison["by_dataset"].get(panel, {})
            qa = cell.get("qa_accuracy")
            if not qa:
                continue
            low, high = qa["delta_ci95"] or (qa["delta"], qa["delta"])
            ax.errorbar(qa["delta"], row, xerr=[[qa["delta"] - low], [high - qa["delta"]]], fmt="o", capsize=3,
                        color="tab:blue" if low > 0 else "tab:red" if high < 0 else "0.4")
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set_title(f"{panel}", fontsize=9)
        ax.set_xlabel("QA difference", fontsize=8)
    axes[0][0].set_yticks(range(len(names)))
    axes[0][0].set_yticklabels(names, fontsize=8)
    axes[0][0].invert_yaxis()
    fig.suptitle("planners question by question (95% paired intervals)", fontsize=10)
    return save_figure(fig, path)
