"""The study's report: the tables, the verdicts on GRPO-MA's claims and the plots, read from the runs'
``metrics.jsonl`` and the variance measurement's JSON only."""

from __future__ import annotations

import math
from pathlib import Path

from vlm_grpo_ma.tools.study_runs import (
    Grid,
    SettingSummary,
    _mean,
    held_out_metrics,
    objective,
    read_run,
    seed_mean,
    smooth,
)

# ----------------------------------------------------------------------------------------------------------
# The report


# A spike score needs a spike ratio, which needs the window's grad norms first (GradSpikeMonitor).
NO_SPIKE_SCORE = "n/a (no step past the spike window)"


def _spread(values: list[float], spec: str, missing: str = "not reached") -> str:
    """min-max of the seeds' values; ``missing`` names what NaN means (a target not reached, a score unknown)."""
    known = [v for v in values if not math.isnan(v)]
    if not known:
        return missing
    text = "-".join(format(v, spec) for v in (min(known), max(known))) if len(known) > 1 else format(known[0], spec)
    return text + ("" if len(known) == len(values) else f"; {len(values) - len(known)} of {len(values)} seeds {missing}")


def verdict(summaries: list[SettingSummary], reference: SettingSummary, name: str, target: float) -> list[str]:
    """One line per setting against the reference: how much of its wall time and tokens the setting needed to
    reach the target, and whether the seeds' own times separate (every seed of one faster than every seed of
    the other) or overlap."""
    _, ref_seconds, ref_tokens = reference.reach(name, target)
    ref_seeds = [v for v in reference.reach_per_seed(name, target) if not math.isnan(v)]
    lines = []
    for s in summaries:
        if s is reference:
            continue
        step, seconds, tokens = s.reach(name, target)
        if step is None:
            lines.append(f"- **{s.setting.name}** ({objective(s.setting)}) did not reach it on its seed mean within "
                         f"{s.runs[0].steps[-1]} steps. {equal_time(s, reference, name)}")  # fmt: skip
            continue
        if step == 0:  # the start already stood at the target: a run too short (or a target too low) to time
            lines.append(f"- **{s.setting.name}** ({objective(s.setting)}) stood at it from step 0, before any "
                         f"training, so there is no time to compare. {equal_time(s, reference, name)}")  # fmt: skip
            continue
        seeds = [v for v in s.reach_per_seed(name, target) if not math.isnan(v)]
        if seeds and ref_seeds and len(seeds) == len(s.runs) and max(seeds) < min(ref_seeds):
            separation = "every seed of it reached the target before every seed of " + reference.setting.name
        elif seeds and ref_seeds and min(seeds) > max(ref_seeds) and len(ref_seeds) == len(reference.runs):
            separation = "every seed of " + reference.setting.name + " reached the target before every seed of it"
        else:
            separation = "the seeds' own times overlap, so the difference is within seed noise"
        if _ratio(seconds, ref_seconds) == "n/a":  # the reference stood at the target from its start
            cost = f"where {reference.setting.name} stood at it from step 0 (no ratio of times)"
        else:
            cost = (f"in {_ratio(seconds, ref_seconds)}x {reference.setting.name}'s wall time and "
                    f"{_ratio(tokens, ref_tokens)}x its generated tokens")  # fmt: skip
        lines.append(
            f"- **{s.setting.name}** ({objective(s.setting)}) reached it at step {step:.0f}, {cost}; {separation}. "
            + equal_time(s, reference, name)
        )
    return lines


def _seed_order(pairs: list[tuple[float, float]], other: str) -> str:
    if all(a > b for a, b in pairs):
        return f"ahead of {other} on every seed"
    if all(a < b for a, b in pairs):
        return f"behind {other} on every seed"
    return "ahead on some seeds and behind on others: within seed noise"


def equal_thoughts(summaries: list[SettingSummary], reference: SettingSummary, name: str) -> list[str]:
    """GRPO at GRPO-MA's thought count (an M = 1 setting other than the reference) against the GRPO-MA settings
    with the same K: at equal steps (their ends), and at the M = 1 setting's end in wall time."""
    lines = []
    for grpo in (s for s in summaries if s.setting.num_answers == 1 and s is not reference):
        for ma in (s for s in summaries if s.setting.num_thoughts == grpo.setting.num_thoughts and s.setting.num_answers > 1):
            ma_end = [r.eval_values[name][-1] for r in ma.runs]
            grpo_end = [r.eval_values[name][-1] for r in grpo.runs]
            lines.append(
                f"- **{ma.setting.name} against {grpo.setting.name}** (the same {ma.setting.num_thoughts} thoughts, {ma.setting.num_answers} "
                f"answers each instead of 1): after the same {ma.runs[0].steps[-1]} steps {_fmt(_mean(ma_end), '.3f')} against "
                f"{_fmt(_mean(grpo_end), '.3f')}, {_seed_order(list(zip(ma_end, grpo_end, strict=True)), grpo.setting.name)}. "
                + equal_time(grpo, ma, name)
            )
    return lines


def claims(summaries: list[SettingSummary], reference: SettingSummary, measured, name: str) -> list[str]:
    """The paper's claims, each next to what this grid (and the variance measurement, when there) shows."""
    lines = ["## The paper's claims next to these numbers", ""]
    if measured is not None:
        results = {r.num_answers: r for r in measured[0]}
        low, high = min(results), max(results)
        if low != high:
            a, b = results[low], results[high]
            lines.append(
                f"- *The thought advantage's variance falls like 1/M.* From M = {low} to {high} (1/M: {high / low:.0f}x less) the "
                f"thought value's variance fell {a.value_var / b.value_var:.1f}x and the thought advantage's "
                f"{a.advantage_var / b.advantage_var:.1f}x (the variance section)."
            )
    ma = [s for s in summaries if s.setting.num_answers > 1]
    if ma:
        lines.append(
            f"- *GRPO-MA trains more steadily (fewer gradient spikes).* Spike score {reference.setting.name} "
            f"{_spread(reference.spike_scores(), '.3f', NO_SPIKE_SCORE)}; " + "; ".join(f"{s.setting.name} {_spread(s.spike_scores(), '.3f', NO_SPIKE_SCORE)}" for s in ma) + "."
        )
        lines.append("- *GRPO-MA reaches GRPO's quality with less time and compute.* See the verdict above.")
        for s in ma:
            step_ratio = (s.rollout_seconds() + s.update_seconds()) / (reference.rollout_seconds() + reference.update_seconds())
            thought, answer = s.thought_tokens(), s.answer_tokens()
            end, ref_end = _mean(s.eval_curve(name)[-1:]), _mean(reference.eval_curve(name)[-1:])
            lines.append(
                f"- *What a step buys ({s.setting.name}).* After the same {s.runs[0].steps[-1]} steps its held-out {name} is "
                f"{_fmt(end, '.3f')} against {reference.setting.name}'s {_fmt(ref_end, '.3f')}, and its step costs {step_ratio:.2f}x {reference.setting.name}'s: sampling "
                f"{_ratio(s.rollout_seconds(), reference.rollout_seconds())}x, the update {_ratio(s.update_seconds(), reference.update_seconds())}x "
                f"(every one of the K*M answers is trained; a shared thought is encoded once). Thoughts are {_fmt(thought, '.1f')} tokens against "
                f"{_fmt(answer, '.1f')} for an answer, so sharing a thought saves at most {_fmt(thought / (thought + answer), '.0%')} of an "
                "answer's sequence; the paper's regime is long thoughts and short answers."
            )
    return [*lines, ""]


def equal_time(s: SettingSummary, reference: SettingSummary, name: str) -> str:
    """The setting's held-out figure at its end against the reference's after the same training wall time, seed
    by seed (seed i of both saw the same prompts): ahead or behind on every seed, or mixed (seed noise)."""
    ends = s.end_seconds_per_seed()
    own = [r.eval_values[name][-1] if r.eval_values[name] else math.nan for r in s.runs]
    theirs = [ref.held_out_at_seconds(name, end) for ref, end in zip(reference.runs, ends, strict=True)]
    pairs = [(a, b) for a, b in zip(own, theirs, strict=True) if not (math.isnan(a) or math.isnan(b))]
    if not pairs:
        return f"Its {_fmt(_mean(ends), '.0f')} s of training are past {reference.setting.name}'s last evaluation."
    order = _seed_order(pairs, reference.setting.name)
    return (f"At equal training wall time ({_fmt(_mean(ends), '.0f')} s, {s.setting.name}'s end) {s.setting.name} stood at {_fmt(_mean(own), '.3f')} against "
            f"{reference.setting.name}'s {_fmt(_mean(theirs), '.3f')}: {order}"
            + ("" if len(pairs) == len(own) else f" ({len(pairs)} of {len(own)} seeds comparable)") + ".")


def write_report(grid: Grid, root: Path, *, task: str, command: str, report_dir: Path | None = None) -> Path:
    """report.md and its plots in ``report_dir`` (default: ``root``), from the runs under ``root``."""
    from vlm_grpo_ma.tools import variance

    report_dir = report_dir or root
    report_dir.mkdir(parents=True, exist_ok=True)
    held_out = held_out_metrics(task)
    summaries = [SettingSummary(s, [read_run(grid.run_dir(root, s, seed), task, held_out) for seed in grid.seeds]) for s in grid.settings]
    reference = next((s for s in summaries if s.setting.name == "T16A1"), summaries[0])
    main = held_out.main
    has_thoughts = any(not all(math.isnan(v) for r in s.runs for v in r.eval_values[held_out.right_thought]) for s in summaries)
    measured = variance.read_outputs(root / "variance")
    plots = {
        "heldout.png": plot_curves(summaries, report_dir / "heldout.png", main, f"held-out greedy {task} {main}"),
        "accuracy.png": held_out.accuracy != main
        and plot_curves(summaries, report_dir / "accuracy.png", held_out.accuracy, f"held-out greedy {task} accuracy"),
        "right_thoughts.png": has_thoughts and plot_curves(summaries, report_dir / "right_thoughts.png", held_out.right_thought,
                                                           "held-out share of right thoughts"),  # fmt: skip
        "reward.png": plot_curves(summaries, report_dir / "reward.png", None, "mean training reward (smoothed)"),
        "variance.png": measured is not None and _plot_variance(measured[0], report_dir / "variance.png"),
        "noise_vs_m.png": plot_noise(summaries, report_dir / "noise_vs_m.png"),
        "step_time.png": plot_step_time(summaries, report_dir / "step_time.png"),
        "spike_score.png": plot_spikes(summaries, report_dir / "spike_score.png"),
    }
    target = reference.eval_curve(main)[-1] if reference.eval_curve(main) else math.nan
    _, ref_seconds, ref_tokens = reference.reach(main, target)
    link = lambda name: [f"![{name}]({name})", ""] if plots.get(name) else []  # noqa: E731
    accuracy_header = "" if held_out.accuracy == main else "held-out accuracy | "  # math's main metric is its accuracy
    lines = [
        "# GRPO-MA study",
        "",
        f"Command: `{command}`",
        "",
        f"Task {task}; settings {', '.join(s.setting.name for s in summaries)}; seeds {', '.join(map(str, grid.seeds))}; "
        f"{grid.steps} steps of {grid.prompts_per_step} prompts; held-out greedy evaluation of {grid.eval_samples} "
        f"samples before step 1 and every {grid.eval_every} steps. Every run sees the same prompts in the same order; "
        f"{f'config file: {grid.config}; ' if grid.config else ''}extra overrides: {' '.join(grid.extra) or 'none'}. Wall time is the training steps' own (evaluations excluded). "
        "Objectives: M = 1 rows train GRPO (`algorithm.advantage_estimator=grpo`, each thought + answer one sequence, "
        "the prompt's answers as baseline); M >= 2 rows train GRPO-MA (answer baseline: the thought's answers); the loss "
        f"is averaged with `algorithm.loss_aggregation={grid.loss_aggregation()}`.",
        "",
        f"## Time and tokens to reach {reference.setting.name}'s final held-out {main}",
        "",
        f"Target: {reference.setting.name}'s seed-mean held-out {main} at its last evaluation, {_fmt(target, '.3f')}. A setting "
        f"reaches it where its seed-mean held-out curve first does (linearly interpolated between evaluations); its "
        "wall time and tokens are the seed means at that step. Per seed: each seed's own curve against the same target.",
        "",
        f"| setting | objective | held-out {main}, start -> end (seeds at the end) | {accuracy_header}step reached | wall time (s) | "
        "ratio | generated tokens | ratio | per-seed wall time to reach (s) | sampling s/step | update s/step | tokens/step | spike score |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if accuracy_header else ""),
    ]
    for s in summaries:
        step, seconds, tokens = s.reach(main, target)
        accuracy_cell = f"{s.eval_change(held_out.accuracy, '.2f')} | " if accuracy_header else ""
        lines.append(
            f"| {s.setting.name} | {objective(s.setting)} | {s.eval_change(main)} | {accuracy_cell}"
            f"{'not reached' if step is None else f'{step:.0f}'} | {_fmt(seconds, '.0f')} | {_ratio(seconds, ref_seconds)} | "
            f"{_fmt(tokens, ',.0f')} | {_ratio(tokens, ref_tokens)} | {_spread(s.reach_per_seed(main, target), '.0f')} | "
            f"{s.rollout_seconds():.3f} | {s.update_seconds():.3f} | {_fmt(s.tokens_per_step(), ',.0f')} | "
            f"{_spread(s.spike_scores(), '.3f', NO_SPIKE_SCORE)} |"
        )
    lines += ["", "**Verdict** (from the table):", "", *verdict(summaries, reference, main, target),
              *equal_thoughts(summaries, reference, main), ""]  # fmt: skip
    lines += [*link("heldout.png"), *link("accuracy.png"), *link("reward.png"), *link("step_time.png")]
    lines += [
        "Spike score: the share of steps whose grad norm exceeds twice the median of the previous 10 steps "
        "(seed range in the table).",
        "",
        *link("spike_score.png"),
    ]
    if has_thoughts:
        lines += [
            "## Thoughts",
            "",
            "The share of thoughts that are the reference thought word for word (`right_thought`; on grounding scenes it "
            "names the target and its place, on counting pictures it lists the picture's inventory): held-out greedy "
            "thoughts, and sampled thoughts in training, first and last fifth of the steps.",
            "",
            "| setting | held-out right thoughts, start -> end (seeds at the end) | sampled right thoughts, first -> last fifth |",
            "|---|---|---|",
        ]
        for s in summaries:
            first, last = s.sampled_right_thought()
            lines.append(f"| {s.setting.name} | {s.eval_change(held_out.right_thought, '.2f')} | {_fmt(first, '.3f')} -> {_fmt(last, '.3f')} |")
        lines += ["", *link("right_thoughts.png")]
    if measured is not None:
        results, about = measured
        lines += [
            "## The thought advantage's variance against M, measured",
            "",
            f"`python -m vlm_grpo_ma.variance {about['run']} --out {root / 'variance'} --resamples {about['resamples']}` "
            f"({about['checkpoint']}): {about['prompts']} held-out prompts x {about['thoughts']} thoughts sampled once; "
            f"{about['answers_per_thought']} answers per thought from its KV cache, split into {about['resamples']} disjoint "
            "redraws of M answers. Variances across the redraws, averaged over the thoughts (95% bootstrap interval over "
            "thoughts); `x M` is the variance times M, constant where the variance falls like 1/M.",
            "",
            variance.table(results),
            "",
            *link("variance.png"),
        ]
        distinct = about.get("distinct_thoughts") or []
        if "differing" in about:
            lines += [
                f"{len(distinct) - about['differing']['prompts']} of the {len(distinct)} prompts drew {about['thoughts']} thoughts of one "
                "text: their true values are equal, so their normalised thought advantages are noise of a fixed scale at any M "
                "(the normalisation divides the noise by itself). Over the other "
                f"{about['differing']['prompts']} prompts alone:",
                "",
                variance.table(variance.differing_results(about)),
                "",
            ]
        signal = about.get("right_thoughts")
        if signal:
            lines += [
                f"Right against wrong thoughts on the same prompts ({signal['prompts_with_both']} of the {about['prompts']} prompts "
                f"hold both; {signal['right_thoughts']} right and {signal['wrong_thoughts']} wrong thoughts in all): mean value "
                f"{_fmt(signal['value_right'], '.3f')} against {_fmt(signal['value_wrong'], '.3f')}, and thought advantage at those "
                f"values (what an unlimited M would give) {_fmt(signal['advantage_right'], '+.2f')} against "
                f"{_fmt(signal['advantage_wrong'], '+.2f')}.",
                "",
            ]
    lines += claims(summaries, reference, measured, main)
    lines += [
        "## The per-step noise diagnostic",
        "",
        "`grpo_ma/thought_value_noise_var` is s2 / M computed from each step's own answers (s2: the variance of single "
        "rewards within a thought, `grpo_ma/answer_reward_var`). It falls like 1/M by its definition whenever s2 stays "
        "the same; it is a cheap per-step diagnostic of how noisy the thought values are, not a measurement of the law "
        + ("(the section above is)." if measured is not None else "(`python -m vlm_grpo_ma.variance`, redrawing answers for fixed thoughts, is)."),
        "",
        "| setting | s2 / M (mean over steps and seeds) | s2 | thought / answer tokens |",
        "|---|---|---|---|",
        *[f"| {s.setting.name} | {_fmt(s.noise_var(), '.4f')} | {_fmt(s.answer_var(), '.4f')} | "
          f"{_fmt(s.thought_tokens(), '.1f')} / {_fmt(s.answer_tokens(), '.1f')} |" for s in summaries],  # fmt: skip
        "",
        *link("noise_vs_m.png"),
    ]
    report = report_dir / "report.md"
    report.write_text("\n".join(lines).rstrip() + "\n")
    return report


def _plot_variance(results, path: Path) -> bool:
    from vlm_grpo_ma.tools import variance

    variance.plot(results, path)
    return True


def _fmt(value: float, spec: str) -> str:
    return "n/a" if value is None or math.isnan(value) else format(value, spec)


def _ratio(value: float, reference: float) -> str:
    if math.isnan(value) or math.isnan(reference) or reference == 0:
        return "n/a"
    return f"{value / reference:.2f}"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(figure, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    _pyplot().close(figure)


def plot_curves(summaries: list[SettingSummary], path: Path, name: str | None, ylabel: str) -> bool:
    """Three panels (against steps, wall time, generated tokens); a line per setting (seed mean) and a band
    from the lowest to the highest seed. ``name``: a held-out figure; None: the smoothed training reward."""
    plt = _pyplot()
    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    drawn = False
    for s in summaries:
        if name is None:
            ys, xs_steps = [smooth(r.reward) for r in s.runs], s.runs[0].steps
        else:
            ys, xs_steps = [r.eval_values[name] for r in s.runs], s.runs[0].eval_steps
        length = min(map(len, ys)) if ys else 0
        if length == 0 or all(math.isnan(v) for y in ys for v in y):
            continue
        ys = [y[:length] for y in ys]
        mean = seed_mean(ys)
        low = [min(y[i] for y in ys) for i in range(length)]
        high = [max(y[i] for y in ys) for i in range(length)]
        at = [(float(step), *_seed_mean_position(s, step)) for step in xs_steps[:length]]
        for axis, column in zip(axes, range(3), strict=True):
            xs = [a[column] for a in at]
            (line,) = axis.plot(xs, mean, label=s.setting.name)
            axis.fill_between(xs, low, high, alpha=0.2, color=line.get_color())
        drawn = True
    for axis, label in zip(axes, ("step", "wall time (s, seed mean)", "generated tokens (seed mean)"), strict=True):
        axis.set_xlabel(label)
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3)
    axes[0].legend()
    if drawn:
        _save(figure, path)
    else:
        plt.close(figure)
    return drawn


def _seed_mean_position(s: SettingSummary, step: float) -> tuple[float, float]:
    at = [r.position(step) for r in s.runs]
    return _mean(a[0] for a in at), _mean(a[1] for a in at)


def _error_bars(per_seed: list[list[float]], means: list[float]) -> list[list[float]]:
    """matplotlib's yerr from each bar's seed values: [below, above] the mean, to the lowest and highest seed."""
    below = [max(0.0, m - min(v)) if v else 0.0 for m, v in zip(means, per_seed, strict=True)]  # max(): rounding
    above = [max(0.0, max(v) - m) if v else 0.0 for m, v in zip(means, per_seed, strict=True)]
    return [below, above]


def noise_points(summaries: list[SettingSummary]) -> list[tuple[str, int, float, list[float]]]:
    """(setting, M, thought-value noise variance, its per-seed values) of the settings with M >= 2, by M."""
    points = [(s.setting.name, s.setting.num_answers, s.noise_var(), s.noise_var_per_seed()) for s in summaries if s.setting.num_answers > 1]
    return sorted((p for p in points if not math.isnan(p[2]) and p[2] > 0), key=lambda p: p[1])


def plot_noise(summaries: list[SettingSummary], path: Path) -> bool:
    """Each setting's per-step s2 / M against M, log-log, with seed ranges and the 1/M line through the smallest M."""
    points = noise_points(summaries)
    if not points:
        return False
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(5.5, 4))
    anchor_name, anchor_m, anchor_noise, _ = points[0]
    ms = [m for m in (1, 2, 4, 8, 16, 32, 64) if m <= 2 * points[-1][1]]
    axis.plot(ms, [anchor_noise * anchor_m / m for m in ms], "--", color="grey", label=f"1/M through {anchor_name}")
    per_seed = [[v for v in p[3] if not math.isnan(v)] for p in points]
    axis.errorbar([p[1] for p in points], [p[2] for p in points], yerr=_error_bars(per_seed, [p[2] for p in points]),
                  fmt="o", capsize=3, label="s2 / M per step (seed range)")  # fmt: skip
    for name, m, noise, _ in points:
        axis.annotate(name, (m, noise), textcoords="offset points", xytext=(6, 4))
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("M (answers per thought)")
    axis.set_ylabel("s2 / M (per-step diagnostic)")
    axis.grid(alpha=0.3, which="both")
    axis.legend()
    _save(figure, path)
    return True


def plot_step_time(summaries: list[SettingSummary], path: Path) -> bool:
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(6.5, 4))
    names = [s.setting.name for s in summaries]
    sampling = [s.rollout_seconds() for s in summaries]
    update = [s.update_seconds() for s in summaries]
    totals = [a + b for a, b in zip(sampling, update, strict=True)]
    per_seed = [[v for v in s.step_seconds_per_seed() if not math.isnan(v)] for s in summaries]
    axis.bar(names, sampling, label="sampling")
    axis.bar(names, update, bottom=sampling, label="update (scoring, loss, backward, step)",
             yerr=_error_bars(per_seed, totals), capsize=3)  # fmt: skip
    axis.set_ylabel("seconds per step (seed range of the total)")
    axis.legend()
    _save(figure, path)
    return True


def plot_spikes(summaries: list[SettingSummary], path: Path) -> bool:
    scores = [s.spike_score() for s in summaries]
    if all(math.isnan(v) for v in scores):
        return False
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(6.5, 4))
    per_seed = [[v for v in s.spike_scores() if not math.isnan(v)] for s in summaries]
    means = [0.0 if math.isnan(v) else v for v in scores]
    axis.bar([s.setting.name for s in summaries], means, yerr=_error_bars(per_seed, means), capsize=3)
    axis.set_ylabel("spike score (share of steps > 2x running median)")
    _save(figure, path)
    return True
