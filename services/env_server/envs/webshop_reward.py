"""WebShop's reward (see webshop.py), as princeton-nlp/WebShop's get_reward computes it: how well a purchase
matches a goal's type, attributes, options and price, from 0 to 1."""

from __future__ import annotations

import difflib

from .webshop_catalog import EXACT_MATCH_OPTIONS, Goal, Product, mentions, words

FUZZY_THRESHOLD = 85          # WebShop: token_set_ratio(...) > 85


def token_set_ratio(a: str, b: str) -> int:
    """thefuzz's token_set_ratio (0..100), with difflib's ratio in place of python-Levenshtein's.

    Sorted common tokens, then each side's remaining tokens appended; the best ratio of the three
    pairs. A phrase whose tokens are a subset of the other's scores 100.
    """
    ta, tb = set(a.lower().split()), set(b.lower().split())
    common = " ".join(sorted(ta & tb))
    sa = (common + " " + " ".join(sorted(ta - tb))).strip()
    sb = (common + " " + " ".join(sorted(tb - ta))).strip()
    pairs = [(sa, sb)] + ([(common, sa), (common, sb)] if common else [])
    return round(100 * max(difflib.SequenceMatcher(None, x, y).ratio() for x, y in pairs))


def _product_text(product: Product) -> str:
    return " ".join([product.title, " ".join(product.bullets), product.description])


def _category_levels(path: str) -> set[str]:
    return {level.strip() for level in path.split("›")}


def type_reward(product: Product, goal: Goal, nouns: frozenset[str]) -> float:
    """WebShop's r_type: 1 when query, category path (2 levels) or title nouns (> 0.2) agree."""
    query_match = product.query == goal.query
    category_match = len(_category_levels(product.product_category) & _category_levels(goal.product_category)) >= 2
    desired = {w for w in words(goal.name) if w in nouns}
    purchased = {w for w in words(product.title) if w in nouns}
    title_score = len(desired & purchased) / len(desired) if desired else 0.2
    r_type = 1.0 if (query_match or category_match or title_score > 0.2) else 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return r_type


def attribute_matches(product: Product, goal: Goal) -> int:
    """Goal attributes the product has: a fuzzy match of its attributes, else named in its text."""
    text = _product_text(product)
    n = 0
    for g in goal.attributes:
        if any(token_set_ratio(p, g) > FUZZY_THRESHOLD for p in product.attributes) or mentions(text, g):
            n += 1
    return n


def option_matches(product: Product, goal: Goal, chosen: dict[str, str]) -> int:
    """Chosen options that a goal option asks for (size exactly, others fuzzily), else named in the text."""
    goal_values = goal.option_values
    text = _product_text(product)
    n = 0
    for name, value in chosen.items():
        if name.lower() in EXACT_MATCH_OPTIONS:
            matched = value in goal_values
        else:
            matched = any(token_set_ratio(g, value) > FUZZY_THRESHOLD for g in goal_values)
        if matched or mentions(text, value):
            n += 1
    return min(n, len(goal_values))


def reward(product: Product, goal: Goal, chosen: dict[str, str], nouns: frozenset[str]) -> float:
    """WebShop's get_reward: (attribute matches + option matches + price ok) / (#attributes + #options + 1),
    times the type reward. 1 only when every part matches."""
    r_price = 1 if product.price <= goal.price_upper else 0
    total = (attribute_matches(product, goal) + option_matches(product, goal, chosen) + r_price) / (
        len(goal.attributes) + len(goal.options) + 1)
    return total * type_reward(product, goal, nouns)

