"""The generated WebShop catalogue: product types, products and shopping goals, all from a seed.

WebShop (princeton-nlp/WebShop) scraped 1.18M Amazon products; AgentGym serves its 1,000-product
subset. This catalogue is generated instead (no downloads): 50 product types over WebShop's five
categories (beauty, food, fashion, furniture, electronics), 30 products per type. A product has
what WebShop's reward reads: an ASIN, a title, the category query it was "scraped" under, an Amazon
style category path ("A › B › C"), attributes, bullet points (Features), a description, options
(name -> values, such as color and size) and one price.

Text is generated so that WebShop's text-matching reward means what it says: a product's title,
features and description mention its own attributes and none of its option values, and within a
product type no two attributes and no two option values are fuzzy matches of each other (so that
a wrong option never scores as a right one); tests/test_env_webshop.py checks both.

A goal is built from a target product as WebShop builds its synthetic goals: some of the target's
attributes, one value of each of its options, and a price bound drawn from the next multiples of
10 dollars above its price ("..., and price lower than 40.00 dollars").

The product types are the table in webshop_types.py.
"""

from __future__ import annotations

import dataclasses
import random
import re

from .webshop_types import PRODUCT_TYPES, ProductType

PRODUCTS_PER_TYPE = 30
# WebShop's goal price bounds: multiples of 10 dollars (goal.py PRICE_RANGE).
PRICE_STEPS = tuple(10.0 * i for i in range(1, 100))
# Option names WebShop matches exactly; other options match fuzzily (goal.py EXACT_MATCH_OPTS).
EXACT_MATCH_OPTIONS = ("size",)

_SYLLABLES = ("ve", "lo", "ra", "ki", "tex", "mo", "na", "zu", "pri", "sol", "da", "ne", "vio", "ar", "bel",
              "co", "fi", "gra", "hu", "lu", "mar", "ost", "qui", "ren", "sy", "tor", "ul", "wen", "xa", "yo")
FILLER_SENTENCES = (
    "Designed with care for everyday use.",
    "Every order is inspected before it ships.",
    "A thoughtful gift for friends and family.",
    "Backed by our friendly customer support.",
    "Loved by thousands of happy customers.",
    "Made to the standards our customers expect.",
)
FEATURE_TAILS = (
    "made for everyday use", "quality you can see and feel", "a favorite of our customers",
    "carefully checked before shipping", "designed with care",
)


@dataclasses.dataclass(frozen=True)
class Product:
    asin: str
    type_index: int
    category: str
    query: str
    product_category: str
    brand: str
    title: str
    attributes: tuple[str, ...]
    bullets: tuple[str, ...]
    description: str
    options: tuple[tuple[str, tuple[str, ...]], ...]   # (name, values), in display order
    price: float

    @property
    def option_names(self) -> dict[str, str]:
        """Option value -> option name (values are unique within a product)."""
        return {v: name for name, values in self.options for v in values}

    @property
    def price_text(self) -> str:
        return f"${self.price:.2f}"


@dataclasses.dataclass(frozen=True)
class Goal:
    asin: str                           # the target product
    query: str
    product_category: str
    name: str                           # the target's title (WebShop's goal "name")
    type_name: str
    attributes: tuple[str, ...]
    options: tuple[tuple[str, str], ...]  # (option name, value) of the target, one per option
    price_upper: float
    instruction: str

    @property
    def option_values(self) -> list[str]:
        return [v for _, v in self.options]


def _brand_names(rng: random.Random, n: int) -> list[str]:
    names: set[str] = set()
    while len(names) < n:
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((2, 2, 3))))
        if 4 <= len(word) <= 9:
            names.add(word.capitalize())
    return sorted(names)


def _asin(rng: random.Random, taken: set[str]) -> str:
    alphabet = "ABCDEFGHJKLMNPQRSTUVWXYZ0123456789"
    while True:
        asin = "B0" + "".join(rng.choice(alphabet) for _ in range(8))
        if asin not in taken:
            taken.add(asin)
            return asin


def _title_case(phrase: str) -> str:
    return " ".join(w if w[:1].isdigit() else w[:1].upper() + w[1:] for w in phrase.split())


def _make_product(rng: random.Random, type_index: int, ptype: ProductType, brand: str, asin: str) -> Product:
    attributes = tuple(rng.sample(ptype.attributes, rng.randint(3, min(4, len(ptype.attributes)))))
    options = []
    for name, pool in ptype.options:
        k = rng.randint(min(2, len(pool)), len(pool))
        chosen = set(rng.sample(pool, k))
        options.append((name, tuple(v for v in pool if v in chosen)))
    modifier = rng.choice(ptype.modifiers)
    shown = rng.sample(attributes, 2)
    title = f"{brand} {_title_case(modifier)} {_title_case(ptype.name)} - {', '.join(_title_case(a) for a in shown)}"
    tails = rng.sample(FEATURE_TAILS, len(attributes))
    bullets = tuple(f"{a.upper()}: {tail}" for a, tail in zip(attributes, tails))
    listed = ", ".join(attributes[:-1]) + f" and {attributes[-1]}"
    description = (f"This {modifier} {ptype.name} from {brand} is {listed}. "
                   + " ".join(rng.sample(FILLER_SENTENCES, 2)))
    lo, hi = ptype.price
    price = round(rng.uniform(lo, hi)) - 0.01 if rng.random() < 0.7 else round(rng.uniform(lo, hi), 2)
    return Product(asin, type_index, ptype.category, ptype.query, ptype.path, brand, title, attributes,
                   bullets, description, tuple(options), max(price, 1.99))


def build_products(seed: int, per_type: int = PRODUCTS_PER_TYPE) -> list[Product]:
    """The catalogue: per_type products of every product type, deterministic in seed."""
    rng = random.Random(f"webshop-catalogue:{seed}")
    brands = _brand_names(rng, 150)
    taken: set[str] = set()
    products = []
    for ti, ptype in enumerate(PRODUCT_TYPES):
        for brand in rng.sample(brands, per_type):
            products.append(_make_product(rng, ti, ptype, brand, _asin(rng, taken)))
    rng.shuffle(products)
    return products


# ---- goals and instructions

_LEADS = ("i need", "i am looking for", "i want", "find me", "i'm searching for", "i would like", "get me",
          "i'm looking for")


def price_bound(rng: random.Random, price: float) -> float:
    """WebShop's goal price: of the next four multiples of 10 above the price, the larger of two drawn."""
    above = [p for p in PRICE_STEPS if p > price][:4]
    if len(above) < 2:
        return 1_000_000.0
    return max(rng.sample(above, 2))


def _join(words: list[str]) -> str:
    if len(words) == 1:
        return words[0]
    return ", ".join(words[:-1]) + f" and {words[-1]}"


def _verb(ptype: ProductType) -> str:
    return "are" if ptype.name.endswith("s") else "is"


def instruction_text(rng: random.Random, ptype: ProductType, attributes: list[str],
                     options: list[tuple[str, str]], price_upper: float) -> str:
    """One shopping instruction, in the styles of WebShop's human and synthetic goals."""
    lead = rng.choice(_LEADS)
    art = f"{ptype.article} " if ptype.article else ""
    style = rng.randrange(4)
    if style == 0:    # "i need a long lasting, waterproof lipstick"
        body = f"{lead} {art}{', '.join(attributes)} {ptype.name}"
    elif style == 1:  # "i want a lipstick that is long lasting and waterproof"
        body = f"{lead} {art}{ptype.name} that {_verb(ptype)} {_join(attributes)}"
    elif style == 2:  # "find me a lipstick which is long lasting, waterproof"
        body = f"{lead} {art}{ptype.name} which {_verb(ptype)} {', '.join(attributes)}"
    else:             # "i'm looking for a lipstick, long lasting and waterproof"
        body = f"{lead} {art}{ptype.name}, {_join(attributes)}"
    if options:
        if rng.random() < 0.6:
            body += " with " + ", and ".join(f"{name}: {value}" for name, value in options)
        else:
            body += " in " + " and ".join(f"{name} {value}" for name, value in options)
    if price_upper < 1_000_000:
        body += f", and price lower than {price_upper:.2f} dollars"
    return body


def make_goal(rng: random.Random, product: Product) -> Goal:
    ptype = PRODUCT_TYPES[product.type_index]
    attributes = rng.sample(product.attributes, rng.randint(1, min(3, len(product.attributes))))
    options = [(name, rng.choice(values)) for name, values in product.options]
    upper = price_bound(rng, product.price)
    text = instruction_text(rng, ptype, attributes, options, upper)
    return Goal(product.asin, product.query, product.product_category, product.title, ptype.name,
                tuple(attributes), tuple(options), upper, text)


# ---- words

_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
STOPWORDS = frozenset("a an the i i'm me my am is are be that which with and or of in on for to it its".split())
_LEAD = re.compile(r"^\s*(?:" + "|".join(re.escape(lead) for lead in sorted(_LEADS, key=len, reverse=True)) + r")\b")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def keywords(instruction: str) -> str:
    """An instruction's key words: the words left after the price clause and small words are removed."""
    text = _LEAD.sub("", instruction.lower())
    text = re.sub(r",?\s*and price lower than [\d.]+ dollars", "", text)
    return " ".join(w for w in words(text) if w not in STOPWORDS)


def mentions(text: str, phrase: str) -> bool:
    """Whether text contains phrase as whole words (case-insensitive)."""
    return re.search(r"(?<![a-z0-9])" + re.escape(phrase.lower()) + r"(?![a-z0-9])", text.lower()) is not None
