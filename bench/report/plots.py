"""Figures of a report (matplotlib, Agg, no pyplot state): PNG for the HTML report, SVG for papers.

Every figure is drawn from the summary frames of bench.report.build (which come from bench.metrics
over the kept records) or from `bench profile` files; a figure with nothing to draw is
returned as `Skipped` with the reason, and the report lists it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on the machines that render reports

import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator, NullFormatter, ScalarFormatter  # noqa: E402
from PIL import Image  # noqa: E402

from bench.report.scaling import scaling_fit, scaling_rows, training_runs  # noqa: E402
from bench.report.tables import BASELINE, Records, Tables  # noqa: E402

# Stable file contents for the same inputs (committed figures should not churn).
RC = {"svg.hashsalt": "bench-report", "font.size": 9, "axes.spines.top": False, "axes.spines.right": False}


@dataclass
class Figured:
    name: str
    title: str
    caption: str
    png: Path
    svg: Path


@dataclass
class Skipped:
    name: str
    title: str
    reason: str


def _order(methods: list[str]) -> list[str]:
    """Registry order (ar first, then as `bench list` shows them), unknown names last."""
    from bench.registry import METHODS

    known = list(METHODS)
    return sorted(set(methods), key=lambda m: (known.index(m) if m in known else len(known), m))


def _color(method: str) -> tuple:
    from bench.registry import METHODS

    known = list(METHODS)
    index = known.index(method) if method in known else len(known) + sum(map(ord, method)) % 7
    return matplotlib.colormaps["tab20"](index % 20)


def labels(frame: pd.DataFrame) -> pd.Series:
    """method, plus the tag (and target) where the selection holds several."""
    label = frame["method"].astype(str)
    if frame["series"].nunique() > 1:
        label = label + " [" + frame["series"].astype(str) + "]"
    if frame["target"].nunique() > 1:
        label = frame["target"].astype(str) + ": " + label
    return label


def _save(fig: Figure, out: Path, name: str, title: str, caption: str) -> Figured:
    out.mkdir(parents=True, exist_ok=True)
    png, svg = out / f"{name}.png", out / f"{name}.svg"
    with matplotlib.rc_context(RC):
        fig.savefig(png, dpi=110, bbox_inches="tight", metadata={"Software": None})
        fig.savefig(svg, bbox_inches="tight", metadata={"Date": None})
    _to_palette(png)
    return Figured(name, title, caption, png, svg)


def _to_palette(png: Path) -> None:
    """256 colours: a third of the bytes of matplotlib's RGBA for flat-coloured plots, whose
    reports embed them (the committed reports stay small); the SVG keeps the exact colours."""
    with Image.open(png) as image:
        palette = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    palette.save(png, optimize=True)


def _figure(width: float, height: float) -> Figure:
    with matplotlib.rc_context(RC):
        return Figure(figsize=(width, height), layout="constrained")


def _with_speedup(frame: pd.DataFrame, column: str) -> pd.DataFrame | None:
    """Rows of methods measured against a baseline, labelled; None when there are none."""
    if column not in frame or "speedup" not in frame:
        return None
    rows = frame[(frame["method"] != BASELINE) & frame["speedup"].notna()]
    return None if rows.empty else rows.assign(label=labels(rows))


def speedup_by_task(per_task: pd.DataFrame, overall: pd.DataFrame, out: Path) -> Figured | Skipped:
    name, title = "speedup", "Speedup over AR by method and task"
    rows = _with_speedup(pd.concat([per_task.assign(group=per_task["task"]), overall.assign(group="overall")],
                                   ignore_index=True), "speedup")
    if rows is None:
        return Skipped(name, title, "no method with an AR baseline in the selection")
    groups = list(dict.fromkeys(list(per_task["task"].unique()) + ["overall"]))
    groups = [g for g in groups if g in set(rows["group"])]
    order = _order(list(rows["method"]))
    method_of = dict(zip(rows["label"], rows["method"]))
    series = sorted(method_of, key=lambda label: (order.index(method_of[label]), label))
    fig = _figure(max(6.0, 1.1 * len(groups) * max(1, len(series)) / 3), 3.6)
    with matplotlib.rc_context(RC):
        ax = fig.add_subplot()
        width = 0.8 / len(series)
        for i, label in enumerate(series):
            sub = rows[rows["label"] == label].set_index("group")
            xs = [groups.index(g) + (i - (len(series) - 1) / 2) * width for g in sub.index]
            lows = [s - ci[0] for s, ci in zip(sub["speedup"], sub["speedup_ci"])]
            highs = [ci[1] - s for s, ci in zip(sub["speedup"], sub["speedup_ci"])]
            err = [[0 if math.isnan(v) else v for v in lows], [0 if math.isnan(v) else v for v in highs]]
            ax.bar(xs, sub["speedup"], width, yerr=err, capsize=2, label=label,
                   color=_color(sub["method"].iloc[0]), edgecolor="black", linewidth=0.3)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(groups)), groups)
        ax.set_ylabel("speedup over AR (ratio of sums)")
        ax.legend(fontsize=7, ncols=min(4, len(series)), loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, out, name, title, "Bars: (ΣT_AR/ΣN_AR)/(ΣT/ΣN) over the same turns; whiskers: 95% "
                 "bootstrap interval over paired turns; dashed: AR speed.")


def acceptance_decay(per_task: pd.DataFrame, overall: pd.DataFrame, out: Path) -> Figured | Skipped:
    name, title = "acceptance", "Per-position acceptance a_i"
    panels = [("overall", overall)] + [(t, per_task[per_task["task"] == t]) for t in per_task["task"].unique()]
    panels = [(p, f[(f["method"] != BASELINE) & f["accept_cond"].map(len).gt(0)]) for p, f in panels]
    panels = [(p, f.assign(label=labels(f))) for p, f in panels if not f.empty][:6]
    if not panels:
        return Skipped(name, title, "no method drafted anything in the selection")
    columns = min(3, len(panels))
    fig = _figure(3.3 * columns, 2.8 * math.ceil(len(panels) / columns))
    with matplotlib.rc_context(RC):
        for index, (panel, frame) in enumerate(panels):
            ax = fig.add_subplot(math.ceil(len(panels) / columns), columns, index + 1)
            for _, row in frame.iterrows():
                rates = row["accept_cond"]
                ax.plot(range(1, len(rates) + 1), rates, marker="o", markersize=3, label=row["label"],
                        color=_color(row["method"]))
            ax.set_title(panel)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("draft position i (tree depth)")
            ax.set_ylabel("a_i (conditional)")
            ax.set_ylim(0, 1.02)
        fig.axes[0].legend(fontsize=6)
    return _save(fig, out, name, title, "a_i = #(n_r ≥ i) / #(n_r ≥ i-1 and proposed_r ≥ i), pooled over rounds; "
                 "positions with few rounds are noisy (counts in the CSV).")


def accept_histograms(overall: pd.DataFrame, out: Path) -> Figured | Skipped:
    name, title = "accept_hist", "Accepted length per round (τ_r = n_r + 1)"
    rows = overall[overall["method"] != BASELINE]
    rows = rows.assign(label=labels(rows))
    if rows.empty:
        return Skipped(name, title, "no drafting method in the selection")
    columns = min(4, len(rows))
    fig = _figure(2.5 * columns, 2.2 * math.ceil(len(rows) / columns))
    top = max(max(h) for h in rows["accept_hist"] if h)
    with matplotlib.rc_context(RC):
        for index, (_, row) in enumerate(rows.iterrows()):
            ax = fig.add_subplot(math.ceil(len(rows) / columns), columns, index + 1)
            hist = row["accept_hist"]
            total = sum(hist.values()) or 1
            ax.bar(list(hist), [v / total for v in hist.values()], color=_color(row["method"]))
            ax.set_title(f"{row['label']} (τ={row['tau']:.2f})", fontsize=8)
            ax.set_xticks(range(1, top + 1))
            ax.set_xlabel("τ_r")
            ax.set_ylim(0, 1)
        fig.axes[0].set_ylabel("share of rounds")
    return _save(fig, out, name, title, "Share of verification rounds committing τ_r tokens, all tasks pooled.")


def tau_vs_budget(per_task: pd.DataFrame, out: Path) -> Figured | Skipped:
    name, title = "tau_budget", "τ vs draft budget"
    rows = per_task[(per_task["method"] != BASELINE) & per_task["tree_size"].gt(0)]
    if rows.empty:
        return Skipped(name, title, "no drafting method in the selection")
    # x: the run's draft budget (recorded with --budget; for older records read from the method's
    # options); a method without a fixed one (an adaptive schedule or tree) sits at its measured
    # mean draft size, drawn hollow.
    budget = rows["budget"] if "budget" in rows else pd.Series(float("nan"), index=rows.index)
    rows = rows.assign(label=labels(rows), x=budget.fillna(rows["tree_size"]), nominal=budget.notna())
    fig = _figure(5.5, 3.6)
    markers = "osD^v<>ph*"
    tasks = list(rows["task"].unique())
    with matplotlib.rc_context(RC):
        ax = fig.add_subplot()
        # One legend entry per method; each point is labelled with its series (a budget, a temperature, ...):
        # series may differ in more than the budget, so points are not joined.
        seen: set[str] = set()
        for _, row in rows.iterrows():
            color = _color(row["method"])
            ax.scatter(row["x"], row["tau"], facecolors=color if row["nominal"] else "none",
                       edgecolors="black" if row["nominal"] else color,
                       marker=markers[tasks.index(row["task"]) % len(markers)], linewidth=0.3 if row["nominal"] else 1,
                       label=None if row["method"] in seen else row["method"])
            seen.add(row["method"])
            if rows["series"].nunique() > 1:
                ax.annotate(str(row["series"]), (row["x"], row["tau"]), fontsize=5, xytext=(3, 2),
                            textcoords="offset points")
        for task in tasks:
            ax.scatter([], [], marker=markers[tasks.index(task) % len(markers)], color="grey", label=task)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())  # 4, 8, 16 rather than 2^2 or 4x10^0
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("draft budget: draft tokens verified per round (log scale)")
        ax.set_ylabel("τ (tokens per round)")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, out, name, title, "One point per method, task and series at its draft budget (draft tokens "
                 "verified per round: `bench run --budget K`, or what the method's options amount to); hollow: no "
                 "fixed budget (an adaptive schedule or tree), at its measured mean draft size. A method run with "
                 "several budgets (tags) gives several points, each labelled with its series.")


def _method_task_lines(ax, rows: pd.DataFrame, x: str, y: str, suffix: str = "", by_run: bool = False) -> None:
    """One line per (method, task), sorted by x: the method's colour, the task's marker; with
    by_run, one per training run too (a method's later runs dashed, their run in the label)."""
    markers = "osD^v<>ph*"
    tasks = sorted(rows["task"].unique())
    runs = training_runs(rows) if by_run else pd.Series("", index=rows.index)
    # how far each of a method's runs trained: the furthest drawn solid, the others dashed
    furthest = rows.groupby(["method", runs])["trained_tokens"].max() if by_run else None
    for (method, task, run), group in rows.groupby(["method", "task", runs]):
        group = group.sort_values(x)
        several = furthest is not None and len(furthest[method]) > 1
        latest = not several or run == furthest[method].idxmax()
        label = f"{method} · {task}{suffix}" + (f" · {_run_label(run)}" if several else "")
        ax.plot(group[x], group[y], color=_color(method), marker=markers[tasks.index(task) % len(markers)],
                linewidth=1, markersize=4, linestyle="-" if latest else "--", label=label)


def _run_label(run: str) -> str:
    """A training run, short: its hash, or its folder's last two parts (the older records)."""
    return run if len(run) <= 8 else "/".join(run.rstrip("/").split("/")[-2:])


def _fit_sentence(fit: pd.DataFrame) -> str:
    parts = []
    for row in fit.itertuples():
        run = f" (run {_run_label(row.run)})" if getattr(row, "run", "") else ""
        text = (f"{row.method} · {row.task}{run}: τ {row.tau_at_largest:.2f} at "
                f"{row.largest_tokens / 1e6:.2g}M tokens, {row.tau_per_10x:+.2f} per tenfold data")
        parts.append(text)
    return " Log-linear fit (scaling_fit.csv): " + "; ".join(parts) + "." if parts else ""


def tau_vs_training_tokens(per_task: pd.DataFrame, out: Path) -> Figured | Skipped:
    name, title = "scaling", "τ vs training tokens"
    rows = scaling_rows(per_task)
    if rows.empty:
        return Skipped(name, title, "no method run with drafters kept at two or more training sizes "
                                    "(bench train --keep-at, then bench run --drafter OUT/kept/<N>-tokens)")
    fig = _figure(5.5, 3.6)
    with matplotlib.rc_context(RC):
        ax = fig.add_subplot()
        _method_task_lines(ax, rows, "trained_tokens", "tau", by_run=True)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # under two decades the minor labels collide
        ax.set_xlabel("tokens the drafter was trained on (log scale)")
        ax.set_ylabel("τ (tokens per round)")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fit = scaling_fit(rows)
    out.mkdir(parents=True, exist_ok=True)
    fit.round(4).to_csv(out / "scaling_fit.csv", index=False)
    return _save(fig, out, name, title, "τ of each trained method against the number of training tokens its "
                 "drafter had seen (drafters kept during one training run with `bench train --keep-at`), per task: "
                 "where a line still rises at the right, more data or steps would raise τ further." +
                 _fit_sentence(fit))


def speedup_vs_tau(per_task: pd.DataFrame, out: Path) -> Figured | Skipped:
    name, title = "speedup_tau", "Measured speedup vs τ, with the speedup model"
    rows = _with_speedup(per_task, "speedup_model")
    if rows is None:
        return Skipped(name, title, "no method with an AR baseline in the selection")
    fig = _figure(5.8, 3.8)
    with matplotlib.rc_context(RC):
        ax = fig.add_subplot()
        top = max(2.0, rows["tau"].max() + 0.3)
        ax.plot([1, top], [1, top], color="grey", linestyle=":", label="S = τ (free draft, verify = 1 AR step)")
        for label, sub in rows.groupby("label", sort=False):
            color = _color(sub["method"].iloc[0])
            low = sub["speedup"] - sub["speedup_ci"].map(lambda c: c[0])
            high = sub["speedup_ci"].map(lambda c: c[1]) - sub["speedup"]
            ax.errorbar(sub["tau"], sub["speedup"], yerr=[low.fillna(0), high.fillna(0)], fmt="o", color=color,
                        markeredgecolor="black", markeredgewidth=0.3, capsize=2, label=label)
            ax.scatter(sub["tau"], sub["speedup_model"], facecolors="none", edgecolors=color, marker="s")
            # The model's line for this method, S = τ · t0 / (t_d + t_v), at its mean per-round cost over tasks.
            slope = (sub["speedup_model"] / sub["tau"]).mean()
            ax.plot([1, top], [slope, slope * top], color=color, linestyle="--", linewidth=0.8)
        _speedup_axes(ax, legend_size=7)
    return _save(fig, out, name, title, "Filled: measured (95% CI); hollow squares and dashed lines: the model "
                 "S = τ·t0/(t_d + t_v) (bench.metrics.modelled_speedup): t0 = AR time per step, t_d, t_v = draft "
                 "and verify time per round; the model leaves out TTFT and the loop's own overhead.")


def load_sweep(per_task: pd.DataFrame, out: Path) -> Figured | Skipped:
    name, title = "load", "Speedup and throughput vs batch size"
    rows = per_task[per_task["batch_size"].gt(1)] if "batch_size" in per_task else per_task.iloc[:0]
    if rows.empty:
        return Skipped(name, title, "no batched run (bench run --batch-size) in the selection")
    rows = per_task.assign(throughput=per_task["tokens_per_s"] * per_task["load"])
    rows = rows[rows.groupby(["target", "task", "method"])["batch_size"].transform("nunique").gt(1)]
    if rows.empty:
        return Skipped(name, title, "no method run at more than one batch size")
    fig = _figure(17.0, 3.6)
    with matplotlib.rc_context(RC):
        left, middle, right, front = (fig.add_subplot(1, 4, i) for i in (1, 2, 3, 4))
        for (method, task), sub in rows.groupby(["method", "task"], sort=False):
            sub = sub.sort_values("batch_size")
            style = dict(color=_color(method), marker="o", linewidth=0.8, label=f"{method} / {task}")
            right.plot(sub["batch_size"], sub["throughput"], **style)
            middle.plot(sub["batch_size"], 1e3 * sub["tpot_s"], **style)
            front.plot(sub["throughput"], sub["tokens_per_s"], **style)  # SPEED-Bench's and DSpark's serving view
            if method != BASELINE:
                left.plot(sub["batch_size"], sub["speedup"], **style)
        front.set_xlabel("total tok/s (all requests)")
        front.set_ylabel("tok/s per request (per user)")
        left.axhline(1.0, color="black", linewidth=0.6)
        left.set_ylabel("speedup over AR at the same batch size")
        middle.set_ylabel("per-request TPOT (ms per token)")
        right.set_ylabel("total tok/s (per-request tok/s x mean load)")
        for ax in (left, middle, right):
            _log2_axis(ax, "batch size (requests decoding at once)")
        front.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, out, name, title, "Each method at several `bench run --batch-size` values, its AR baseline run "
                 "at the same batch size. First: speedup (ratio of sums over paired turns). Second: each request's "
                 "time per output token. Third: total throughput, per-request tok/s times the mean number of "
                 "requests sharing its target passes. Fourth: tok/s per request against total tok/s, one point per "
                 "batch size (the serving front SPEED-Bench and DSpark draw: up and right is better). τ does not "
                 "depend on the batch size (the tables give it).")


def _log2_axis(ax, label: str) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(label)


def context_sweep(per_task: pd.DataFrame, out: Path) -> Figured | Skipped:
    """τ and speedup against the prompt's length (python -m bench.context_sweep, series ctx<L>)."""
    name, title = "context", "τ and speedup against context length"
    rows = per_task[per_task["series"].str.fullmatch(r"ctx\d+") & per_task["method"].ne(BASELINE)] \
        if not per_task.empty else per_task
    if rows.empty:
        return Skipped(name, title, "no context sweep kept (python -m bench.context_sweep)")
    rows = rows.assign(context=rows["series"].str[3:].astype(int)).sort_values("context")
    fig = _figure(10.0, 3.6)
    with matplotlib.rc_context(RC):
        left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
        for method, sub in rows.groupby("method", sort=False):
            style = dict(color=_color(method), marker="o", linewidth=0.8, label=method)
            left.plot(sub["context"], sub["tau"], **style)
            right.plot(sub["context"], sub["speedup"], **style)
        left.set_ylabel("τ (tokens per verification)")
        right.set_ylabel("speedup over AR (same prompts)")
        right.axhline(1.0, color="black", linewidth=0.6)
        for ax in (left, right):
            _log2_axis(ax, "prompt length (tokens)")
        right.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, out, name, title, "Each method on prompts built to each length from a suite's questions (a "
                 "reference block of other questions' text before the request), its AR baseline on the same prompts.")


def _speedup_axes(ax, legend_size: int) -> None:
    """Speedup against τ: the break-even line, labels, the legend outside on the right."""
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_xlabel("τ (tokens per round)")
    ax.set_ylabel("speedup over AR")
    ax.legend(fontsize=legend_size, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def speedup_at_tau(per_task: pd.DataFrame, out: Path) -> Figured | Skipped:
    name, title = "oracle", "Speedup at τ: oracle acceptance against the real drafters"
    rows = _with_speedup(per_task, "speedup")
    oracle = rows[rows["oracle_accept"].notna()] if rows is not None and "oracle_accept" in rows else None
    if oracle is None or oracle.empty:
        return Skipped(name, title, "no run with oracle acceptance (make oracle-sweep, or "
                                    "bench run --option oracle_accept=A)")
    real = rows[rows["oracle_accept"].isna() & rows["method"].isin(oracle["method"])]
    fig = _figure(5.8, 3.8)
    with matplotlib.rc_context(RC):
        ax = fig.add_subplot()
        _method_task_lines(ax, oracle, "tau", "speedup", " (oracle)")
        for _, row in real[real["task"].isin(oracle["task"].unique())].iterrows():
            ax.scatter(row["tau"], row["speedup"], color=_color(row["method"]), marker="*", s=60,
                       edgecolors="black", linewidths=0.4)
        ax.scatter([], [], marker="*", color="grey", edgecolors="black", label="the method's own drafter")
        _speedup_axes(ax, legend_size=6)
    return _save(fig, out, name, title, "Lines: each method drafting as usual with its draft tokens replaced by "
                 "the AR baseline's own next tokens at per-node acceptance a (`--option oracle_accept=a`, "
                 "bench.core.oracle), so τ is chosen and only the method's drafting and verification cost decide "
                 "the speedup. Stars: the same method with its real drafter. A star below its line at equal τ "
                 "would mean the real drafts cost more than the oracle run's (they should not); a star left of "
                 "the line's τ range says how much acceptance the drafter is missing.")


def hardware_profile(profiles: list[dict], out: Path) -> Figured | Skipped:
    name, title = "profile", "Hardware profile: verification latency t_v(k) and draft cost per round"
    if not profiles:
        return Skipped(name, title, "no `bench profile` output for the selected targets")
    costs = [(Path(p["path"]).stem, row) for p in profiles for row in p.get("drafters", []) if "skipped" not in row]
    fig = _figure(12.0 if costs else 8.0, 3.2)
    with matplotlib.rc_context(RC):
        left, right = fig.add_subplot(1, 3 if costs else 2, 1), fig.add_subplot(1, 3 if costs else 2, 2)
        for profile in profiles:
            source = Path(profile["path"]).stem
            label = f"{profile['target']} {source} ({profile.get('provenance', {}).get('device_name', '?')})"
            for kind, style in (("chain", "-o"), ("tree", "--s")):
                rows = sorted((r for r in profile["rows"] if r["kind"] == kind), key=lambda r: r["k"])
                if not rows:
                    continue
                ks = [r["k"] for r in rows]
                left.plot(ks, [1e3 * r["median_s"] for r in rows], style, markersize=3, label=f"{label}, {kind}")
                if rows[0].get("ratio_to_k1") is not None:
                    line, = right.plot(ks, [r["ratio_to_k1"] for r in rows], style, markersize=3)
                    floor = profile.get("compute_bound") or {}
                    if kind == "chain" and floor.get("least_ratio_to_k1"):  # what the matmul rate allows at best
                        right.plot([floor["k"]], [floor["least_ratio_to_k1"]], "*", markersize=9,
                                   color=line.get_color())
        for ax in (left, right):
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.set_xlabel("tokens verified in one pass (k)")
        left.set_ylabel("median ms per pass")
        right.set_ylabel("t_v(k) / t_v(1)")
        right.axhline(1.0, color="black", linewidth=0.6)
        left.legend(fontsize=6)
        if costs:  # `bench profile --drafters`: what one round of each method costs here
            ax = fig.add_subplot(1, 3, 3)
            names = [f"{row['method']} ({source})" if len(profiles) > 1 else row["method"] for source, row in costs]
            draft = [row["draft_ms_per_round"] for _, row in costs]
            ax.barh(names, draft, color=[_color(row["method"]) for _, row in costs], label="draft")
            ax.barh(names, [row["verify_ms_per_round"] for _, row in costs], left=draft, color="lightgrey",
                    label="verify")
            ax.set_xlabel("ms per round (one prompt)")
            ax.invert_yaxis()
            ax.legend(fontsize=6)
    skipped = [f"{row['method']}: {row['skipped']}" for p in profiles for row in p.get("drafters", [])
               if "skipped" in row]
    return _save(fig, out, name, title, "One target forward over k new tokens after a fixed context "
                 "(`bench profile`); chains solid, top-2 trees dashed; a star: the least t_v(16)/t_v(1) the "
                 "measured matmul rate allows (16 rows of arithmetic at that rate, over the measured t_v(1)); "
                 "right: draft and verify time per round of each drafter on one prompt."
                 + (f" Not profiled: {'; '.join(skipped)}." if skipped else ""))


def tuning_curves(tunings: list[dict], out: Path) -> Figured | Skipped:
    name, title = "tune", "Speedup at each draft budget on held-back prompts (bench tune)"
    if not tunings:
        return Skipped(name, title, "no `bench tune` record for the selected targets")
    tunings = tunings[:3]  # one panel per machine record; more is unreadable
    fig = _figure(5.0 * len(tunings), 3.4)
    with matplotlib.rc_context(RC):
        for panel, tuning in enumerate(tunings, start=1):
            ax = fig.add_subplot(1, len(tunings), panel)
            budgets = sorted({row["budget"] for e in tuning["methods"].values() for row in e["candidates"]
                              if row["budget"] is not None})
            where = {None: 0, **{b: i + 1 for i, b in enumerate(budgets)}}
            for method in _order(list(tuning["methods"])):
                rows = tuning["methods"][method]["candidates"]
                sized = sorted((r for r in rows if r["budget"] is not None), key=lambda r: r["budget"])
                ax.plot([where[r["budget"]] for r in sized], [r["speedup"] for r in sized], "-o", markersize=3,
                        color=_color(method), label=method)
                ax.plot([0], [r["speedup"] for r in rows if r["budget"] is None][:1], "x", color=_color(method))
            ax.axhline(1.0, color="black", linewidth=0.6)
            ax.set_xticks(range(len(where)), ["defaults", *map(str, budgets)])
            ax.set_xlabel("draft tokens verified per round (--budget)")
            ax.set_ylabel("speedup over AR")
            ax.set_title(Path(tuning["path"]).stem, fontsize=7)
            ax.legend(fontsize=6, ncol=2)
    return _save(fig, out, name, title, "Each method at its own defaults (x) and at each candidate budget, greedy, "
                 "interleaved with AR on the ShareGPT prompts distillation holds back; the fastest is what "
                 "`--budget auto` runs (results/<target>/tune/).")


def training_curves(logs: list[dict], out: Path) -> Figured | Skipped:
    """Each shipped drafter's training agreement at draft position 0 against tokens seen, from
    the log it ships, with the held-out agreement its manifest records at the end."""
    name, title = "training", "Training curves of the shipped drafters"
    logs = [log for log in logs if len(log["tokens"]) > 1]
    if not logs:
        return Skipped(name, title, "no shipped drafter of the selected targets ships a training log")
    fig = _figure(7.0, 3.6)
    with matplotlib.rc_context(RC):
        ax = fig.add_subplot(1, 1, 1)
        for log in sorted(logs, key=lambda g: (_order([g["method"]]), g["target"])):
            label = log["method"] + (f" ({log['target']})" if len({g["target"] for g in logs}) > 1 else "")
            window = max(1, len(log["tokens"]) // 20)  # a moving mean over 5% of the logged steps
            smooth = pd.Series(log["agreement"]).rolling(window, min_periods=1).mean()
            ax.plot(log["tokens"], smooth, color=_color(log["method"]), linewidth=1.2, label=label)
            if log["heldout"] is not None:
                ax.plot([log["tokens"][-1]], [log["heldout"]], "*", markersize=9, color=_color(log["method"]))
        ax.set_xscale("log")
        ax.set_xlabel("tokens the drafter has trained on (log scale)")
        ax.set_ylabel("top-1 agreement with the target, draft position 0")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7, ncol=2)
    return _save(fig, out, name, title, "Training top-1 agreement at the first draft position (`acc0`, else `acc`, "
                 "as each trainer logs it; a moving mean over 5% of the logged steps) against tokens seen, from "
                 "each shipped drafter's training log (thinned to about 1,000 steps when shipped); a star: the "
                 "held-out agreement its manifest records at the end. Trainers differ in what they average over "
                 "(teacher-forced features, blocks, heads), so compare a drafter's curve with its own star first.")


def gpu_utilization(records: Records, out: Path) -> Figured | Skipped:
    name, title = "gpu_util", "GPU utilization over time"
    series: dict[str, list[tuple[float, float]]] = {}
    for run in records.runs:
        offset = 0.0
        label = f"{run.method} on {run.task}" + (f" [{run.series}]" if run.series else "") + (
            f" pass {run.repeat}" if run.repeat > 1 else "")
        for turn in run.turns:
            util = turn.get("utilization") or {}
            if util.get("kind") != "gpu" or not util.get("series"):
                continue
            points = series.setdefault(label, [])
            points += [(offset + t, u) for t, u in util["series"]]
            offset += util["series"][-1][0]
    if not series:
        return Skipped(name, title, "not measured: no GPU runs among the selected records (CPU runs record "
                       "process CPU utilization; see the CSV)")
    fig = _figure(7.0, 3.0)
    with matplotlib.rc_context(RC):
        ax = fig.add_subplot()
        for label, points in list(series.items())[:12]:  # more lines than that is unreadable
            ax.plot([p[0] for p in points], [p[1] for p in points], linewidth=0.8, label=label)
        ax.set_xlabel("decode time, turns laid end to end (s)")
        ax.set_ylabel("GPU utilization %")
        ax.set_ylim(0, 100)
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, out, name, title, "pynvml samples every 0.2 s while each turn decodes.")


def make_figures(records: Records, tables: Tables, out: Path, load: pd.DataFrame | None = None,
                 training_logs: list[dict] | None = None) -> list[Figured | Skipped]:
    """Every figure from the selection's tables; `load`: a load sweep's per-task rows, drawn
    in the load figure instead of the selection's; `training_logs`: the shipped drafters'
    (bench.report.build.shipped_training_logs)."""
    out = Path(out) / "figures"
    per_task, overall = tables.per_task, tables.overall
    if per_task.empty:
        reason = "no turn records in the selection"
        figures: list[Figured | Skipped] = [Skipped(n, t, reason) for n, t in (
            ("speedup", "Speedup over AR by method and task"), ("acceptance", "Per-position acceptance a_i"),
            ("accept_hist", "Accepted length per round"), ("tau_budget", "τ vs draft budget"),
            ("speedup_tau", "Measured speedup vs τ, with the speedup model"), ("scaling", "τ vs training tokens"),
            ("oracle", "Speedup at τ: oracle acceptance against the real drafters"),
            ("load", "Speedup and throughput vs batch size"))]
    else:
        figures = [speedup_by_task(per_task, overall, out), acceptance_decay(per_task, overall, out),
                   accept_histograms(overall, out), tau_vs_budget(per_task, out), speedup_vs_tau(per_task, out),
                   tau_vs_training_tokens(per_task, out), speedup_at_tau(per_task, out),
                   load_sweep(per_task if load is None else load, out)]
    return figures + [hardware_profile(records.profiles, out), tuning_curves(records.tunings, out),
                      training_curves(training_logs or [], out), gpu_utilization(records, out)]
