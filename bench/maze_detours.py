"""How direct the Maze trajectories in a client's buffer are: expert demonstrations against the
successes its exploration kept.

Each Maze observation names the goal's position and the agent's. For every trajectory this counts
its steps, the moves that did not bring the agent closer to the goal (Manhattan distance; walls
make a few of those necessary), and its steps per unit of the starting distance (1.0 is a straight
path). Run it on the buffers of an experiment's runs:

    .venv/bin/python bench/maze_detours.py results/long/runs/fedse-seed*/state/clients/org-maze/buffer.jsonl
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics

POSITIONS = re.compile(r"goal is at position (\d+), (\d+)\. Your current position is at position (\d+), (\d+)")


def directness(turns: list[list[str]]) -> tuple[int, int, float]:
    """(steps, moves that did not bring the agent closer, steps per unit of the starting distance)."""
    dist = []
    for observation, _ in turns:
        found = POSITIONS.search(observation)
        if found:
            gx, gy, x, y = map(int, found.groups())
            dist.append(abs(gx - x) + abs(gy - y))
    not_closer = sum(1 for a, b in zip(dist, dist[1:]) if b >= a)
    return len(turns), not_closer, len(turns) / max(1, dist[0] if dist else 1)


def summary(path: pathlib.Path) -> dict[str, dict[str, float]]:
    """Per source (expert, explored): trajectories, mean steps, share of moves not closer, mean ratio."""
    by: dict[str, list[tuple[int, int, float]]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("env") == "maze" and row.get("success"):
            by.setdefault("expert" if row["source"] == "expert" else "explored", []).append(directness(row["turns"]))
    return {src: {"n": len(v), "steps": statistics.mean(s for s, _, _ in v),
                  "not_closer": sum(b for _, b, _ in v) / max(1, sum(s for s, _, _ in v)),
                  "ratio": statistics.mean(r for _, _, r in v)} for src, v in by.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("buffers", nargs="+", type=pathlib.Path, help="buffer.jsonl files of Maze clients")
    args = ap.parse_args(argv)
    print("| buffer | source | trajectories | mean steps | moves not closer | steps / start distance |")
    print("|---|---|---:|---:|---:|---:|")
    for path in args.buffers:
        run = path.parts[-5] if len(path.parts) >= 5 else str(path)  # runs/<run>/state/clients/<id>/buffer.jsonl
        for src, s in sorted(summary(path).items()):
            print(f"| {run} | {src} | {s['n']} | {s['steps']:.1f} | {100 * s['not_closer']:.0f}% | {s['ratio']:.2f} |")


if __name__ == "__main__":
    main()
