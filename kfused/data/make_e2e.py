"""Generate ``e2e_tiny.jsonl``: a small E2E-NLG-style data-to-text set for ``kfused demo``.

Each line is ``{"mr": "name[The Eagle], food[Italian], area[riverside]", "ref": "The Eagle ..."}``.
Restaurants, attributes and sentence templates are invented here; the set is reproducible:

    python -m kfused.data.make_e2e            # rewrites kfused/data/e2e_tiny.jsonl (seed 0)
"""

from __future__ import annotations

import json
import os
import random

NAMES = ["The Eagle", "The Mill", "Blue Spice", "The Punter", "Zizzi", "Aromi", "The Golden Curry",
         "Cotto", "The Phoenix", "Green Man", "The Wrestlers", "Fitzbillies", "Alimentum",
         "The Cricketers", "Strada", "Loch Fyne", "The Rice Boat", "Clowns", "Giraffe",
         "The Olive Grove", "Midsummer House", "Browns Cambridge", "The Vaults", "Wildwood"]
NEAR = ["Burger King", "the Rice Boat", "Café Sicilia", "Crowne Plaza Hotel", "Raja Indian Cuisine",
        "the Sorrento", "Yippee Noodle Bar", "All Bar One", "The Portland Arms", "Café Brazil"]
FOOD = ["Italian", "French", "Chinese", "Indian", "Japanese", "English", "fast food"]
EAT = ["restaurant", "coffee shop", "pub"]
PRICE = ["cheap", "moderate", "high", "less than £20", "£20-25", "more than £30"]
RATING = ["low", "average", "high", "1 out of 5", "3 out of 5", "5 out of 5"]
AREA = ["riverside", "city centre"]
FAMILY = ["yes", "no"]

OPENERS = ["{name} is a {eat}", "{name} is a {food} {eat}", "There is a {eat} called {name}",
           "Located in the {area}, {name} is a {eat}", "{name}, a {eat}"]


def _price_phrase(p: str) -> str:
    if p in ("cheap", "moderate", "high"):
        return {"cheap": "cheap prices", "moderate": "moderate prices", "high": "high prices"}[p]
    return f"prices {p}"


def _rating_phrase(r: str) -> str:
    if " out of " in r:
        return f"a customer rating of {r}"
    return f"{'an' if r[0] in 'aeiou' else 'a'} {r} customer rating"


def make_example(rng: random.Random) -> dict:
    mr = {"name": rng.choice(NAMES), "eatType": rng.choice(EAT)}
    for key, pool, p in [("food", FOOD, 0.8), ("priceRange", PRICE, 0.6),
                         ("customer rating", RATING, 0.5), ("area", AREA, 0.7),
                         ("familyFriendly", FAMILY, 0.5), ("near", NEAR, 0.4)]:
        if rng.random() < p:
            mr[key] = rng.choice(pool)
    used = {"name", "eatType"}
    fmt = {"name": mr["name"], "eat": mr["eatType"], "food": mr.get("food", ""),
           "area": mr.get("area", "")}
    openers = [o for o in OPENERS if ("{food}" not in o or "food" in mr)
               and ("{area}" not in o or "area" in mr)]
    opener = rng.choice(openers)
    if "{food}" in opener:
        used.add("food")
    if "{area}" in opener:
        used.add("area")
    parts = [opener.format(**fmt)]
    clauses = []  # (inline phrase, standalone sentence)
    if "food" in mr and "food" not in used:
        food = mr["food"] if mr["food"] == "fast food" else f"{mr['food']} food"
        clauses.append((rng.choice([f"serving {food}", f"that serves {food}"]),
                        f"It serves {food}."))
    if "priceRange" in mr:
        p = mr["priceRange"]
        clauses.append((rng.choice([f"with {_price_phrase(p)}", f"in the {p} price range"]),
                        f"Prices are {p}." if p in ("cheap", "moderate", "high")
                        else f"It is in the {p} price range."))
    if "customer rating" in mr:
        r = mr["customer rating"]
        clauses.append((f"with {_rating_phrase(r)}", f"It has {_rating_phrase(r)}."))
    if "area" in mr and "area" not in used:
        clauses.append((rng.choice([f"in the {mr['area']}", f"located in the {mr['area']}"]),
                        f"It is located in the {mr['area']}."))
    if "near" in mr:
        clauses.append((rng.choice([f"near {mr['near']}", f"close to {mr['near']}"]),
                        f"You can find it near {mr['near']}."))
    rng.shuffle(clauses)
    sent = " ".join(parts + [c[0] for c in clauses[:2]]).rstrip(",") + "."
    for _, standalone in clauses[2:]:
        sent += " " + standalone
    if "familyFriendly" in mr:
        sent += rng.choice([" It is family friendly.", " Kids are welcome."]
                           if mr["familyFriendly"] == "yes" else
                           [" It is not family friendly.", " It is not suitable for children."])
    return {"mr": ", ".join(f"{k}[{v}]" for k, v in mr.items()), "ref": sent}


def generate(n: int = 600, seed: int = 0) -> list:
    rng = random.Random(seed)
    return [make_example(rng) for _ in range(n)]


def main(argv=None) -> None:
    import argparse

    argparse.ArgumentParser(  # takes no options: --help (or a typo) never rewrites the file
        prog="python -m kfused.data.make_e2e",
        description="Rewrite kfused/data/e2e_tiny.jsonl (600 examples, seed 0).").parse_args(argv)
    from kfused._files import replace_atomically

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "e2e_tiny.jsonl")

    def write(tmp: str) -> None:  # replaced whole: a kill part way left a shorter data set
        with open(tmp, "w", encoding="utf-8") as f:
            for ex in generate():
                f.write(json.dumps(ex, ensure_ascii=False) + "\n")

    replace_atomically(path, write)
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
