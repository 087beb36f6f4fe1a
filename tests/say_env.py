"""A tiny environment an organisation might bring, for tests: no expert and no listed actions.

Each task shows a word; the agent succeeds by saying it (its action is the word). Served by a real env
server as `say=say_env:SayEnv` (tests/ is on the test session's import path), it exercises the client's
path for such environments: no ExpertAction calls, seeding from demonstration files, and actions the
agent writes as ReAct text.
"""

from __future__ import annotations

from fedse.env import Environment, Episode, NumberedTasks, StepResult

WORDS = ("apple", "river", "stone", "cloud", "lemon", "tiger", "piano", "grass", "amber", "coral", "maple", "otter")
NUM_TEST = 4
INSTRUCTION = "Say the word you are shown. Answer with your thought, then the word as your action."


class SayEpisode(Episode):
    def __init__(self, word: str):
        self.word = word
        self.instruction = INSTRUCTION
        self.observation = f"The word is {word}."

    def step(self, action: str) -> StepResult:
        if action.strip().strip(".").lower() == self.word:
            return StepResult("Correct.", 1.0, True, True)
        return StepResult(f"No. The word is {self.word}.", 0.0, False, False, valid=False)


class SayEnv(Environment):
    max_turns = 2
    has_expert = False
    lists_actions = False

    def __init__(self, seed: int = 0):
        self._tasks = NumberedTasks("say", WORDS[:NUM_TEST], WORDS[NUM_TEST:])

    def tasks(self, split: str) -> list[int]:
        return self._tasks.ids(split)

    def reset(self, task_id: int) -> SayEpisode:
        return SayEpisode(self._tasks[task_id])


def demo_record(task_id: int) -> dict:
    """A successful episode of a task in AgentGym's AgentTraj format (the acknowledgement included)."""
    word = WORDS[task_id]
    return {"item_id": f"say_{task_id}", "conversations": [
        {"from": "human", "loss": None, "value": INSTRUCTION},
        {"from": "gpt", "loss": False, "value": "OK. I'll follow your instructions and try my best to solve the task."},
        {"from": "human", "loss": None, "value": f"The word is {word}."},
        {"from": "gpt", "loss": True, "value": f"Thought:\nI am shown {word}, so I say it.\n\nAction:\n{word}"},
    ]}
