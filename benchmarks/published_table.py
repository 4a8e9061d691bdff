"""The hardware plan's step time against torchtitan's published table, row by row (issue 80, part 3).

    python benchmarks/published_table.py [--fit "Llama 2 13B, batch 2, no"] [--csv published_table.csv]

The rows, the models' configs, the A100 SXM 80GB spec and the fit are the test's
(tests/integration/test_published_table.py, which holds the table's figures); this prints each
row's published tokens/s per GPU, the prediction, the error and the step's parts, and writes them
to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _the_test():
    spec = importlib.util.spec_from_file_location("published_table_test",
                                                  ROOT / "tests" / "integration" / "test_published_table.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    test = _the_test()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", default=test.FITTED, help="the row the compute efficiency is fitted on")
    parser.add_argument("--csv", default="published_table.csv")
    args = parser.parse_args()
    efficiency, rows = test.predicted_rows(args.fit)
    out = [{"row": row.key, "published_wps": row.wps, "predicted_wps": round(p.tokens_per_s_per_rank, 1),
            "error_pct": round(100 * (p.tokens_per_s_per_rank - row.wps) / row.wps, 1), "published_mfu_pct": row.mfu,
            "predicted_mfu_pct": round(100 * p.model_flops_utilization, 1), "step_s": round(p.step_s, 3),
            "compute_s": round(p.compute_s, 3), "communication_s": round(p.communication_s, 3),
            "optimizer_s": round(p.optimizer_s, 4), "fitted": row.key == args.fit,
            "compute_efficiency": round(efficiency, 4)} for row, p in rows]
    with open(RESULTS / args.csv, "w", newline="") as table:
        writer = csv.DictWriter(table, list(out[0]))
        writer.writeheader()
        writer.writerows(out)
    print(f"compute efficiency {efficiency:.4f}, fitted on {args.fit}")
    for row in out:
        print(f"{row['row']:<40} published {row['published_wps']:>6} predicted {row['predicted_wps']:>8} "
              f"{row['error_pct']:+6.1f}%  step {row['step_s']} s (compute {row['compute_s']}, communication "
              f"{row['communication_s']}, optimizer {row['optimizer_s']}){'  fitted' if row['fitted'] else ''}")


if __name__ == "__main__":
    main()
