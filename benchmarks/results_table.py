"""Turn pytest-benchmark JSONs (``--benchmark-json``) into the README's markdown table: median,
ratio to the group's baseline, and GB/s where the benchmark recorded the bytes it reads. Several
JSONs (separate runs, e.g. gpu_check.sh's stages) make one table; a group must not span two runs,
since its ratios compare timings taken side by side in one run.

    python benchmarks/results_table.py bench.json [more.json ...] [--title "H200, torch 2.11"] > results.md
"""
import argparse
import json
import sys


def table(data: dict, title: str = "") -> str:
    groups: dict = {}
    for b in data["benchmarks"]:
        groups.setdefault(b["group"], []).append(b)
    machine = data.get("machine_info", {})
    lines = [f"## {title or machine.get('node', '')}", "",
             f"torch / python: {machine.get('python_version', '?')}; date {data.get('datetime', '?')}", "",
             "| group | candidate | median ms | ratio | GB/s | baseline |", "|---|---|---|---|---|---|"]
    for group, benches in groups.items():
        base = [b for b in benches if b["extra_info"].get("role") == "baseline"]
        base_median = base[0]["stats"]["median"] if base else None
        for b in sorted(benches, key=lambda b: b["stats"]["median"]):
            median = b["stats"]["median"]
            ratio = f"{median / base_median:.2f}" if base_median else "-"
            bytes_read = b["extra_info"].get("bytes_read")
            gbs = f"{bytes_read / median / 1e9:.0f}" if bytes_read else "-"
            lines.append(f"| {group} | {b['extra_info'].get('label', b['name'])} | {median * 1e3:.3f} | {ratio} | "
                         f"{gbs} | {base[0]['extra_info'].get('label') if base else '-'} |")
    return "\n".join(lines) + "\n"


def merged(runs: list) -> dict:
    """One pytest-benchmark document holding the benchmarks of every run (the first run's machine
    info and date). Refuses a group found in two runs: its ratios would mix runs."""
    seen: dict = {}
    for k, run in enumerate(runs):
        for group in {b["group"] for b in run["benchmarks"]}:
            if seen.setdefault(group, k) != k:
                raise ValueError(f"group {group!r} is in runs {seen[group]} and {k}: a group's ratios must "
                                 "come from one run")
    return dict(runs[0], benchmarks=[b for run in runs for b in run["benchmarks"]])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    runs = []
    for path in args.json:
        with open(path) as f:
            runs.append(json.load(f))
    sys.stdout.write(table(merged(runs), args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
