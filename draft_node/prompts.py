"""Training prompts for self-distillation: many, varied, deterministic.

A drafter learns the target's habits from the target's own answers, so what matters is
the spread of prompts, not their quality. A few hundred prompts overfit within minutes
(val loss plateaus while train loss falls), so we combine templated tasks with prompts
derived from text already on the machine (Python docstrings, man-page summaries). The
held-out evaluation prompts are excluded by exact text, so no eval prompt is ever trained on.
"""

from __future__ import annotations

import gzip
import inspect
import json
import random
import re
import sys
from collections.abc import Iterator
from pathlib import Path

EVAL_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "eval_prompts.jsonl"
NAMES = "Alice Ben Carla Dev Emma Farid Grace Hugo Ines Jamal Kira Leo Maya Nico Olga Priya Quinn Rosa Sam Tara".split()
ITEMS = [
    ("apples", "a bag"),
    ("pencils", "a box"),
    ("cookies", "a jar"),
    ("marbles", "a bag"),
    ("stickers", "a sheet"),
    ("books", "a shelf"),
    ("eggs", "a carton"),
    ("cards", "a deck"),
    ("flowers", "a vase"),
    ("coins", "a purse"),
    ("bottles", "a crate"),
    ("candles", "a pack"),
    ("shirts", "a drawer"),
    ("tickets", "a roll"),
    ("beads", "a jar"),
]
TOPICS = (
    "photosynthesis, black holes, the water cycle, volcanoes, earthquakes, the immune system, vaccines, "
    "electricity, magnetism, gravity, the moon, the sun, Mars, Jupiter, comets, tides, rainbows, clouds, "
    "glaciers, deserts, rainforests, coral reefs, bees, ants, octopuses, whales, penguins, dinosaurs, "
    "fossils, DNA, evolution, the human heart, the brain, sleep, memory, nutrition, exercise, coffee, tea, "
    "chocolate, bread, cheese, the printing press, the steam engine, the internet, email, smartphones, "
    "batteries, solar panels, wind turbines, nuclear power, recycling, climate change, the ozone layer, "
    "airplanes, rockets, satellites, GPS, bicycles, trains, bridges, skyscrapers, the Roman Empire, "
    "ancient Egypt, the Renaissance, the Industrial Revolution, democracy, taxes, inflation, banks, "
    "money, supply and demand, chess, music theory, the piano, jazz, painting, photography, poetry, "
    "libraries, maps, compasses, clocks, calendars, languages, writing systems, mathematics, prime numbers, "
    "fractions, probability, statistics, geometry, algebra, computers, algorithms, databases, encryption, "
    "passwords, operating systems, compilers, the cloud, machine learning, robots, 3D printing, "
    "microscopes, telescopes, lighthouses, kites, magnets, spiders, trees, mushrooms, rivers, oceans, "
    "mountains, islands, weather forecasts, hurricanes, lightning, snow, friendship, teamwork, "
    "time management, public speaking, job interviews, budgeting, gardening, cooking pasta, baking bread, "
    "camping, hiking, swimming, running a marathon, learning a language, studying for exams"
).split(", ")
EXPLAIN = [
    "Explain {t} to a ten-year-old.",
    "Explain {t} in simple terms.",
    "What is {t}? Answer in a short paragraph.",
    "Give me three interesting facts about {t}.",
    "Write a short paragraph about {t}.",
    "Summarize the history of {t} in a few sentences.",
    "What are the main benefits and drawbacks of {t}?",
    "List five key ideas about {t}.",
    "Write a haiku about {t}.",
    "Write a short poem about {t}.",
    "Write a short story that involves {t}.",
    "What are common misconceptions about {t}?",
    "How would you teach {t} to a beginner? Give a step-by-step plan.",
    "Write a quiz with three questions about {t}.",
    "Why does {t} matter? Explain briefly.",
    "Describe {t} in exactly three sentences.",
    "Write a tweet about {t}.",
    "Give me a one-sentence definition of {t}.",
    "What questions do people often ask about {t}? List a few with short answers.",
    "Write a short dialogue between a teacher and a student about {t}.",
]
COMPARE = [
    "Compare {a} and {b} in a short answer.",
    "What do {a} and {b} have in common?",
    "Write a short story that involves both {a} and {b}.",
]
FUNCTIONS = [
    "reverses a string",
    "checks whether a number is prime",
    "computes the factorial of n",
    "returns the n-th Fibonacci number",
    "finds the largest element of a list",
    "sorts a list of words by length",
    "counts the vowels in a string",
    "removes duplicates from a list while keeping order",
    "merges two sorted lists",
    "checks whether a word is a palindrome",
    "converts Celsius to Fahrenheit",
    "computes the average of a list",
    "flattens a nested list",
    "counts word frequencies in a text",
    "finds the second largest number in a list",
    "checks whether two strings are anagrams",
    "computes the greatest common divisor of two numbers",
    "converts a decimal number to binary",
    "returns the sum of the digits of a number",
    "capitalizes the first letter of every word",
    "finds all even numbers in a list",
    "transposes a matrix",
    "reads a CSV file and returns the rows as dictionaries",
    "validates an email address with a regex",
    "implements binary search",
    "implements bubble sort",
    "finds the longest word in a sentence",
    "computes compound interest",
    "rotates a list by k positions",
    "checks whether parentheses are balanced",
    "groups a list of words by their first letter",
    "returns the intersection of two lists",
    "counts the lines in a text file",
    "generates all subsets of a list",
    "computes the median of a list",
]
CODE = [
    "Write a Python function that {f}.",
    "Write a JavaScript function that {f}.",
    "Explain how to write a function that {f} in Python, with an example.",
    "Write a Python function that {f}, and add a docstring and a test.",
    "Write a C function that {f}.",
]
COUNTRIES = [
    ("France", "Paris"),
    ("Japan", "Tokyo"),
    ("Brazil", "Brasilia"),
    ("Canada", "Ottawa"),
    ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"),
    ("India", "New Delhi"),
    ("Australia", "Canberra"),
    ("Mexico", "Mexico City"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Norway", "Oslo"),
    ("Peru", "Lima"),
    ("Argentina", "Buenos Aires"),
    ("China", "Beijing"),
    ("Turkey", "Ankara"),
    ("Greece", "Athens"),
    ("Vietnam", "Hanoi"),
    ("Poland", "Warsaw"),
    ("Portugal", "Lisbon"),
    ("Chile", "Santiago"),
]
FACTS = [
    "What is the capital of {c}?",
    "Tell me about the culture of {c}.",
    "What is {k} famous for?",
    "Plan a three-day trip to {k}.",
    "What language is spoken in {c}, and what are a few common phrases?",
    "Describe the geography of {c} briefly.",
]
SNIPPETS = [
    "Rewrite this sentence to be more formal: {s}",
    "Fix the grammar in this sentence: {s}",
    "Translate this sentence into French: {s}",
    "Summarize in one sentence: {s}",
    "Turn this into a bulleted list of key points: {s}",
    "Rewrite this for a child: {s}",
]


def _arithmetic(rng: random.Random) -> str:
    name, other = rng.sample(NAMES, 2)
    item, holder = rng.choice(ITEMS)
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 12)
    forms = [
        f"{name} has {a} {item}. {other} gives {name} {b} more. How many {item} does {name} have now?",
        f"{name} has {a + b} {item} and gives {b} to {other}. How many are left?",
        f"{holder.capitalize()} holds {c} {item}. How many {item} are in {a} of them?",
        f"{name} shares {a * c} {item} equally among {c} friends. How many does each friend get?",
        f"What is {a} times {b}? Explain step by step.",
        f"What is {a} plus {b}? Show your work.",
        f"What is {a * b} divided by {b}?",
        f"What is {a}% of {b * 10}?",
        f"A shop sells {item} for {a} cents each. How much do {b} {item} cost in dollars?",
        f"{name} reads {c} pages a day. How many days does a {a * c}-page book take?",
        f"A train travels at {a} km/h for {c} hours. How far does it go?",
        f"Solve for x: {c}x + {a} = {c * b + a}.",
        f"Is {a * b + 1} a prime number? Explain.",
        f"What is the area of a rectangle that is {a} cm by {b} cm?",
    ]
    return rng.choice(forms)


def templated(rng: random.Random) -> Iterator[str]:
    """Endless templated tasks in a seeded, interleaved order."""
    while True:
        kind = rng.random()
        if kind < 0.22:
            yield _arithmetic(rng)
        elif kind < 0.55:
            yield rng.choice(EXPLAIN).format(t=rng.choice(TOPICS))
        elif kind < 0.62:
            a, b = rng.sample(TOPICS, 2)
            yield rng.choice(COMPARE).format(a=a, b=b)
        elif kind < 0.80:
            yield rng.choice(CODE).format(f=rng.choice(FUNCTIONS))
        elif kind < 0.88:
            c, k = rng.choice(COUNTRIES)
            yield rng.choice(FACTS).format(c=c, k=k)
        else:
            n, topic = rng.randint(3, 10), rng.choice(TOPICS)
            yield rng.choice(
                [
                    f"List {n} facts about {topic}.",
                    f"Give me {n} tips for {topic}.",
                    f"Name {n} words related to {topic}.",
                    f"Write {n} questions a student might ask about {topic}.",
                ]
            )


def docstring_prompts(limit: int = 6000) -> list[str]:
    """Prompts from the Python stdlib's own docstrings: real technical prose, already on disk."""
    import importlib
    import warnings

    out: list[str] = []
    names = sorted(m for m in sys.stdlib_module_names if not m.startswith("_") and m not in {"antigravity", "this"})
    for mod_name in names:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(mod_name)
        except Exception:  # noqa: BLE001 - platform-specific or GUI modules just don't count
            continue
        for attr, obj in sorted(vars(mod).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != mod_name:
                continue
            doc = inspect.getdoc(obj) or ""
            first = doc.strip().split("\n\n")[0].replace("\n", " ")
            if not 30 <= len(first) <= 400:
                continue
            full = f"{mod_name}.{attr}"
            out += [
                f"Explain what the Python function `{full}` does and show an example.",
                f"Summarize this documentation in plain words: {first}",
            ]
            if len(out) >= limit:
                return out
    return out


def man_prompts(root: str = "/usr/share/man/man1", limit: int = 6000) -> list[str]:
    """Prompts from man-page NAME lines: one-line descriptions of command-line tools."""
    out: list[str] = []
    for path in sorted(Path(root).glob("*.gz")) if Path(root).is_dir() else []:
        try:
            with gzip.open(path, "rt", errors="ignore") as fh:
                head = fh.read(4000)
        except OSError:
            continue
        m = re.search(r"\.SH\s+\"?NAME\"?\s*\n(.+?)\n", head)
        if not m:
            continue
        line = re.sub(r"\\f[BIRP]|\\", "", m.group(1)).strip()
        if " - " not in line:
            continue
        cmd, desc = (s.strip() for s in line.split(" - ", 1))
        cmd = cmd.split(",")[0].strip()
        if not cmd or len(desc) < 10:
            continue
        out.append(f"What does the `{cmd}` command do? ({desc}) Give an example of how to use it.")
        if len(out) >= limit:
            break
    return out


def read_prompts(path: str | Path) -> list[str]:
    return [json.loads(line)["prompt"] for line in Path(path).read_text().splitlines() if line.strip()]


def build_prompts(
    count: int, seed: int = 0, starter: str | Path | None = None, exclude: set[str] | None = None
) -> list[str]:
    """`count` distinct prompts: the starter set first, then a seeded mix of every source.

    The held-out evaluation prompts are always excluded, whatever `exclude` adds.
    """
    rng = random.Random(seed)
    exclude = set(exclude or ()) | (set(read_prompts(EVAL_PROMPTS)) if EVAL_PROMPTS.is_file() else set())
    derived = docstring_prompts() + man_prompts()
    rng.shuffle(derived)
    gen = templated(rng)
    seen: set[str] = set()
    out: list[str] = []

    def add(p: str) -> None:
        if p not in seen and p not in exclude:
            seen.add(p)
            out.append(p)

    for p in read_prompts(starter) if starter and Path(starter).is_file() else []:
        add(p)
    derived_iter = iter(derived)
    stalls = 0
    while len(out) < count and stalls < 10 * count:
        before = len(out)
        # About 40% derived text, the rest templated tasks, while derived prompts last.
        src = next(derived_iter, None) if rng.random() < 0.4 else None
        add(src if src is not None else next(gen))
        stalls = stalls + 1 if len(out) == before else 0
    return out[:count]
