"""What the held-out thoughts of counting runs (``configs/tiny-counting.yaml``) say about the sums they end with:
``python scripts/counting_thoughts.py RUN [RUN ...]``.

The counting warm start learned an arithmetic slip on ``sum`` and ``add`` problems ("1 + 1 = 1", the answer
following the thought). For those problems of each held-out evaluation it prints: accuracy; the share of
thoughts whose sum is right, slipped (one short) or otherwise wrong; and the share whose first count is the
picture's true count, one too high, or otherwise off. A run that fixes the reasoning moves thoughts from
"slipped" to "right"; one that compensates keeps the slip and counts one too high, right answers from wrong
thoughts. The truth comes from the rows of the run's held-out file (``objects`` and ``program``).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

SUM = re.compile(r"(\d+) \+ (\d+) = (\d+)")


def true_terms(row: dict) -> tuple[int, int] | None:
    """The two numbers a right thought adds, from the generator's record of the picture; None for other kinds."""
    program, objects = row["program"], row["objects"]

    def count(colour: str, shape: str) -> int:
        return sum(o["colour"] == colour and o["shape"] == shape for o in objects)

    if program["kind"] == "sum":
        (c1, s1), (c2, s2) = program["terms"]
        return count(c1, s1), count(c2, s2)
    if program["kind"] == "add":
        return count(program["colour"], program["shape"]), program["add"]
    return None


def classify(thought: str, terms: tuple[int, int]) -> tuple[str, str]:
    """(the sum: right / slipped / wrong / none, the first count: true / one high / off / none)."""
    found = SUM.search(thought)
    if found is None:
        return "none", "none"
    a, b, c = map(int, found.groups())
    total = "right" if c == a + b else "slipped" if c == a + b - 1 else "wrong"
    first = "true" if a == terms[0] else "one high" if a == terms[0] + 1 else "off"
    return total, first


def report(records: list[dict], rows: dict[str, dict]) -> dict[str, float]:
    """Shares over the sum/add problems of one evaluation."""
    picked = [(r, true_terms(rows[r["id"]])) for r in records if r["id"] in rows]
    picked = [(r, terms) for r, terms in picked if terms is not None]
    if not picked:
        return {"problems": 0}
    kinds = [classify(r["thought"] or "", terms) for r, terms in picked]
    share = lambda index, name: sum(k[index] == name for k in kinds) / len(kinds)  # noqa: E731
    return {
        "problems": len(picked),
        "accuracy": sum(r["parts"].get("accuracy", 0.0) for r, _ in picked) / len(picked),
        **{f"sum {name}": share(0, name) for name in ("right", "slipped", "wrong", "none")},
        **{f"count {name}": share(1, name) for name in ("true", "one high", "off")},
    }


def held_out_rows(run_dir: Path) -> dict[str, dict]:
    import yaml

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    source = (config["data"].get("eval_sources") or {}).get("math")
    if source is None:
        raise SystemExit(f"{run_dir}: not a counting run (its config names no data.eval_sources.math file)")
    path = Path(source)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row["id"]: row for row in rows if "program" in row}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", type=Path, nargs="+")
    args = parser.parse_args(argv)
    columns = ("accuracy", "sum right", "sum slipped", "sum wrong", "count true", "count one high", "count off")
    for run_dir in args.run_dirs:
        evaluations = sorted(run_dir.glob("eval/step-*/math.jsonl"))
        if not evaluations:
            raise SystemExit(f"no held-out math evaluations under {run_dir}/eval")
        rows = held_out_rows(run_dir)
        print(f"{run_dir}: sum and add problems of the held-out set")
        print("  step  problems  " + "  ".join(f"{c:>14}" for c in columns))
        for path in evaluations:
            records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            figures = report(records, rows)
            step = int(path.parent.name.split("-")[1])
            print(f"  {step:4d}  {figures['problems']:8d}  " + "  ".join(f"{figures.get(c, float('nan')):14.3f}" for c in columns))


if __name__ == "__main__":
    main()
