"""table.md / table.json of results/elastic/stragglers.sh: per variant, the wall time of the training rounds until
the first evaluation at or above each target accuracy, rounds, client-rounds dropped or late, final accuracy."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

TARGETS = (0.70, 0.75, 0.78)


def time_to(rows: list[dict], target: float, waited: float) -> float | None:
    """Seconds of the run (less its wait for workers) at its first row with eval_accuracy >= target."""
    for row in rows:
        if (row.get("eval_accuracy") or 0) >= target:
            return round(row["wall_time_s"] - waited, 1)
    return None


def main(out: Path) -> None:
    table = {}
    for variant in ("wait_all", "timeout", "over_select"):
        for run in sorted((out / "runs" / variant).glob("seed*")):
            s = json.loads((run / "summary.json").read_text())
            if s.get("status") != "completed":
                continue
            rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            coord = s["transport"]["workers"]["coordinator"]
            waited = coord["waiting_for_workers_s"]
            p = s["participation"]
            entry = table.setdefault(variant, [])
            entry.append({
                "seed": int(run.name[4:]),
                "time_to": {f"{t:.2f}": time_to(rows, t, waited) for t in TARGETS},
                "round_s": coord["round_s"],
                "rounds": s["rounds"],
                "final_accuracy": s["final"]["eval_accuracy"],
                "dropped": p["dropped"], "late": p["late"], "sampled": p["sampled"],
            })  # fmt: skip
    lines = ["| variant | " + " | ".join(f"time to {t:.0%} (s)" for t in TARGETS) +
             " | rounds' wall time (s) | rounds | client-rounds dropped / late / sampled | final accuracy |",
             "|---|" + "---:|" * (len(TARGETS) + 4)]  # fmt: skip
    for variant, runs in table.items():

        def med(values: list) -> str:
            values = [v for v in values if v is not None]
            return f"{statistics.median(values):,.1f}" if values else "not reached"

        cells = [med([r["time_to"][f"{t:.2f}"] for r in runs]) for t in TARGETS]
        lines.append(f"| {variant} | " + " | ".join(cells) + f" | {med([r['round_s'] for r in runs])} | "
                     f"{med([r['rounds'] for r in runs])} | {sum(r['dropped'] for r in runs)} / "
                     f"{sum(r['late'] for r in runs)} / {sum(r['sampled'] for r in runs)} | "
                     f"{100 * statistics.median(r['final_accuracy'] for r in runs):.2f} % "
                     f"(n={len(runs)}) |")  # fmt: skip
    (out / "table.md").write_text("\n".join(lines) + "\n")
    (out / "table.json").write_text(json.dumps(table, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
