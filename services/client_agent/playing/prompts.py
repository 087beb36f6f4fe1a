"""What the model reads and writes: prompts that end where the agent's text begins, and that text.

One `PromptFormat` serves acting (the scorer and generation) and training, so the model is trained on
exactly the tokens it sees when it acts:
- `PlainFormat` (the embedded tiny byte model): the instruction, the last `max_history` turns and the
  current observation as ReAct text, cut to the model's window (the start of an observation too long
  for it); the agent writes "Action: <action>\\n".
- `ChatFormat` (a real instruct model whose tokenizer has a chat template): a system message, the
  instruction with the first observation as the user's first message, each earlier action as an
  assistant message "Action: <action>" and each later observation as a user message, rendered by
  the tokenizer's own template up to the assistant header; the agent writes "Action: <action>" and
  the template's end-of-turn text (ChatML: "<|im_end|>"), so generation stops at the end of the
  action line by itself. By default it shows the whole episode while it fits in the prompt window;
  when the next turn would not fit, the conversation starts again from the current observation
  (`window_start`). So consecutive prompts of an episode extend each other: the scorer reuses the
  previous turn's KV cache, and training runs a trajectory's turns as one sequence with the loss on
  every action (`encode_trajectory`), instead of once per turn.

Where the agent writes its own text instead of picking a listed action (an environment that lists no
actions), the format's ReAct variant (`as_react()`) tells the model to answer as AgentGym's agents do,
"Thought:\n<thought>\n\nAction:\n<action>" (the chat format in its system message, the plain format
after the instruction), and every turn that has a written text (a file's demonstration, a generated
turn) shows and trains on that whole text instead of "Action: <action>": `target(action, text)`,
and `prompt(..., texts)` for the earlier turns. The next turn's prompt then still extends the
previous one by exactly the agent's text.
"""

from __future__ import annotations

import dataclasses
import re
from collections import OrderedDict
from typing import Protocol, Sequence

# The tiny model sees the last this many prompt tokens (bytes): in the maze exactly the current
# observation plus the previous "Action: ..." line in the longest case. Real LLMs see a few thousand.
TINY_MAX_PROMPT_TOKENS = 160
DEFAULT_MAX_PROMPT_TOKENS = 3072
# Prompt room kept free for the agent's answer when deciding whether a turn still fits the window.
ANSWER_ROOM = 64

SYSTEM_PROMPT = ("You are an agent completing a task in a text environment. Each turn you read an observation "
                 "and answer with exactly one line, \"Action: <action>\", naming one of the actions available "
                 "in that situation.")
# AgentGym's answer format ("Thought: ...\n\nAction:\n<action>"), for environments where the agent
# writes its action itself, said in words: shown as a template with placeholders, SmolLM2-135M-Instruct
# learnt to copy them after one round of training on 8 TextCraft demonstrations (it answered
# "Action:\n<your next action>"; 4 of 36 greedy steps named an action, against 36 of 36 with the words).
REACT_FORMAT = ("two parts: first a line that begins with \"Thought:\" and says in one sentence what to do next, "
                "then a line \"Action:\" and, on the line after it, the action alone, written as the task "
                "describes its commands")
REACT_SYSTEM_PROMPT = ("You are an agent completing a task in a text environment. Each turn you read an observation "
                       "and answer in " + REACT_FORMAT + ".")
REACT_HINT = "Answer each observation in " + REACT_FORMAT + "."
# How a written answer begins, already in the prompt: asked for the format alone, SmolLM2-135M-Instruct
# restated the task instead ("Craft the goal item in a Minecraft-like crafting game."); after
# "Thought:" it wrote a thought and an "Action:" line (3 of 3 TextCraft goals tried).
REACT_OPENING = "Thought:"
# What follows a written thought that named no action, so that the model writes the action line next:
# sampled at temperature 1, SmolLM2-135M-Instruct's text named an action on 3 of 36 TextCraft steps
# before training and 17 of 36 after, wandering on past its thought.
ACTION_CUE = "\n\nAction:\n"
# The most characters of such a thought kept before the cue.
MAX_CUED_THOUGHT_CHARS = 300


def thought_before_cue(written: str) -> str:
    """What is kept of a written text that named no action before ACTION_CUE follows it: its first
    paragraph (up to the first blank line), without trailing blanks, cut to MAX_CUED_THOUGHT_CHARS."""
    head = re.split(r"\n[ \t]*\n", written.lstrip("\n"), maxsplit=1)[0]
    return head[:MAX_CUED_THOUGHT_CHARS].rstrip()


def after_opening(said: str) -> str:
    """What the agent writes after the prompt's REACT_OPENING for a turn whose answer is `said`: the rest
    of it where it begins with the opening, else a space and all of it."""
    return said[len(REACT_OPENING):] if said.startswith(REACT_OPENING) else " " + said


# "Action:" as a ReAct answer marks it (not the end of a word such as "Reaction:").
_REACT_MARK = re.compile(r"(?<![A-Za-z])Action\s*:", re.IGNORECASE)
# The most characters of an action the agent writes (the env server refuses more than 1000).
MAX_WRITTEN_ACTION_CHARS = 300
# What is sent when the agent wrote nothing at all (an env server refuses an empty action).
EMPTY_TEXT_ACTION = "none"


def parse_react(text: str) -> str | None:
    r"""The action of a ReAct text, or None where it names none: the first non-empty line after its
    last "Action:" (on the same line, "Action: move up", or on the next, AgentGym's "Action:\nmove
    up"), stripped, out of one pair of surrounding quotes, and cut to MAX_WRITTEN_ACTION_CHARS. AgentGym's own clients read the same: the
    regex `Action:\s*(.*?)(?=\n|$)`, or what follows the last "Action:"."""
    marks = list(_REACT_MARK.finditer(text))
    if not marks:
        return None
    for line in text[marks[-1].end():].splitlines():
        line = line.strip()
        if len(line) > 2 and line[0] == line[-1] and line[0] in "\"'`":
            line = line[1:-1].strip()  # a quoted action: SmolLM2 writes "craft 1 stick using 2 oak planks"
        if line:
            return line[:MAX_WRITTEN_ACTION_CHARS]
    return None


def fallback_action(text: str) -> str:
    """What is sent for a text that names no action: its last non-empty line but a bare "Action:"
    (the end of ACTION_CUE with nothing written after it), cut to MAX_WRITTEN_ACTION_CHARS
    (EMPTY_TEXT_ACTION for a text with none). The environment answers it as it answers any action
    it does not know, so the episode goes on."""
    lines = [line.strip() for line in text.splitlines() if line.strip() and not _REACT_MARK.fullmatch(line.strip())]
    return lines[-1][:MAX_WRITTEN_ACTION_CHARS] if lines else EMPTY_TEXT_ACTION


def inner_model(model):
    """The causal LM under a PeftModel (its layers carry the active LoRA), else the model itself."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def is_tiny(model) -> bool:
    """True for the embedded tiny model (built in code, or exported as a directory)."""
    from fedse.model.tinymodel import TINY_MODEL_NAME

    config = getattr(inner_model(model), "config", None)
    return config is not None and (getattr(config, "name_or_path", None) == TINY_MODEL_NAME
                                   or bool(getattr(config, "fedse_tiny", False)))


def default_max_prompt_tokens(model) -> int:
    """TINY_MAX_PROMPT_TOKENS for the embedded tiny model, else DEFAULT_MAX_PROMPT_TOKENS (capped by
    the model's max_position_embeddings less room for the action). Scorer and trainer both use it
    when not told otherwise, so training sees what acting sees."""
    if is_tiny(model):
        return TINY_MAX_PROMPT_TOKENS
    config = getattr(inner_model(model), "config", None)
    limit = getattr(config, "max_position_embeddings", None) if config is not None else None
    return min(DEFAULT_MAX_PROMPT_TOKENS, limit - 64) if limit and limit > 128 else DEFAULT_MAX_PROMPT_TOKENS


def format_target(action: str, text: str = "") -> str:
    """The plain format's agent text for one step: what the loss covers and what scoring scores.
    "Action: <action>\n", or the text the agent wrote (stripped, then a newline) where it wrote one."""
    return f"{text.strip()}\n" if text.strip() else f"Action: {action}\n"


def turn_text(texts: Sequence[str], i: int) -> str:
    """The text written at turn i, "" where none was (texts empty: none at all)."""
    return texts[i] if texts else ""


def format_prompt(instruction: str, turns: Sequence[tuple[str, str]], observation: str, max_history: int,
                  texts: Sequence[str] = ()) -> str:
    """Plain ReAct-style prompt ending exactly where the agent's text (format_target) begins.

    instruction, then the last `max_history` (observation, action) turns, then the current
    observation:
        <instruction>
        Observation: <obs 1>
        Action: <action 1>
        Observation: <current obs>
    An earlier turn with a written text (`texts`, one per turn or none) shows that text instead of
    its "Action: ..." line.
    """
    if max_history < 0:
        raise ValueError(f"max_history must be >= 0, got {max_history}")
    parts = [instruction.strip(), "\n"]
    first = max(len(turns) - max_history, 0) if max_history > 0 else len(turns)
    for i in range(first, len(turns)):
        obs, action = turns[i]
        parts.append(f"Observation: {obs.strip()}\n")
        parts.append(format_target(action, turn_text(texts, i)))
    parts.append(f"Observation: {observation.strip()}\n")
    return "".join(parts)


class TokenCache:
    """Tokenizes without adding special tokens (those written in the text, such as a chat
    template's, are kept) and remembers recent texts (candidate targets and prompts repeat), up to
    `max_chars` characters of them, least recently used dropped first."""

    def __init__(self, tokenizer, max_chars: int = 4_000_000):
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._chars = 0
        # Tokenizers that normally start a text with BOS (Llama-2 style) get it before each prompt.
        bos = getattr(tokenizer, "bos_token_id", None)
        self.bos = [bos] if bos is not None and getattr(tokenizer, "add_bos_token", False) else []

    def prompt(self, text: str, max_prompt_tokens: int | None) -> list[int]:
        """A prompt's ids: the last max_prompt_tokens tokens (BOS, where the tokenizer uses one, first)."""
        ids = self(text)
        if max_prompt_tokens:
            ids = ids[-(max_prompt_tokens - len(self.bos)):]
        return self.bos + ids

    def __call__(self, text: str) -> list[int]:
        ids = self._cache.get(text)
        if ids is None:
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            self._cache[text] = ids
            self._chars += len(text)
            while self._chars > self.max_chars and len(self._cache) > 1:
                self._chars -= len(self._cache.popitem(last=False)[0])
        else:
            self._cache.move_to_end(text)
        return ids


def encode_example(tokenize: TokenCache, prompt: str, action_text: str,
                   max_prompt_tokens: int | None) -> tuple[list[int], list[int]]:
    """(prompt ids truncated on the left to max_prompt_tokens, ids of the agent's text)."""
    return tokenize.prompt(prompt, max_prompt_tokens), tokenize(action_text)


class PromptFormat(Protocol):
    def prompt(self, instruction: str, turns: Sequence[tuple[str, str]], observation: str,
               texts: Sequence[str] = ()) -> str: ...

    def target(self, action: str, text: str = "") -> str: ...

    # What a prompt ends with: the start of the agent's answer ("" unless it writes ReAct text).
    opening: str

    def as_react(self) -> "PromptFormat": ...


def head_bytes(text: str, n: int) -> str:
    """The longest start of `text` of at most n UTF-8 bytes (never half a character)."""
    return text.encode("utf-8")[:max(n, 0)].decode("utf-8", errors="ignore")


@dataclasses.dataclass(frozen=True)
class PlainFormat:
    """ReAct text without a chat template: the embedded tiny model's format.

    `window`: the prompt bytes the model sees (the tiny model's tokens are bytes), or None for no
    limit here (the caller truncates tokens on the left). Where the previous action and the current
    observation fit in the window, the prompt is the usual text and its end fills the window (the
    maze: the previous observation's end, the previous action, the current observation). Where the
    current observation alone is too long, the prompt is the previous action and the *start* of the
    observation, cut to fit: environments put what matters first (BabyAI's goal, WebShop's
    instruction), and the end of a long observation (a list of actions, a page's last products)
    tells a 160-byte window less. Measured in-process on BabyAI with the tiny model (60 expert
    demonstrations, 16 explorations and 3 epochs a round, 20 test tasks): held-out success by round 4
    was 25% (seed 0) and 30% (seed 1) with the start of the observation, 5% (seed 1) with its end.

    `react`: the agent writes its own ReAct text (an environment that lists no actions); the
    instruction is followed by REACT_HINT, the prompt ends with REACT_OPENING (`opening`), and a
    written text longer than half the window is left out of a cut prompt (the current observation's
    start matters more)."""

    max_history: int = 1
    window: int | None = None
    react: bool = False

    def prompt(self, instruction: str, turns: Sequence[tuple[str, str]], observation: str,
               texts: Sequence[str] = ()) -> str:
        if self.window is not None:
            previous = format_target(turns[-1][1], turn_text(texts, len(turns) - 1)) \
                if turns and self.max_history > 0 else ""
            current = f"Observation: {observation.strip()}\n"
            if len((previous + current).encode("utf-8")) > self.window:
                if len(previous.encode("utf-8")) > self.window // 2:
                    previous = ""
                # the observation's cut start, then "\n" and the opening
                room = self.window - len(previous.encode("utf-8")) - 1 - len(self.opening)
                return previous + head_bytes(current, room).rstrip("\n") + "\n" + self.opening
        if self.react:
            instruction = f"{instruction.strip()}\n{REACT_HINT}"
        return format_prompt(instruction, turns, observation, self.max_history, texts) + self.opening

    def target(self, action: str, text: str = "") -> str:
        said = format_target(action, text)
        return after_opening(said) if self.react else said

    @property
    def opening(self) -> str:
        """What the prompt ends with, the start of the agent's answer: REACT_OPENING where it writes."""
        return REACT_OPENING if self.react else ""

    def as_react(self) -> "PlainFormat":
        """This format for an environment where the agent writes its action (see the class docstring)."""
        return dataclasses.replace(self, react=True)


class ChatFormat:
    """The tokenizer's chat template (see the module docstring). max_history < 0: every earlier turn
    of the episode while the prompt fits in max_prompt_tokens; k >= 0: the last k turns. `react`:
    the agent writes its own ReAct text, and the system message (REACT_SYSTEM_PROMPT unless `system`
    is given) says how."""

    def __init__(self, tokenizer, max_prompt_tokens: int, max_history: int = -1, system: str | None = None,
                 tokenize: TokenCache | None = None, react: bool = False):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("ChatFormat needs a tokenizer with a chat template")
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.max_history = max_history
        self.react = react
        self.system = system if system is not None else REACT_SYSTEM_PROMPT if react else SYSTEM_PROMPT
        # What the prompt ends with, the start of the agent's answer: REACT_OPENING where it writes.
        self.opening = REACT_OPENING if react else ""
        self.tokenize = tokenize or TokenCache(tokenizer)
        self.end_of_turn = self._end_of_turn()
        self._starts: OrderedDict[tuple, int] = OrderedDict()

    def _end_of_turn(self) -> str:
        """The text the template puts after an assistant message's content (ChatML: "<|im_end|>"),
        trailing whitespace dropped: the template's own newline then starts the next message."""
        mark = "\x00fedse-end\x00"
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": "u"}, {"role": "assistant", "content": mark}], tokenize=False)
        return text[text.rindex(mark) + len(mark):].rstrip()

    def as_react(self) -> "ChatFormat":
        """This format for an environment where the agent writes its action (see the class docstring)."""
        return ChatFormat(self.tokenizer, self.max_prompt_tokens, self.max_history, tokenize=self.tokenize, react=True)

    @staticmethod
    def said(action: str, text: str = "") -> str:
        """The assistant message of a turn: the text the agent wrote, else "Action: <action>"."""
        return text.strip() if text.strip() else f"Action: {action}"

    def messages(self, instruction: str, turns: Sequence[tuple[str, str]], observation: str,
                 texts: Sequence[str] = ()) -> list[dict]:
        observations = [obs for obs, _ in turns] + [observation]
        out = [{"role": "system", "content": self.system},
               {"role": "user", "content": f"{instruction.strip()}\n\nObservation: {observations[0].strip()}"}]
        for i, ((_, action), obs) in enumerate(zip(turns, observations[1:])):
            out.append({"role": "assistant", "content": self.said(action, turn_text(texts, i))})
            out.append({"role": "user", "content": f"Observation: {obs.strip()}"})
        return out

    def render(self, instruction: str, turns: Sequence[tuple[str, str]], observation: str,
               texts: Sequence[str] = ()) -> str:
        return self.tokenizer.apply_chat_template(self.messages(instruction, turns, observation, texts),
                                                  tokenize=False, add_generation_prompt=True)

    def window_start(self, instruction: str, turns: Sequence[tuple[str, str]], observation: str,
                     texts: Sequence[str] = ()) -> int:
        """Index of the first earlier turn the prompt shows. With the whole episode (max_history < 0)
        it stays where the previous turn's window started while the prompt fits, else it moves to
        the current turn, so consecutive prompts extend each other between restarts."""
        n = len(turns)
        if self.max_history >= 0:
            return max(0, n - self.max_history)
        if n == 0:
            return 0
        texts = tuple(texts)
        key = (instruction, tuple(turns), observation, texts)
        start = self._starts.get(key)
        if start is None:
            prev = self.window_start(instruction, turns[:-1], turns[-1][0], texts[:-1])
            fits = len(self.tokenize(self.render(instruction, turns[prev:], observation, texts[prev:]))) \
                + ANSWER_ROOM <= self.max_prompt_tokens
            start = prev if fits else n
            self._starts[key] = start
            if len(self._starts) > 8192:
                self._starts.popitem(last=False)
        return start

    def prompt(self, instruction: str, turns: Sequence[tuple[str, str]], observation: str,
               texts: Sequence[str] = ()) -> str:
        start = self.window_start(instruction, turns, observation, texts)
        return self.render(instruction, list(turns)[start:], observation, tuple(texts)[start:]) + self.opening

    def target(self, action: str, text: str = "") -> str:
        said = self.said(action, text)
        return f"{after_opening(said) if self.react else said}{self.end_of_turn}"


def make_format(model, tokenizer, max_history: int = -1, max_prompt_tokens: int | None = None,
                tokenize: TokenCache | None = None) -> PromptFormat:
    """ChatFormat for a model whose tokenizer has a chat template, else PlainFormat. max_history < 0
    means the format's default: the whole episode in the window (chat), 1 turn (plain). `tokenize`:
    a TokenCache to share with the scorer and training (a prompt is then tokenized once). The variant
    for environments where the agent writes its action is the format's as_react()."""
    tiny = is_tiny(model)
    if not tiny and getattr(tokenizer, "chat_template", None):
        return ChatFormat(tokenizer, max_prompt_tokens or default_max_prompt_tokens(model), max_history,
                          tokenize=tokenize)
    window = (max_prompt_tokens or TINY_MAX_PROMPT_TOKENS) if tiny else None
    return PlainFormat(1 if max_history < 0 else max_history, window)


@dataclasses.dataclass(frozen=True)
class Encoded:
    """One training sequence: token ids and the [start, end) spans of the agent's own tokens (the
    only ones the loss covers), and how many agent turns it holds."""

    ids: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]

    @property
    def turns(self) -> int:
        return len(self.spans)

    @property
    def targets(self) -> int:
        return sum(e - s for s, e in self.spans)


def encode_trajectory(fmt: PromptFormat, tokenize: TokenCache, instruction: str, turns: Sequence[tuple[str, str]],
                      max_prompt_tokens: int | None, texts: Sequence[str] = ()) -> list[Encoded]:
    """The training sequences of one trajectory, one turn each as the agent saw it (its prompt,
    truncated on the left to max_prompt_tokens exactly as acting truncates it, then its text: the
    text it wrote where `texts` has one for the turn, else its action as fmt.target writes it).
    Where a turn's prompt begins with the previous turn's prompt and text, token for token (the
    chat format within one window), the turn is added to that sequence instead: the same tokens the
    agent saw, computed once. In the plain format every turn stays a sequence of its own, as the
    tiny model was trained and measured."""
    merge = not isinstance(fmt, PlainFormat)
    out: list[Encoded] = []
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    texts = tuple(texts)
    for i, (obs, action) in enumerate(turns):
        p = tokenize.prompt(fmt.prompt(instruction, turns[:i], obs, texts[:i]), max_prompt_tokens)
        t = tokenize(fmt.target(action, turn_text(texts, i)))
        if merge and ids and len(p) >= len(ids) and p[:len(ids)] == ids:
            ids = ids + p[len(ids):]
        else:
            if ids:
                out.append(Encoded(tuple(ids), tuple(spans)))
            ids, spans = list(p), []
        spans.append((len(ids), len(ids) + len(t)))
        ids = ids + t
    if ids:
        out.append(Encoded(tuple(ids), tuple(spans)))
    return out
