"""Agent conversations for training that teach reading the tools offered, not memorising them.

Everything a user varies is drawn from the seed: tool names, parameter names and descriptions, how many
tools are offered (unused distractors), system prompts, phrasings, earlier turns of the conversation,
tool errors that must be read and recovered from, follow-up questions, thinking on or off. Families:

- `calc`, `notes`, `files`, `recall`, `calc_faulty`, `arith`: the task families of `clover.training.synthetic`
  (the harness's `tools` and `memory` suites draw them on test seeds), renamed and dressed up;
  `recall` runs up to 32 tool results, as the `memory` suite does;
- `everyday`: natural tools (weather, population, capitals, local time, exchange rates, definitions)
  over fictional places and words, so the answer can only come from calling the tool;
- `lookup`: tools with random schemas (`{verb}_{entity}_{attribute}` with a parameter and a
  description saying what they return), several offered, one asked for.

Tool vocabularies come in two disjoint pools: `train` (training and validation data) and `heldout`
(names, parameters and descriptions never used in training; the harness's `heldout` suite), so that
success on held-out schemas measures reading, not recall. Seeds decide everything.

Names on the `train` pool are coined per conversation (`coin_names`: a natural stem or an invented word,
with affixes and casings), so that no name is seen often enough to be recalled: a model that names a tool
not offered has not read the list. The harness's own names are kept for a third of the tasks of its
families (so its suites stay in distribution), the everyday tools' natural names for half of theirs.
The `heldout` pool coins nothing: its calc, notes, files and recall tasks use the harness's names.

The values a task asks to copy (the memory suite's code word, a note's value, the files' names, the word to
reverse) come from `synthetic.WORDS`, 26 words, as the harness draws them: a model can name one of them from
training without reading the conversation. With `coin_values` > 0 that share of the `train` pool's tasks of
those families draws them from invented words instead, so that only copying from the context gets them right.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from clover.training import synthetic
from clover.training.synthetic import Alias, Task, World, _Builder, _tool, check_share

FAMILY_WEIGHTS = {"calc": 3, "calc_faulty": 1, "notes": 2, "files": 2, "recall": 3, "everyday": 3, "lookup": 4,
                  "arith": 2}
RECALL_STEPS = (2, 4, 8, 16, 32)
KEEP_HARNESS_NAMES = 1 / 3

SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are an assistant that can call tools. Use them when they help.",
                  "Answer the user's questions. Call a tool whenever you need information you do not have.",
                  "You are a careful agent: check tool results before you answer.", "Be brief.",
                  "You help users with everyday questions using the tools provided.")

# Tool names on the `train` pool are coined per conversation from a large space: a stem (a natural
# name), or an invented word, with affixes and casings users write (snake_case, camelCase, run-together).
# Apart from the harness's own names (kept for KEEP_HARNESS_NAMES of the tasks of its families) and the
# everyday tools' natural ones (kept for 1 - COIN_SHARE of theirs), no name recurs often enough to be
# recalled, so naming the right tool takes reading the offered list. `heldout` is never coined.
_AFFIXES = ("my", "do", "tool", "api", "fn", "util", "svc", "app", "sys", "x", "run", "v2", "new", "local")
_NAMING = {  # group -> (name stems per tool of the group, parameter stems per own parameter, descriptions)
    "calculator": ((("calc", "calculator", "evaluate", "math", "compute", "arithmetic", "calculate", "eval",
                     "solve", "expr_eval", "compute_expression", "do_math"),),
                   {"expression": ("expression", "expr", "formula", "input", "query", "math", "q", "text",
                                   "sum", "calculation")},
                   (("Compute an arithmetic expression.",), ("Evaluate a formula with + - * / and parentheses.",),
                    ("Do arithmetic on the input and return the number.",),
                    ("Return the value of an arithmetic query.",), ("Exact arithmetic: + - * / and brackets.",))),
    "notes": ((("save_note", "memory_write", "kv_put", "remember", "set_memo", "store", "write_slot", "put",
                "add_entry", "keep", "stash", "note_write"),
               ("get_note", "memory_read", "kv_get", "recall_note", "get_memo", "load", "read_slot", "get",
                "find_entry", "lookup_key", "unstash", "note_read")),
              {"key": ("key", "slot", "name", "label", "id", "tag", "field"),
               "value": ("value", "text", "content", "data", "body", "note", "payload")},
              (("Save a note under a key.", "Get the note saved under a key."),
               ("Write content into a memory slot.", "Read the content of a memory slot."),
               ("Put data in the store under a name.", "Get the data stored under a name."),
               ("Remember a value under a label.", "Recall the value remembered under a label."))),
    "files": ((("ls", "list_files", "browse", "list_dir", "dir", "scan_folder", "show_dir", "list_folder",
                "tree", "ls_path"),
               ("cat", "open_file", "view_file", "read_text", "show_file", "load_file", "get_file", "print_file",
                "read_doc", "file_contents")),
              {"path": ("path", "location", "dir", "where", "target", "filepath", "p", "file_path")},
              (("List a directory.", "Print a file."), ("List the files in a folder.", "Open a text file."),
               ("Show what a directory holds.", "Show the text of a file."))),
}
_PAIRS = {"notes": ("note_set", "note_get"), "files": ("list_dir", "read_file")}
_OWN_PARAMS = {"note_set": ("key", "value"), "note_get": ("key",), "list_dir": ("path",), "read_file": ("path",),
               "calculator": ("expression",)}


def _invented(r: random.Random) -> str:
    return "".join(r.choice(_SYL) for _ in range(r.randint(2, 3)))


def _styled(words: list[str], casing: int) -> str:
    if casing == 1:
        return words[0] + "".join(w.capitalize() for w in words[1:])
    return ("" if casing == 2 else "_").join(words)


def coin_names(rng: random.Random, *stems: tuple[str, ...]) -> list[str]:
    """One distinct tool name per tuple of stems, all in one style (affix and casing shared, as one API names
    its tools): the stems as they are, after or before an affix or an invented word, or invented words alone."""
    style, affix, casing = rng.random(), rng.choice(_AFFIXES + (_invented(rng),)), rng.choice((0, 0, 0, 1, 2))
    out = []
    for options in stems:
        words = rng.choice(options).split("_")
        if style < 0.2:
            words = [_invented(rng)]
        elif style < 0.45:
            words = [affix, *words]
        elif style < 0.55:
            words = [*words, affix]
        out.append(_styled(words, casing))
    return out if len(set(out)) == len(out) else coin_names(rng, *stems)


def coin_param(rng: random.Random, stems: tuple[str, ...]) -> str:
    return _invented(rng) if rng.random() < 0.1 else rng.choice(stems)


@dataclass(frozen=True)
class Everyday:
    name: str
    param: str
    description: str
    questions: tuple[str, ...]
    answer: str                                     # final answer, with {x} and {v}
    value: Callable[[random.Random], str]


def _num(lo: int, hi: int) -> Callable[[random.Random], str]:
    return lambda r: f"{r.randint(lo, hi):,}"


_WEATHER = ("sunny", "cloudy", "rainy", "windy", "foggy", "snowing")
_DEFS = ("a small boat used on rivers", "a kind of sweet bread", "a tool for cutting wood", "a cold northern wind",
         "a song sung at harvest", "a narrow mountain path", "a bright red bird", "an old unit of length")

EVERYDAY = {
    "train": [
        Everyday("get_weather", "city", "Current weather in a city.", ("What's the weather in {x}?",
                 "Is it warm in {x} right now?", "Tell me the weather for {x}."), "In {x} it is {v}.",
                 lambda r: f"{r.randint(-5, 35)} C and {r.choice(_WEATHER)}"),
        Everyday("get_population", "city", "Number of people living in a city.", ("How many people live in {x}?",
                 "What is the population of {x}?"), "{x} has {v} inhabitants.", _num(2_000, 9_000_000)),
        Everyday("capital_of", "country", "The capital city of a country.", ("What is the capital of {x}?",
                 "Which city is the capital of {x}?"), "The capital of {x} is {v}.", lambda r: _place(r)),
        Everyday("local_time", "city", "The current local time in a city.", ("What time is it in {x}?",
                 "Tell me the local time in {x}."), "It is {v} in {x}.",
                 lambda r: f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}"),
        Everyday("exchange_rate", "currency", "Value of one unit of a currency in US dollars.",
                 ("How many dollars is one {x} worth?", "What's the dollar rate of the {x}?"),
                 "One {x} is worth {v} US dollars.", lambda r: f"{r.uniform(0.01, 5):.4f}"),
        Everyday("define", "word", "Dictionary definition of a word.", ("What does '{x}' mean?",
                 "Define the word {x}."), "'{x}' means {v}.", lambda r: r.choice(_DEFS)),
    ],
    "heldout": [
        Everyday("fetch_forecast", "area", "Tomorrow's forecast for an area.",
                 ("What will the weather be like tomorrow in {x}?",), "Tomorrow in {x}: {v}.",
                 lambda r: f"{r.choice(_WEATHER)}, high of {r.randint(0, 35)} degrees"),
        Everyday("stock_quote", "ticker", "Latest trading price of a stock ticker, in dollars.",
                 ("What is {x} trading at?", "Give me the share price of {x}."), "{x} trades at {v} dollars.",
                 lambda r: f"{r.uniform(1, 900):.2f}"),
        Everyday("track_parcel", "tracking_number", "Delivery status of a parcel.",
                 ("Where is my parcel {x}?", "Track package {x} for me."), "Parcel {x}: {v}.",
                 lambda r: r.choice(("out for delivery", "held at the depot", "delivered", "in transit"))),
        Everyday("book_author", "title", "Who wrote a book.", ("Who wrote {x}?", "Who is the author of {x}?"),
                 "{x} was written by {v}.", lambda r: f"{_place(r)} {_place(r)}"),
    ],
}

# `train` pool: other stems for the everyday tools and their parameters (coined as above for half the tasks)
EVERYDAY_STEMS = {
    "get_weather": ("get_weather", "weather", "current_weather", "weather_now", "check_weather"),
    "get_population": ("get_population", "population", "city_population", "count_people", "inhabitants"),
    "capital_of": ("capital_of", "capital", "get_capital", "country_capital", "capital_city"),
    "local_time": ("local_time", "time_in", "get_time", "clock", "current_time"),
    "exchange_rate": ("exchange_rate", "fx_rate", "currency_value", "usd_rate", "get_rate"),
    "define": ("define", "dictionary", "get_definition", "meaning", "lookup_word"),
    "city": ("city", "town", "place", "location", "city_name"), "country": ("country", "nation", "country_name"),
    "currency": ("currency", "code", "currency_code", "unit"), "word": ("word", "term", "query", "entry"),
}
COIN_SHARE = 0.5   # share of `train` everyday and lookup tools shown under coined names

LOOKUP_POOLS = {
    "train": dict(verbs=("get", "find", "lookup", "query", "fetch", "read"),
                  entities=("item", "user", "order", "device", "product", "account", "ticket", "server", "team",
                            "course"),
                  attributes=("color", "owner", "price", "size", "score", "status", "rank", "weight", "label",
                              "origin", "version", "region", "level", "code"),
                  params=("id", "name", "key", "ref")),
    "heldout": dict(verbs=("retrieve", "obtain"),
                    entities=("vessel", "painting", "recipe", "planet", "species"),
                    attributes=("altitude", "vintage", "genre", "mileage", "diameter", "habitat"),
                    params=("identifier", "handle")),
}

_SYL = ("ka", "lo", "ven", "tar", "mi", "dor", "sel", "ru", "bex", "qua", "nim", "oth", "pel", "zan", "vi", "gro")


def _place(r: random.Random) -> str:
    return _invented(r).capitalize()


def _entity_value(r: random.Random, entity: str) -> str:
    return r.choice((f"{entity[:3].upper()}-{r.randint(100, 9999)}", _place(r), f"{r.choice(synthetic.WORDS)}"
                     f"{r.randint(1, 99)}"))


def _attribute_value(r: random.Random, attribute: str) -> str:
    return r.choice((str(r.randint(1, 5000)), r.choice(synthetic.WORDS), f"{r.choice(synthetic.WORDS)}-"
                     f"{r.randint(1, 9)}", _place(r)))


def _coined_everyday(rng: random.Random, specs: list[Everyday], pool: str) -> list[Everyday]:
    if pool != "train" or rng.random() >= COIN_SHARE:
        return specs
    names = coin_names(rng, *(EVERYDAY_STEMS[s.name] for s in specs))
    return [replace(s, name=n, param=coin_param(rng, EVERYDAY_STEMS[s.param])) for s, n in zip(specs, names,
                                                                                                 strict=True)]


def _everyday(rng: random.Random, b: _Builder, pool: str) -> tuple[str, list[dict]]:
    specs = rng.sample(EVERYDAY[pool], rng.randint(1, min(4, len(EVERYDAY[pool]))))
    specs = _coined_everyday(rng, specs, pool)
    asked = specs[0]
    tools = [_tool(s.name, s.description, {s.param: "string"}) for s in specs]
    answers = []
    for turn in range(2 if rng.random() < 0.3 else 1):
        spec = asked if turn == 0 else rng.choice(specs)
        x = _place(rng)
        value = spec.value(rng)
        b.world.tables.setdefault(spec.name, {})[x] = value
        typed = x
        if rng.random() < 0.2:  # the user writes the name in lower case; the tool says how to fix it
            typed = x.lower()
            b.world.errors[spec.name, typed] = f"error: unknown {spec.param} {typed!r}; names are capitalised, " \
                                              f"e.g. {x!r}"
        b.user(rng.choice(spec.questions).format(x=typed))
        got = b.act(f"The {spec.name} tool gives this; call it with {spec.param} {typed}.", spec.name,
                    **{spec.param: typed})
        if got.startswith("error"):
            got = b.act(f"The tool wants the name capitalised: {x}.", spec.name, **{spec.param: x})
        text = spec.answer.format(x=x, v=got)
        b.answer(f"The tool answered {got}.", text)
        answers.append(got)
    return answers[-1], tools  # the final answer is checked


def _lookup(rng: random.Random, b: _Builder, pool: str) -> tuple[str, list[dict]]:
    p = LOOKUP_POOLS[pool]
    entity = rng.choice(p["entities"])
    attrs = rng.sample(p["attributes"], rng.randint(1, 4))
    param = rng.choice(p["params"] + (entity,))
    names = [f"{rng.choice(p['verbs'])}_{entity}_{a}" for a in attrs]
    if pool == "train" and rng.random() < COIN_SHARE:
        names = coin_names(rng, *((n,) for n in names))
    tools = [_tool(n, f"Return the {a} of a {entity}, given its {param}.", {param: "string"})
             for n, a in zip(names, attrs, strict=True)]
    k = rng.randrange(len(attrs))
    x = _entity_value(rng, entity)
    value = _attribute_value(rng, attrs[k])
    for n, a in zip(names, attrs, strict=True):
        b.world.tables[n] = {x: value if n == names[k] else _attribute_value(rng, a)}
    b.user(rng.choice(("What is the {a} of {e} {x}?", "Find the {a} of the {e} {x}.", "I need the {a} of {e} {x}.",
                       "{e} {x}: what {a} does it have?")).format(a=attrs[k], e=entity, x=x))
    got = b.act(f"{names[k]} returns the {attrs[k]} of a {entity}.", names[k], **{param: x})
    b.answer(f"The tool returned {got}.", f"The {attrs[k]} of {entity} {x} is {got}.")
    return got, tools


def _renamed(rng: random.Random, b: _Builder, family: str, pool: str) -> dict[str, dict]:
    """Rename the tools a canonical family uses (`train` pool; `heldout` keeps the harness's names, as its
    suites do); returns canonical name -> shown tool definition."""
    group = "calculator" if family in ("calc", "recall") else family
    if pool != "train" or group not in _NAMING or rng.random() < KEEP_HARNESS_NAMES:
        return {}
    name_stems, param_stems, descriptions = _NAMING[group]
    own = _PAIRS.get(group, ("calculator",))
    params = {q: coin_param(rng, options) for q, options in param_stems.items()}
    if len(set(params.values())) < len(params):  # notes: key and value must differ
        params = {q: f"{q}_{name}" if q == "value" else name for q, name in params.items()}
    shown = {}
    for own_name, new_name, desc in zip(own, coin_names(rng, *name_stems), rng.choice(descriptions), strict=True):
        mapping = {q: params[q] for q in _OWN_PARAMS[own_name]}
        b.renames[own_name] = (new_name, mapping)
        b.world.aliases[new_name] = Alias(own_name, {v: k for k, v in mapping.items()})
        shown[own_name] = _tool(new_name, desc, {mapping[q]: "string" for q in _OWN_PARAMS[own_name]})
    return shown


def _distractors(rng: random.Random, pool: str, offered: list[dict]) -> list[dict]:
    """Unused tools to offer beside `offered`: none with a name already offered, nor doing what an offered
    tool does under another name (then either would be right)."""
    taken = {t["function"]["name"] for t in offered}
    does = [t["function"]["description"] for t in offered]
    out = []
    for _ in range(rng.choice((0, 0, 1, 2, 3))):
        kind = rng.random()
        if kind < 0.5:
            spec = _coined_everyday(rng, [rng.choice(EVERYDAY[pool])], pool)[0]
            tool = _tool(spec.name, spec.description, {spec.param: "string"})
        else:
            p = LOOKUP_POOLS[pool]
            e, a = rng.choice(p["entities"]), rng.choice(p["attributes"])
            name = f"{rng.choice(p['verbs'])}_{e}_{a}"
            if pool == "train" and rng.random() < COIN_SHARE:
                name = coin_names(rng, (name,))[0]
            tool = _tool(name, f"Return the {a} of a {e}.", {rng.choice(p["params"]): "string"})
        task = tool["function"]["description"].rstrip(".")   # a lookup's offered form adds ", given its ..."
        if tool["function"]["name"] not in taken and not any(d.startswith(task) for d in does):
            taken.add(tool["function"]["name"])
            does.append(tool["function"]["description"])
            out.append(tool)
    return out


def make_training_task(family: str, seed: int, pool: str = "train", coin_values: float = 0.0,
                       recall_ledger: float = 0.0) -> Task:
    """One conversation of `family` from `seed`, dressed up as described in the module docstring;
    `coin_values`: the share of `train`-pool tasks whose values to copy are invented words (0: WORDS, and
    the conversations are exactly those generated before the option existed); `recall_ledger`: the share of
    `recall` conversations whose calls say the number added and those left (`synthetic._recall`'s `ledger`;
    decided by a draw of its own, so a conversation with the ledger is otherwise the one without it)."""
    if family not in FAMILY_WEIGHTS:
        raise ValueError(f"unknown family {family!r}; choose from {sorted(FAMILY_WEIGHTS)}")
    if pool not in LOOKUP_POOLS:
        raise ValueError(f"unknown pool {pool!r}; choose from {sorted(LOOKUP_POOLS)}")
    check_share("coin_values", coin_values)
    check_share("recall_ledger", recall_ledger)
    rng = random.Random(f"agent:{family}:{pool}:{seed}")
    thinking = rng.random() < 0.5
    b = _Builder(World(), thinking)
    if pool == "train" and coin_values > 0 and rng.random() < coin_values:   # no draw at 0: the data stays as it was
        b.lexicon = _invented
    if family == "calc_faulty":
        base = synthetic.make_faulty_calc(seed, thinking=thinking)
        b.messages, answer, tools = base.messages, base.answer, base.tools
        shown = {}
    else:
        shown = _renamed(rng, b, family, pool)
        if family == "everyday":
            answer, tools = _everyday(rng, b, pool)
        elif family == "lookup":
            answer, tools = _lookup(rng, b, pool)
        elif family == "recall":
            ledger = recall_ledger > 0 and random.Random(f"ledger:{pool}:{seed}").random() < recall_ledger
            answer, tools = synthetic._recall(rng, b, steps=rng.choice(RECALL_STEPS), ledger=ledger)
        else:
            answer, tools = synthetic._FAMILY[family](rng, b)
    tools = [shown.get(t["function"]["name"], t) for t in tools]
    if tools:
        tools = tools + _distractors(rng, pool, tools)
        rng.shuffle(tools)
    messages = list(b.messages)
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    if rng.random() < 0.25:  # an earlier, unrelated exchange, of a seed from the conversation's own split
        start = max(first for first in synthetic.SPLIT_SEEDS.values() if first <= seed)
        for _ in range(rng.randint(1, 2)):
            prior = synthetic.make_task("arith", rng.randrange(start, start + synthetic.SPLIT_SPAN),
                                        thinking=thinking).messages
            messages[first_user:first_user] = prior
            first_user += len(prior)
    if rng.random() < 0.5:
        prompt = rng.choice(SYSTEM_PROMPTS)
        if messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": prompt + "\n" + messages[0]["content"]}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    # the chat template drops the reasoning of turns before the last user message: so does the data
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    messages = [{k: v for k, v in m.items() if k != "reasoning_content"} if i < last_user else m
                for i, m in enumerate(messages)]
    parts = answer.split("|")
    return Task(family, seed, tools, messages, answer, check=lambda text: synthetic.holds(text, parts), world=b.world,
                thinking=thinking, initial_files=b.initial_files if b.initial_files is not None else dict(b.world.files),
                start=last_user)


def training_tasks(split: str, count: int, pool: str = "train", coin_values: float = 0.0,
                   recall_ledger: float = 0.0) -> list[Task]:
    """`count` conversations of `split` (seeds from its own range), families drawn by FAMILY_WEIGHTS."""
    if split not in synthetic.SPLIT_SEEDS:
        raise ValueError(f"unknown split {split!r}; choose from {list(synthetic.SPLIT_SEEDS)}")
    cycle = [f for f, w in FAMILY_WEIGHTS.items() for _ in range(w)]
    base = synthetic.SPLIT_SEEDS[split]
    return [make_training_task(cycle[i % len(cycle)], base + i, pool, coin_values, recall_ledger) for i in range(count)]
