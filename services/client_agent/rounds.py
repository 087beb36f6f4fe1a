"""Which rounds a client plays (`RoundLoop`, a part of agent.ClientAgent): synchronous rounds, where it
sits out a round the aggregator chose other clients for unless it is topped up into it while it is
open, and asynchronous ones (RunConfig.mode "async"), where it plays each training slot it is given on
a newer version; in both it books each release in the organisation's privacy budget first and
declines the round where the budget is spent. The phases of a round it plays: phases.RoundPhases."""

from __future__ import annotations

import logging

from fedse.transport.serving import log_fields
from fedse.v1 import federation_pb2 as fpb

from services.client_agent.federation.heartbeat import RoundPhase
from services.client_agent.federation.link import selected
from services.client_agent.metrics import PHASE_SECONDS, ROUND, ROUNDS_DECLINED
from services.client_agent.playing.tasks import EnvTasks

log = logging.getLogger("client_agent")


class RoundLoop:
    """The rounds of a run, from where a (resumed) client stands to the final evaluation. Of the agent
    it uses `cfg`, `run_config`, `fed`, `heartbeat` and `budget`, and plays a round with `play_round`."""

    def run_rounds(self, round_: int, done: str, st: fpb.RoundStatus, tasks: list[EnvTasks]) -> None:
        """Synchronous rounds: plays each round from `round_` (after phase `done`) to the final evaluation,
        sitting out a round the aggregator chose other clients for (RoundStatus.selected) unless it is
        chosen while that round is still open (topped up in place of a chosen client that died)."""
        me, sat_out = self.cfg.client_id, False
        while True:
            ROUND.set(round_)
            final = st.state == fpb.ROUND_STATE_FINISHED or round_ >= self.run_config.num_rounds
            taking = final or done or selected(st, me)
            sat_out = not taking
            if taking and not final and not self.take_release(round_):
                pass  # declined: the organisation's privacy budget allows no more releases of its data
            elif taking:
                self.play_round(round_, done, final, tasks)
            else:  # the aggregator chose other clients for this round: wait for the next
                log.info("not selected for this round; waiting for the next",
                         extra=log_fields(round=round_, selected=len(st.selected), joined=len(st.joined)))
                self.heartbeat.set(RoundPhase.NOT_SELECTED, round_)
            if final:
                break
            if self.heartbeat.phase[1] not in (RoundPhase.NOT_SELECTED.value, RoundPhase.DECLINED.value):
                self.heartbeat.set(RoundPhase.WAITING, round_)
            with PHASE_SECONDS.labels("wait").time():
                st = self.fed.wait_until(
                    lambda s, r=round_, out=sat_out: (s.round > r and s.state in (fpb.ROUND_STATE_OPEN,
                                                                                 fpb.ROUND_STATE_FINISHED))
                    or (out and s.round == r and s.state == fpb.ROUND_STATE_OPEN and selected(s, me)),
                    timeout_s=self.cfg.round_timeout_s)
            if st.round == round_:
                log.info("chosen for this round in place of a client that dropped out", extra=log_fields(round=round_))
            elif st.round > round_ + 1 and st.state == fpb.ROUND_STATE_OPEN:
                log.warning("catching up", extra=log_fields(last_round=round_, open_round=st.round))
            round_, done = st.round, ""

    def run_async(self, round_: int, done: str, tasks: list[EnvTasks]) -> None:
        """Asynchronous rounds (RunConfig.mode "async"): whenever the aggregator gives this client a
        training slot (RoundStatus.selected) on a version newer than the last it trained from, it plays
        that version as a round (download, evaluate, explore, train, upload); once the run finished, it
        evaluates the final version. `round_`, `done`: where the resumed progress stands.

        Each version it would upload to takes a release from the privacy budget first (`take_release`),
        as a synchronous round does. Once the budget declines one, every later one would be declined
        too (a run's releases all cost the same), so the client trains no more: its heartbeat says
        "declined", the aggregator frees its slot and gives it none (a held slot would keep the buffer
        from folding), and it follows the versions until the run finishes, then evaluates the final one."""
        me, last, declined = self.cfg.client_id, -1, False
        if done:  # a version under way before a restart: finish it (an upload may still be taken)
            final = round_ >= self.run_config.num_rounds
            declined = not final and not self.take_release(round_)
            if not declined:
                self.play_round(round_, done, final, tasks)
            if final:
                return
            last = round_
        while True:
            if not declined:
                self.heartbeat.set(RoundPhase.WAITING, last)
            with PHASE_SECONDS.labels("wait").time():
                st = self.fed.wait_until(lambda s: s.round > last and (declined or (
                    s.state == fpb.ROUND_STATE_OPEN and selected(s, me))), timeout_s=self.cfg.round_timeout_s)
            ROUND.set(st.round)
            if st.state == fpb.ROUND_STATE_FINISHED:
                self.play_round(st.round, "", True, tasks)
                return
            declined = declined or not self.take_release(st.round)
            if not declined:
                self.play_round(st.round, "", False, tasks)
            last = st.round

    def take_release(self, round_: int) -> bool:
        """Books round `round_`'s release of this organisation's data in its privacy budget, before anything
        is trained or uploaded (guardian.PrivacyBudget.take); False where the budget declines it: logged,
        the heartbeat says "declined" (the aggregator does not wait for this client) and counted."""
        declined = self.budget.take(round_)
        if declined is None:
            return True
        log.warning("declining this round: the privacy budget is spent",
                    extra=log_fields(round=round_, reason=declined))
        self.heartbeat.set(RoundPhase.DECLINED, round_)
        ROUNDS_DECLINED.inc()
        return False
