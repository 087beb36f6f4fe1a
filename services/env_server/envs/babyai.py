"""BabyAI as AgentGym serves it (agentenv-babyai), on minigrid's own BabyAI levels.

Tasks. A task id is AgentGym's `data_idx`: level number `id % 40 + 1` of AgentGym's 40 levels,
minigrid seed `id // 40` (plus `seed` * SEED_STRIDE for a non-zero env seed). Only the levels in
`levels` are served (by default DEFAULT_LEVELS, those whose every task our expert finishes in
20 turns); the first 90 of their ids are the test split, the next 810 the training split.

Text. The reset observation is "Your goal: <mission>" and the description of what the agent sees
in its 7x7 egocentric view, in AgentGym's sentences: every door, key, ball and box seen, nearest
first and numbered per name ("There is a red ball 1 3 steps in front of you and 1 steps to your
right."), the nearest wall or box straight ahead ("You are facing a wall 4 steps away."), and what
the agent carries. With `actions_in_observation` (the default, as AgentGym does) every
observation ends with the admissible actions ("Available actions: [...]").

Actions, as AgentGym names and expands them into minigrid moves: "turn left", "turn right",
"move forward" (unless a wall or box is right ahead), "pickup <obj> <n>" (a shortest path to face a
seen key, ball or box, then pick it up; "pick up <obj> <n>" is accepted too), "drop", "go to <obj>
<n>" (a shortest path to face a seen object or door), "go through <open door> <n>" (onto the
door), "toggle and go through <closed or locked door> <n>" (face it, toggle, step forward; a
locked door needs the key of its colour in hand), "toggle" (a closed or locked door right ahead)
and "check available actions". Paths run over cells the agent can see and avoid objects. The moves
of an action stop early when one of them has no effect or the level's mission ends.

Reward and success. Success is the level's own verdict: minigrid's verifier says the mission is
accomplished (reward 1, done). A mission that can no longer be accomplished (a strict level's wrong
door) ends the episode with reward 0. Minigrid's own step limit does not apply: the session's
20 turns do.

Differences from AgentGym, all deliberate: the goal is minigrid's mission verbatim (AgentGym
rewrites "then" and "after you" to "and", which loses the order the level checks); objects are
numbered the same way in the description and in the action names (AgentGym's action numbers skip
unreachable objects); paths avoid cells the agent cannot see and pass closed doors only as the
destination; an action with no moves ("go to <obj> <n>" when already facing it) lets the level
check the mission (minigrid's no-op "done") instead of answering "No change in state."; an
invalid action is answered with AgentGym's error message followed by the current description;
"drop" is not offered onto a door (minigrid would not drop there); a move "has no effect" when the
agent's cell, direction, load and the cell ahead stay the same (AgentGym compares view images,
which a turn in a symmetric room leaves equal); reward is 1 on success (AgentGym passes on
minigrid's 1 - 0.9 * steps / max_steps). The instruction is AgentGym's prompt without its
"Thought:/Action:" format lines, with "drop" and "check available actions" added to its list.

Levels. DEFAULT_LEVELS are 27 of AgentGym's 40: the expert finishes every one of the 900 tasks
they give (seed 0) within 20 turns. Left out: KeyInBox (the key is inside a box, and no AgentGym
action opens a box); OpenDoorsOrderN4Debug (minigrid 3.2.0 fails every two-door mission of it: in
strict mode the toggle that completes the first clause is checked again against the second); and
levels whose missions can need more than 20 high-level turns from the expert (GoToImpUnlock,
UnblockPickup, Unlock, UnlockLocalDist, KeyCorridorS6R3, MoveTwoAcrossS8N9, SynthS5R2, SynthSeq,
MiniBossLevel, BossLevel, BossLevelNoUnlock). Any of the 40 can be served through `levels`.

Expert: babyai_expert.py, a planner over the high-level actions with the whole map in view. What
the agent sees and the actions it may take are built in babyai_view.py.
"""

from __future__ import annotations

import logging
from typing import Sequence

import gymnasium
import minigrid  # noqa: F401  (registers the BabyAI levels with gymnasium)
from minigrid.envs.babyai.core import roomgrid_level

from .babyai_expert import Expert, Unreachable
from .babyai_view import CHECK, DONE, View, normalize_action
from .base import Environment, Episode, StepResult, UnknownTask, check_split

log = logging.getLogger(__name__)

# minigrid prints rejected samplings while generating a level; send them to the log instead.
roomgrid_level.print = lambda *args, **kwargs: log.debug("minigrid: %s", " ".join(map(str, args)))

# AgentGym's level list, in its order: task id i is level AGENTGYM_LEVELS[i % 40].
AGENTGYM_LEVELS = (
    "GoToRedBallGrey", "GoToRedBall", "GoToRedBallNoDists", "GoToObjS6", "GoToLocalS8N7",
    "GoToObjMazeS7", "GoToImpUnlock", "GoToSeqS5R2", "GoToRedBlueBall", "GoToDoor",
    "GoToObjDoor", "Open", "OpenRedDoor", "OpenDoorLoc", "OpenRedBlueDoorsDebug",
    "OpenDoorsOrderN4Debug", "Pickup", "UnblockPickup", "PickupLoc", "PickupDistDebug",
    "PickupAbove", "PutNextLocalS6N4", "PutNextS7N4Carrying", "Unlock", "UnlockLocalDist",
    "KeyInBox", "UnlockPickupDist", "BlockedUnlockPickup", "UnlockToUnlock", "ActionObjDoor",
    "FindObjS7", "KeyCorridorS6R3", "OneRoomS20", "MoveTwoAcrossS8N9", "SynthS5R2",
    "SynthLoc", "SynthSeq", "MiniBossLevel", "BossLevel", "BossLevelNoUnlock",
)
# minigrid 3 retired BabyAI-GoToObjS6-v0 for v1 (same level, a generation bug fixed).
GYM_IDS = {name: f"BabyAI-{name}-v1" if name == "GoToObjS6" else f"BabyAI-{name}-v0" for name in AGENTGYM_LEVELS}

# The levels whose every task (test and train, seed 0) the expert finishes within 20 turns.
DEFAULT_LEVELS = (
    "GoToRedBallGrey", "GoToRedBall", "GoToRedBallNoDists", "GoToObjS6", "GoToLocalS8N7",
    "GoToObjMazeS7", "GoToSeqS5R2", "GoToRedBlueBall", "GoToDoor", "GoToObjDoor",
    "Open", "OpenRedDoor", "OpenDoorLoc", "OpenRedBlueDoorsDebug", "Pickup",
    "PickupLoc", "PickupDistDebug", "PickupAbove", "PutNextLocalS6N4", "PutNextS7N4Carrying",
    "UnlockPickupDist", "BlockedUnlockPickup", "UnlockToUnlock", "ActionObjDoor", "FindObjS7",
    "OneRoomS20", "SynthLoc",
)

NUM_TRAIN, NUM_TEST = 810, 90
MAX_TURNS = 20
# A non-zero env seed shifts every task's minigrid seed by seed * SEED_STRIDE.
SEED_STRIDE = 1_000_003
# Minigrid's own step limit would end long episodes early; the session's turn limit applies instead.
MINIGRID_MAX_STEPS = 1_000_000

SUCCESS_TEXT = "The task is completed."
FAILURE_TEXT = "The task has failed: the mission can no longer be accomplished."
UNRECOGNIZED = "The action is not recognized. Please check valid actions."

INSTRUCTION = (
    "You are an exploration master that wants to finish every goal you are given. Every round I will "
    "give you an observation, and you have to respond an action based on the observation to finish the "
    "given task. You are placed in a room and you need to accomplish the given goal with actions.\n\n"
    "You can use the following actions: \n\n"
    "- turn right \n\n"
    "- turn left \n\n"
    "- move forward \n\n"
    "- go to <obj> <id> \n\n"
    "- pickup <obj> <id> \n\n"
    "- go through <door> <id>: <door> must be an open door. \n\n"
    "- toggle and go through <door> <id>: <door> can be a closed door or a locked door. If you want to "
    "open a locked door, you need to carry a key that is of the same color as the locked door. \n\n"
    "- toggle: there is a closed or locked door right in front of you and you can toggle it.\n\n"
    "- drop: put down the object you carry in front of you.\n\n"
    "- check available actions\n\n"
    "Your goal: {goal}"
)


def _make_level(level: str):
    """A fresh, unwrapped minigrid level (gymnasium's checking wrappers cost time per step)."""
    return gymnasium.make(GYM_IDS[level], max_steps=MINIGRID_MAX_STEPS).unwrapped


# ---------------------------------------------------------------- episodes


class BabyAIEpisode(Episode):
    def __init__(self, level: str, minigrid_seed: int, actions_in_observation: bool = True):
        self.level = level
        self.minigrid_seed = minigrid_seed
        self.env = _make_level(level)
        self.env.reset(seed=minigrid_seed)
        self.mission = self.env.mission
        self.instruction = INSTRUCTION.format(goal=self.mission)
        self._listing = actions_in_observation
        self._done = False
        self._success = False
        self._view = View(self.env)
        self.observation = self._text(f"Your goal: {self.mission}\n{self._view.description}")

    def _text(self, body: str) -> str:
        if self._listing and not self._done:
            return f"{body}\n{self._view.action_list()}"
        return body

    def available_actions(self) -> list[str]:
        return [] if self._done else list(self._view.actions)

    def step(self, action: str) -> StepResult:
        if self._done:
            return StepResult(self.observation, 0.0, True, self._success, valid=False)
        name = normalize_action(action)
        entry = self._view.actions.get(name)
        if entry is None:
            error = self._view.errors.get(name, UNRECOGNIZED)
            self.observation = self._text(f"{error} {self._view.description}")
            return StepResult(self.observation, 0.0, False, False, valid=False)
        if name == CHECK:
            self.observation = self._text("You can take the following actions: " + ", ".join(self._view.actions))
            return StepResult(self.observation, 0.0, False, False)
        terminated, reward = self._execute(entry[0] or [DONE])
        self._view = View(self.env)
        if terminated:
            self._done, self._success = True, reward > 0
            ending = SUCCESS_TEXT if self._success else FAILURE_TEXT
            self.observation = f"{self._view.description}\n{ending}"
            return StepResult(self.observation, 1.0 if self._success else 0.0, True, self._success)
        self.observation = self._text(self._view.description)
        return StepResult(self.observation, 0.0, False, False)

    def _execute(self, moves: Sequence[int]) -> tuple[bool, float]:
        """Runs moves until one has no effect or the mission ends."""
        env = self.env
        for move in moves:
            before = (tuple(env.agent_pos), env.agent_dir, env.carrying, self._front_state())
            _, reward, terminated, _, _ = env.step(move)
            if terminated:
                return True, float(reward)
            after = (tuple(env.agent_pos), env.agent_dir, env.carrying, self._front_state())
            if after == before and move != DONE:
                break
        return False, 0.0

    def _front_state(self):
        cell = self.env.grid.get(*self.env.front_pos)
        return None if cell is None else (cell.type, getattr(cell, "is_open", None), getattr(cell, "is_locked", None))

    def expert_action(self) -> str:
        if self._done:
            return CHECK
        try:
            return Expert(self.env, self._view).action()
        except Unreachable:
            log.debug("babyai expert found no plan for %s seed %d; turning", self.level, self.minigrid_seed)
            return "turn left"


class BabyAIEnv(Environment):
    """AgentGym's BabyAI tasks over `levels`: the first 90 ids of those levels are the test split."""

    name = "babyai"
    max_turns = MAX_TURNS
    has_expert = lists_actions = True

    def __init__(self, seed: int = 0, levels: Sequence[str] | None = None, actions_in_observation: bool = True):
        levels = tuple(DEFAULT_LEVELS if levels is None else levels)
        unknown = [lvl for lvl in levels if lvl not in GYM_IDS]
        if unknown or not levels:
            raise ValueError(f"unknown BabyAI levels {unknown}: choose from {', '.join(AGENTGYM_LEVELS)}")
        self.seed = seed
        self.levels = levels
        self.actions_in_observation = actions_in_observation
        wanted = {AGENTGYM_LEVELS.index(lvl) for lvl in levels}
        ids: list[int] = []
        i = 0
        while len(ids) < NUM_TEST + NUM_TRAIN:
            if i % len(AGENTGYM_LEVELS) in wanted:
                ids.append(i)
            i += 1
        self._test, self._train = ids[:NUM_TEST], ids[NUM_TEST:]
        self._ids = frozenset(ids)

    def tasks(self, split: str) -> list[int]:
        check_split(split)
        return list(self._test) if split == "test" else list(self._train)

    def task(self, task_id: int) -> tuple[str, int]:
        """(level, minigrid seed) of a task id."""
        if task_id not in self._ids:
            raise UnknownTask(f"babyai has no task {task_id}: list the task ids of a split with tasks()")
        seed, level = divmod(task_id, len(AGENTGYM_LEVELS))
        return AGENTGYM_LEVELS[level], seed + self.seed * SEED_STRIDE

    def reset(self, task_id: int) -> BabyAIEpisode:
        level, minigrid_seed = self.task(task_id)
        return BabyAIEpisode(level, minigrid_seed, self.actions_in_observation)
