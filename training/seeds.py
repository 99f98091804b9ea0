"""Seed vocabularies for self-instruct prompts: topics, personas, task phrasings, languages.

The target writes the user questions itself; these lists only steer what it writes about
and for whom. Topics come from large offline sources when the machine has them: WordNet's
nouns (Debian's `wordnet-base`, ~11K familiar senses in 26 categories), Python's own
docstrings and man-page summaries, plus a hand-picked core. Personas come from Faker's job
list when it is installed. A missing source only narrows the mix; the generator is the
same function of (seed, sources), so a machine with the same sources builds the same list.
"""

from __future__ import annotations

import gzip
import importlib
import inspect
import re
import sys
import warnings
from functools import cache
from pathlib import Path

WORDNET = Path("/usr/share/wordnet")
MAN_PAGES = Path("/usr/share/man/man1")

CORE_TOPICS = (
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
    "camping, hiking, swimming, running a marathon, learning a language, studying for exams, "
    "saving money, renting an apartment, buying a used car, starting a small business, writing a resume, "
    "raising a puppy, houseplants, meditation, stress, healthy eating, first aid, home repairs, "
    "social media, online privacy, video games, board games, movies, novels, museums, travel insurance"
).split(", ")

PERSONAS = [
    "a high-school student",
    "a college student",
    "a retired teacher",
    "a parent of two young children",
    "a small business owner",
    "a nurse",
    "a software engineer",
    "a beginner programmer",
    "a chef",
    "a farmer",
    "a journalist",
    "a history buff",
    "a curious ten-year-old",
    "a grandparent",
    "a new employee",
    "a manager",
    "a traveler",
    "a scientist",
    "a musician",
    "an artist",
    "a personal trainer",
    "a librarian",
    "a lawyer",
    "a doctor",
    "a data analyst",
    "a teacher",
    "a shop owner",
    "a student learning English",
    "a first-time home buyer",
    "a gardener",
]

# What kind of help a question asks for: the task families a chat assistant is asked to do.
ASK_KINDS = {
    "question": "List three questions {persona} might ask about {topic}.",
    "advice": "List three questions {persona} might ask an assistant for advice about {topic}.",
    "how-to": "List three how-to questions {persona} might ask about {topic}.",
    "explain": "List three things {persona} might ask an assistant to explain about {topic}.",
    "opinion": "List three questions asking for an opinion or a comparison about {topic}.",
    "planning": "List three requests {persona} might make to get help planning something involving {topic}.",
    "writing": "List three writing tasks {persona} might ask an assistant to do about {topic}.",
    "faq": "Write three questions people often ask about {topic}, one per line.",
}

# Added to some questions, so answers come in many shapes.
STYLES = [
    "Answer in one short paragraph.",
    "Explain it to a ten-year-old.",
    "Use three bullet points.",
    "Keep it under 100 words.",
    "Give a step-by-step answer.",
    "Include an example.",
    "Explain it simply.",
    "Answer briefly.",
    "Give me a numbered list.",
    "Be friendly and encouraging.",
    "Explain it like I'm an expert.",
    "Start with a one-sentence summary.",
]

AUDIENCES = [
    "a five-year-old",
    "a high-school student",
    "a grandparent",
    "a busy manager",
    "an engineer",
    "someone who has never heard of it",
    "a non-native English speaker",
    "a university professor",
]

# Texts the target writes, which later prompts hand back to it as input.
TEXT_KINDS = [
    "Write a short paragraph about {topic}.",
    "Write a short email to a friend about {topic}.",
    "Write a short news report about {topic}.",
    "Write a short product review of something related to {topic}.",
    "Write a short story about {topic}.",
    "Write a short blog post about {topic}.",
    "Write a short encyclopedia entry about {topic}.",
]

TEXT_TASKS = [
    "Summarize the following text in one sentence.",
    "Summarize the following text in three bullet points.",
    "Extract all the names, places and numbers mentioned in this text.",
    "List the key facts in this text.",
    "Classify the tone of this text as positive, negative or neutral, and explain why.",
    "What is the main topic of this text? Answer in a few words, then explain.",
    "Rewrite this text in a more formal style.",
    "Rewrite this text for a ten-year-old.",
    "Make this text shorter without losing the key points.",
    "Fix any grammar or spelling mistakes in this text.",
    "Write three questions that this text answers.",
    "Translate the first two sentences of this text into French.",
    "Translate the first two sentences of this text into Spanish.",
    "Suggest a good title for this text.",
    "Turn this text into a short list of bullet points.",
    "What could be improved in this text?",
]

LANGUAGES = ["Python", "JavaScript", "TypeScript", "Java", "C", "C++", "Go", "Rust", "Ruby", "Bash", "SQL", "C#"]

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
    "reads a CSV file and returns its rows",
    "validates an email address",
    "implements binary search",
    "implements bubble sort",
    "finds the longest word in a sentence",
    "computes compound interest",
    "rotates a list by k positions",
    "checks whether parentheses are balanced",
    "groups words by their first letter",
    "returns the intersection of two lists",
    "counts the lines in a text file",
    "generates all subsets of a list",
    "computes the median of a list",
    "parses a date string",
    "converts a string to title case",
    "finds the most common element in a list",
    "checks whether a year is a leap year",
    "splits a list into chunks of size n",
    "computes the distance between two points",
    "counts how many times each character appears",
    "removes whitespace from both ends of every line",
    "finds the minimum and maximum of a list in one pass",
    "converts minutes to hours and minutes",
    "checks whether a list is sorted",
    "implements a simple stack",
    "implements a queue with two stacks",
    "returns the prime factors of a number",
    "generates a random password",
]

CODE_TASKS = [
    "Explain what this code does, step by step.",
    "Are there any bugs in this code? Fix them if so.",
    "Add comments to this code.",
    "Rewrite this code in {other}.",
    "Write two unit tests for this code.",
    "How could this code be made faster or simpler?",
    "What is the time complexity of this code?",
]

FOLLOW_UPS = [
    "Can you give me an example?",
    "Can you explain that more simply?",
    "Can you make it shorter?",
    "Why is that?",
    "What are the drawbacks?",
    "Can you put that in a numbered list?",
    "Thanks! Can you tell me more?",
    "What would you recommend for a beginner?",
    "Can you summarize that in one sentence?",
    "What is a common mistake people make with this?",
    "How would that work in practice?",
]

ROLES = [
    "a pirate captain",
    "a medieval knight",
    "a friendly robot",
    "a wise old wizard",
    "a detective",
    "a travel guide in Rome",
    "a museum curator",
    "a fitness coach",
    "a chef at a busy restaurant",
    "an astronaut on the space station",
    "a kind librarian",
    "a Shakespearean actor",
    "a cat",
    "a tour guide",
    "a job interviewer",
    "a customer support agent for an internet company",
    "a history teacher",
    "a dungeon master running a fantasy game",
    "a barista",
    "a park ranger",
]

ROLE_QUESTIONS = [
    "What is a typical day like for you?",
    "Tell me about your biggest adventure.",
    "What advice would you give a beginner?",
    "What is the hardest part of your work?",
    "Can you describe where you are right now?",
    "What do you like most about what you do?",
    "Tell me a short story from your life.",
    "How would you greet a new visitor?",
]

NAMES = (
    "Alice Ben Carla Dev Emma Farid Grace Hugo Ines Jamal Kira Leo Maya Nico Olga Priya Quinn Rosa Sam Tara "
    "Uma Victor Wen Xavier Yara Zoe Omar Lena Mateo Aiko Sofia Kwame Ivan Mei Pablo Hana Tom Ana Raj Elif"
).split()


def _clean_lemma(lemma: str) -> str:
    return lemma.replace("_", " ")


@cache
def wordnet_topics(root: Path = WORDNET, min_tagged: int = 1) -> tuple[str, ...]:
    """Familiar WordNet noun senses (tagged in the Brown corpus at least `min_tagged` times)."""
    index = root / "index.noun"
    if not index.is_file():
        return ()
    out = []
    for line in index.read_text(errors="ignore").splitlines():
        if line.startswith(" "):
            continue
        fields = line.split()
        lemma, pointers = fields[0], int(fields[3])
        tagged = int(fields[5 + pointers])
        if tagged >= min_tagged and lemma.isascii() and not any(c.isdigit() for c in lemma) and len(lemma) > 2:
            out.append(_clean_lemma(lemma))
    return tuple(sorted(out))


@cache
def faker_personas() -> tuple[str, ...]:
    """Job titles from Faker's en_US provider, as personas ('an accountant')."""
    try:
        from faker.providers.job.en_US import Provider
    except ImportError:
        return ()
    jobs = sorted({j.split(",")[0].strip().lower() for j in Provider.jobs})
    return tuple(("an " if j[0] in "aeiou" else "a ") + j for j in jobs if 3 <= len(j) <= 40)


@cache
def stdlib_functions(limit: int = 3000) -> tuple[tuple[str, str], ...]:
    """(dotted name, first docstring paragraph) of public stdlib functions and classes."""
    out: list[tuple[str, str]] = []
    names = sorted(m for m in sys.stdlib_module_names if not m.startswith("_") and m not in {"antigravity", "this"})
    for mod_name in names:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(mod_name)
        except Exception:  # platform-specific or GUI modules just don't count
            continue
        for attr, obj in sorted(vars(mod).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != mod_name:
                continue
            first = (inspect.getdoc(obj) or "").strip().split("\n\n")[0].replace("\n", " ")
            if 30 <= len(first) <= 400:
                out.append((f"{mod_name}.{attr}", first))
            if len(out) >= limit:
                return tuple(out)
    return tuple(out)


@cache
def man_summaries(root: Path = MAN_PAGES, limit: int = 3000) -> tuple[tuple[str, str], ...]:
    """(command, one-line description) from man-page NAME sections."""
    out: list[tuple[str, str]] = []
    for path in sorted(root.glob("*.gz")) if root.is_dir() else []:
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
        if cmd and len(desc) >= 10:
            out.append((cmd, desc))
        if len(out) >= limit:
            break
    return tuple(out)
