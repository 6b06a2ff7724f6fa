"""The pretraining text of the shipped base model: descriptive English, generated here.

No model hub and no text corpus can be downloaded, so the small GPT-2-shaped base that ships in
``kfused/data/base/`` is pretrained on English that this module writes from a hand-made grammar
(seeded, so the corpus is the same on every machine). Three kinds of document, one per line:

* **prose** about towns, travel, weather, shops, hotels, museums, parks, cafés, pubs and
  restaurants: several sentences with varied openings, clauses and connectives;
* **notes**: a short record, the separator token, then a description of it (general
  "structured data, then text" material, as web text has), in three layouts: ``Key: value |
  Key: value``, ``key=value; key=value`` with other key names, and a name followed by its
  values in parentheses;
* **short dialogue-style** questions and answers about places;
* **lists** of coined names said twice ("The guests were Varnelle, Osbry and Tamsen. Later
  that day Varnelle, Osbry and Tamsen came back."): the plainest material for learning to
  copy from context, which the descriptions alone taught too slowly (a 3,000-step base
  trained without them stated the record's name in 2 % of held-out notes, with them 19 %).

Most venues and many landmarks get a **coined name** (``_coined``: syllables drawn afresh for
each document, "Varnelle", "The Osbry Arms", "Tamsen House") rather than one of a fixed pool:
a name the model cannot have memorised has to be copied from where the document first states
it (the record of a note, the first sentence of prose), which is what a data-to-text task
later asks of the base. The first base, pretrained on 56 fixed names only, never learned to
copy: adapted on the task it wrote pool-like or garbled names and few of the slots it was given.

Distinct from the demo's data-to-text task (:mod:`kfused.data.make_e2e`): no document uses the
task's ``key[value]`` meaning-representation syntax or its slot names, and every venue and
landmark name is drawn from pools disjoint from the task's ``NAMES`` and ``NEAR`` lists (a test
checks this). So the held-out meaning representations and their reference sentences never
appear in pretraining; none of the task's training pairs are used either.

    python -m kfused.data.make_corpus            # prints statistics of the corpus
"""

from __future__ import annotations

import random
from typing import List, Tuple

# Venue names: none of them is (or contains) a name of the data-to-text task (tested).
VENUE_NAMES = [
    "The Copper Kettle", "The Old Forge", "Harbour Lights", "The Silver Birch", "Maple House",
    "The Red Lion Yard", "Rosewood", "The Lantern", "Northgate Hall", "The Bluebell",
    "Kingfisher Lodge", "The Orchard", "Juniper", "The Willow Tree", "Saffron Court",
    "The Stag and Hound", "Pebble Beach", "The Granary", "Hillside", "The Tinners Arms",
    "Marigold", "The Brass Monkey", "Oak and Ivy", "The Lighthouse", "Seven Bridges",
    "The Chestnut", "Bay Leaf", "The Weavers", "Castle View", "The Harvest Moon",
    "Meadowbank", "The Ferryman", "Larkspur", "The Tollhouse", "Riverbend", "The Quarry",
    "Fig and Olive", "The Anchor House", "Foxglove", "The Market Cross", "Elm Street Kitchen",
    "The Cobbler", "Thistle Lane", "The Oak Barrel", "Windmill Corner", "The Pelican",
    "Cedar and Sage", "The Bell Tower", "Wren House", "The Nightingale", "Sunflower Deli",
    "The Salt Store", "Lavender Hill", "The Clockmaker", "Amber Rooms", "The Signal Box",
]
# Syllables of coined names (checked against the task's names like the pools above).
_ONSETS = ["b", "br", "c", "cr", "d", "dr", "f", "g", "gr", "h", "j", "k", "l", "m", "n", "p",
           "pr", "qu", "r", "s", "st", "t", "tr", "v", "w", "z", "th", "ch", "sh", "bl", "pl"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "y", "ie"]
_CODAS = ["", "", "", "n", "r", "l", "s", "m", "nd", "rn", "th", "x", "ck", "ll", "st"]
_ENDINGS = ["", "", "a", "o", "elle", "ino", "ford", "by", "ton", "well", "more", "wick",
            "ara", "eo", "ista"]
_NAME_NOUNS = ["Arms", "House", "Kitchen", "Rooms", "Grill", "Tavern", "Table", "Lounge",
               "Yard", "Cellar", "Corner", "Place", "Garden", "Hall", "Bar", "Parlour"]
_LANDMARK_KINDS = ["the {} Hotel", "the {} Theatre", "{} Bridge", "the {} Gallery",
                   "{} Park", "the {} Centre", "{} Station", "the {} Tower"]
LANDMARKS = [
    "the railway station", "the cathedral", "the town hall", "the old bridge", "the harbour",
    "the market square", "the university", "the botanic garden", "the bus station",
    "the castle", "the museum of science", "the public library", "the football ground",
    "the art college", "the clock tower", "the swimming pool", "the war memorial",
    "the theatre royal", "the canal basin", "the city park", "the main post office",
]
TOWNS = ["Whitby", "Bath", "York", "Norwich", "Exeter", "Durham", "Lincoln", "Chester",
         "Salisbury", "Ludlow", "Kendal", "Truro", "Hexham", "Ripon", "Wells", "Oban",
         "Stirling", "Conwy", "Tenby", "Harrogate", "Keswick", "Lewes", "Rye", "Totnes"]
CUISINES = ["Thai", "Greek", "Spanish", "Turkish", "Mexican", "Korean", "Vietnamese",
            "Lebanese", "Italian", "French", "Chinese", "Indian", "Japanese", "English",
            "Moroccan", "Portuguese", "vegetarian", "seafood"]
DISHES = ["fresh pasta", "grilled fish", "slow-cooked stews", "homemade soups", "stone-baked "
          "pizza", "curries", "noodle bowls", "roast dinners", "tapas", "dumplings", "salads",
          "pies", "pancakes", "sandwiches", "cakes and pastries", "burgers", "kebabs"]
VENUE_KINDS = ["restaurant", "coffee shop", "pub", "hotel", "bakery", "bookshop", "museum",
               "gallery", "tea room", "wine bar", "bistro", "guest house", "deli", "cinema",
               "inn", "brasserie", "noodle bar", "market hall"]
FOOD_KINDS = {"restaurant", "coffee shop", "pub", "bakery", "tea room", "wine bar", "bistro",
              "deli", "inn", "brasserie", "noodle bar"}
PRICE_WORDS = [("cheap", "low prices"), ("inexpensive", "fair prices"),
               ("moderately priced", "moderate prices"), ("mid-range", "average prices"),
               ("expensive", "high prices"), ("upmarket", "high prices"),
               ("affordable", "reasonable prices"), ("pricey", "steep prices")]
MONEY = ["under £10", "about £15", "£10-20", "around £25", "over £30", "£20-30", "less than £15",
         "more than £40"]
RATINGS = ["poor", "mixed", "average", "good", "very good", "excellent", "outstanding"]
STARS = ["1 star", "2 stars", "3 stars", "4 stars", "5 stars", "2 out of 5", "4 out of 5",
         "3 out of 5", "5 out of 5", "1 out of 5"]
AREAS = ["the city centre", "the riverside", "the old town", "the harbour front", "the suburbs",
         "the university quarter", "the high street", "a quiet side street", "the seafront",
         "the north end of town", "the shopping district", "the village green"]
PEOPLE = ["families", "students", "couples", "tourists", "walkers", "business travellers",
          "children", "older visitors", "locals", "groups of friends", "cyclists", "dog owners"]
HOURS = ["from early morning", "until late", "every day except Monday", "at weekends only",
         "from noon until ten", "all year round", "in the summer months", "seven days a week"]
WEATHER = ["sunny", "wet", "windy", "foggy", "cold", "mild", "warm", "grey", "bright", "stormy"]
SEASONS = ["spring", "summer", "autumn", "winter"]
TIMES = ["in the morning", "in the afternoon", "in the evening", "at night", "at lunchtime",
         "on Sundays", "on market days", "during the holidays"]
ADJ_PLACE = ["small", "busy", "quiet", "friendly", "charming", "modern", "old", "popular",
             "lively", "cosy", "spacious", "family-run", "well-known", "bright", "tiny"]
FEATURES = ["a garden at the back", "a view of the river", "outdoor seating", "free wifi",
            "a log fire", "live music on Fridays", "a children's corner", "a roof terrace",
            "parking nearby", "wheelchair access", "a large function room", "a reading room",
            "a play area", "a terrace by the water", "bicycle racks outside"]
VERBS_SERVE = ["serves", "offers", "specialises in", "is known for", "has a menu of",
               "sells", "cooks"]
CONNECT = ["Also,", "In addition,", "Besides this,", "On top of that,", "What is more,", ""]
OPINION = ["Visitors say it is worth the trip.", "It can be crowded at busy times.",
           "Booking ahead is a good idea.", "The staff are helpful and polite.",
           "It is a good place to meet friends.", "Service can be slow when it is full.",
           "Many people come back again and again.", "It is easy to miss from the road.",
           "Prices have gone up this year.", "It gets quieter after nine.",
           "The portions are generous.", "It is best visited on a weekday."]


def _a(word: str) -> str:
    return ("an " if word[0].lower() in "aeiou" else "a ") + word


def _cap(s: str) -> str:
    return s[0].upper() + s[1:] if s else s


def _word(rng: random.Random) -> str:
    """One coined word of one or two syllables and an ending ("Varnelle", "Quosby")."""
    w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                for _ in range(rng.choice([1, 1, 2])))
    return _cap(w + rng.choice(_ENDINGS))


def _clashes(name: str) -> bool:
    """Whether ``name`` contains, or is contained in, a name of the demo task."""
    from kfused.data.make_e2e import NAMES, NEAR

    low = name.lower()
    return any(n.lower() in low or low in n.lower() for n in NAMES + NEAR)


def _coined(rng: random.Random, landmark: bool = False) -> str:
    """A name made up for one document (never one of the task's: redrawn on a clash)."""
    while True:
        w = _word(rng)
        if landmark:
            name = rng.choice(_LANDMARK_KINDS).format(w)
        else:
            r = rng.random()
            name = (w if r < 0.45 else f"The {w} {rng.choice(_NAME_NOUNS)}" if r < 0.75
                    else f"{w} {rng.choice(_NAME_NOUNS)}" if r < 0.9 else f"The {w}")
        if not _clashes(name):
            return name


def _venue(rng: random.Random) -> dict:
    kind = rng.choice(VENUE_KINDS)
    name = _coined(rng) if rng.random() < 0.75 else rng.choice(VENUE_NAMES)
    v = {"name": name, "kind": kind, "town": rng.choice(TOWNS),
         "adj": rng.choice(ADJ_PLACE)}
    if kind in FOOD_KINDS and rng.random() < 0.8:
        v["cuisine"] = rng.choice(CUISINES)
        v["dish"] = rng.choice(DISHES)
    if rng.random() < 0.7:
        v["price"] = rng.choice(PRICE_WORDS)
    if rng.random() < 0.4:
        v["money"] = rng.choice(MONEY)
    if rng.random() < 0.6:
        v["rating"] = rng.choice(RATINGS if rng.random() < 0.5 else STARS)
    if rng.random() < 0.7:
        v["area"] = rng.choice(AREAS)
    if rng.random() < 0.5:
        v["near"] = _coined(rng, landmark=True) if rng.random() < 0.5 else rng.choice(LANDMARKS)
    if rng.random() < 0.5:
        v["people"] = rng.choice(PEOPLE)
        v["suits"] = rng.random() < 0.75
    if rng.random() < 0.5:
        v["feature"] = rng.choice(FEATURES)
    if rng.random() < 0.4:
        v["hours"] = rng.choice(HOURS)
    return v


def _venue_sentences(v: dict, rng: random.Random) -> List[str]:
    name, kind = v["name"], v["kind"]
    first = rng.choice([
        f"{name} is {_a(v['adj'])} {kind} in {v['town']}.",
        f"In {v['town']} there is {_a(v['adj'])} {kind} called {name}.",
        f"{name} is {_a(kind)}" + (f" in {v['area']}" if "area" in v else "") + ".",
        f"If you are in {v['town']}, {name} is {_a(v['adj'])} {kind} worth knowing.",
        f"{name}, {_a(v['adj'])} {kind}, opened in {v['town']} some years ago.",
    ])
    out = [first]
    pending = []
    if "cuisine" in v:
        pending.append(rng.choice([
            f"It {rng.choice(VERBS_SERVE)} {v['cuisine']} food.",
            f"The kitchen {rng.choice(VERBS_SERVE)} {v['dish']} and other {v['cuisine']} dishes.",
            f"The menu is mostly {v['cuisine']}, with {v['dish']} as the favourite.",
            f"You can eat {v['cuisine']} food there.",
        ]))
    if "price" in v:
        word, phrase = v["price"]
        pending.append(rng.choice([f"It is {word}.", f"It has {phrase}.",
                                   f"Most people find it {word}.",
                                   f"The prices are {phrase.split()[0]}."]))
    if "money" in v:
        pending.append(rng.choice([f"A meal costs {v['money']} per person.",
                                   f"Expect to pay {v['money']}.",
                                   f"Most things cost {v['money']}."]))
    if "rating" in v:
        r = v["rating"]
        if "star" in r or "out of" in r:
            pending.append(rng.choice([f"Reviewers give it {r}.", f"It is rated {r}.",
                                       f"Its rating is {r}."]))
        else:
            pending.append(rng.choice([f"Reviews are {r}.", f"It has {_a(r)} reputation.",
                                       f"Guests rate it as {r}."]))
    if "area" in v and v["area"] not in first:
        pending.append(rng.choice([f"It is in {v['area']}.", f"You will find it in {v['area']}.",
                                   f"It sits in {v['area']}."]))
    if "near" in v:
        pending.append(rng.choice([f"It is near {v['near']}.", f"It is close to {v['near']}.",
                                   f"It is a short walk from {v['near']}.",
                                   f"Look for it next to {v['near']}."]))
    if "people" in v:
        p = v["people"]
        pending.append(rng.choice([f"It is good for {p}.", f"It is popular with {p}.",
                                   f"{_cap(p)} are welcome."] if v["suits"] else
                                  [f"It is not ideal for {p}.", f"It is not suited to {p}.",
                                   f"{_cap(p)} may prefer somewhere else."]))
    if "feature" in v:
        pending.append(rng.choice([f"There is {v['feature']}.", f"It has {v['feature']}.",
                                   f"Inside you will find {v['feature']}."]))
    if "hours" in v:
        pending.append(rng.choice([f"It is open {v['hours']}.",
                                   f"The doors are open {v['hours']}."]))
    rng.shuffle(pending)
    for i, s in enumerate(pending):
        c = rng.choice(CONNECT) if i and rng.random() < 0.25 else ""
        out.append((c + " " + s[0].lower() + s[1:]) if c else s)
    if rng.random() < 0.5:
        out.append(rng.choice(OPINION))
    return out


def prose(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.55:
        return " ".join(_venue_sentences(_venue(rng), rng))
    if r < 0.75:
        town, w, s = rng.choice(TOWNS), rng.choice(WEATHER), rng.choice(SEASONS)
        lm = rng.choice(LANDMARKS)
        parts = [rng.choice([f"{town} is {_a(rng.choice(ADJ_PLACE))} town.",
                             f"The weather in {town} was {w} today.",
                             f"In {s}, {town} is often {w}.",
                             f"Many {rng.choice(PEOPLE)} visit {town} in {s}."]),
                 rng.choice([f"The best way to see it is on foot, starting at {lm}.",
                             f"Most visitors begin at {lm}.",
                             f"Buses leave from {lm} {rng.choice(TIMES)}.",
                             f"It is {rng.choice(WEATHER)} {rng.choice(TIMES)}, so bring a coat."]),
                 rng.choice([f"There are {rng.choice(['two', 'three', 'four', 'several', 'many'])}"
                             f" {rng.choice(VENUE_KINDS)}s in {rng.choice(AREAS)}.",
                             f"{rng.choice(VENUE_NAMES)} is the place people mention most.",
                             rng.choice(OPINION)])]
        return " ".join(parts)
    if r < 0.9:  # two venues compared
        a, b = _venue(rng), _venue(rng)
        pa, pb = a.get("price", ("cheap", ""))[0], b.get("price", ("expensive", ""))[0]
        return (f"{a['name']} and {b['name']} are both in {a['town']}. "
                f"{a['name']} is {_a(a['kind'])} and {b['name']} is {_a(b['kind'])}. "
                f"The first is {pa}, while the second is {pb}. "
                + rng.choice(["Both are worth a visit.", "Locals prefer the first one.",
                              "The second one is easier to reach.",
                              "Neither takes bookings."]))
    v = _venue(rng)
    return (f"Where can I find {_a(v['kind'])} in {v['town']}? "
            + " ".join(_venue_sentences(v, rng)[:3]))


_NOTE_KEYS = [("Kind", "kind"), ("Town", "town"), ("Cuisine", "cuisine"), ("Prices", "price"),
              ("Cost", "money"), ("Rating", "rating"), ("Area", "area"), ("Near", "near"),
              ("Good for", "people"), ("Extras", "feature"), ("Open", "hours")]


# The second layout's key names (never the task's slot names).
_EQ_KEYS = {"kind": "type", "town": "town", "cuisine": "cuisine", "price": "prices",
            "money": "cost", "rating": "rating", "area": "district", "near": "close to",
            "people": "suits", "feature": "extras", "hours": "open"}


def _note_values(v: dict) -> List[Tuple[str, str]]:
    """(key, value) of a venue's record fields, in the record's order."""
    out = []
    for _, key in _NOTE_KEYS:
        if key not in v:
            continue
        val = v[key]
        if key == "price":
            val = val[0]
        if key == "people":
            val = ("" if v["suits"] else "not ") + val
        out.append((key, val))
    return out


def note(rng: random.Random) -> Tuple[str, str]:
    """A record of a venue, in one of three layouts, and a description of it."""
    v = _venue(rng)
    fields = _note_values(v)
    r = rng.random()
    if r < 0.5:
        labels = dict((key, label) for label, key in _NOTE_KEYS)
        record = " | ".join([f"Name: {v['name']}"] + [f"{labels[k]}: {x}" for k, x in fields])
    elif r < 0.8:
        record = "; ".join([f"name={v['name']}"] + [f"{_EQ_KEYS[k]}={x}" for k, x in fields])
    else:
        record = f"{v['name']} (" + ", ".join(x for _, x in fields) + ")"
    return record, " ".join(_venue_sentences(v, rng))


def record_name(record: str) -> str:
    """The venue name of a :func:`note` record, in any of its three layouts."""
    for head, sep in (("Name: ", " | "), ("name=", "; ")):
        if record.startswith(head):
            return record[len(head):].split(sep)[0]
    return record.split(" (")[0]


_LIST_FRAMES = [
    ("The guests were {}.", "Later that day {} came back."),
    ("On the map you can see {}.", "Walking back we passed {} again."),
    ("The shortlist named {}.", "In the end the judges chose {}, in that order."),
    ("Stops on the route: {}.", "On the way home the bus called at {}."),
    ("The new members are {}.", "Please welcome {}."),
    ("Our favourite places this year were {}.", "Next year we will visit {} once more."),
]


def _and(names: List[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def name_list(rng: random.Random) -> str:
    """A list of coined names and the same names again (in order, or reversed)."""
    names = [_coined(rng, landmark=rng.random() < 0.3) for _ in range(rng.randint(2, 6))]
    first, second = rng.choice(_LIST_FRAMES)
    again = names[::-1] if rng.random() < 0.25 else names
    text = first.format(_and(names)) + " " + second.format(_and(again))
    if rng.random() < 0.5:  # and one of them once more
        text += f" {_cap(rng.choice(names))} was the one people talked about most."
    return text


def documents(n: int, seed: int = 1234, note_fraction: float = 0.4,
              list_fraction: float = 0.2) -> List[Tuple[str, str]]:
    """``n`` documents as (record, text); record is "" for prose and lists."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        r = rng.random()
        out.append(note(rng) if r < note_fraction else ("", name_list(rng))
                   if r < note_fraction + list_fraction else ("", prose(rng)))
    return out


def main(argv=None) -> None:
    import argparse

    argparse.ArgumentParser(prog="python -m kfused.data.make_corpus",
                            description="Print a summary and the first documents of the "
                            "pretraining corpus (20000 documents).").parse_args(argv)
    docs = documents(20000)
    chars = sum(len(a) + len(b) for a, b in docs)
    print(f"{len(docs)} documents, {chars} characters, {sum(bool(a) for a, _ in docs)} notes")
    for a, b in docs[:6]:
        print((a + "  =>  " if a else "") + b)


if __name__ == "__main__":  # pragma: no cover
    main()
