"""What `fedse run` shows while it runs (apps.display): on a terminal, one table redrawn in place with
the clients' progress beneath it; anywhere else, only new lines: the table's head once, each round's
row once, progress lines as they change."""

from __future__ import annotations

import io
import re

from apps.display import TITLE, Display


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def screen(text: str) -> list[str]:
    """What a terminal shows after `text`: the escape codes Display writes (cursor up, clear the line,
    clear below) applied."""
    rows, r, c = [""], 0, 0
    for tok in re.findall(r"\x1b\[\d*[AJK]|\r|\n|[^\x1b\r\n]+", text):
        if tok == "\n":
            r, c = r + 1, 0
            rows += [""] * (r + 1 - len(rows))
        elif tok == "\r":
            c = 0
        elif tok.endswith("A"):
            r = max(0, r - int(tok[2:-1] or 1))
        elif tok == "\x1b[2K":
            rows[r] = ""
        elif tok == "\x1b[J":
            rows[r] = rows[r][:c]
            del rows[r + 1:]
        else:
            rows[r] = rows[r][:c] + tok + rows[r][c + len(tok):]
            c += len(tok)
    return rows


def row(rnd: int, success: float) -> dict:
    return {"round": rnd, "test_success": success, "test_tasks": 4}


def reports(**by_env: list[float]) -> dict[str, list[dict]]:
    return {env: [row(i, s) for i, s in enumerate(values)] for env, values in by_env.items()}


def lines_of(out: io.StringIO, start: str) -> list[str]:
    return [line for line in out.getvalue().splitlines() if line.startswith(start)]


def test_elsewhere_the_head_comes_once_and_each_rounds_row_once_complete():
    out = io.StringIO()
    d = Display(out, ["wordle", "maze"], rounds=2)
    d.table({})
    d.table(reports(maze=[0.25]))
    assert out.getvalue() == ""  # round 0 waits for wordle
    d.table(reports(maze=[0.25], wordle=[0.5]))
    d.table(reports(maze=[0.25, 0.5], wordle=[0.5]))
    d.progress({"org-maze": "round 1 training: 3/8 steps, 40s"})
    d.progress({"org-maze": "round 1 training: 3/8 steps, 40s"})  # unchanged: not again
    d.table(reports(maze=[0.25, 0.5], wordle=[0.5, 0.75]))
    d.table(reports(maze=[0.25, 0.5, 0.75], wordle=[0.5, 0.75]))
    d.close()  # the run ended before wordle's round 2: its row comes now, as it is
    text = out.getvalue()
    assert "\x1b[" not in text
    assert text.count(TITLE) == 1 and len(lines_of(out, "round |")) == 1
    assert [line.split("|")[0].strip() for line in lines_of(out, "    ")] == ["0", "1", "2"]
    assert lines_of(out, "    0 |")[0].split() == ["0", "|", "25.0%", "|", "50.0%", "|", "37.5%"]
    assert lines_of(out, "    2 |")[0].split() == ["2", "|", "75.0%", "|", "-", "|", "-"]
    assert text.count("org-maze: round 1 training: 3/8 steps, 40s") == 1
    assert text.index("    0 |") < text.index("org-maze: round 1 training") < text.index("    1 |")


def test_elsewhere_a_failed_clients_environment_is_not_waited_for():
    out = io.StringIO()
    d = Display(out, ["maze", "wordle"], rounds=1)
    d.table(reports(maze=[0.25, 0.5]), lost=["wordle"])
    assert [line.split()[:3] for line in lines_of(out, "    ")] == [["0", "|", "25.0%"], ["1", "|", "50.0%"]]


def test_on_a_terminal_the_table_is_redrawn_in_place_with_progress_beneath(monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")  # lines are cut to the terminal's width
    out = Terminal()
    d = Display(out, ["maze", "wordle"], rounds=1)
    d.table({})
    d.progress({"org-maze": "round 0 evaluating maze: 0/20 episodes, 30s"})
    d.table(reports(maze=[0.25], wordle=[0.5]))
    d.progress({"org-maze": "round 1 exploring maze: 4/16 episodes, 30s",
                "org-wordle": "round 1 training: 1/9 steps, 5s"})
    d.say("client org-x failed")  # a message goes above the table
    d.table(reports(maze=[0.25, 1.0], wordle=[0.5]))
    text = out.getvalue()
    assert "\x1b[2K" in text and re.search(r"\x1b\[\d+A", text)  # moved up and cleared, not appended
    shown = [line for line in screen(text) if line]
    assert shown[0] == "client org-x failed"
    assert sum(TITLE in line for line in shown) == 1 and sum(line.startswith("round |") for line in shown) == 1
    assert [line.split() for line in shown if line.startswith("    ")] == [
        ["0", "|", "25.0%", "|", "50.0%", "|", "37.5%"], ["1", "|", "100.0%", "|", "-", "|", "-"]]
    assert shown[-2:] == ["org-maze: round 1 exploring maze: 4/16 episodes, 30s",
                          "org-wordle: round 1 training: 1/9 steps, 5s"]
    d.progress({"org-wordle": "round 1 training: 9/9 steps, 50s"})  # org-maze's process ended
    d.close()
    assert [line for line in screen(out.getvalue()) if line][-1].startswith("    1 |")  # progress gone at the end
