"""Selection against members that misbehave: six tiny-model clients as a whole local federation
(`fedse run`'s processes, real gRPC), two of them started through bench/adversarial_client.py:

  org-wordle2  a liar: reports held-out success 1.0, a training loss of 1e30 and a buffer of 1e12
               for every training round as soon as it opens, also rounds it was not chosen in
  org-maze2    dies: trains in the first round it is chosen for, then kills itself before uploading

run once per selector policy and seed (all as the reference; sample, utility and agent-tools taking
half the clients a round, each under the default fairness floor), each to --rounds rounds with a
round deadline of --deadline-s. It prints, per policy, the places the liar got against its honest
share (the sum over rounds of K_t / N_t: the places chosen over the clients alive when the round
chose, i.e. rounds * K / N while nobody dies) and beside those of its honest twin (org-wordle: the
same environment, so the same speed), each round's duration against the deadline and each top-up
(a client put into a round in place of the dead one), then a PASS/FAIL line per check:

  liar       no policy gives the liar more than its honest share plus one place (a small run's rounding),
             its honest share being the larger of the even share and what its honest twin got (a
             policy may prefer a client for what the server sees of it, its speed: the twin shows
             what an honest member in the liar's place was given)
  deadline   no round outlives its deadline plus --margin-s (the aggregator's tick, the aggregation)
  top-up     every client topped up into a round uploaded in it

Written to --results: adversarial.json and adversarial.png; --reuse re-reads the runs already there
instead. About 6 minutes with the defaults on a 2-core machine (four runs of four rounds, one seed);
the exit status is 1 where a check fails.

    .venv/bin/python bench/selection_adversarial.py [--rounds 4] [--seeds 1] [--deadline-s 60]
        [--policies all,sample,utility,agent-tools] [--reuse]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from apps import launcher  # noqa: E402
from apps.planning import RunConfig  # noqa: E402
from apps.processes import Proc  # noqa: E402
from bench.selection import run_fresh  # noqa: E402
from fedse.config import to_argv  # noqa: E402
from fedse.machine import describe_cpu  # noqa: E402

ENVS = "maze,maze2=maze,wordle?vocab_size=30,wordle2=wordle?vocab_size=30,babyai,babyai2=babyai"
LIAR, DIES = "org-wordle2", "org-maze2"
TWIN = "org-wordle"  # the liar's honest twin (same environment, same speed): what an honest member got
BEHAVIOUR = {LIAR: "liar", DIES: "dies"}
POLICIES = {
    "all": {},
    "sample": {"selector": "sample", "selection_fraction": 0.5},
    "utility": {"selector": "utility", "selection_fraction": 0.5},
    "agent-tools": {"selector": "agent-tools", "selection_fraction": 0.5},
    "agent-llm": {"selector": "agent-llm", "selection_fraction": 0.5},
}
LIAR_SLACK = 1.0  # places above the honest share a small run's rounding may give


class AdversarialLaunch(launcher.Launch):
    """fedse run's launch, with the liar and the dying client started through bench/adversarial_client.py."""

    def process(self, name, service, config):
        if service == "client" and config.client_id in BEHAVIOUR:
            self.procs.append(Proc(name, ["bench.adversarial_client", BEHAVIOUR[config.client_id],
                                          *to_argv(config)], self.logs))
            return self.procs[-1]
        return super().process(name, service, config)


def shares(selections: list[dict], rounds: int) -> tuple[float, dict[int, list[str]]]:
    """The honest share of places (sum over rounds of chosen / alive, from each round's first choice) and
    each round's final choice (after any top-up), from selections.jsonl's records."""
    first, final = {}, {}
    for rec in selections:
        first.setdefault(rec["round"], rec)
        final[rec["round"]] = rec["chosen"]
    share = 0.0
    for rnd in range(rounds):
        rec = first.get(rnd)
        if rec is not None:
            alive = [c for c, why in rec["reasons"].items() if not why.startswith("not alive")]
            share += len(rec["chosen"]) / max(1, len(alive))
    return share, final


def run_one(cfg: RunConfig) -> dict:
    """One run, then what its aggregator recorded (`analyse`)."""
    launch = AdversarialLaunch(cfg, open(os.devnull, "w"))
    run_fresh(launch)
    return analyse(launch.dir)


def analyse(folder: pathlib.Path) -> dict:
    """A finished run's figures, from its results.json and its aggregator's state: the places of the liar
    and of its honest twin against the honest share, each round's duration, the dying client's rounds
    and each top-up (whether the client put in its place uploaded in that round)."""
    results = json.loads((folder / "results.json").read_text())
    state = folder / "state" / "aggregator" / "local"
    run = json.loads((state / "run.json").read_text())
    path = state / "selections.jsonl"
    selections = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    rounds, clients = len(run["round_seconds"]), run["clients"]
    if selections:
        share, chosen = shares(selections, rounds)
        places = {cid: sum(cid in chosen.get(r, ()) for r in range(rounds)) for cid in (LIAR, TWIN)}
    else:  # `all`: every alive client takes part in every round
        share, chosen = float(rounds), {}
        places = {cid: len(clients[cid]["rounds_uploaded"]) for cid in (LIAR, TWIN)}
    first: dict[int, set[str]] = {}
    added: set[tuple[int, str]] = set()  # (round, client) put in a round after its first choice
    for rec in selections:
        before = first.setdefault(rec["round"], set(rec["chosen"]))
        added |= {(rec["round"], cid) for cid in set(rec["chosen"]) - before}
    top_ups = [{"round": r, "client": cid, "uploaded": r in clients[cid]["rounds_uploaded"]}
               for r, cid in sorted(added)]
    return {"complete": results["complete"], "wall_s": results["wall_s"], "round_s": run["round_seconds"],
            "liar_places": places[LIAR], "twin_places": places[TWIN], "liar_share": round(share, 3),
            "dies_chosen": clients.get(DIES, {}).get("rounds_selected", []) if selections else "every round",
            "top_ups": top_ups, "fallbacks": run.get("selector_fallbacks", 0),
            "chosen": {str(r): c for r, c in chosen.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--deadline-s", type=float, default=60.0, help="the aggregator's round deadline")
    ap.add_argument("--margin-s", type=float, default=5.0, help="how far past its deadline a round may close")
    ap.add_argument("--policies", default="all,sample,utility,agent-tools", help=f"of {','.join(POLICIES)}")
    ap.add_argument("--eval-tasks", type=int, default=4, help="held-out tasks per client and round")
    ap.add_argument("--results", default="results/bench-selection-adversarial")
    ap.add_argument("--reuse", action="store_true", help="re-read the runs already under --results, run nothing")
    args = ap.parse_args()
    root = pathlib.Path(args.results)
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    print(f"machine: {describe_cpu()}; 6 clients ({ENVS}); {LIAR} lies ({TWIN} its honest twin), {DIES} dies "
          f"once chosen; {args.rounds} rounds, deadline {args.deadline_s:g} s", flush=True)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for seed in range(args.seeds):
        for name in names:
            cfg = RunConfig(envs=ENVS, rounds=args.rounds, results=str(root / f"{name}-seed{seed}"), seed=seed,
                            expert_demos=4, explore_tasks=4, eval_tasks=args.eval_tasks, epochs=1,
                            round_deadline_s=args.deadline_s, **POLICIES[name])
            out = analyse(pathlib.Path(cfg.results)) if args.reuse else run_one(cfg)
            runs[name].append(out)
            ups = ", ".join(f"{t['client']} in round {t['round']} ({'uploaded' if t['uploaded'] else 'no upload'})"
                            for t in out["top_ups"])
            print(f"  {name:<12} seed {seed}: liar {out['liar_places']} places, twin {out['twin_places']} (share "
                  f"{out['liar_share']:.2f}); {DIES} chosen in {out['dies_chosen']}; topped up: {ups or 'none'}; "
                  "rounds " + ", ".join(f"{s:.0f}" for s in out["round_s"]) + f" s; whole run {out['wall_s']:.0f} s"
                  + (f", {out['fallbacks']} selector fallbacks" if out["fallbacks"] else ""), flush=True)
    ok = report(runs, args)
    (root / "adversarial.json").write_text(json.dumps({"machine": describe_cpu(), **vars(args), "pass": ok,
                                                       "runs": runs}, indent=1))
    plot(runs, args.deadline_s, root / "adversarial.png")
    print(f"\nwrote {root / 'adversarial.json'} and {root / 'adversarial.png'}")
    sys.exit(0 if ok else 1)


def report(runs: dict[str, list[dict]], args: argparse.Namespace) -> bool:
    """Prints the table and a PASS/FAIL line per check; whether every check passed. The top-up check is
    one more: a client put into a round in place of a dead one (docs/selection.md) must take part in it,
    else the round waits for it until its deadline."""
    print(f"\n{'policy':<12} {'liar places':>11} {'twin places':>11} {'share':>6} {'liar/share':>10} "
          f"{'rounds s':>22} {'deadline s':>10}")
    liar_bad, late, idle = [], [], []
    for name, rs in runs.items():
        places, share = sum(r["liar_places"] for r in rs), sum(r["liar_share"] for r in rs)
        durations = " ".join(f"{s:.0f}" for r in rs for s in r["round_s"])
        print(f"{name:<12} {places:>11} {sum(r['twin_places'] for r in rs):>11} {share:>6.2f} "
              f"{places / share if share else 0:>10.2f} {durations:>22} {args.deadline_s:>10.0f}")
        liar_bad += [f"{name} seed {i}: {r['liar_places']} > {r['liar_share']:.2f} + {LIAR_SLACK:g}, its honest "
                     f"twin {r['twin_places']}" for i, r in enumerate(rs)
                     if name != "all" and r["liar_places"] > max(r["liar_share"], r["twin_places"]) + LIAR_SLACK]
        late += [f"{name} seed {i} round {j}: {s:.1f} s" for i, r in enumerate(rs)
                 for j, s in enumerate(r["round_s"]) if s > args.deadline_s + args.margin_s]
        idle += [f"{name} seed {i}: {t['client']} in round {t['round']}" for i, r in enumerate(rs)
                 for t in r["top_ups"] if not t["uploaded"]]
    checks = [("liar", f"no policy gives {LIAR} more than its honest share (the even share, or its twin's "
                       f"places where more) + {LIAR_SLACK:g} place", liar_bad),
              ("deadline", f"no round outlives {args.deadline_s:g} s + {args.margin_s:g} s", late),
              ("top-up", "every client topped up into a round uploaded in it", idle)]
    print()
    for check, claim, failed in checks:
        print(f"{'FAIL' if failed else 'PASS'} {check}: {claim}"
              + (f" (not so: {'; '.join(failed)})" if failed else ""))
    return not any(failed for _, _, failed in checks)


def plot(runs: dict[str, list[dict]], deadline_s: float, path: pathlib.Path) -> None:
    """Left: the places of the liar and of its honest twin beside the honest share; right: each round's
    duration, the deadline dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(runs)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    xs = range(len(names))
    bars = ((-0.27, "liar_places", f"liar ({LIAR})"), (0.0, "twin_places", f"honest twin ({TWIN})"),
            (0.27, "liar_share", "honest share"))
    for off, key, label in bars:
        left.bar([x + off for x in xs], [sum(r[key] for r in runs[n]) for n in names], 0.27, label=label)
    left.set_xticks(list(xs), names)
    left.set_ylabel("places taken")
    left.legend(fontsize=8)
    for name in names:
        for i, r in enumerate(runs[name]):
            right.plot(range(len(r["round_s"])), r["round_s"], marker="o", label=f"{name} s{i}")
    right.axhline(deadline_s, color="k", linestyle="--", label="deadline")
    right.set_xlabel("round")
    right.xaxis.get_major_locator().set_params(integer=True)
    right.set_ylabel("round duration (s)")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
