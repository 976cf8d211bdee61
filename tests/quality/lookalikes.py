#!/usr/bin/env python3
"""Look-alike sets: /rerank questions whose distractors look like the answer, in four kinds
that each isolate one way a ranker can be fooled, measured against a live fitmd with R@1 and
MRR per kind, and the rate at which each kind of distractor scores at least the gold.

Every question has K = 10 documents, exactly one of which answers it (the gold), placed at a
random position; the entities are fictional (name syllables of their own: only "tor" is also
one of dataset.py's dev syllables), so only the documents can answer. The asked value (the
item's "answer") is in the gold and in no other document of its item. Four kinds, 40
questions each:

  same_entity   every document is about the asked company X (its founding, founder, chief
                executive, city, products, staff, listing, ...); only the gold states the
                asked attribute. Roles: the attribute each distractor states.
  similar_name  every document states the asked attribute, but of a look-alike entity
                ("X Group", "New X", "the X Foundation", a sister company, "Old X", a
                namesake with another stem, ...); only the gold is about X itself. Roles: the
                look-alike's form (group, new, old, foundation, museum, sister, intl,
                surname, sons, former, club).
  temporal      "What was the population of X in 1990?": 6 documents give X's figure for
                other years (other_year), 2 mention the asked year for other facts of X
                (same_year_other_fact), 1 gives a neighbour's figure for the asked year
                (other_entity_same_year).
  paraphrase    the gold states the fact in other words than the question (it shares only
                the name); the distractors repeat the question's words: an FAQ page that
                quotes the question (echo), 4 keyword-stuffed pages about X (stuffed), a
                relative's same attribute named with X (relative), and 3 other people's same
                attribute in the question's own words (other_person).

The items are generated on the fly from a fixed seed, SEED (the same seed gives the same
items); each kind has its own random stream, so a kind's items do not depend on the others.
Splits: dev = questions 0-19 of each kind (for choosing), test = questions 20-39 (for
reporting).
Item:
  {"id": "<kind>-<i>", "kind", "split", "query", "documents": [str] (K), "gold_index"
   (0-based), "roles": [str] (per document, "gold" for the gold), "attribute" (the asked
   one), "entity" (the asked X), "answer" (the asked value, as the gold states it)}

Methods as in quality.py: `bm25` (computed here), a server method name, or LABEL=JSON with
/rerank request fields passed through unchanged (default: `default={}`, the server's own
ranking, then query_likelihood, calibrated and bm25). The gold's rank is 1 + the number of
other documents scoring at least as high (ties count against the gold). The report: R@1
(count / n) and MRR per method and kind (and ALL) on the split, and for the first method
that ran, per kind and distractor role, how often such a distractor scored at least the gold.

    python3 tests/quality/lookalikes.py --model M.gguf [--split dev|test] [--kinds ...]
        [--method LABEL=JSON ...] [--json OUT] [--markdown OUT]
    python3 tests/quality/lookalikes.py --url http://127.0.0.1:8080 ...
    python3 tests/quality/lookalikes.py --show 1    # print one item per kind, no server
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import random
import sys

import requests

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import quality  # noqa: E402

SEED = 20261129
N = 40
K = 10
KINDS = ("same_entity", "similar_name", "temporal", "paraphrase")
DEFAULT_METHODS = ["default={}", "query_likelihood", "calibrated", "bm25"]

# ---- names ---------------------------------------------------------------------------------

SYL = "vor lan tes mir quel dan oph rin sab tor ele kam nur ast fel bro gan ithe jal pok".split()
CITY_SUF = ["more", "by", "ley", "wick", "thorpe", "ham", "dale", "crest"]
NOUNS = ["Instruments", "Textiles", "Mills", "Foundry", "Ceramics", "Ropeworks", "Optics",
         "Freight", "Press", "Engineering", "Glassworks", "Canning"]
PRODUCTS = ["folding bicycles", "ceramic water filters", "marine compasses", "wool blankets",
            "tin toys", "hand pumps", "oil lamps", "pocket barometers", "rope ladders",
            "sewing machines", "canned sardines", "printing presses", "greenhouse glass"]
MOTTOS = ["Built to outlast us", "Steady hands, steady work", "Nothing wasted",
          "Made for the long road", "Measure twice", "Quality in every thread",
          "From the harbour to the world", "Honest goods"]
OCCUPATIONS = [("clockmaker", "repairing and building clocks"),
               ("ferryman", "rowing passengers across the river"),
               ("bookbinder", "stitching and gluing the covers of books"),
               ("cartographer", "drawing maps of the coast"),
               ("glassblower", "shaping molten glass into bottles and lamps"),
               ("beekeeper", "tending hives and selling honey"),
               ("schoolteacher", "teaching children to read and count"),
               ("stonemason", "cutting and laying stone for churches"),
               ("midwife", "delivering babies in the surrounding farms"),
               ("surveyor", "measuring land boundaries for the county")]


class Namer:
    """Fictional names from SYL, none given twice within a kind's stream."""

    def __init__(self, rnd: random.Random):
        self.rnd, self.used = rnd, set()

    def word(self, n: int = 2) -> str:
        # one more syllable after many collisions, two more after very many
        for t in range(100000):
            m = n + (t > 200) + (t > 5000)
            w = "".join(self.rnd.choice(SYL) for _ in range(m)).capitalize()
            if w not in self.used and len(w) <= 12:
                self.used.add(w)
                return w
        raise RuntimeError("names exhausted")

    def person(self) -> str:
        return f"{self.word(2)} {self.word(2)}"

    def city(self) -> str:
        while True:
            c = self.word(1 + (self.rnd.random() < 0.5)) + self.rnd.choice(CITY_SUF)
            if c not in self.used:
                self.used.add(c)
                return c


def place(rnd: random.Random, gold: str, distractors: list) -> tuple:
    """(documents, gold index): the distractors shuffled, the gold inserted at a random
    position."""
    docs = list(distractors)
    rnd.shuffle(docs)
    pos = rnd.randrange(len(docs) + 1)
    docs.insert(pos, gold)
    return docs, pos


def fmt_int(n: int) -> str:
    return f"{n:,}"


def item(query: str, docs: list, pos: int, roles: list, attribute: str, entity: str,
         answer: str) -> dict:
    return {"query": query, "documents": docs, "gold_index": pos, "roles": roles,
            "attribute": attribute, "entity": entity, "answer": answer}


# ---- same_entity: the asked company throughout, one document states the asked attribute ----

def company_facts(rnd: random.Random, nm: Namer) -> dict:
    y0 = rnd.randrange(1840, 1960)
    return {
        "X": f"{nm.word(2)} {rnd.choice(NOUNS)}",
        "founded": y0,
        "founder": nm.person(),
        "ceo": nm.person(),
        "ceo_year": rnd.randrange(1990, 2020),
        "hq": nm.city(),
        "hq_year": rnd.randrange(y0 + 10, 1995),
        "employees": rnd.randrange(120, 9000),
        "product": rnd.choice(PRODUCTS),
        "revenue": rnd.randrange(20, 900),
        "acquirer": f"{nm.word(2)} Holdings",
        "acq_year": rnd.randrange(1995, 2022),
        "listing": rnd.randrange(1960, 2010),
        "exchange": nm.city(),
        "rival": f"{nm.word(2)} {rnd.choice(NOUNS)}",
        "motto": rnd.choice(MOTTOS),
        "factory": nm.city(),
        "factory_year": rnd.randrange(y0 + 5, 2000),
    }


# asked attribute -> (questions, gold/statement templates).  Every statement names X and,
# where it can, carries a year or a name (look-alike answers for other questions).
SAME_ENTITY = {
    "founded": (["When was {X} founded?", "In what year was {X} established?"],
                ["{X} was founded in {founded}, when its first workshop opened with four "
                 "workers.",
                 "The story of {X} begins in {founded}, the year the firm was set up in a "
                 "rented shed."]),
    "founder": (["Who founded {X}?", "Who was the founder of {X}?"],
                ["{X} was started by {founder}, a former apprentice who borrowed money from "
                 "an uncle to open it.",
                 "It was {founder} who set up {X}, after years of working for other firms."]),
    "ceo": (["Who is the chief executive of {X}?", "Who runs {X} today?"],
            ["Since {ceo_year}, {X} has been led by chief executive {ceo}.",
             "{ceo} became chief executive of {X} in {ceo_year} and still holds the post."]),
    "hq": (["Where is {X} headquartered?", "In which city is {X} based?"],
           ["{X} moved its head office to {hq} in {hq_year}, and it has stayed there since.",
            "The headquarters of {X} have been in {hq} since {hq_year}."]),
    "employees": (["How many people does {X} employ?", "How many employees does {X} have?"],
                  ["{X} employs {employees_s} people across its sites.",
                   "The payroll of {X} lists {employees_s} staff."]),
    "product": (["What is {X} best known for making?", "What does {X} produce?"],
                ["{X} is known above all for its {product}, sold in shops across the region.",
                 "Most of the output of {X} is {product}."]),
    "revenue": (["What was the annual revenue of {X}?", "How much money does {X} make a "
                 "year?"],
                ["{X} reported yearly sales of {revenue} million euros in its latest "
                 "accounts.",
                 "In its last financial year {X} took in {revenue} million euros."]),
    "acquirer": (["Which company acquired {X}?", "Who bought {X}?"],
                 ["In {acq_year}, {X} was bought by {acquirer} for an undisclosed sum.",
                  "{acquirer} took over {X} in {acq_year}."]),
    "listing": (["When did {X} go public?", "In what year was {X} listed on the stock "
                 "exchange?"],
                ["{X} floated its shares on the {exchange} exchange in {listing}.",
                 "Shares of {X} began trading on the {exchange} exchange in {listing}."]),
    "rival": (["Who is the main competitor of {X}?", "Which firm is the biggest rival of "
               "{X}?"],
              ["For decades the fiercest competitor of {X} has been {rival}.",
               "{X} and {rival} have fought over the same customers for generations."]),
    "motto": (["What is the motto of {X}?", "What slogan does {X} use?"],
              ["\"{motto}\" is printed on every crate that leaves {X}.",
               "The motto of {X}, \"{motto}\", dates from its early years."]),
    "factory": (["Where is the main factory of {X}?", "Where does {X} make its goods?"],
                ["The main plant of {X} stands in {factory}, opened in {factory_year}.",
                 "{X} makes nearly everything at its works in {factory}, built in "
                 "{factory_year}."]),
}



def gen_same_entity(rnd: random.Random, nm: Namer, i: int) -> dict:
    f = company_facts(rnd, nm)
    f["employees_s"] = fmt_int(f["employees"])
    attrs = list(SAME_ENTITY)
    asked = attrs[i % len(attrs)]  # the attributes in turn
    qs, gold_t = SAME_ENTITY[asked]
    q = rnd.choice(qs).format(**f)
    gold = rnd.choice(gold_t).format(**f)
    # 9 of the 11 other attributes, at random, one document each
    others = [a for a in attrs if a != asked]
    rnd.shuffle(others)
    dis = [rnd.choice(SAME_ENTITY[a][1]).format(**f) for a in others[:K - 1]]
    role_of = dict(zip(dis, others[:K - 1]))
    docs, pos = place(rnd, gold, dis)
    roles = ["gold" if j == pos else role_of[d] for j, d in enumerate(docs)]
    answer = f["employees_s"] if asked == "employees" else str(f[asked])
    return item(q, docs, pos, roles, asked, f["X"], answer)


# ---- similar_name: the asked attribute throughout, one document about the asked entity ----

LOOKALIKES = [
    ("group", "{X} Group"),
    ("new", "New {X}"),
    ("old", "Old {X}"),
    ("foundation", "the {X} Foundation"),
    ("museum", "the {X} Museum"),
    ("sister", "{S} {N2}, a sister company of {X},"),
    ("intl", "{X} International"),
    ("surname", "{S2} {N}"),
    ("sons", "{S} & Sons {N}"),
    ("former", "{X2}, formerly a division of {X},"),
    ("club", "the {X} Sports Club"),
]

SIMILAR_Q = {
    "founded": (["When was {X} founded?", "In what year was {X} established?"],
                ["{E} was founded in {v}.", "{E} was established in {v}.",
                 "{E} dates from {v}, when it was set up."]),
    "hq": (["Where is {X} headquartered?", "In which city is {X} based?"],
           ["{E} has its headquarters in {v}.", "{E} is based in {v}.",
            "The head office of {E} is in {v}."]),
    "founder": (["Who founded {X}?", "Who was the founder of {X}?"],
                ["{E} was founded by {v}.", "The founder of {E} was {v}.",
                 "{E} was started by {v}."]),
    "ceo": (["Who is the chief executive of {X}?", "Who leads {X}?"],
            ["The chief executive of {E} is {v}.", "{E} is led by {v}.",
             "{v} heads {E} as chief executive."]),
}



def cap(s: str) -> str:
    return s[0].upper() + s[1:]


# a sentence after a statement, none 3 times in 7, so that length does not mark the gold
FILLER = ["It is a family-owned business.", "It publishes an annual report each spring.",
          "Its buildings are of red brick.", "It has a small shop open to visitors.",
          "", "", ""]


def gen_similar_name(rnd: random.Random, nm: Namer, i: int) -> dict:
    S, N = nm.word(2), rnd.choice(NOUNS)
    X = f"{S} {N}"
    N2 = rnd.choice([n for n in NOUNS if n != N])
    X2 = f"{nm.word(2)} {rnd.choice(NOUNS)}"
    S2 = nm.word(2)
    asked = list(SIMILAR_Q)[i % len(SIMILAR_Q)]
    qs, tmpl = SIMILAR_Q[asked]
    vals = set()

    def fresh() -> str:
        """A value of the asked attribute no other document of the item states."""
        while True:
            if asked == "founded":
                v = str(rnd.randrange(1840, 2015))
            elif asked == "hq":
                v = nm.city()
            else:
                v = nm.person()
            if v not in vals:
                vals.add(v)
                return v

    q = rnd.choice(qs).format(X=X)

    def stmt(E: str) -> tuple:
        t = rnd.choice(tmpl)
        v = fresh()
        # the "sister" and "former" forms end in a comma: drop it before one of the
        # template's own
        s = cap(t.format(E=E, v=v)).replace(",, ", ", ").replace(",.", ".")
        return (s + " " + rnd.choice(FILLER)).strip(), v

    gold, answer = stmt(X)
    looks = rnd.sample(LOOKALIKES, K - 1)
    dis = [stmt(t.format(X=X, S=S, N=N, N2=N2, S2=S2, X2=X2))[0] for _, t in looks]
    role_of = dict(zip(dis, [n for n, _ in looks]))
    docs, pos = place(rnd, gold, dis)
    roles = ["gold" if j == pos else role_of[d] for j, d in enumerate(docs)]
    return item(q, docs, pos, roles, asked, X, answer)


# ---- temporal: the asked entity's figure for other years, the asked year for other facts --

METRICS = {
    "population": {
        "kind": "town",
        "q": ["What was the population of {X} in {Y}?", "How many people lived in {X} in {Y}?"],
        "s": ["In {y}, {X} had {v} inhabitants.", "The census of {y} counted {v} residents in "
              "{X}.", "{X} was home to {v} people in {y}.",
              "By {y} the population of {X} stood at {v}."],
        "other": ["In {Y}, {X} opened a new railway station on the line to {C}.",
                  "The town hall of {X} was rebuilt in {Y} after a fire.",
                  "In {Y}, {X} elected {P} as its mayor.",
                  "A flood in {Y} damaged the bridges of {X}."],
        "range": (800, 90000),
    },
    "students": {
        "kind": "college",
        "q": ["How many students were enrolled at {X} in {Y}?",
              "What was the enrolment of {X} in {Y}?"],
        "s": ["In {y}, {X} had {v} students.", "Enrolment at {X} reached {v} in {y}.",
              "{X} taught {v} students in the {y} academic year.",
              "The {y} register of {X} lists {v} enrolled students."],
        "other": ["In {Y}, {X} opened a new library wing named after {P}.",
                  "{X} appointed {P} as its rector in {Y}.",
                  "In {Y}, {X} began offering evening courses in {C}.",
                  "The main hall of {X} was renovated in {Y}."],
        "range": (300, 30000),
    },
    "revenue": {
        "kind": "company",
        "q": ["What was the revenue of {X} in {Y}?", "How much did {X} earn in {Y}?"],
        "s": ["In {y}, {X} had revenue of {v} million euros.",
              "{X} reported sales of {v} million euros for {y}.",
              "Revenue at {X} came to {v} million euros in {y}.",
              "For the year {y}, {X} took in {v} million euros."],
        "other": ["In {Y}, {X} opened a second factory in {C}.",
                  "{X} named {P} as its chief executive in {Y}.",
                  "In {Y}, {X} launched a new line of {Q}.",
                  "{X} moved its head office to {C} in {Y}."],
        "range": (5, 2000),
    },
}



def gen_temporal(rnd: random.Random, nm: Namer, i: int) -> dict:
    metric = list(METRICS)[i % len(METRICS)]
    m = METRICS[metric]
    if m["kind"] == "town":
        X, X_nb = nm.city(), nm.city()
    elif m["kind"] == "college":
        X, X_nb = f"{nm.word(2)} College", f"{nm.word(2)} College"
    else:
        X, X_nb = f"{nm.word(2)} {rnd.choice(NOUNS)}", f"{nm.word(2)} {rnd.choice(NOUNS)}"
    years = rnd.sample(range(1950, 2021, 5), 7)
    Y, others = years[0], years[1:]
    lo, hi = m["range"]
    used = set()

    def fig(x: str, y: int) -> tuple:
        """(statement, figure): x's figure in year y, a value no other statement has."""
        t = rnd.choice(m["s"])
        while True:
            v = rnd.randrange(lo, hi)
            if v not in used:
                used.add(v)
                break
        return t.format(X=x, y=y, v=fmt_int(v)), fmt_int(v)

    q = rnd.choice(m["q"]).format(X=X, Y=Y)
    gold, answer = fig(X, Y)
    dis = [fig(X, y)[0] for y in others[:6]]
    ctx = dict(X=X, Y=Y, C=nm.city(), P=nm.person(), Q=rnd.choice(PRODUCTS))
    dis += [o.format(**ctx) for o in rnd.sample(m["other"], 2)]
    dis.append(fig(X_nb, Y)[0])
    roles = ["other_year"] * 6 + ["same_year_other_fact"] * 2 + ["other_entity_same_year"]
    order = list(range(K - 1))
    rnd.shuffle(order)
    dis = [dis[j] for j in order]
    roles = [roles[j] for j in order]
    pos = rnd.randrange(K)
    return item(q, dis[:pos] + [gold] + dis[pos:], pos,
                roles[:pos] + ["gold"] + roles[pos:], metric, X, answer)


# ---- paraphrase: the gold in other words, the distractors in the question's ----------------

PARA = {
    "birthplace": {
        "q": ["What is the birthplace of {X}?", "Where was {X} born?"],
        "words": "birthplace born",
        "gold": ["{X} first drew breath in the fishing village of {v}, where the family mended "
                 "nets.", "The infant {X} arrived in {v} on a stormy night; the family later "
                 "moved inland."],
        "same": ["The birthplace of {o} is {v2}.", "{o} was born in {v2}."],
        "rel": ["{X} often visited the birthplace of a cousin, {o}, who was born in {v2}."],
        "gen": lambda nm, rnd: nm.city(),
    },
    "occupation": {
        "q": ["What was the occupation of {X}?", "What did {X} do for a living?"],
        "words": "occupation living job",
        "gold": ["{X} spent forty years {v}.", "Most days {X} could be found {v}, work that "
                 "paid for the family house."],
        "same": ["The occupation of {o} was {v2}.", "{o} worked as a {v2} for a living."],
        "rel": ["{X} admired the occupation of a neighbour, {o}, who worked as a {v2}."],
        "gen": None,
    },
    "spouse": {
        "q": ["Who was the spouse of {X}?", "Who was {X} married to?"],
        "words": "spouse married",
        "gold": ["In the spring of their twenty-third year, {X} and {v} exchanged vows in the "
                 "village church.", "{X} shared a house and a life with {v}, whom {X} had met "
                 "at a dance."],
        "same": ["The spouse of {o} was {v2}.", "{o} was married to {v2}."],
        "rel": ["{X} was a witness when a friend, {o}, was married to {v2}."],
        "gen": lambda nm, rnd: nm.person(),
    },
    "death": {
        "q": ["In what year did {X} die?", "When did {X} die?"],
        "words": "year die died death",
        "gold": ["{X} passed away in the winter of {v}, aged seventy.", "The last letter "
                 "{X} wrote is dated {v}; the funeral followed a week later."],
        "same": ["{o} died in {v2}.", "The year of death of {o} was {v2}."],
        "rel": ["{X} attended the funeral of a brother, {o}, who died in {v2}."],
        "gen": lambda nm, rnd: str(rnd.randrange(1790, 1950)),
    },
}

STUFFED = [
    "{Q} This is one of the most frequently asked questions about {X}. Our page "
    "on {X} will be updated when the society's volume appears.",
    "Questions about the {w1} of {X} come up often in the local {w1} archive; the archive "
    "collects {w1} records for many families of the region, including that of {X}.",
    "The {X} Society meets on the first Monday of each month to discuss {X}, the {w1} of "
    "{X}, and other topics; new members who want to learn about {X} are welcome.",
    "Readers interested in {X} and the {w1} of {X} may consult the catalogue of the county "
    "library, which lists every pamphlet about {X} published since 1900.",
    "{X}: {w1}, {w2} and other facts about {X}. See also: people named {Xl}; places "
    "associated with {X}; list of portraits of {X}.",
    "A new exhibition asks visitors to think about {X} and about the {w1} question that "
    "scholars of {X} keep returning to.",
]



def gen_paraphrase(rnd: random.Random, nm: Namer, i: int) -> dict:
    asked = list(PARA)[i % len(PARA)]
    p = PARA[asked]
    X = nm.person()
    if asked == "occupation":
        # the gold describes the work; the others name an occupation, all different
        occ = rnd.sample(OCCUPATIONS, 5)
        v = occ[0][1]
        v2s = [o[0] for o in occ[1:]]
    else:
        v = p["gen"](nm, rnd)
        v2s = []
        while len(v2s) < 4:
            x = p["gen"](nm, rnd)
            if x != v and x not in v2s:
                v2s.append(x)
    q = rnd.choice(p["q"]).format(X=X)
    gold = rnd.choice(p["gold"]).format(X=X, v=v)
    w = p["words"].split()
    ctx = dict(X=X, Xl=X.split()[-1], Q=q, w1=w[0], w2=w[1] if len(w) > 1 else w[0])
    # 1 echo of the question (an FAQ page), 4 other keyword-stuffed non-answers
    dis = [STUFFED[0].format(**ctx)]
    dis += [s.format(**ctx) for s in rnd.sample(STUFFED[1:], 4)]
    roles = ["echo"] + ["stuffed"] * 4
    # 1 relative's same attribute, named with X
    dis.append(rnd.choice(p["rel"]).format(X=X, o=nm.person(), v2=v2s[0]))
    roles.append("relative")
    # 3 other people, the attribute in the question's own words
    for j in range(3):
        dis.append(rnd.choice(p["same"]).format(o=nm.person(), v2=v2s[1 + j]))
        roles.append("other_person")
    order = list(range(K - 1))
    rnd.shuffle(order)
    dis = [dis[j] for j in order]
    roles = [roles[j] for j in order]
    pos = rnd.randrange(K)
    return item(q, dis[:pos] + [gold] + dis[pos:], pos,
                roles[:pos] + ["gold"] + roles[pos:], asked, X, v)


GENERATORS = {"same_entity": gen_same_entity, "similar_name": gen_similar_name,
              "temporal": gen_temporal, "paraphrase": gen_paraphrase}


def items(split: str | None = None, kinds=KINDS, seed: int = SEED) -> list:
    """The items of a split (dev, test; None: both) of the given kinds, kind by kind in
    KINDS' order, each kind's questions in order. A kind's whole stream is generated, so a
    split's items do not depend on which split is asked for."""
    out = []
    for kind in KINDS:
        if kind not in kinds:
            continue
        rnd = random.Random(f"{seed}-{kind}")
        nm = Namer(rnd)
        for i in range(N):
            it = GENERATORS[kind](rnd, nm, i)
            sp = "dev" if i < N // 2 else "test"
            if split in (None, sp):
                out.append({"id": f"{kind}-{i}", "kind": kind, "split": sp, **it})
    return out


# ---- runs ----------------------------------------------------------------------------------

def scores(url: str, headers: dict, it: dict, label: str, fields: dict):
    """The score of each document of item it (by document index) under one method, or an
    error str: BM25 computed here, anything else the server's relevance_score."""
    if label == "bm25" and not fields:
        return quality.bm25(it["query"], [{"text": d} for d in it["documents"]])
    js, _ = quality.post_rerank(url, headers, it, fields)
    if isinstance(js, str):
        return js
    s = [float("-inf")] * len(it["documents"])  # a document left out of the answer ranks last
    for x in js["results"]:
        s[x["index"]] = x["relevance_score"]
    return s


def run(url: str, headers: dict, its: list, specs: list) -> dict:
    """{label: {item id: scores}}; a method the server rejects is {"error": str} (and the run
    goes on)."""
    out = {}
    for label, fields in specs:
        got = out[label] = {}
        for it in its:
            s = scores(url, headers, it, label, fields)
            if isinstance(s, str):
                print(f"{label}: {s}", file=sys.stderr, flush=True)
                out[label] = {"error": s}
                break
            got[it["id"]] = s
        print(f"{label}: done", file=sys.stderr, flush=True)
    return out


# ---- reports -------------------------------------------------------------------------------

def rank_of(s: list, g: int) -> int:
    """The gold's 1-based rank: 1 + the other documents scoring at least as high (ties count
    against the gold)."""
    return 1 + sum(1 for j, x in enumerate(s) if j != g and x >= s[g])


def table(its: list, results: dict) -> str:
    """Markdown: one row per method, per kind (and ALL) R@1 as count / n and the MRR."""
    kinds = [k for k in KINDS if any(it["kind"] == k for it in its)] + ["ALL"]
    head = ["method"] + [f"{k} R@1 / MRR" for k in kinds]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, got in results.items():
        row = [f"`{label}`"]
        if "error" in got:
            lines.append("| " + " | ".join(row + [f"not run: {got['error'][:80]}"]
                                           + [""] * (len(kinds) - 1)) + " |")
            continue
        for k in kinds:
            ranks = [rank_of(got[it["id"]], it["gold_index"]) for it in its
                     if it["id"] in got and k in ("ALL", it["kind"])]
            row.append(f"{sum(r == 1 for r in ranks)}/{len(ranks)} "
                       f"{sum(1 / r for r in ranks) / len(ranks):.2f}" if ranks else "–")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def pairwise(its: list, got: dict) -> str:
    """Markdown: per kind and distractor role, how often a distractor of that role scores at
    least as high as the gold (losses / pairs)."""
    pw = {}
    for it in its:
        s = got.get(it["id"])
        if s is None:
            continue
        g = it["gold_index"]
        for j, role in enumerate(it["roles"]):
            if j != g:
                c = pw.setdefault((it["kind"], role), [0, 0])
                c[0] += s[j] >= s[g]
                c[1] += 1
    lines = ["| kind | distractor | losses / pairs | rate |", "|---|---|---|---|"]
    for kind in KINDS:
        for (k, role), (lost, n) in sorted(pw.items()):
            if k == kind:
                lines.append(f"| {kind} | {role} | {lost}/{n} | {lost / n:.2f} |")
    return "\n".join(lines)


def report(its: list, results: dict, specs: list, split: str, model: str, cmd: str) -> str:
    """The markdown report: the table, the first method's pairwise losses, the methods."""
    out = [f"# Look-alike sets, {split} split: {model}", "",
           "Generated by `tests/quality/lookalikes.py` (its docstring describes the sets); "
           f"`{cmd}`, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.", "",
           "Cells: R@1 as questions with the gold ranked first / questions, then the MRR; a "
           "tie with the gold counts against it.", "", table(its, results), ""]
    first = next(((label, got) for label, got in results.items() if "error" not in got), None)
    if first:
        out += [f"Pairwise losses of `{first[0]}`: how often a distractor of each role scores "
                "at least as high as the gold.", "", pairwise(its, first[1]), ""]
    out += ["Methods (request fields as sent):", ""]
    out += [f"- `{label}`: `{json.dumps(fields)}`" if fields or label != "bm25" else
            f"- `{label}`: BM25 (k1 1.2, b 0.75, the request's K documents as the collection), "
            "computed by the tool" for label, fields in specs]
    out.append("")
    return "\n".join(out)


def show(its: list, n: int) -> None:
    """Print the first n items of each kind, the gold marked *."""
    for kind in KINDS:
        for it in [x for x in its if x["kind"] == kind][:n]:
            print(f"== {it['id']} ({it['split']}) {it['query']}  gold {it['gold_index']}, "
                  f"answer {it['answer']!r}")
            for j, d in enumerate(it["documents"]):
                print(("  * " if j == it["gold_index"] else "    ")
                      + f"[{it['roles'][j]}] {d}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    quality.server_args(ap)
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--method", nargs="+", action="extend", default=None,
                    help="methods to rank with (default: " + " ".join(DEFAULT_METHODS) + ")")
    ap.add_argument("--json", help="write every question's scores per method here")
    ap.add_argument("--markdown", help="write the report here")
    ap.add_argument("--show", type=int, default=0,
                    help="print this many items of each kind of the split and exit")
    a = ap.parse_args()
    its = items(a.split, a.kinds)
    if a.show:
        show(its, a.show)
        return 0
    if not a.model and not a.url:
        ap.error("give --model or --url")
    specs = [quality.parse_spec(s) for s in (a.method or DEFAULT_METHODS)]
    cmd = "python3 tests/quality/lookalikes.py " + " ".join(sys.argv[1:])
    if a.url:
        proc, url = None, a.url
    else:
        proc, url = quality.start_daemon(a.model, a.build, a.daemon_arg)
    headers = {"Authorization": f"Bearer {a.key}"} if a.key else {}
    try:
        model = requests.get(url + "/v1/models", headers=headers).json()["data"][0]["id"]
        results = run(url, headers, its, specs)
    finally:
        if proc:
            proc.terminate()
            proc.wait(60)
    text = report(its, results, specs, a.split, model, cmd)
    print(text)
    if a.markdown:
        pathlib.Path(a.markdown).write_text(text)
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({
            "meta": {"cmd": cmd, "split": a.split, "model": model, "machine": quality.machine(),
                     "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"},
            "specs": specs,
            "questions": [{k: it[k] for k in ("id", "kind", "split", "attribute",
                                              "gold_index", "roles")} for it in its],
            "scores": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
