#!/usr/bin/env python3
"""The quality sets: fictional multi-document QA, generated deterministically from a seed, so
that only the documents can answer (no entity exists outside them).

Every question asks for one attribute of one fictional entity (a person, a company or a
town); K documents describe K entities of the same kind in the same shape, one of them the
gold entity. Two variants:

  plain  the distractors are about unrelated entities of the same kind.
  hard   every distractor shares part of the gold entity's name (a person's first or family
         name, a company's or town's name stem) and states the asked attribute, so it repeats
         the question's words about another entity.

Two splits with disjoint name syllables and disjoint wordings (document sentences and
question templates): `dev` (for choosing options and fitting profiles) and `test` (for
reporting once). For each (split, variant, K) there are N question groups; a group's gold
document is placed first, in the middle ((K + 1) // 2, 1-based) and last, the other
documents keeping their order, so the three positions are paired on the same questions.

Item (one per group and gold position), as written to tests/quality/data/<split>.jsonl:
  {"id", "split", "variant", "k", "gold_pos" (1-based), "query", "documents": [{"title",
   "text"}], "gold_index" (0-based), "answer"}

  python3 tests/quality/dataset.py            # rewrite tests/quality/data/{dev,test}.jsonl
  python3 tests/quality/dataset.py --check    # exit 1 when the files differ from the script's
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys

HERE = pathlib.Path(__file__).resolve().parent
DATA = HERE / "data"
SEED = 9
GROUPS = 50
KS = (10, 20)
VARIANTS = ("plain", "hard")

# Disjoint name material per split.
SYLLABLES = {
    "dev": "ka lo mi ra ven tor shi bel qua dre nim os tal fen gor wyn pel zar ith un".split(),
    "test": "ba ce du fo gi ha je ku ly ma ne po ri su te vo xa yu zo ar".split(),
}
PRODUCTS = {
    "dev": ["copper kettles", "glass lanterns", "wool blankets", "rope ladders",
            "clay pipes", "brass compasses", "paper kites", "oak barrels"],
    "test": ["iron anchors", "silk banners", "tin whistles", "leather saddles",
             "stone mortars", "reed baskets", "wax candles", "linen sails"],
}
PROFESSIONS = {
    "dev": ["cartographer", "glassblower", "botanist", "clockmaker", "ferry pilot",
            "archivist", "stonemason", "beekeeper"],
    "test": ["astronomer", "bookbinder", "shipwright", "perfumer", "bell founder",
             "surveyor", "weaver", "lock keeper"],
}
RIVERS = {"dev": ["Velm", "Ossar", "Trine", "Kell", "Amber", "Dusk"],
          "test": ["Fold", "Marrow", "Sable", "Quill", "Hollow", "Brae"]}

# Per split and kind: document sentences (one per attribute, in order) and the questions that
# ask for one attribute. {name} is the entity; other fields are its attributes.
WORDING = {
    "dev": {
        "person": {
            "sentences": [
                "{name} was born in the town of {town} in {year}.",
                "{name} worked for many years as a {profession}.",
                "In later life {name} married {spouse}, a teacher from the coast.",
                "{name} is best remembered for a map of the {river} valley.",
            ],
            "questions": [
                ("In which town was {name} born?", "town"),
                ("In which year was {name} born?", "year"),
                ("Whom did {name} marry?", "spouse"),
                ("What was the profession of {name}?", "profession"),
            ],
        },
        "company": {
            "sentences": [
                "{name} was founded by {founder} in {year}.",
                "The firm has its head office in {town}.",
                "{name} is known for making {product}.",
                "Its ships carried goods up the {river} every spring.",
            ],
            "questions": [
                ("Who founded {name}?", "founder"),
                ("In which year was {name} founded?", "year"),
                ("Where is the head office of {name}?", "town"),
                ("What does {name} make?", "product"),
            ],
        },
        "town": {
            "sentences": [
                "{name} lies on the banks of the river {river}.",
                "The mayor of {name} is {mayor}.",
                "{name} received its charter in {year}.",
                "The town market of {name} is famous for {product}.",
            ],
            "questions": [
                ("Who is the mayor of {name}?", "mayor"),
                ("On which river does {name} lie?", "river"),
                ("In which year did {name} receive its charter?", "year"),
                ("What is the market of {name} famous for?", "product"),
            ],
        },
    },
    "test": {
        "person": {
            "sentences": [
                "Records give {year} as the year {name} came into the world, in {town}.",
                "By trade {name} was a {profession}.",
                "{name} and {spouse} wed after a long courtship.",
                "Travellers on the {river} still tell stories about {name}.",
            ],
            "questions": [
                ("Where did {name} come into the world?", "town"),
                ("When was {name} born?", "year"),
                ("Who was the spouse of {name}?", "spouse"),
                ("What trade did {name} follow?", "profession"),
            ],
        },
        "company": {
            "sentences": [
                "{founder} started {name} in the year {year}.",
                "{name} keeps its headquarters in {town}.",
                "The workshops of {name} turn out {product}.",
                "Barges of the firm still work the {river}.",
            ],
            "questions": [
                ("Which person started {name}?", "founder"),
                ("When was {name} started?", "year"),
                ("In which town are the headquarters of {name}?", "town"),
                ("What do the workshops of {name} turn out?", "product"),
            ],
        },
        "town": {
            "sentences": [
                "The river {river} flows through {name}.",
                "{mayor} currently serves as mayor of {name}.",
                "A royal charter was granted to {name} in {year}.",
                "{name} is a market town, famous for {product}.",
            ],
            "questions": [
                ("Who serves as mayor of {name}?", "mayor"),
                ("Which river flows through {name}?", "river"),
                ("When was {name} granted its charter?", "year"),
                ("For what is the market town {name} famous?", "product"),
            ],
        },
    },
}
COMPANY_SUFFIX = {"dev": ["Works", "Trading Company", "and Sons", "Foundry"],
                  "test": ["Holdings", "Guild", "Brothers", "Manufactory"]}
TOWN_SUFFIX = {"dev": ["ford", "holm", "wick"], "test": ["bury", "stead", "mouth"]}


class Namer:
    """Fresh names from a split's syllables (this module's, or those given); never the same
    name twice in one group."""

    def __init__(self, rnd: random.Random, split: str, syllables: dict | None = None):
        self.rnd, self.syl, self.used = rnd, (syllables or SYLLABLES)[split], set()

    def word(self, n: int) -> str:
        while True:
            w = "".join(self.rnd.choice(self.syl) for _ in range(n)).capitalize()
            if w not in self.used:
                self.used.add(w)
                return w

    def person(self) -> tuple:
        return (self.word(2), self.word(3))


def entity_name(kind: str, parts: tuple) -> str:
    return parts[0] + parts[1] if kind == "town" else f"{parts[0]} {parts[1]}"


def attributes(rnd: random.Random, namer: Namer, split: str) -> dict:
    return dict(town=namer.word(2) + rnd.choice(TOWN_SUFFIX[split]),
                year=str(rnd.randint(1610, 1930)),
                profession=rnd.choice(PROFESSIONS[split]),
                spouse=" ".join(namer.person()),
                founder=" ".join(namer.person()),
                mayor=" ".join(namer.person()),
                product=rnd.choice(PRODUCTS[split]),
                river=rnd.choice(RIVERS[split]))


def new_parts(kind: str, rnd: random.Random, namer: Namer, split: str) -> tuple:
    if kind == "person":
        return namer.person()
    if kind == "company":
        return (namer.word(3), rnd.choice(COMPANY_SUFFIX[split]))
    return (namer.word(2), rnd.choice(TOWN_SUFFIX[split]))


def hard_parts(kind: str, gold: tuple, i: int, rnd: random.Random, namer: Namer,
               split: str, taken: set) -> tuple:
    """A distractor's name sharing one part with the gold name: a person's first or family
    name (alternating); for companies and towns the gold's stem with another suffix while
    such names are left, else the gold's suffix with another stem."""
    if kind == "person":
        return (gold[0], namer.word(3)) if i % 2 else (namer.word(2), gold[1])
    suffixes = COMPANY_SUFFIX[split] if kind == "company" else TOWN_SUFFIX[split]
    free = [s for s in suffixes if entity_name(kind, (gold[0], s)) not in taken]
    if i % 2 and free:
        return (gold[0], free[0])
    return (namer.word(3 if kind == "company" else 2), gold[1])


def document(kind: str, name: str, attrs: dict, split: str) -> dict:
    text = " ".join(s.format(name=name, **attrs) for s in WORDING[split][kind]["sentences"])
    return {"title": name, "text": text}


def make_group(rnd: random.Random, split: str, variant: str, k: int) -> dict:
    """One question and its K documents, gold first (index 0)."""
    namer = Namer(rnd, split)
    kind = rnd.choice(sorted(WORDING[split]))
    question, attr = rnd.choice(WORDING[split][kind]["questions"])
    gold_parts = new_parts(kind, rnd, namer, split)
    gold_name = entity_name(kind, gold_parts)
    gold_attrs = attributes(rnd, namer, split)
    docs = [document(kind, gold_name, gold_attrs, split)]
    names = {gold_name}
    values = {gold_attrs[attr]}
    for i in range(1, k):
        while True:
            parts = (hard_parts(kind, gold_parts, i, rnd, namer, split, names) if variant == "hard"
                     else new_parts(kind, rnd, namer, split))
            name = entity_name(kind, parts)
            if name not in names:
                break
        names.add(name)
        attrs = attributes(rnd, namer, split)
        # The gold answer must not also be a distractor's answer to the same attribute.
        while attrs[attr] in values and attr in ("year", "product", "river", "profession"):
            attrs = attributes(rnd, namer, split)
        docs.append(document(kind, name, attrs, split))
    return {"query": question.format(name=gold_name), "documents": docs,
            "answer": gold_attrs[attr], "kind": kind, "attribute": attr}


def positions(k: int) -> list:
    return [1, (k + 1) // 2, k]


def items(split: str, groups: int = GROUPS, seed: int = SEED) -> list:
    """Every item of one split, in a fixed order."""
    out = []
    for variant in VARIANTS:
        for k in KS:
            rnd = random.Random(f"{seed}/{split}/{variant}/{k}")
            for g in range(groups):
                grp = make_group(rnd, split, variant, k)
                gold, rest = grp["documents"][0], grp["documents"][1:]
                for pos in positions(k):
                    docs = rest[:pos - 1] + [gold] + rest[pos - 1:]
                    out.append({"id": f"{split}-{variant}-k{k}-g{g:02d}-p{pos}", "split": split,
                                "variant": variant, "k": k, "gold_pos": pos,
                                "query": grp["query"], "documents": docs,
                                "gold_index": pos - 1, "answer": grp["answer"],
                                "kind": grp["kind"], "attribute": grp["attribute"]})
    return out


def moved(it: dict, pos: int) -> dict:
    """The item with its gold document moved to position pos (1-based), the other documents
    keeping their order: positions beyond first / middle / last, paired on the same question
    (quality.py --positions)."""
    docs = list(it["documents"])
    gold = docs.pop(it["gold_index"])
    docs.insert(pos - 1, gold)
    return {**it, "id": it["id"].rsplit("-p", 1)[0] + f"-p{pos}", "gold_pos": pos,
            "documents": docs, "gold_index": pos - 1}


def group(it: dict) -> int:
    """The question group an item belongs to (the gNN of its id)."""
    return int(it["id"].split("-g")[1][:2])


def render(split: str) -> str:
    return "".join(json.dumps(it, ensure_ascii=False, sort_keys=True) + "\n"
                   for it in items(split))


def load(split: str, path: pathlib.Path | None = None) -> list:
    """The committed items of a split (dev or test)."""
    path = path or DATA / f"{split}.jsonl"
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true",
                    help="compare the committed files with a fresh generation")
    a = ap.parse_args()
    DATA.mkdir(exist_ok=True)
    bad = 0
    for split in ("dev", "test"):
        path = DATA / f"{split}.jsonl"
        text = render(split)
        if a.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                print(f"{path} differs from `python3 tests/quality/dataset.py`")
                bad = 1
        else:
            path.write_text(text, encoding="utf-8")
            print(f"{path}: {text.count(chr(10))} items")
    return bad


if __name__ == "__main__":
    sys.exit(main())
