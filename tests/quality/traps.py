#!/usr/bin/env python3
"""The trap sets: fictional biographies where the distractors that matter *name the asked
person* and carry the asked attribute's words about someone else, so that the question's
words (the name, "born", the prize) point at them as much as at the gold document.

Every question asks one attribute (city or year of birth, profession, prize) of one fictional
person X. The gold document is X's biography. Of the other K - 1 documents, `n_traps` are
traps, each in a different form:

  correspondence  X corresponded with Y; the two met in Y's city of birth.
  relative        X had a cousin, Y, who was born in ...
  namesake        Y was named after X ...
  place           a town named after X, where Y was born ...
  negated         X was *not* born in ..., did not work as ..., never received ... (a claim
                  about X, denied; the values are not X's)

and every trap states all four attributes (city, year, profession, prize) for its own
subject, so whatever is asked, the trap repeats the question's words. The rest are unrelated
biographies in the gold's shape. No value the question asks appears in any document but the
gold.

Variants: `traps` (titled: a document's title is its subject's name, 2 traps),
`traps_untitled` (every title empty, 3 traps), `traps_long` (untitled, 3 traps, the gold and
the unrelated biographies seven sentences long: the asked attribute is one sentence among
others about the person's life, while each trap is two short sentences of the asked person's
name and the attribute's words, the shape that favours a trap for a signal that measures how
much of a document the question's words cover) and `traps_pronoun` (untitled, 3 traps, the
gold and the unrelated biographies name their person once and then say "he" or "she": the
traps name the asked person as often as the gold does, the denied claim twice). K = 10 and
20; each group's gold document is placed first, in the middle ((K + 1) // 2) and last, the
other documents keeping their order (paired positions, as in dataset.py). Splits `dev` and `test` share no name syllable, city
suffix, profession, prize word, document sentence or question wording; `dev2`, a third wording
for choosing only (tests/quality/fuse_sweep.py), shares none with `test` either.

The items are generated on the fly (deterministic: the same seed gives the same items), in
dataset.py's item format plus "traps": the 0-based indices of the trap documents and
"forms": their forms. quality.py takes them with `--variants traps traps_untitled`.

    python3 tests/quality/traps.py --split dev --show 2    # print two groups
"""
from __future__ import annotations

import argparse
import json
import random
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import dataset  # noqa: E402

SEED = 39
GROUPS = 50
KS = (10, 20)
VARIANTS = ("traps", "traps_untitled", "traps_long", "traps_pronoun")
N_TRAPS = {"traps": 2, "traps_untitled": 3, "traps_long": 3, "traps_pronoun": 3}
FORMS = ("correspondence", "relative", "namesake", "place", "negated")
ATTRIBUTES = ("city", "year", "profession", "prize")

SYLLABLES = {
    "dev": "cal bar dor bel gus pel mar ru kor ob sen ti vad lon fir ga hes tum ev ro".split(),
    "test": "zan wel dru pim oth ask vey lib num che rak sul hon bri ef dag mos ul ten ky".split(),
    "dev2": "nor vil tas qua mep fen jor hal dri sto bix pra wum lek yor gim tro zel cas mun".split(),
}
CITY_SUFFIX = {"dev": ["ford", "holm", "wick", "port"], "test": ["bury", "stead", "mouth", "gate"],
               "dev2": ["ton", "field", "burgh", "haven"]}
PROFESSIONS = {
    "dev": ["cartographer", "glassblower", "botanist", "clockmaker", "ferry pilot", "archivist",
            "stonemason", "beekeeper", "sculptor", "organ builder", "tanner", "chemist"],
    "test": ["astronomer", "bookbinder", "shipwright", "perfumer", "bell founder", "surveyor",
             "weaver", "lock keeper", "engraver", "violin maker", "cooper", "apothecary"],
    "dev2": ["miller", "tailor", "potter", "blacksmith", "carpenter", "printer", "glazier",
             "saddler", "chandler", "jeweller", "furrier", "cordwainer"],
}
PRIZE_KIND = {"dev": ["Medal", "Prize", "Cup"], "test": ["Award", "Laurel", "Ribbon"],
              "dev2": ["Star", "Shield", "Crown"]}
RELATIVES = {"dev": ["cousin", "nephew", "niece"], "test": ["brother-in-law", "grandson",
                                                            "granddaughter"],
             "dev2": ["uncle", "stepdaughter", "stepson"]}

# {n}: the subject's name; {x}: the asked person's name (traps); {p}: the place named after X.
WORDING = {
    "dev": {
        "bio": ["The parish book notes that {n} was born in the city of {city} in {year}.",
                "{n} worked for many years as a {profession}.",
                "In middle age {n} was awarded the {prize} for that work."],
        "bio_long": ["{n} grew up in a family of millers and learned to read under a village "
                     "priest.",
                     "The parish book notes that {n} was born in the city of {city} in {year}.",
                     "As a young adult {n} spent two winters copying maps for a merchant house.",
                     "{n} worked for many years as a {profession}.",
                     "Friends remembered {n} as quiet, stubborn and generous with money.",
                     "In middle age {n} was awarded the {prize} for that work.",
                     "{n} died after a short illness, leaving notebooks and drawings to a "
                     "nephew."],
        "bio_pronoun": ["The parish book notes that {n} was born in the city of {city} in "
                        "{year}.",
                        "{He} worked for many years as a {profession}.",
                        "In middle age {he} was awarded the {prize} for that work."],
        "correspondence": ["{x} corresponded for years with the {profession} {n}; the two "
                           "first met in {city}, where {n} was born in {year}.",
                           "{n} worked as a {profession} and was awarded the {prize}."],
        "relative": ["{x} had a {relative}, {n}, who was born in the city of {city} in {year}.",
                     "{n} worked as a {profession} and was awarded the {prize}."],
        "namesake": ["{n} was named after {x} and was born in the city of {city} in {year}.",
                     "{n} worked as a {profession} and was awarded the {prize}."],
        "place": ["The town of {p} was named after {x}.",
                  "{n}, who was born in {p} in {year}, worked as a {profession} and was "
                  "awarded the {prize}."],
        "negated": ["Contrary to an old story, {x} was not born in the city of {city} in {year}.",
                    "{x} never worked as a {profession} and was not awarded the {prize}."],
        "questions": {"city": "What is the birthplace of {x}?",
                      "year": "What is the birth year of {x}?",
                      "profession": "What was the job of {x}?",
                      "prize": "Which honour went to {x}?"},
    },
    "test": {
        "bio": ["Records give {year} as the year {n} came into the world, in {city}.",
                "By trade {n} was a {profession}.",
                "Late in life {n} received the {prize}."],
        "bio_long": ["Raised by an aunt near the harbour, {n} showed an early gift for numbers.",
                     "Records give {year} as the year {n} came into the world, in {city}.",
                     "Later {n} travelled widely, keeping careful diaries of each journey.",
                     "By trade {n} was a {profession}.",
                     "Neighbours described {n} as cheerful, restless and fond of music.",
                     "Late in life {n} received the {prize}.",
                     "{n} passed away peacefully at home, survived by three children."],
        "bio_pronoun": ["Records give {year} as the year {n} came into the world, in {city}.",
                        "By trade {he} was a {profession}.",
                        "Late in life {he} received the {prize}."],
        "correspondence": ["{x} wrote letters for decades to {n}, a {profession} living in "
                           "{city}, where {n} came into the world in {year}.",
                           "By trade {n} was a {profession}, and {n} received the {prize}."],
        "relative": ["{x} had a {relative}, {n}, who came into the world in {city} in {year}.",
                     "By trade {n} was a {profession}, and {n} received the {prize}."],
        "namesake": ["{n}, whose parents named the child for {x}, came into the world in "
                     "{city} in {year}.",
                     "By trade {n} was a {profession}, and {n} received the {prize}."],
        "place": ["{p} takes its name from {x}.",
                  "{n} came into the world in {p} in {year}, was by trade a {profession} "
                  "and received the {prize}."],
        "negated": ["It is wrongly said that {x} came into the world in {city} in {year}.",
                    "{x} was never a {profession} by trade and never received the {prize}."],
        "questions": {"city": "Where was {x} born?",
                      "year": "When was {x} born?",
                      "profession": "What was the occupation of {x}?",
                      "prize": "Which award did {x} receive?"},
    },
}
WORDING["dev2"] = {
    "bio": ["{n} was born in {year} in the town of {city}.",
            "{n} earned a livelihood as a {profession}.",
            "{n} was eventually honoured with the {prize}."],
    "bio_long": ["{n} was the youngest of five in a carter's family.",
                 "{n} was born in {year} in the town of {city}.",
                 "Aged sixteen, {n} left the village with a borrowed coat and little else.",
                 "{n} earned a livelihood as a {profession}.",
                 "People who met {n} spoke of a dry humour and a long memory.",
                 "{n} was eventually honoured with the {prize}.",
                 "{n} spent the last years on the coast, writing to old friends."],
    "bio_pronoun": ["{n} was born in {year} in the town of {city}.",
                    "{He} earned a livelihood as a {profession}.",
                    "{He} was eventually honoured with the {prize}."],
    "correspondence": ["{x} kept up a long correspondence with {n}, a {profession} of "
                       "{city}, where {n} was born in {year}.",
                       "{n} earned a livelihood as a {profession} and was eventually honoured "
                       "with the {prize}."],
    "relative": ["The {relative} of {x}, {n}, was born in {city} in {year}.",
                 "{n} earned a livelihood as a {profession} and was honoured with the {prize}."],
    "namesake": ["{n}, who was named in honour of {x}, was born in {city} in {year}.",
                 "{n} earned a livelihood as a {profession} and was honoured with the {prize}."],
    "place": ["The village of {p} was called after {x}.",
              "{n} was born in {p} in {year}, earned a livelihood as a {profession} and was "
              "honoured with the {prize}."],
    "negated": ["Some sources claim that {x} was born in {city} in {year}, a claim without "
                "basis.",
                "{x} never earned a livelihood as a {profession} and was never honoured with "
                "the {prize}."],
    "questions": {"city": "In which town was {x} born?",
                  "year": "In what year was {x} born?",
                  "profession": "What did {x} do for a living?",
                  "prize": "What honour did {x} receive?"},
}
NEGATED_TITLE = {"dev": "A story about {x}", "test": "What is said of {x}",
                 "dev2": "Claims about {x}"}


class Namer(dataset.Namer):
    """dataset's namer on this module's syllables; a person is one string."""

    def __init__(self, rnd: random.Random, split: str):
        super().__init__(rnd, split, SYLLABLES)

    def person(self) -> str:
        return f"{self.word(2)} {self.word(3)}"


def attributes(rnd: random.Random, namer: Namer, split: str, avoid: dict | None = None) -> dict:
    """A subject's four attribute values, none equal to the value avoid (the gold's) has."""
    while True:
        a = {"city": namer.word(2) + rnd.choice(CITY_SUFFIX[split]),
             "year": str(rnd.randint(1610, 1930)),
             "profession": rnd.choice(PROFESSIONS[split]),
             "prize": f"{namer.word(2)} {rnd.choice(PRIZE_KIND[split])}"}
        if not avoid or all(a[k] != avoid[k] for k in a):
            return a


def fill(sentences: list, **kv) -> str:
    text = " ".join(s.format(**kv) for s in sentences)
    return re.sub(r"\b([Aa]) ([aeiou])", r"\1n \2", text)


def make_group(rnd: random.Random, split: str, variant: str, k: int) -> dict:
    """One question and its K documents, gold first (index 0), traps at random places."""
    namer = Namer(rnd, split)
    w = WORDING[split]
    attr = rnd.choice(ATTRIBUTES)
    x = namer.person()
    gold_attrs = attributes(rnd, namer, split)
    titled = variant == "traps"
    bio = {"traps_long": w["bio_long"], "traps_pronoun": w["bio_pronoun"]}.get(variant, w["bio"])
    pronoun = variant == "traps_pronoun"

    def he() -> dict:  # the subject's pronoun, for the one-mention biographies
        p = rnd.choice(("he", "she")) if pronoun else "he"
        return {"he": p, "He": p.capitalize()}
    docs = [{"title": x if titled else "", "text": fill(bio, n=x, **he(), **gold_attrs)}]
    forms = rnd.sample(FORMS, N_TRAPS[variant])
    others = []
    for form in forms:
        y = namer.person()
        a = attributes(rnd, namer, split, gold_attrs)
        place = namer.word(2) + rnd.choice(CITY_SUFFIX[split])
        text = fill(w[form], n=y, x=x, p=place, relative=rnd.choice(RELATIVES[split]), **a)
        title = (NEGATED_TITLE[split].format(x=x) if form == "negated" else
                 place if form == "place" else y)
        others.append(({"title": title if titled else "", "text": text}, form))
    while len(others) < k - 1:
        y = namer.person()
        a = attributes(rnd, namer, split, gold_attrs)
        others.append(({"title": y if titled else "", "text": fill(bio, n=y, **he(), **a)},
                       None))
    rnd.shuffle(others)
    return {"query": w["questions"][attr].format(x=x), "entity": x,
            "documents": docs + [d for d, _ in others], "forms": [f for _, f in others],
            "answer": gold_attrs[attr], "attribute": attr}


def positions(k: int) -> list:
    return [1, (k + 1) // 2, k]


def items(split: str, groups: int = GROUPS, seed: int = SEED, variants=VARIANTS,
          ks=KS) -> list:
    """Every item of one split (dev or test) for the variants and Ks, in a fixed order."""
    if split not in WORDING:
        raise ValueError(f"unknown split {split!r}")
    out = []
    for variant in variants:
        for k in ks:
            rnd = random.Random(f"{seed}/{split}/{variant}/{k}")
            for g in range(groups):
                grp = make_group(rnd, split, variant, k)
                gold, rest = grp["documents"][0], grp["documents"][1:]
                for pos in positions(k):
                    docs = rest[:pos - 1] + [gold] + rest[pos - 1:]
                    forms = grp["forms"][:pos - 1] + [None] + grp["forms"][pos - 1:]
                    out.append({"id": f"{split}-{variant}-k{k}-g{g:02d}-p{pos}", "split": split,
                                "variant": variant, "k": k, "gold_pos": pos,
                                "query": grp["query"], "documents": docs,
                                "gold_index": pos - 1, "answer": grp["answer"],
                                "kind": "person", "attribute": grp["attribute"],
                                "entity": grp["entity"],
                                "traps": [i for i, f in enumerate(forms) if f],
                                "forms": [f for f in forms if f]})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", default="dev", choices=sorted(WORDING))
    ap.add_argument("--variant", default="traps", choices=VARIANTS)
    ap.add_argument("--k", type=int, default=10, choices=KS)
    ap.add_argument("--show", type=int, default=1, help="groups to print (gold first)")
    a = ap.parse_args()
    for it in items(a.split, a.show, variants=(a.variant,), ks=(a.k,)):
        if it["gold_pos"] == 1:
            print(json.dumps(it, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
