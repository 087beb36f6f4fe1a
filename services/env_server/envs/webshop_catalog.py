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
"""

from __future__ import annotations

import dataclasses
import random
import re

CATEGORIES = ("beauty", "food", "fashion", "furniture", "electronics")
PRODUCTS_PER_TYPE = 30
# WebShop's goal price bounds: multiples of 10 dollars (goal.py PRICE_RANGE).
PRICE_STEPS = tuple(10.0 * i for i in range(1, 100))
# Option names WebShop matches exactly; other options match fuzzily (goal.py EXACT_MATCH_OPTS).
EXACT_MATCH_OPTIONS = ("size",)

APPAREL_SIZES = ("small", "medium", "large", "x-large", "xx-large")
SHOE_SIZES = ("6", "7", "8", "9", "10")


@dataclasses.dataclass(frozen=True)
class ProductType:
    category: str
    name: str              # noun phrase, as titles and instructions write it
    article: str           # "a", "an" or "" (plural names)
    query: str             # WebShop's "query": the search the product was collected under
    path: str              # WebShop's "product_category"
    modifiers: tuple[str, ...]
    attributes: tuple[str, ...]
    options: tuple[tuple[str, tuple[str, ...]], ...]
    price: tuple[float, float]


def _t(category, name, article, query, path, modifiers, attributes, options, price) -> ProductType:
    return ProductType(category, name, article, query, path, tuple(modifiers), tuple(attributes),
                       tuple((k, tuple(v)) for k, v in options.items()), price)


_B, _G, _C, _H, _E = ("Beauty & Personal Care", "Grocery & Gourmet Food", "Clothing, Shoes & Jewelry",
                      "Home & Kitchen", "Electronics")

PRODUCT_TYPES: tuple[ProductType, ...] = (
    # ---- beauty
    _t("beauty", "hair extension", "a", "hair extensions",
       f"{_B} › Hair Care › Hair Extensions, Wigs & Accessories › Hair Extensions",
       ["clip-in", "human hair", "seamless", "thick"],
       ["natural looking", "easy to apply", "heat resistant", "tangle free", "long lasting", "reusable"],
       {"color": ["jet black", "dark brown", "auburn", "ash blonde", "platinum", "chestnut"],
        "size": ["14 inch", "18 inch", "22 inch"]}, (15, 80)),
    _t("beauty", "shampoo", "a", "shampoo", f"{_B} › Hair Care › Shampoo & Conditioner › Shampoos",
       ["moisturizing", "clarifying", "volumizing", "repairing"],
       ["sulfate free", "paraben free", "cruelty free", "color safe", "natural ingredients", "anti frizz"],
       {"scent": ["lavender", "coconut", "tea tree", "argan", "eucalyptus", "unscented"],
        "size": ["8.5 fl oz", "16.9 fl oz", "33.8 fl oz"]}, (6, 35)),
    _t("beauty", "lipstick", "a", "lipstick", f"{_B} › Makeup › Lips › Lipstick",
       ["matte", "satin", "creamy"],
       ["long lasting", "waterproof", "cruelty free", "highly pigmented", "vegan", "smudge proof"],
       {"color": ["ruby", "nude", "coral", "plum", "mauve", "berry", "crimson"]}, (5, 30)),
    _t("beauty", "face moisturizer", "a", "face moisturizer",
       f"{_B} › Skin Care › Face › Creams & Moisturizers",
       ["daily", "hydrating", "overnight"],
       ["oil free", "fragrance free", "for sensitive skin", "non comedogenic", "anti aging", "hyaluronic acid"],
       {"size": ["1.7 fl oz", "3.4 fl oz", "6.7 fl oz"]}, (10, 60)),
    _t("beauty", "nail polish", "a", "nail polish",
       f"{_B} › Foot, Hand & Nail Care › Nail Art & Polish › Nail Polish",
       ["gel", "glossy", "shimmer"],
       ["non toxic", "quick drying", "chip resistant", "long lasting", "vegan", "easy to remove"],
       {"color": ["cherry", "lilac", "navy", "nude", "emerald", "gold"],
        "size": ["pack of 2", "pack of 4", "pack of 6"]}, (4, 25)),
    _t("beauty", "perfume", "a", "perfume for women", f"{_B} › Fragrance › Women's › Eau de Parfum",
       ["eau de parfum", "floral", "fresh"],
       ["long lasting", "alcohol free", "cruelty free", "natural ingredients", "hypoallergenic"],
       {"scent": ["jasmine", "sandalwood", "citrus", "amber", "vanilla", "rose"],
        "size": ["1.7 fl oz", "3.4 fl oz"]}, (20, 95)),
    _t("beauty", "makeup brush set", "a", "makeup brushes",
       f"{_B} › Tools & Accessories › Makeup Brushes & Tools › Brush Sets",
       ["professional", "synthetic", "travel"],
       ["cruelty free", "easy to clean", "soft bristles", "portable", "high quality", "with storage case"],
       {"color": ["black", "rose", "champagne", "silver", "lavender"]}, (8, 40)),
    _t("beauty", "body lotion", "a", "body lotion", f"{_B} › Skin Care › Body › Moisturizers › Lotions",
       ["whipped", "daily", "shea"],
       ["fast absorbing", "paraben free", "for dry skin", "non greasy", "natural ingredients",
        "dermatologist tested"],
       {"scent": ["cocoa butter", "lavender", "unscented", "almond", "oatmeal"],
        "size": ["8 fl oz", "16 fl oz", "32 fl oz"]}, (5, 30)),
    _t("beauty", "beard oil", "a", "beard oil",
       f"{_B} › Shaving & Hair Removal › Men's › Beard & Mustache Care › Oils",
       ["conditioning", "organic", "premium"],
       ["non greasy", "natural ingredients", "softens hair", "promotes growth", "alcohol free"],
       {"scent": ["sandalwood", "cedarwood", "bergamot", "unscented", "pine"],
        "size": ["1 fl oz", "2 fl oz", "4 fl oz"]}, (8, 30)),
    _t("beauty", "hair dryer", "a", "hair dryer",
       f"{_B} › Hair Care › Styling Tools & Appliances › Hair Dryers & Accessories › Hair Dryers",
       ["ionic", "compact", "salon"],
       ["fast drying", "low noise", "lightweight", "foldable handle", "with diffuser", "cool shot button"],
       {"color": ["black", "white", "pink", "purple", "teal"]}, (20, 120)),
    # ---- food
    _t("food", "protein bar", "a", "protein bars", f"{_G} › Snacks & Sweets › Bars › Protein Bars",
       ["chewy", "crunchy", "layered"],
       ["gluten free", "low sugar", "keto friendly", "non gmo", "high protein", "plant based"],
       {"flavor": ["chocolate chip", "peanut butter", "cookie dough", "salted caramel", "blueberry"],
        "size": ["pack of 12", "pack of 24"]}, (12, 45)),
    _t("food", "ground coffee", "", "ground coffee",
       f"{_G} › Beverages › Coffee, Tea & Cocoa › Coffee › Ground Coffee",
       ["arabica", "single origin", "artisan"],
       ["organic", "fair trade", "low acid", "non gmo", "kosher", "smooth taste"],
       {"flavor": ["french vanilla", "hazelnut", "mocha", "original", "caramel"],
        "size": ["12 ounce", "24 ounce", "32 ounce"]}, (8, 35)),
    _t("food", "green tea", "", "green tea", f"{_G} › Beverages › Coffee, Tea & Cocoa › Tea › Green",
       ["loose leaf", "japanese", "premium"],
       ["organic", "decaffeinated", "antioxidant rich", "non gmo", "kosher", "sugar free"],
       {"flavor": ["jasmine", "mint", "lemon", "ginger", "matcha", "peach"],
        "size": ["20 count", "50 count", "100 count"]}, (5, 25)),
    _t("food", "trail mix", "", "trail mix", f"{_G} › Snacks & Sweets › Snack Foods › Trail Mix",
       ["roasted", "deluxe", "energy"],
       ["gluten free", "low sodium", "vegan", "non gmo", "high fiber", "resealable bag"],
       {"flavor": ["sweet and salty", "tropical", "dark chocolate", "honey roasted", "cranberry"],
        "size": ["8 ounce", "16 ounce", "26 ounce"]}, (6, 30)),
    _t("food", "olive oil", "", "olive oil",
       f"{_G} › Pantry Staples › Cooking & Baking › Oils, Vinegars & Salad Dressings › Oils › Olive",
       ["extra virgin", "italian", "greek", "spanish"],
       ["cold pressed", "organic", "non gmo", "kosher", "first harvest", "dark glass bottle"],
       {"flavor": ["garlic", "basil", "lemon", "plain", "chili"],
        "size": ["16.9 fl oz", "33.8 fl oz", "68 fl oz"]}, (8, 40)),
    _t("food", "raw honey", "", "raw honey",
       f"{_G} › Pantry Staples › Jams, Jellies & Sweet Spreads › Honey",
       ["pure", "unfiltered", "local"],
       ["organic", "non gmo", "kosher", "gluten free", "unpasteurized"],
       {"flavor": ["wildflower", "clover", "manuka", "orange blossom", "buckwheat"],
        "size": ["12 ounce", "16 ounce", "32 ounce"]}, (6, 40)),
    _t("food", "pasta", "", "pasta", f"{_G} › Pantry Staples › Pasta & Noodles › Pasta",
       ["italian", "artisan", "bronze cut"],
       ["gluten free", "high protein", "organic", "non gmo", "whole grain", "low carb"],
       {"style": ["penne", "spaghetti", "fusilli", "rigatoni", "elbow"],
        "size": ["pack of 4", "pack of 6", "pack of 12"]}, (5, 30)),
    _t("food", "chocolate bar", "a", "dark chocolate bars",
       f"{_G} › Snacks & Sweets › Candy & Chocolate › Chocolate › Chocolate Bars",
       ["premium", "belgian", "swiss"],
       ["sugar free", "vegan", "fair trade", "gluten free", "non gmo", "keto friendly"],
       {"flavor": ["sea salt", "almond", "orange", "raspberry", "espresso"],
        "size": ["pack of 3", "pack of 6", "pack of 12"]}, (6, 35)),
    _t("food", "beef jerky", "", "beef jerky", f"{_G} › Snacks & Sweets › Snack Foods › Jerky & Dried Meats › Beef",
       ["smoked", "thick cut", "tender"],
       ["high protein", "low fat", "gluten free", "no preservatives", "grass fed", "low sodium"],
       {"flavor": ["teriyaki", "peppered", "sweet and spicy", "original", "hickory"],
        "size": ["3 ounce", "8 ounce", "16 ounce"]}, (8, 40)),
    _t("food", "sparkling water", "", "sparkling water",
       f"{_G} › Beverages › Bottled Beverages, Water & Drink Mixes › Water › Sparkling Water",
       ["crisp", "refreshing", "classic"],
       ["zero calories", "sugar free", "caffeine free", "non gmo", "kosher", "naturally flavored"],
       {"flavor": ["lime", "grapefruit", "black cherry", "watermelon", "lemon", "mango"],
        "size": ["pack of 8", "pack of 12", "pack of 24"]}, (5, 30)),
    # ---- fashion
    _t("fashion", "women's running shoes", "", "women's running shoes",
       f"{_C} › Women › Shoes › Athletic › Running",
       ["mesh", "athletic", "trail"],
       ["lightweight", "breathable", "non slip", "arch support", "memory foam", "rubber sole"],
       {"color": ["black", "white", "navy", "grey", "pink", "coral"], "size": SHOE_SIZES}, (25, 110)),
    _t("fashion", "men's dress shirt", "a", "men's dress shirts", f"{_C} › Men › Clothing › Shirts › Dress Shirts",
       ["button down", "classic", "formal"],
       ["slim fit", "wrinkle free", "machine wash", "stretch fabric", "moisture wicking", "long sleeve"],
       {"color": ["white", "light blue", "pink", "lavender", "black", "grey"], "size": APPAREL_SIZES}, (15, 60)),
    _t("fashion", "yoga pants", "", "women's yoga pants",
       f"{_C} › Women › Clothing › Active › Active Pants › Leggings",
       ["seamless", "workout", "athletic"],
       ["high waist", "tummy control", "moisture wicking", "squat proof", "four way stretch", "side pockets"],
       {"color": ["black", "navy", "olive", "burgundy", "charcoal", "teal"],
        "size": ("x-small",) + APPAREL_SIZES[:4]}, (15, 50)),
    _t("fashion", "men's hoodie", "a", "men's hoodies", f"{_C} › Men › Clothing › Fashion Hoodies & Sweatshirts",
       ["pullover", "zip up", "fleece"],
       ["machine wash", "relaxed fit", "kangaroo pocket", "midweight", "drawstring hood", "cotton blend"],
       {"color": ["black", "heather grey", "navy", "forest green", "maroon", "sand"], "size": APPAREL_SIZES},
       (20, 60)),
    _t("fashion", "summer dress", "a", "women's summer dresses", f"{_C} › Women › Clothing › Dresses › Casual",
       ["boho", "flowy", "casual"],
       ["short sleeve", "v neck", "with pockets", "elastic waist", "machine wash", "lightweight"],
       {"color": ["black", "white", "yellow", "sage", "dusty blue", "red"],
        "size": ("x-small",) + APPAREL_SIZES[:4]}, (18, 55)),
    _t("fashion", "men's jeans", "", "men's jeans", f"{_C} › Men › Clothing › Jeans",
       ["classic", "five pocket", "everyday"],
       ["straight leg", "relaxed fit", "stretch denim", "machine wash", "button fly"],
       {"color": ["dark wash", "light wash", "black", "medium wash", "stone"],
        "size": ["30w x 30l", "32w x 30l", "32w x 32l", "34w x 32l", "36w x 32l"]}, (20, 70)),
    _t("fashion", "flat sandals", "", "women's flat sandals", f"{_C} › Women › Shoes › Sandals › Flat Sandals",
       ["strappy", "slide", "beach"],
       ["arch support", "open toe", "non slip", "adjustable strap", "cushioned footbed", "rubber sole"],
       {"color": ["tan", "black", "white", "gold", "brown", "silver"], "size": SHOE_SIZES}, (15, 60)),
    _t("fashion", "baseball cap", "a", "baseball caps", f"{_C} › Men › Accessories › Hats & Caps › Baseball Caps",
       ["classic", "vintage", "low profile"],
       ["adjustable", "breathable", "washed cotton", "sun protection", "unisex", "quick dry"],
       {"color": ["black", "navy", "khaki", "red", "olive", "white"]}, (8, 30)),
    _t("fashion", "wool socks", "", "wool socks", f"{_C} › Men › Clothing › Socks › Casual",
       ["hiking", "thermal", "crew"],
       ["moisture wicking", "cushioned", "odor resistant", "warm", "breathable"],
       {"color": ["grey", "brown", "charcoal", "navy", "oatmeal"], "size": ["small", "medium", "large"]},
       (10, 35)),
    _t("fashion", "wallet", "a", "men's wallets",
       f"{_C} › Men › Accessories › Wallets, Card Cases & Money Organizers › Wallets",
       ["bifold", "trifold", "minimalist"],
       ["rfid blocking", "genuine leather", "slim design", "gift box", "multiple card slots", "id window"],
       {"color": ["black", "brown", "tan", "navy", "cognac"]}, (12, 60)),
    # ---- furniture
    _t("furniture", "office chair", "an", "office chair",
       f"{_H} › Furniture › Home Office Furniture › Home Office Chairs › Desk Chairs",
       ["mesh", "executive", "swivel"],
       ["lumbar support", "adjustable height", "ergonomic design", "easy assembly", "padded armrests", "high back"],
       {"color": ["black", "grey", "white", "blue", "pink"]}, (60, 250)),
    _t("furniture", "coffee table", "a", "coffee table",
       f"{_H} › Furniture › Living Room Furniture › Tables › Coffee Tables",
       ["round", "rectangular", "lift top"],
       ["easy assembly", "storage shelf", "solid wood", "scratch resistant", "space saving"],
       {"color": ["walnut", "oak", "white", "black", "espresso"]}, (50, 220)),
    _t("furniture", "bookshelf", "a", "bookshelf", f"{_H} › Furniture › Living Room Furniture › Bookcases",
       ["ladder", "cube", "corner"],
       ["easy assembly", "sturdy frame", "anti tip", "adjustable shelves", "space saving"],
       {"color": ["rustic brown", "white", "black", "natural", "grey"], "size": ["3 tier", "4 tier", "5 tier"]},
       (40, 180)),
    _t("furniture", "throw pillow covers", "", "throw pillow covers",
       f"{_H} › Bedding › Decorative Pillows, Inserts & Covers › Throw Pillow Covers",
       ["decorative", "boho", "farmhouse"],
       ["machine washable", "hidden zipper", "double sided", "soft fabric", "fade resistant"],
       {"color": ["sage", "cream", "rust", "navy", "blush", "mustard"],
        "size": ["18 x 18 inch", "20 x 20 inch", "24 x 24 inch"]}, (10, 40)),
    _t("furniture", "bed sheet set", "a", "bed sheets",
       f"{_H} › Bedding › Sheets & Pillowcases › Sheet & Pillowcase Sets",
       ["hotel", "brushed", "classic"],
       ["deep pocket", "breathable", "wrinkle resistant", "hypoallergenic", "machine washable", "cooling"],
       {"color": ["white", "light grey", "navy", "sage green", "ivory", "taupe"],
        "size": ["twin", "full", "queen", "king"]}, (20, 90)),
    _t("furniture", "area rug", "an", "area rug", f"{_H} › Home Décor Products › Area Rugs, Runners & Pads › Area Rugs",
       ["shag", "vintage", "geometric"],
       ["non slip", "machine washable", "stain resistant", "low pile", "non shedding", "easy to clean"],
       {"color": ["grey", "beige", "blue", "multicolor", "ivory", "terracotta"], "size": ["3x5", "5x7", "8x10"]},
       (30, 200)),
    _t("furniture", "floor lamp", "a", "floor lamp", f"{_H} › Lighting & Ceiling Fans › Lamps & Shades › Floor Lamps",
       ["arc", "tripod", "torchiere"],
       ["dimmable", "energy efficient", "foot switch", "easy assembly", "adjustable head", "remote control"],
       {"color": ["black", "brass", "white", "nickel", "bronze"]}, (30, 160)),
    _t("furniture", "dining chairs", "", "dining chairs",
       f"{_H} › Furniture › Kitchen & Dining Room Furniture › Chairs",
       ["upholstered", "mid century", "armless"],
       ["easy assembly", "padded seat", "sturdy frame", "solid wood legs", "easy to clean"],
       {"color": ["grey", "beige", "green", "black", "cognac"], "size": ["set of 2", "set of 4", "set of 6"]},
       (70, 300)),
    _t("furniture", "shower curtain", "a", "shower curtain",
       f"{_H} › Bath › Shower Curtains, Hooks & Liners › Shower Curtains",
       ["fabric", "waffle", "textured"],
       ["waterproof", "machine washable", "mildew resistant", "hooks included", "weighted hem", "quick drying"],
       {"color": ["white", "grey", "navy", "sage", "blush"], "size": ["72 x 72 inch", "72 x 84 inch"]}, (10, 45)),
    _t("furniture", "storage basket", "a", "storage baskets",
       f"{_H} › Storage & Organization › Baskets, Bins & Containers › Storage Baskets",
       ["woven", "rope", "fabric"],
       ["foldable", "sturdy handles", "lightweight", "easy to clean", "large capacity"],
       {"color": ["natural", "grey", "white", "black", "brown"], "size": ["set of 2", "set of 3", "set of 4"]},
       (12, 50)),
    # ---- electronics
    _t("electronics", "wireless earbuds", "", "wireless earbuds",
       f"{_E} › Headphones, Earbuds & Accessories › Headphones & Earbuds › Earbud Headphones",
       ["bluetooth", "true wireless", "sport"],
       ["noise cancelling", "long battery life", "water resistant", "fast charging", "built in microphone",
        "touch control"],
       {"color": ["black", "white", "navy", "rose", "graphite"]}, (20, 150)),
    _t("electronics", "phone case", "a", "phone case",
       "Cell Phones & Accessories › Cases, Holsters & Sleeves › Basic Cases",
       ["slim", "rugged", "hybrid"],
       ["shockproof", "wireless charging compatible", "raised edges", "anti scratch", "drop protection",
        "card holder"],
       {"color": ["black", "clear", "purple", "midnight green", "red"],
        "size": ["iphone 13", "iphone 14", "iphone 15", "galaxy s23"]}, (8, 35)),
    _t("electronics", "usb c charger", "a", "usb c charger",
       f"{_E} › Computers & Accessories › Laptop Accessories › Chargers & Adapters",
       ["fast", "compact", "dual port"],
       ["fast charging", "foldable plug", "overheat protection", "travel friendly", "gan technology",
        "universal compatibility"],
       {"color": ["white", "black", "grey"], "size": ["20w", "30w", "65w", "100w"]}, (10, 60)),
    _t("electronics", "bluetooth speaker", "a", "portable bluetooth speaker",
       f"{_E} › Portable Audio & Video › Portable Speakers & Docks › Portable Bluetooth Speakers",
       ["portable", "outdoor", "mini"],
       ["waterproof", "long battery life", "deep bass", "hands free calling", "dustproof", "stereo pairing"],
       {"color": ["black", "blue", "red", "teal", "camo"]}, (20, 150)),
    _t("electronics", "hdmi cable", "an", "hdmi cable",
       f"{_E} › Accessories & Supplies › Audio & Video Accessories › Cables › HDMI Cables",
       ["braided", "high speed", "ultra"],
       ["gold plated", "ultra hd", "ethernet support", "tangle free", "flexible jacket"],
       {"color": ["black", "grey", "white"], "size": ["3 feet", "6 feet", "10 feet", "15 feet"]}, (6, 30)),
    _t("electronics", "laptop sleeve", "a", "laptop sleeve",
       f"{_E} › Computers & Accessories › Laptop Accessories › Bags, Cases & Sleeves › Sleeves",
       ["padded", "neoprene", "slim"],
       ["water resistant", "shock absorbing", "extra pocket", "lightweight", "soft lining"],
       {"color": ["black", "grey", "navy", "pink", "olive"], "size": ["13 inch", "14 inch", "15.6 inch"]},
       (10, 40)),
    _t("electronics", "wireless mouse", "a", "wireless mouse",
       f"{_E} › Computers & Accessories › Computer Accessories & Peripherals › Keyboards, Mice & Accessories › Mice",
       ["ergonomic", "silent", "compact"],
       ["silent click", "long battery life", "plug and play", "adjustable dpi", "rechargeable", "ergonomic grip"],
       {"color": ["black", "white", "grey", "pink", "blue"]}, (8, 50)),
    _t("electronics", "smart watch", "a", "smart watch", f"{_E} › Wearable Technology › Smartwatches",
       ["fitness", "sport", "round"],
       ["heart rate monitor", "sleep tracking", "water resistant", "long battery life", "gps", "bluetooth calling"],
       {"color": ["black", "silver", "rose pink", "midnight blue", "gold"], "size": ["40mm", "44mm"]}, (30, 250)),
    _t("electronics", "desk lamp", "a", "led desk lamp",
       "Tools & Home Improvement › Lighting & Ceiling Fans › Lamps & Shades › Desk Lamps",
       ["led", "architect", "clamp"],
       ["dimmable", "eye caring", "usb charging port", "touch control", "adjustable arm", "memory function"],
       {"color": ["black", "white", "silver", "grey"]}, (15, 70)),
    _t("electronics", "power bank", "a", "portable power bank",
       f"{_E} › Cell Phones & Accessories › Chargers & Power Adapters › Portable Power Banks",
       ["slim", "magnetic", "compact"],
       ["fast charging", "led display", "dual output", "lightweight", "airline approved", "wireless charging"],
       {"color": ["black", "white", "blue", "pink"], "size": ["5000mah", "10000mah", "20000mah"]}, (15, 60)),
)

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
