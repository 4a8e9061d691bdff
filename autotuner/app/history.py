"""`launcher --history [URL]`: the tuning runs a history database holds, one row per workload."""

from __future__ import annotations

import time
from pathlib import Path

from autotuner.core.errors import UsageError
from autotuner.tuning.trials.history import STUDY_PREFIX, default_url, open_storage
from autotuner.tuning.models.transfer import WorkloadSignature, size_text

DEFAULT_RESULTS_DIR = "autotuning_results"


def history_rows(url: str) -> list[dict]:
    """One row per tuned workload in the storage at `url`, oldest first."""
    import optuna

    rows = []
    summaries = optuna.get_all_study_summaries(open_storage(url), include_best_trial=False)
    for summary in sorted(summaries, key=lambda s: (s.datetime_start is None, s.datetime_start)):
        if not summary.study_name.startswith(STUDY_PREFIX + ":"):
            continue
        fingerprint = summary.user_attrs.get("fingerprint", {})
        pick = summary.user_attrs.get("pick")  # the last run's final pick, not optuna's best single trial
        args = " ".join(fingerprint.get("script_args", []))
        ranks = fingerprint.get("nproc_per_node", 0) * fingerprint.get("num_nodes", 1)
        signature = summary.user_attrs.get("signature")
        rows.append({
            "workload": f"{Path(fingerprint.get('script', '?')).name} {args}".strip()[:60],
            "model": _model_text(signature),
            "hardware": f"{fingerprint.get('device', '?')}, {ranks} ranks",
            "pick": pick["name"] if pick else "(none succeeded)",
            summary.user_attrs.get("metric", "metric"): f"{pick['value']:.4g} {pick['unit']}" if pick else "",
            "launches": summary.n_trials,
            "last run": time.strftime("%Y-%m-%d %H:%M", time.localtime(summary.user_attrs["last_run_unix"]))
            if "last_run_unix" in summary.user_attrs else "",
        })
    return rows


def _model_text(signature) -> str:
    """The model's size from the study's workload signature; empty for a run recorded before it."""
    try:
        return size_text(WorkloadSignature.from_json(signature)) if isinstance(signature, dict) else ""
    except TypeError:
        return ""


def show_history(url: str | None) -> int:
    from tabulate import tabulate

    url = url or default_url(Path(DEFAULT_RESULTS_DIR))
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).is_file():
        raise UsageError(f"--history: no history database at {url} (a tuning run writes one in its results_dir; "
                         "pass its URL, e.g. sqlite:///autotuning_results/history.db)")
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise UsageError("--history: optuna is not installed (pip install 'autotuner[history]')") from None
    try:
        rows = history_rows(url)
    except Exception as err:  # noqa: BLE001 - whatever SQLAlchemy or optuna raise: one line
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        raise UsageError(f"--history: cannot read {url} ({type(err).__name__}: {first})") from None
    if not rows:
        print(f"no tuning runs recorded in {url}")
        return 0
    print(tabulate(rows, headers="keys", tablefmt="github"))
    print(f"{len(rows)} workload(s) in {url}; view every trial with: optuna-dashboard {url}")
    return 0
