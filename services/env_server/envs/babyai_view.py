"""BabyAI's view (see babyai.py): what the agent sees of a minigrid level, as AgentGym describes it, and
the high-level actions it may take from there, each expanded into minigrid moves along a path over
the cells it sees."""

from __future__ import annotations

import collections

from minigrid.core.constants import IDX_TO_COLOR, IDX_TO_OBJECT, STATE_TO_IDX

IDX_TO_STATE = {i: state for state, i in STATE_TO_IDX.items()}
LEFT, RIGHT, FORWARD, PICKUP, DROP, TOGGLE, DONE = range(7)
DIR_VEC = ((1, 0), (0, 1), (-1, 0), (0, -1))
CHECK = "check available actions"

# What blocks "move forward" and is reported as "You are facing a ... steps away" (AgentGym's).
BARRIERS = frozenset({"box", "wall"})
DESCRIBED = frozenset({"door", "key", "ball", "box", "goal", "lava", "wall"})
PICKABLE = frozenset({"key", "ball", "box"})


def add(a: tuple[int, int], b: tuple[int, int], k: int = 1) -> tuple[int, int]:
    return a[0] + k * b[0], a[1] + k * b[1]


def _seen_objects(env) -> tuple[list[dict], dict[tuple[int, int], str]]:
    """What the agent sees: described objects nearest first, and the type of every seen cell.

    Cells are visited as AgentGym visits the encoded view (far row first, left to right), and the
    sort by Manhattan distance is stable, so ties keep that order.
    """
    grid, vis_mask = env.gen_obs_grid()
    image = grid.encode(vis_mask)
    view = env.agent_view_size
    pos = (int(env.agent_pos[0]), int(env.agent_pos[1]))
    f = DIR_VEC[env.agent_dir]
    r = DIR_VEC[(env.agent_dir + 1) % 4]
    top_left = add(add(pos, f, view - 1), r, -(view // 2))
    objects: list[dict] = []
    cells: dict[tuple[int, int], str] = {}
    for vj in range(view):
        for vi in range(view):
            cell = add(add(top_left, f, -vj), r, vi)
            if not (0 <= cell[0] < env.width and 0 <= cell[1] < env.height):
                continue
            type_idx, color_idx, state_idx = (int(v) for v in image[vi, vj])
            obj_type = IDX_TO_OBJECT[type_idx]
            if obj_type == "unseen":
                continue
            cells[cell] = obj_type
            distance = abs(cell[0] - pos[0]) + abs(cell[1] - pos[1])
            if distance == 0 or obj_type not in DESCRIBED:
                continue
            color = IDX_TO_COLOR[color_idx]
            if obj_type == "door":
                state = IDX_TO_STATE[state_idx]
                name = f"{color} {state} door"
            else:
                state, name = "", f"{color} {obj_type}"
            rel = (cell[0] - pos[0], cell[1] - pos[1])
            objects.append({
                "name": name, "type": obj_type, "color": color, "state": state, "pos": cell,
                "dist": distance, "front": rel[0] * f[0] + rel[1] * f[1], "right": rel[0] * r[0] + rel[1] * r[1],
            })
    objects.sort(key=lambda o: o["dist"])
    counts: collections.Counter[str] = collections.Counter()
    for obj in objects:
        if obj["type"] != "wall":
            counts[obj["name"]] += 1
            obj["n"] = counts[obj["name"]]
    return objects, cells


def _paths_in_view(env, cells: dict[tuple[int, int], str]) -> dict[tuple[tuple[int, int], int], list[int]]:
    """Shortest low-level move lists from the agent's pose to every pose reachable over seen cells.

    Breadth first over (cell, direction), moves tried in AgentGym's order (forward, left, right).
    A cell can be entered when it is seen and empty or an open door.
    """
    start = ((int(env.agent_pos[0]), int(env.agent_pos[1])), int(env.agent_dir))
    parent: dict[tuple[tuple[int, int], int], tuple[tuple[tuple[int, int], int], int] | None] = {start: None}
    queue = collections.deque([start])
    while queue:
        pose = queue.popleft()
        pos, d = pose
        for move in (FORWARD, LEFT, RIGHT):
            if move == FORWARD:
                nxt = add(pos, DIR_VEC[d])
                kind = cells.get(nxt)
                if kind not in ("empty", "floor", "goal") and not (kind == "door" and _is_open(env, nxt)):
                    continue
                new = (nxt, d)
            else:
                new = (pos, (d - 1) % 4 if move == LEFT else (d + 1) % 4)
            if new not in parent:
                parent[new] = (pose, move)
                queue.append(new)
    paths: dict[tuple[tuple[int, int], int], list[int]] = {}
    for pose in parent:
        moves, cur = [], pose
        while parent[cur] is not None:
            cur, move = parent[cur]
            moves.append(move)
        paths[pose] = moves[::-1]
    return paths


def _is_open(env, pos: tuple[int, int]) -> bool:
    cell = env.grid.get(*pos)
    return cell is not None and cell.type == "door" and cell.is_open


def _path_to_face(paths, target: tuple[int, int]) -> tuple[list[int], tuple[tuple[int, int], int]] | None:
    """The shortest path (and the pose it ends in) that leaves the agent facing target."""
    best = None
    for d, vec in enumerate(DIR_VEC):
        pose = ((target[0] - vec[0], target[1] - vec[1]), d)
        if pose in paths and (best is None or len(paths[pose]) < len(best[0])):
            best = (paths[pose], pose)
    return best


def _path_onto(paths, target: tuple[int, int]) -> tuple[list[int], tuple[tuple[int, int], int]] | None:
    """The shortest path that ends standing on target (an open door)."""
    best = None
    for d in range(4):
        pose = (target, d)
        if pose in paths and (best is None or len(paths[pose]) < len(best[0])):
            best = (paths[pose], pose)
    return best


class View:
    """One state's text and high-level action table, as AgentGym's postprocess_obs builds them.

    `actions` maps each admissible action's name to (low-level moves, the pose they end in, the object
    they act on), in the order AgentGym lists them; `errors` maps an inadmissible one to why."""

    def __init__(self, env):
        objects, cells = _seen_objects(env)
        paths = _paths_in_view(env, cells)
        carrying = env.carrying
        here = ((int(env.agent_pos[0]), int(env.agent_pos[1])), int(env.agent_dir))
        seen = [o for o in objects if o["type"] != "wall"]
        ahead = sorted((o for o in objects if o["type"] in BARRIERS and o["right"] == 0 and o["front"] > 0),
                       key=lambda o: o["front"])
        self.description = _describe(objects, seen, ahead, carrying)
        self.actions: dict[str, tuple[list[int], tuple[tuple[int, int], int], dict | None]] = {}
        self.errors: dict[str, str] = {}
        self._add_moves(env, here, ahead)
        if carrying is None:
            self._add_reaches("pickup", [o for o in seen if o["type"] in PICKABLE], paths, [PICKUP])
        self._add_drop(env, here, cells)
        for o in seen:
            if o["type"] == "door":
                self._add_door(o, paths, here, carrying)
        self._add_reaches("go to", [o for o in seen if o["type"] != "goal"], paths, [])
        self.actions[CHECK] = ([], here, None)

    def _add_moves(self, env, here: tuple[tuple[int, int], int], ahead: list[dict]) -> None:
        pos, d = here
        self.actions["turn left"] = ([LEFT], (pos, (d - 1) % 4), None)
        self.actions["turn right"] = ([RIGHT], (pos, (d + 1) % 4), None)
        if not ahead or ahead[0]["front"] > 1:
            front = add(pos, DIR_VEC[d])
            cell = env.grid.get(*front)
            moved = cell is None or cell.can_overlap()
            self.actions["move forward"] = ([FORWARD], (front, d) if moved else here, None)
        else:
            self.errors["move forward"] = "There is a barrier in front of you, you can't move forward."

    def _add_reaches(self, verb: str, objects: list[dict], paths, then: list[int]) -> None:
        """For each object, the action "<verb> <obj> <n>": a shortest path to face it, then the moves `then`."""
        for o in objects:
            name = f"{verb} {o['name']} {o['n']}"
            found = _path_to_face(paths, o["pos"])
            if found is None:
                self.errors[name] = f"You cannot {verb} {o['name']} {o['n']}, as there is no path leading to it."
            else:
                self.actions[name] = (found[0] + then, found[1], o)

    def _add_drop(self, env, here: tuple[tuple[int, int], int], cells: dict[tuple[int, int], str]) -> None:
        if env.carrying is not None:
            front = add(here[0], DIR_VEC[here[1]])
            if front in cells and env.grid.get(*front) is None:
                self.actions["drop"] = ([DROP], here, None)
            else:
                self.errors["drop"] = "You cannot drop the object, as there is already an object in front of you."
        else:
            self.errors["drop"] = "You cannot drop the object, as you are not carrying anything."

    def _add_door(self, o: dict, paths, here: tuple[tuple[int, int], int], carrying) -> None:
        label = f"{o['name']} {o['n']}"
        through = f"go through {label}"
        if o["state"] == "open":
            found = _path_onto(paths, o["pos"])
            if found is None:
                self.errors[through] = f"You cannot go through {label}, as there is no path leading to it."
            else:
                self.actions[through] = (found[0], found[1], o)
            return
        self.errors[through] = f"You cannot go through {label}, as it is closed. You should toggle it first."
        name = f"toggle and go through {label}"
        if o["state"] == "locked":
            if carrying is None or carrying.type != "key":
                self.errors[name] = f"You cannot toggle and go through {label}, as you are not carrying a key."
                return
            if carrying.color != o["color"]:
                self.errors[name] = (f"You cannot toggle and go through {label}, as the color of the key you are "
                                     "carrying does not match the color of door.")
                return
        found = _path_to_face(paths, o["pos"])
        if found is None:
            self.errors[name] = f"You cannot toggle and go through {label}, as there is no path leading to it."
            return
        self.actions[name] = (found[0] + [TOGGLE, FORWARD], (o["pos"], found[1][1]), o)
        if not found[0]:
            self.actions["toggle"] = ([TOGGLE], here, o)

    def action_list(self) -> str:
        return "Available actions: [" + ", ".join(f'"{a}"' for a in self.actions) + "]"


def _describe(objects: list[dict], seen: list[dict], ahead: list[dict], carrying) -> str:
    """AgentGym's description of the view: the objects seen, the barrier ahead, what the agent carries."""
    sentences = []
    if objects:
        sentences.append("In front of you in this room, you can see several objects:")
        for o in seen:
            if o["right"] == 0:
                where = f"right in front of you {o['front']} steps away."
            elif o["right"] > 0:
                where = f"{o['front']} steps in front of you and {o['right']} steps to your right."
            else:
                where = f"{o['front']} steps in front of you and {-o['right']} steps to your left."
            sentences.append(f"There is a {o['name']} {o['n']} {where}")
    else:
        sentences.append("You cannot see any objects within sight.")
    sentences.append("The room has walls around you.")
    if ahead:
        sentences.append(f"You are facing a {ahead[0]['type']} {ahead[0]['front']} steps away.")
    if carrying is not None:
        sentences.append(f"You are carrying a {carrying.color} {carrying.type}.")
    else:
        sentences.append("You are not carrying anything.")
    return " ".join(sentences)


def normalize_action(action: str) -> str:
    """Lower case, single spaces, and "pick up" read as AgentGym's "pickup"."""
    text = " ".join(action.strip().lower().split())
    if text.startswith("pick up "):
        text = "pickup " + text[len("pick up "):]
    return text

