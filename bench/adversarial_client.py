"""Client agents that misbehave, for benchmarks only (bench/selection_adversarial.py). Started as the
launcher starts `fedse client`, with the behaviour first:

    python -m bench.adversarial_client liar --client-id org-wordle2 --env wordle ...
    python -m bench.adversarial_client dies --client-id org-maze2 --env maze ...

liar: a real client agent whose metrics reports are rewritten to what would win it a place if the
  aggregator believed them (LIES: held-out success 1.0, a training loss of 1e30, a buffer of 1e12
  trajectories). It reports them for every training round, as soon as the round opens, also for
  rounds it was not chosen in (which an honest agent does not report at all); its own later report
  of a round is then a repeat the aggregator acknowledges and does not record. The final
  evaluation's report is left honest, so that the bench's success figures stay real.
dies: a real client agent that, in the first round it is chosen for, trains and then kills itself
  (SIGKILL) before it uploads: its heartbeat stops, and the aggregator must replace it.
"""

from __future__ import annotations

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from apps.cli import main  # noqa: E402
from fedse.v1 import federation_pb2 as fpb  # noqa: E402
from services.client_agent.agent import ClientAgent  # noqa: E402
from services.client_agent.federation.link import FederationClient  # noqa: E402

LIES = {"test_success": 1.0, "train_loss": 1e30, "buffer": 1e12}


def lying() -> None:
    """Patches the client agent: every training round's report says LIES, sent once the round opens."""
    wait_until, finish_round, run = FederationClient.wait_until, ClientAgent.finish_round, ClientAgent.run
    told: set[int] = set()
    agents: list[ClientAgent] = []

    def lies() -> dict[str, float]:
        """LIES, with each of its environments' success (1.0) as a report carries it."""
        cfg = agents[0].cfg
        per_env = {k: v for e in cfg.env.split(",")
                   for k, v in ((f"test_success/{e}", 1.0), (f"test_tasks/{e}", float(max(1, cfg.eval_tasks))))}
        return {**LIES, **per_env}

    def tell(fed: FederationClient, round_: int) -> None:
        if round_ not in told:
            told.add(round_)
            fed.report(round_, lies())

    def lying_run(self):
        agents.append(self)
        return run(self)

    def lying_wait(self, done, timeout_s=None):
        st = wait_until(self, done, timeout_s)
        if st.state == fpb.ROUND_STATE_OPEN:  # a training round (the final evaluation's state is FINISHED)
            tell(self, st.round)
        return st

    def lying_finish(self, round_, metrics):
        if round_ < self.run_config.num_rounds:
            tell(self.fed, round_)  # before its own report: the aggregator records the first of a round
            metrics = {**metrics, **lies()}
        return finish_round(self, round_, metrics)

    FederationClient.wait_until, ClientAgent.finish_round, ClientAgent.run = lying_wait, lying_finish, lying_run


def dying() -> None:
    """Patches the client agent: its first training ends the process, before the upload."""
    train = ClientAgent.train

    def train_then_die(self, round_):
        train(self, round_)
        print(f'{{"message": "bench: dying after training round {round_}, before its upload"}}', flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    ClientAgent.train = train_then_die


BEHAVIOURS = {"liar": lying, "dies": dying}

if __name__ == "__main__":
    BEHAVIOURS[sys.argv[1]]()
    sys.exit(main(["client", *sys.argv[2:]]))
