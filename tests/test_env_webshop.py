"""WebShop: catalogue, BM25 search, page text, WebShop's reward, splits, invalid actions and the expert."""

from __future__ import annotations

import itertools
import re

import pytest

from services.env_server.envs.base import UnknownTask
from services.env_server.envs.webshop import INSTRUCTION, NUM_TEST, NUM_TRAIN, PAGE_SIZE, WebShopEnv, parse_action
from services.env_server.envs.webshop_catalog import EXACT_MATCH_OPTIONS, Goal, Product, keywords, mentions, price_bound
from services.env_server.envs.webshop_reward import reward, token_set_ratio
from services.env_server.envs.webshop_search import SearchIndex, fts_query
from services.env_server.envs.webshop_types import CATEGORIES, PRODUCT_TYPES
from services.env_server.sessions import Outcome, SessionManager


@pytest.fixture(scope="module")
def env() -> WebShopEnv:
    return WebShopEnv(seed=0)


def play_expert(env: WebShopEnv, task_id: int) -> tuple[list[tuple[str, str]], float, bool]:
    episode = env.reset(task_id)
    trace = []
    for _ in range(env.max_turns):
        action = episode.expert_action()
        assert action in episode.available_actions(), (task_id, action)
        result = episode.step(action)
        assert result.valid, (task_id, action, result.observation)
        trace.append((action, result.observation))
        if result.done:
            return trace, result.reward, result.success
    return trace, 0.0, False


# ---- splits and determinism

def test_splits_have_the_papers_counts_and_held_out_targets(env):
    test, train = env.tasks("test"), env.tasks("train")
    assert (len(train), len(test)) == (NUM_TRAIN, NUM_TEST) == (3930, 200)
    assert len(set(test + train)) == len(test) + len(train)
    assert len({env.goal(t).instruction for t in test + train}) == len(test) + len(train)
    test_targets = {env.goal(t).asin for t in test}
    train_targets = {env.goal(t).asin for t in train}
    assert len(test_targets) == 200
    assert not test_targets & train_targets
    with pytest.raises(UnknownTask):
        env.reset(NUM_TEST + NUM_TRAIN)
    with pytest.raises(ValueError):
        env.tasks("dev")


def test_tasks_and_episodes_are_deterministic_per_task_id_and_seed(env):
    again = WebShopEnv(seed=0)
    ids = env.tasks("test") + env.tasks("train")
    assert [env.goal(t) for t in ids] == [again.goal(t) for t in ids]
    assert env.products == again.products
    for task in (0, 57, 3000):
        assert play_expert(env, task) == play_expert(again, task)
    other = WebShopEnv(seed=1)
    assert [other.goal(t).instruction for t in ids[:50]] != [env.goal(t).instruction for t in ids[:50]]


# ---- catalogue

def test_catalogue_has_products_with_categories_types_attributes_options_and_prices(env):
    products = env.products
    assert len(products) >= 1000
    assert len({p.asin for p in products}) == len(products)
    assert all(re.fullmatch(r"B0[A-Z0-9]{8}", p.asin) for p in products)
    assert {p.category for p in products} == set(CATEGORIES)
    assert len({p.type_index for p in products}) == len(PRODUCT_TYPES) >= 50
    for p in products:
        assert len(p.attributes) >= 3 and p.price > 0 and p.title and p.bullets and p.description
        values = [v for _, vs in p.options for v in vs]
        assert len(values) == len(set(values)), p  # a click on a value names one option
    assert sum(1 for p in products if p.options) > 0.9 * len(products)


def test_product_text_names_its_own_attributes_and_no_option_values(env):
    """WebShop's reward also finds attributes and options in a product's title, features and
    description; the generated text must not hand out matches the product does not have."""
    for p in env.products:
        ptype = PRODUCT_TYPES[p.type_index]
        text = " ".join([p.title, *p.bullets, p.description])
        for attribute in ptype.attributes:
            assert mentions(text, attribute) == (attribute in p.attributes), (p.asin, attribute)
        for _, values in ptype.options:
            for value in values:
                assert not mentions(text, value), (p.asin, value)


def test_within_a_type_no_attribute_or_option_value_fuzzily_matches_another():
    for ptype in PRODUCT_TYPES:
        for a, b in itertools.combinations(ptype.attributes, 2):
            assert token_set_ratio(a, b) <= 85, (ptype.name, a, b)
        values = [(name, v) for name, vs in ptype.options for v in vs]
        for (n1, v1), (n2, v2) in itertools.combinations(values, 2):
            assert v1 != v2
            if n1 not in EXACT_MATCH_OPTIONS or n2 not in EXACT_MATCH_OPTIONS:
                assert token_set_ratio(v1, v2) <= 85, (ptype.name, v1, v2)


def test_goals_follow_webshop_price_bounds_and_instruction_style(env):
    for t in env.tasks("test"):
        goal = env.goal(t)
        target = env.product(goal.asin)
        assert target.price < goal.price_upper <= target.price + 40
        assert goal.price_upper % 10 == 0
        assert goal.instruction.endswith(f", and price lower than {goal.price_upper:.2f} dollars")
        assert goal.type_name in goal.instruction
        assert all(a in goal.instruction for a in goal.attributes)
        assert all(v in goal.instruction for v in goal.option_values)
        assert [n for n, _ in goal.options] == [n for n, _ in target.options]
    import random
    rng = random.Random(0)
    assert {price_bound(rng, 23.5) for _ in range(50)} == {40.0, 50.0, 60.0}


def test_keywords_drop_the_lead_the_price_and_small_words():
    text = ("i am looking for a hair extension which is natural looking with color: auburn, and size: 18 inch, "
            "and price lower than 40.00 dollars")
    assert keywords(text) == "hair extension natural looking color auburn size 18 inch"


# ---- search

def test_search_finds_the_target_for_its_instruction(env):
    for t in env.tasks("test"):
        goal = env.goal(t)
        for query in (keywords(goal.instruction), goal.instruction):
            found = [p.asin for p in env.index.search(query)]
            assert goal.asin in found, (t, query)
            assert found.index(goal.asin) < 2 * PAGE_SIZE, (t, query)


def test_search_ranks_by_bm25_and_returns_at_most_fifty(env):
    hits = env.index.search("wireless earbuds noise cancelling")
    assert len(hits) == 50
    assert all(PRODUCT_TYPES[p.type_index].name == "wireless earbuds" for p in hits[:20])
    assert hits[0].attributes.count("noise cancelling") == 1
    assert env.index.search("!!!") == ()
    assert fts_query('the "quoted" women\'s (shoes) OR') == '"quoted" OR "women\'s" OR "shoes"'
    assert env.index.search("Wireless EARBUDS") == env.index.search("wireless earbuds")


def test_search_index_stems_words():
    index = SearchIndex([p for p in WebShopEnv(seed=0).products[:200]])
    assert index.search("lamps") == index.search("lamp")


# ---- pages and actions

def test_page_texts_follow_webshops_text_mode(env):
    episode = env.reset(0)
    goal = env.goal(0)
    head = f"Instruction: [SEP] {goal.instruction}"
    assert episode.observation == f"WebShop [SEP] {head} [SEP] Search"
    assert episode.instruction == INSTRUCTION

    query = keywords(goal.instruction)
    obs = episode.step(f"search[{query}]").observation
    hits = env.index.search(query)
    listed = " [SEP] ".join(f"{p.asin} [SEP] {p.title} [SEP] {p.price_text}" for p in hits[:10])
    assert obs == f"{head} [SEP] Back to Search [SEP] Page 1 (Total results: 50) [SEP] Next > [SEP] {listed}"
    assert re.search(r"\[SEP\] \$\d+\.\d\d", obs)
    actions = episode.available_actions()
    assert actions == ["click[back to search]", "click[next >]"] + [f"click[{p.asin.lower()}]" for p in hits[:10]]

    obs = episode.step("click[next >]").observation
    assert obs.startswith(f"{head} [SEP] Back to Search [SEP] Page 2 (Total results: 50) [SEP] < Prev [SEP] "
                          f"Next > [SEP] {hits[10].asin} [SEP] ")
    episode.step("click[< prev]")

    product = hits[0]
    obs = episode.step(f"click[{product.asin}]").observation   # upper case works as well
    options = "".join(f" [SEP] {name} [SEP] " + " [SEP] ".join(values) for name, values in product.options)
    assert obs == (f"{head} [SEP] Back to Search [SEP] < Prev{options} [SEP] {product.title} [SEP] "
                   f"Price: {product.price_text} [SEP] Rating: N.A. [SEP] Description [SEP] Features [SEP] "
                   "Reviews [SEP] Buy Now")
    values = [v for _, vs in product.options for v in vs]
    assert episode.available_actions() == (["click[back to search]", "click[< prev]"] + [f"click[{v}]" for v in values]
                                           + ["click[description]", "click[features]", "click[reviews]",
                                              "click[buy now]"])

    assert episode.step("click[Description]").observation == \
        f"{head} [SEP] Back to Search [SEP] < Prev [SEP] {product.description}"
    assert episode.available_actions() == ["click[back to search]", "click[< prev]"]
    episode.step("click[< prev]")
    assert episode.step("click[features]").observation == \
        f"{head} [SEP] Back to Search [SEP] < Prev [SEP] " + " [SEP] ".join(product.bullets)
    episode.step("click[< prev]")
    review = r" \[SEP\] [^[]+ \[SEP\] [1-5] \[SEP\] [^[]+"
    assert re.fullmatch(re.escape(f"{head} [SEP] Back to Search [SEP] < Prev") + f"({review})+",
                        episode.step("click[reviews]").observation)
    episode.step("click[< prev]")
    assert episode.step("click[< prev]").observation.startswith(f"{head} [SEP] Back to Search [SEP] Page 1 ")
    assert episode.step("click[back to search]").observation == f"WebShop [SEP] {head} [SEP] Search"


def test_buy_now_ends_the_episode_with_the_reward_on_a_done_page(env):
    goal = env.goal(3)
    episode = env.reset(3)
    trace, score, success = play_expert(env, 3)
    assert success and score == 1.0
    actions = [a for a, _ in trace]
    for a in actions:
        result = episode.step(a)
    target = env.product(actions[1][len("click["):-1].upper())
    chosen = {name: v for name, v in goal.options if v in [x for _, xs in target.options for x in xs]}
    assert result.observation == ("Thank you for shopping with us! [SEP] Purchased [SEP] asin [SEP] "
                                  f"{target.asin} [SEP] options [SEP] " + str(chosen).replace("'", '"')
                                  + " [SEP] Your score (min 0.0, max 1.0) [SEP] 1.0")
    assert episode.available_actions() == []
    after = episode.step("click[buy now]")
    assert after.done and not after.valid and after.reward == 0.0


def test_search_page_offers_a_bounded_set_of_searches_and_free_text_works(env):
    goal = env.goal(5)
    episode = env.reset(5)
    actions = episode.available_actions()
    assert 3 <= len(actions) <= 5 and all(a.startswith("search[") and a.endswith("]") for a in actions)
    assert actions[0] == f"search[{keywords(goal.instruction)}]"
    assert f"search[{goal.instruction.lower()}]" in actions
    assert f"search[{goal.type_name}]" in actions
    for action in actions:
        fresh = env.reset(5)
        assert fresh.step(action).valid
        assert fresh.page == "results" and fresh.results
    result = episode.step("search[something soft to sit on]")
    assert result.valid and "Page 1 (Total results: " in result.observation


def test_invalid_actions_say_so_change_nothing_and_never_raise(env):
    episode = env.reset(7)
    start = episode.observation
    for action in ("xyzzy plugh 42", "click[buy now]", "search[]", "search[!!!]", "buy[it]", "click[", "[x]"):
        result = episode.step(action)
        assert not result.valid and not result.done and result.reward == 0.0
        assert result.observation.startswith("Invalid action:") and result.observation.endswith(start)
    episode.step("search[desk lamp]")
    results = episode.observation
    result = episode.step("search[office chair]")   # only the search page has a search bar
    assert not result.valid and "search bar" in result.observation and result.observation.endswith(results)
    assert not episode.step("click[b000000000]").valid
    assert episode.step("click[Back To Search]").valid


def test_parse_action():
    assert parse_action("search[red shoes]") == ("search", "red shoes")
    assert parse_action(" Click [ Buy Now ] ") == ("click", "Buy Now")
    assert parse_action("click[a [b]]") == ("click", "a [b]")
    assert parse_action("buy now") is None and parse_action("jump[x]") is None and parse_action("[x]") is None


def test_invalid_actions_use_turns_of_the_session(env):
    manager = SessionManager({"webshop": env})
    reset = manager.reset("webshop", 0)
    assert reset.max_turns == 10 and reset.available_actions
    for _ in range(10):
        step = manager.step(reset.session_id, "click[nowhere]")
    assert (step.turn, step.done, step.success, step.valid, step.outcome) == (10, True, False, False, Outcome.TRUNCATED)


# ---- WebShop's reward on hand-worked cases

HAIR = PRODUCT_TYPES[0]
LIPSTICK = PRODUCT_TYPES[2]
NOUNS = frozenset({"hair", "extension", "lipstick", "velora", "kintex"})


def _product(**overrides) -> Product:
    fields = dict(
        asin="B000000001", type_index=0, category="beauty", query=HAIR.query, product_category=HAIR.path,
        brand="Velora", title="Velora Clip-In Hair Extension - Natural Looking, Heat Resistant",
        attributes=("natural looking", "heat resistant", "reusable"),
        bullets=("NATURAL LOOKING: designed with care", "HEAT RESISTANT: made for everyday use",
                 "REUSABLE: a favorite of our customers"),
        description="This clip-in hair extension from Velora is natural looking, heat resistant and reusable.",
        options=(("color", ("jet black", "auburn")), ("size", ("14 inch", "18 inch"))), price=25.99)
    fields.update(overrides)
    return Product(**fields)


def _goal(**overrides) -> Goal:
    fields = dict(asin="B000000001", query=HAIR.query, product_category=HAIR.path,
                  name="Velora Clip-In Hair Extension - Natural Looking, Heat Resistant", type_name="hair extension",
                  attributes=("natural looking", "heat resistant"), options=(("color", "auburn"), ("size", "18 inch")),
                  price_upper=40.0, instruction="i need a natural looking, heat resistant hair extension ...")
    fields.update(overrides)
    return Goal(**fields)


RIGHT = {"color": "auburn", "size": "18 inch"}


@pytest.mark.parametrize("product,goal,chosen,expected", [
    # (attributes + options + price) / (2 + 2 + 1), times the type reward
    (_product(), _goal(), RIGHT, 1.0),
    (_product(), _goal(), {"color": "jet black", "size": "18 inch"}, 4 / 5),       # wrong color
    (_product(), _goal(), {"color": "auburn", "size": "14 inch"}, 4 / 5),          # wrong size (exact match)
    (_product(), _goal(), {"color": "auburn"}, 4 / 5),                             # a goal option not chosen
    (_product(), _goal(), {}, 3 / 5),
    (_product(), _goal(price_upper=20.0), RIGHT, 4 / 5),                           # price too high
    (_product(price=40.0), _goal(), RIGHT, 1.0),                                   # "lower than" is <=, as WebShop
    (_product(), _goal(attributes=("natural looking", "tangle free")), RIGHT, 4 / 5),  # an attribute missing
    # An attribute named in the description counts although it is not in the attribute list.
    (_product(description="Tangle free and soft."), _goal(attributes=("natural looking", "tangle free")), RIGHT, 1.0),
    # Another brand of the same type: query and category match, title nouns 2/3.
    (_product(brand="Kintex", title="Kintex Seamless Hair Extension - Natural Looking, Heat Resistant"), _goal(),
     RIGHT, 1.0),
    # A lipstick with the hair extension's attributes and options is the wrong type: no shared noun.
    (_product(query=LIPSTICK.query, product_category=LIPSTICK.path, brand="Kintex",
              title="Kintex Matte Lipstick - Natural Looking, Heat Resistant"), _goal(), RIGHT, 0.0),
    # A goal without options: (attributes + price) / (2 + 1).
    (_product(options=()), _goal(options=()), {}, 1.0),
    (_product(options=()), _goal(options=(), price_upper=20.0), {}, 2 / 3),
])
def test_reward_on_hand_worked_cases(product, goal, chosen, expected):
    assert reward(product, goal, chosen, NOUNS) == pytest.approx(expected)
    assert (reward(product, goal, chosen, NOUNS) == 1.0) == (expected == 1.0)


def test_token_set_ratio_behaves_like_thefuzz():
    assert token_set_ratio("natural looking", "natural looking") == 100
    assert token_set_ratio("Navy Blue", "blue") == 100   # a subset of tokens matches fully
    assert token_set_ratio("black", "white") < 50
    assert token_set_ratio("12 pack", "10 pack") > 85     # why numeric options are "size" (exact match)


def test_wrong_options_never_score_one_on_any_test_target(env):
    for t in env.tasks("test"):
        goal = env.goal(t)
        target = env.product(goal.asin)
        right = dict(goal.options)
        assert reward(target, goal, right, env.nouns) == 1.0
        for name, values in target.options:
            for v in values:
                if v != right[name]:
                    assert reward(target, goal, {**right, name: v}, env.nouns) < 1.0, (t, name, v)


# ---- the expert

def test_expert_solves_every_test_task_with_reward_one_within_ten_turns(env):
    failed = []
    for t in env.tasks("test"):
        trace, score, success = play_expert(env, t)
        assert len(trace) <= env.max_turns
        assert success == (score == 1.0)
        if not success:
            failed.append(t)
    assert not failed


def test_expert_solves_sampled_training_tasks(env):
    train = env.tasks("train")
    assert all(play_expert(env, t)[2] for t in train[::40])


def test_expert_recovers_after_a_wrong_product_and_option(env):
    for t in range(10):
        goal = env.goal(t)
        episode = env.reset(t)
        episode.step(f"search[{goal.type_name}]")
        wrong = next(p for p in episode.results[:PAGE_SIZE] if episode.plan(p) is None)
        episode.step(f"click[{wrong.asin}]")
        turns = 2
        if wrong.options:
            episode.step(f"click[{wrong.options[0][1][0]}]")
            turns += 1
        while True:
            result = episode.step(episode.expert_action())
            turns += 1
            assert result.valid
            if result.done:
                break
        assert result.success and turns <= env.max_turns, (t, turns)
