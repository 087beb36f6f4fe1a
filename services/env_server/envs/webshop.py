"""WebShop as AgentGym serves it (princeton-nlp/WebShop's text mode), over a generated catalogue.

A shop with a search page, result pages, product pages and their Description / Features / Reviews
sub-pages. The agent reads a page as WebShop's "simple" text mode writes it, its visible texts
joined by " [SEP] ":

    WebShop [SEP] Instruction: [SEP] i need ... [SEP] Search
    Instruction: [SEP] i need ... [SEP] Back to Search [SEP] Page 1 (Total results: 50) [SEP] Next >
        [SEP] B0XXXXXXXX [SEP] <title> [SEP] $12.99 [SEP] ...
    Instruction: [SEP] i need ... [SEP] Back to Search [SEP] < Prev [SEP] color [SEP] black [SEP] white
        [SEP] <title> [SEP] Price: $12.99 [SEP] Rating: N.A. [SEP] Description [SEP] Features [SEP] Reviews
        [SEP] Buy Now

and acts with `search[keywords]` (only on the search page, which alone has a search bar) or
`click[value]` with a clickable of the page, matched case-insensitively (WebShop lowercases the
argument; its clickables are lowercase, product ids included). "Buy Now" ends the episode with
WebShop's reward (webshop_reward.py); success is reward 1. Search is a real full-text index
(webshop_search.py): SQLite FTS5 (stdlib sqlite3, in memory, porter stemming) ranked by BM25, top 50
results, 10 per page, as WebShop (Lucene BM25, SEARCH_RETURN_N = 50, PRODUCT_WINDOW = 10). An action
that is not admissible changes nothing, says so, and still uses a turn; the session layer enforces
the 10-turn limit.

Admissible actions: on the search page a bounded set of searches built from the instruction (its
key words, the instruction itself, and shorter queries from its words; any other `search[...]` works
too); on every other page each clickable as `click[...]`.

Differences from WebShop, on purpose: the catalogue is generated (webshop_catalog.py); every product
has one price; attribute and option text fallbacks match whole words, not substrings ("red" is not
found in "featured"); type similarity uses the catalogue's nouns (type names and brands) instead of
spaCy's part-of-speech tags; fuzzy matching is thefuzz's token_set_ratio computed with difflib; and
option matches count at most once per goal option, so a reward never exceeds 1.
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Iterable, Sequence

from .base import Environment, Episode, NumberedTasks, StepResult, shuffled_cycle
from .webshop_catalog import EXACT_MATCH_OPTIONS, Goal, Product, build_products, keywords, make_goal, words
from .webshop_reward import FUZZY_THRESHOLD, reward, token_set_ratio
from .webshop_search import SearchIndex, fts_query
from .webshop_types import PRODUCT_TYPES

NUM_TRAIN, NUM_TEST = 3930, 200
PAGE_SIZE = 10

SEP = " [SEP] "
BACK_TO_SEARCH, NEXT_PAGE, PREV_PAGE, BUY_NOW = "Back to Search", "Next >", "< Prev", "Buy Now"
SUB_PAGES = ("Description", "Features", "Reviews")

INSTRUCTION = (
    "You are web shopping. Each observation is the current page of a web shop, its parts separated by "
    "[SEP]; it repeats the instruction saying what to buy. Act with one action per turn, either "
    "search[keywords] (only on the search page, the one page with a search bar) or click[value], where "
    "value is one of the page's clickables: buttons such as \"back to search\", \"next >\", \"< prev\", "
    "\"description\", \"buy now\", product ids from the search results, and product options such as a "
    "size or a color. Choose the product's options on its page before you click \"buy now\". Buying "
    "ends the episode; the purchase scores from 0 to 1 by how well the product matches the instruction's "
    "attributes, options and price, and only a full match (score 1) is a success. An action that is not "
    "available changes nothing but still uses one of the 10 turns."
)


# ---- pages

def _instruction_head(goal: Goal) -> str:
    return f"Instruction:{SEP}{goal.instruction}"


def search_page(goal: Goal) -> str:
    return f"WebShop{SEP}{_instruction_head(goal)}{SEP}Search"


def results_page(goal: Goal, results: Sequence[Product], page: int) -> str:
    parts = [_instruction_head(goal), BACK_TO_SEARCH, f"Page {page} (Total results: {len(results)})"]
    if page > 1:
        parts.append(PREV_PAGE)
    if page * PAGE_SIZE < len(results):
        parts.append(NEXT_PAGE)
    for p in results[(page - 1) * PAGE_SIZE: page * PAGE_SIZE]:
        parts += [p.asin, p.title, p.price_text]
    return SEP.join(parts)


def item_page(goal: Goal, product: Product) -> str:
    parts = [_instruction_head(goal), BACK_TO_SEARCH, PREV_PAGE]
    for name, values in product.options:
        parts += [name, *values]
    parts += [product.title, f"Price: {product.price_text}", "Rating: N.A.", *SUB_PAGES, BUY_NOW]
    return SEP.join(parts)


_REVIEW_TITLES = ("Just what I wanted", "Good value", "Works as described", "Pretty good", "Would buy again")
_REVIEW_BODIES = ("Arrived quickly and matches the listing.", "Does the job; I am happy with it.",
                  "Nice quality for the money.", "Exactly as pictured, no complaints.",
                  "Took a star off for the packaging, otherwise great.")


def reviews(product: Product) -> list[tuple[str, int, str]]:
    rng = random.Random(f"reviews:{product.asin}")
    return [(rng.choice(_REVIEW_TITLES), rng.randint(3, 5), rng.choice(_REVIEW_BODIES))
            for _ in range(rng.randint(1, 3))]


def sub_page(goal: Goal, product: Product, which: str) -> str:
    parts = [_instruction_head(goal), BACK_TO_SEARCH, PREV_PAGE]
    if which == "Description":
        parts.append(product.description)
    elif which == "Features":
        parts += list(product.bullets)
    else:
        for title, score, body in reviews(product):
            parts += [title, str(score), body]
    return SEP.join(parts)


def done_page(product: Product, chosen: dict[str, str], score: float) -> str:
    return SEP.join(["Thank you for shopping with us!", "Purchased", "asin", product.asin, "options",
                     json.dumps(chosen), "Your score (min 0.0, max 1.0)", f"{round(score, 4)}"])


def parse_action(action: str) -> tuple[str, str] | None:
    """("search" | "click", argument) of `name[argument]`, or None."""
    text = action.strip()
    i = text.find("[")
    if i <= 0 or not text.endswith("]"):
        return None
    name = text[:i].strip().lower()
    if name not in ("search", "click"):
        return None
    return name, text[i + 1:-1].strip()


# ---- episodes

@dataclasses.dataclass(frozen=True)
class _Click:
    kind: str                 # back | prev_page | next_page | product | results | option | sub | item | buy
    value: str = ""
    option: str = ""


class WebShopEpisode(Episode):
    def __init__(self, env: "WebShopEnv", goal: Goal):
        self._env = env
        self.goal = goal
        self.instruction = INSTRUCTION
        self.page = "search"            # search | results | item | sub | done
        self.query = ""
        self.results: tuple[Product, ...] = ()
        self.page_number = 1
        self.product: Product | None = None
        self.chosen: dict[str, str] = {}
        self.sub = ""
        self.reward = 0.0
        self._plans: dict[str, dict[str, str] | None] = {}
        self.observation = self._render()

    # -- pages and actions

    def _render(self) -> str:
        if self.page == "search":
            return search_page(self.goal)
        if self.page == "results":
            return results_page(self.goal, self.results, self.page_number)
        assert self.product is not None
        if self.page == "item":
            return item_page(self.goal, self.product)
        if self.page == "sub":
            return sub_page(self.goal, self.product, self.sub)
        return done_page(self.product, self.chosen, self.reward)

    def clickables(self) -> dict[str, _Click]:
        """The current page's clickables, lowercase as WebShop lists them."""
        c: dict[str, _Click] = {}
        if self.page in ("search", "done"):
            return c
        c[BACK_TO_SEARCH.lower()] = _Click("back")
        if self.page == "results":
            if self.page_number > 1:
                c[PREV_PAGE.lower()] = _Click("prev_page")
            if self.page_number * PAGE_SIZE < len(self.results):
                c[NEXT_PAGE.lower()] = _Click("next_page")
            for p in self.results[(self.page_number - 1) * PAGE_SIZE: self.page_number * PAGE_SIZE]:
                c[p.asin.lower()] = _Click("product", p.asin)
        elif self.page == "item":
            assert self.product is not None
            c[PREV_PAGE.lower()] = _Click("results")
            for name, values in self.product.options:
                for v in values:
                    c[v.lower()] = _Click("option", v, name)
            for s in SUB_PAGES:
                c[s.lower()] = _Click("sub", s)
            c[BUY_NOW.lower()] = _Click("buy")
        else:
            c[PREV_PAGE.lower()] = _Click("item")
        return c

    def search_actions(self) -> list[str]:
        return [f"search[{q}]" for q in self._env.search_queries(self.goal)]

    def available_actions(self) -> list[str]:
        if self.page == "search":
            return self.search_actions()
        return [f"click[{k}]" for k in self.clickables()]

    def _invalid(self, action: str, why: str) -> StepResult:
        shown = action.strip()
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        self.observation = f"Invalid action: {shown!r}: {why}; nothing happened.{SEP}{self._render()}"
        return StepResult(self.observation, 0.0, False, False, valid=False)

    def step(self, action: str) -> StepResult:
        if self.page == "done":
            return StepResult(self.observation, 0.0, True, False, valid=False)
        parsed = parse_action(action)
        if parsed is None:
            return self._invalid(action, "an action is search[keywords] or click[value]")
        name, arg = parsed
        if name == "search":
            if self.page != "search":
                return self._invalid(action, "only the search page has a search bar (click[back to search])")
            if not fts_query(arg):
                return self._invalid(action, "give some keywords to search for")
            self.query, self.results, self.page_number = arg.lower(), self._env.index.search(arg.lower()), 1
            self.page = "results"
        else:
            click = self.clickables().get(arg.lower())
            if click is None:
                return self._invalid(action, f"{arg!r} is not a clickable of this page")
            if click.kind == "buy":
                return self._buy()
            self._apply(click)
        self.observation = self._render()
        return StepResult(self.observation, 0.0, False, False)

    def _apply(self, click: _Click) -> None:
        if click.kind == "back":
            self.page, self.query, self.results, self.product, self.chosen = "search", "", (), None, {}
        elif click.kind == "prev_page":
            self.page_number -= 1
        elif click.kind == "next_page":
            self.page_number += 1
        elif click.kind == "product":
            self.page, self.product, self.chosen = "item", self._env.product(click.value), {}
        elif click.kind == "results":
            self.page, self.product, self.chosen = "results", None, {}
        elif click.kind == "option":
            self.chosen[click.option] = click.value
        elif click.kind == "sub":
            self.page, self.sub = "sub", click.value
        elif click.kind == "item":
            self.page = "item"

    def _buy(self) -> StepResult:
        assert self.product is not None
        self.reward = reward(self.product, self.goal, self.chosen, self._env.nouns)
        self.page = "done"
        self.observation = self._render()
        return StepResult(self.observation, self.reward, True, self.reward == 1.0)

    # -- the expert

    def plan(self, product: Product) -> dict[str, str] | None:
        """The options to choose for a purchase of product with reward 1, or None if it cannot have it."""
        if product.asin not in self._plans:
            self._plans[product.asin] = self._env.plan(product, self.goal)
        return self._plans[product.asin]

    def _first_match(self, results: Iterable[Product]) -> int | None:
        return next((i for i, p in enumerate(results) if self.plan(p) is not None), None)

    def expert_action(self) -> str:
        """Search with the instruction's key words, open the first result that can score 1 (paging
        to it), choose the options it needs, buy. Recovers from any state the agent left."""
        if self.page == "search":
            queries = self._env.search_queries(self.goal)
            for q in queries:
                if self._first_match(self._env.index.search(q)) is not None:
                    return f"search[{q}]"
            return f"search[{queries[0]}]"
        if self.page == "results":
            i = self._first_match(self.results)
            if i is None:
                return f"click[{BACK_TO_SEARCH.lower()}]"
            page = i // PAGE_SIZE + 1
            if page > self.page_number:
                return f"click[{NEXT_PAGE.lower()}]"
            if page < self.page_number:
                return f"click[{PREV_PAGE.lower()}]"
            return f"click[{self.results[i].asin.lower()}]"
        if self.page == "item":
            assert self.product is not None
            plan = self.plan(self.product)
            if plan is None:
                return f"click[{PREV_PAGE.lower()}]"
            for name, value in plan.items():
                if self.chosen.get(name) != value:
                    return f"click[{value.lower()}]"
            return f"click[{BUY_NOW.lower()}]"
        if self.page == "sub":
            return f"click[{PREV_PAGE.lower()}]"
        return f"click[{BACK_TO_SEARCH.lower()}]"  # the episode is over; nothing helps


class WebShopEnv(Environment):
    """Tasks 0..199 are the test split, 200..4129 the training split.

    Catalogue: 50 product types x 30 products (1,500), generated from the seed. The 200 test tasks
    target 200 distinct products that no training task targets; training tasks cycle through seeded
    shuffles of the other 1,300 products, each with its own draw of attributes, options, price bound
    and wording. No two tasks have the same instruction.
    """

    name = "webshop"
    max_turns = 10
    has_expert = lists_actions = True

    def __init__(self, seed: int = 0):
        self.products = build_products(seed)
        self._by_asin = {p.asin: p for p in self.products}
        self.nouns = frozenset({w for t in PRODUCT_TYPES for w in words(t.name)}
                               | {p.brand.lower() for p in self.products})
        self.index = SearchIndex(self.products)
        rng = random.Random(f"webshop-goals:{seed}")
        order = list(range(len(self.products)))
        rng.shuffle(order)
        test_targets, train_targets = order[:NUM_TEST], order[NUM_TEST:]
        seen: set[str] = set()
        test = [self._new_goal(rng, self.products[j], seen) for j in test_targets]
        train_targets = shuffled_cycle(train_targets, rng)  # drawn lazily, between the goals' own draws
        train = [self._new_goal(rng, self.products[next(train_targets)], seen) for _ in range(NUM_TRAIN)]
        self._goals = NumberedTasks(self.name, test, train)

    @staticmethod
    def _new_goal(rng: random.Random, product: Product, seen: set[str], tries: int = 50) -> Goal:
        """A goal for product whose instruction no earlier task has (redrawn until new)."""
        for _ in range(tries):
            goal = make_goal(rng, product)
            if goal.instruction not in seen:
                break
        seen.add(goal.instruction)
        return goal

    def tasks(self, split: str) -> list[int]:
        return self._goals.ids(split)

    def goal(self, task_id: int) -> Goal:
        return self._goals[task_id]

    def reset(self, task_id: int) -> WebShopEpisode:
        return WebShopEpisode(self, self.goal(task_id))

    def product(self, asin: str) -> Product:
        return self._by_asin[asin]

    def search_queries(self, goal: Goal) -> list[str]:
        """The admissible searches of a goal: its key words first, then the instruction itself, then
        shorter queries from its words (type with attributes, type with options, type)."""
        name = goal.type_name
        queries = [keywords(goal.instruction), goal.instruction.lower(),
                   " ".join([*goal.attributes, name]), " ".join([name, *goal.option_values]), name]
        return list(dict.fromkeys(q for q in queries if q))

    def plan(self, product: Product, goal: Goal) -> dict[str, str] | None:
        """For each option of product, the first value a goal option asks for; None unless buying
        product with those options scores 1."""
        wanted = goal.option_values
        chosen: dict[str, str] = {}
        for name, values in product.options:
            for v in values:
                exact = name.lower() in EXACT_MATCH_OPTIONS
                if (v in wanted) if exact else any(token_set_ratio(g, v) > FUZZY_THRESHOLD for g in wanted):
                    chosen[name] = v
                    break
        return chosen if reward(product, goal, chosen, self.nouns) == 1.0 else None
