"""Recall drills: short synthetic documents whose later lines copy values stated earlier, for pretraining.

An agent copies what it reads: a number from the user's message into a tool call, a path from a
listing into the next call, a result into its answer. The shipped models did not learn that from the
corpus (teacher-forced on a repeated string they predicted the second copy of a random digit string at
chance and of a list of words never), a known gap of small models trained on few tokens, whose
induction (find the earlier occurrence, copy what followed it) forms late on natural text. These
documents make copying the only way to predict their second half: values no model can guess (random
numbers, made-up names, paths, dates, hex ids), stated once in one of several formats (a table, code
assignments, JSON, sentences, a plain sequence) and then asked for, repeated or reformatted. Every
token is scored (AR pretraining): the first statement is noise, the copies are the lesson.

Seeds decide everything; training, validation and test draw disjoint seed ranges (the chat data's).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator

from clover.training.synthetic import SPLIT_SEEDS, check_share

_SYLLABLES = ("ka ri mo len tas vel dor mi ssa bru qen zo fa nit lo gra pe hul wen tiv ar os "
              "ul cre dan vix pol sen thu").split()
WORDS = ("apple river stone cloud maple tiger piano orbit candle harbor lemon violet falcon meadow copper "
          "silver garden rocket winter summer forest island pepper castle bridge planet amber cedar delta "
          "ember frost glacier hollow ivory jasper kettle lantern marble nectar onyx pebble quartz raven "
          "saffron thistle umber velvet willow yarrow zephyr").split()
_DIRS = ("srv data home tmp var opt logs src build cache reports archive config notes").split()
_EXTS = ("txt log csv json py md yaml cfg").split()
_KEYS = ("id port host user city count total limit path owner status code price size level mode "
         "target region score token").split()


def made_up_name(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def _number(rng: random.Random) -> str:
    digits = rng.choice((1, 2, 3, 3, 4, 4, 5, 5, 6, 7))
    n = str(rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits - 1))
    return n if rng.random() > 0.15 else f"{n}.{rng.randint(0, 99):02d}"


def _path(rng: random.Random) -> str:
    parts = [rng.choice(_DIRS) for _ in range(rng.randint(1, 3))] + [rng.choice(WORDS) + str(rng.randint(0, 99))]
    return "/" + "/".join(parts) + "." + rng.choice(_EXTS)


def _ident(rng: random.Random) -> str:
    return "_".join(rng.sample(WORDS, rng.randint(1, 2))) + (str(rng.randint(0, 999)) if rng.random() < 0.5 else "")


def _date(rng: random.Random) -> str:
    return f"{rng.randint(1990, 2035)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _hex(rng: random.Random) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(rng.randint(4, 10)))


VALUES: tuple[Callable[[random.Random], str], ...] = (_number, _number, _number, made_up_name, _path, _ident, _date, _hex,
                                                      lambda rng: rng.choice(WORDS))


def _value(rng: random.Random) -> str:
    return rng.choice(VALUES)(rng)


def _keys(rng: random.Random, n: int) -> list[str]:
    """n distinct keys: field names, words, made-up names or short ids."""
    keys: list[str] = []
    while len(keys) < n:
        k = rng.choice((lambda: rng.choice(_KEYS), lambda: rng.choice(WORDS), lambda: made_up_name(rng).lower(),
                        lambda: rng.choice(_KEYS) + "_" + str(rng.randint(1, 99))))()
        if k not in keys:
            keys.append(k)
    return keys


def _queries(rng: random.Random, items: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Some of the items, in a new order, one of them maybe twice."""
    asked = rng.sample(items, rng.randint(1, len(items)))
    if rng.random() < 0.3:
        asked.append(rng.choice(items))
    return asked


def table(rng: random.Random) -> str:
    items = list(zip(_keys(rng, rng.randint(2, 8)), [_value(rng) for _ in range(8)], strict=False))
    sep = rng.choice((": ", " = ", " -> ", "\t"))
    head = rng.choice(("records:", "inventory", "# settings", "Table", "entries"))
    lines = [head] + [f"{k}{sep}{v}" for k, v in items] + [""]
    ask = rng.choice(("lookup {k}: {v}", "{k}? {v}", "get({k}) returns {v}", "The {k} is {v}."))
    lines += [ask.format(k=k, v=v) for k, v in _queries(rng, items)]
    return "\n".join(lines)


def code(rng: random.Random) -> str:
    items = [(_ident(rng).replace("-", "_"), _value(rng)) for _ in range(rng.randint(2, 6))]
    items = list(dict(items).items())

    def lit(v: str) -> str:
        return v if v.replace(".", "", 1).isdigit() else json.dumps(v)
    lines = [f"{k} = {lit(v)}" for k, v in items] + [""]
    for k, v in _queries(rng, items):
        lines.append(rng.choice((f"assert {k} == {lit(v)}", f"print({k})  # {v}", f"log({k!r}, {lit(v)})")))
    return "\n".join(lines)


def record(rng: random.Random) -> str:
    items = list(zip(_keys(rng, rng.randint(2, 6)), [_value(rng) for _ in range(6)], strict=False))
    obj = json.dumps(dict(items))
    form = rng.choice(("kv", "json", "call"))
    if form == "kv":
        again = " ".join(f"{k}={v}" for k, v in items)
    elif form == "json":
        again = json.dumps(dict(_queries(rng, items)))
    else:
        again = f"{_ident(rng)}(" + ", ".join(f"{k}={json.dumps(v)}" for k, v in _queries(rng, items)) + ")"
    return f"{obj}\n{again}"


def sentences(rng: random.Random) -> str:
    person, place, amount, code_, day = made_up_name(rng), made_up_name(rng), _number(rng), _hex(rng), _date(rng)
    facts = [f"{person} lives in {place}.", f"The order total was {amount}.", f"The access code is {code_}.",
             f"The meeting is on {day}."]
    rng.shuffle(facts)
    asks = [(f"Where does {person} live? In {place}.", 0), (f"What was the total? {amount}.", 1),
            (f"Which code opens it? {code_}.", 2), (f"When is the meeting? On {day}.", 3)]
    rng.shuffle(asks)
    return " ".join(facts) + "\n" + "\n".join(q for q, _ in asks[: rng.randint(1, 4)])


def sequence(rng: random.Random) -> str:
    kind = rng.choice(("digits", "words", "names", "mixed"))
    n = rng.randint(4, 16)
    if kind == "digits":
        seq = [str(rng.randint(0, 9)) for _ in range(n)]
    elif kind == "words":
        seq = [rng.choice(WORDS) for _ in range(n)]
    elif kind == "names":
        seq = [made_up_name(rng) for _ in range(max(2, n // 3))]
    else:
        seq = [_value(rng) for _ in range(max(2, n // 3))]
    sep = rng.choice((" ", ", ", "") if kind == "digits" else (" ", ", ", " | "))
    text = sep.join(seq)
    return f"{rng.choice(('sequence', 'copy', 'input', 'say'))}: {text}\n{rng.choice(('again', 'output', 'echo'))}: {text}"


FORMATS: tuple[Callable[[random.Random], str], ...] = (table, code, record, sentences, sequence)

# Crossing drills. The byte-level tokenizer glues a space to the word after it, so a value spelt on a line of its
# own (`\nOthru`: `Oth`+`ru`, a tool's answer, a call's argument) and after a space (` Oth`+`ru`, a sentence that
# quotes it) starts with different tokens, and copying it from one place to the other cannot write back the
# token it attended to. The other formats restate values in the spelling they were stated in; these cross it.
_ONSETS = ("b c d f g h j k l m n p r s t v w z br dr gr kr pl st th sh ch qu").split()
_VOWELS = ("a e i o u a e o ai ou ei").split()
_CODAS = ("", "", "", "n", "r", "s", "l", "th", "x", "m")


def wide_name(rng: random.Random) -> str:
    """A made-up name from a wide syllable inventory (1,792 syllables), capitalised or not."""
    name = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(2, 3)))
    return name.capitalize() if rng.random() < 0.6 else name


def _spelt(rng: random.Random) -> str:
    """A value that starts with a letter: the kind whose first token differs between the two spellings."""
    word = rng.choice(WORDS)
    return rng.choice((lambda: made_up_name(rng), lambda: wide_name(rng), lambda: wide_name(rng), lambda: word,
                       lambda: word.capitalize(), lambda: f"{word}{rng.randint(1, 99)}",
                       lambda: f"{word}-{rng.randint(1, 9)}", lambda: f"{word[:3].upper()}-{rng.randint(100, 9999)}",
                       lambda: " ".join(rng.sample(WORDS, rng.randint(2, 3))), lambda: _ident(rng)))()


_ON_A_LINE = ("{k}:\n{v}", "<{k}>\n{v}\n</{k}>", "[{k}]\n{v}", "{k}\n{v}", "<tool_response>\n{v}\n</tool_response>",
              "<parameter={k}>\n{v}\n</parameter>")
_AFTER_A_SPACE = ("The {k} is {v}.", "It answered {v}.", "So {k} = {v}", "Result for {k}: {v}", "{k} was {v}, as stated.",
                  "Use {v} as the {k}.", "What is the {k} of {v}?", "I need {v} for {k}.")


def crossing(rng: random.Random) -> str:
    """Values stated in one spelling and restated in the other: each on a line of its own, then quoted after a
    space, or the other way round (a user names it in a sentence, a call writes it on its own line). Known
    flaw, kept so that session 37's data can be rebuilt: with several values, forms without the key or with the
    value before it leave about 31% of the restated values without a cue to which one comes next."""
    items = list(zip(_keys(rng, rng.randint(1, 4)), [_spelt(rng) for _ in range(4)], strict=False))
    forms = (_ON_A_LINE, _AFTER_A_SPACE) if rng.random() < 0.5 else (_AFTER_A_SPACE, _ON_A_LINE)
    stated, asked = rng.choice(forms[0]), rng.choice(forms[1])
    return "\n".join([stated.format(k=k, v=v) for k, v in items] + [""]
                     + [asked.format(k=k, v=v) for k, v in _queries(rng, items)])


def drill(seed: int, crossing_share: float = 0.0) -> str:
    """One document: 2-5 drills of random formats, blank lines between; each drill a crossing drill with
    probability `crossing_share` (at 0 no draw is made: the documents are those written before it existed)."""
    rng = random.Random(seed)

    def one() -> str:
        if crossing_share > 0 and rng.random() < crossing_share:
            return crossing(rng)
        return rng.choice(FORMATS)(rng)
    return "\n\n".join(one() for _ in range(rng.randint(2, 5))) + "\n"


def documents(split: str, count: int, crossing_share: float = 0.0) -> Iterator[str]:
    """`count` drill documents of `split`, from its own seed range; `crossing_share`: see `drill`."""
    if split not in SPLIT_SEEDS:
        raise ValueError(f"unknown split {split!r}; choose from {list(SPLIT_SEEDS)}")
    check_share("crossing_share", crossing_share)
    base = SPLIT_SEEDS[split]
    for i in range(count):
        yield drill(base + i, crossing_share)
