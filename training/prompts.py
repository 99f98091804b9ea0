"""Self-instruct prompts: the target writes the user questions, texts and code it is then asked about.

A job starts from seeds (task kind x topic x persona x style) and runs as a short chain of
chat turns, each answered greedily by the target:

- ask:      "List three questions a nurse might ask about X" -> the target's questions ->
            each answered, one of them as a second turn after another (multi-turn);
- text:     "Write a short news report about X" -> the report -> "Summarize / extract /
            classify / rewrite / translate ... <the report>";
- code:     "Write a Go function that ..." -> its code -> "Explain / fix / test / port <the code>";
- problem:  "Write a math word problem about X" -> the problem -> its solution;
- explain, roleplay, docs, math: one seeded turn (explanations for an audience, a system
            persona, stdlib and man-page questions, arithmetic word problems), sometimes
            continued with a follow-up question.

Every turn the target answers is training data, the meta turns included: they are chat
prompts too. Templates are only the seeds; the text the drafter learns from is the target's.

Held-out prompts (`data/eval_prompts.jsonl`) and their near-duplicates never become a
prompt: every user turn is checked against them before it is queued.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from training import seeds

EVAL_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "eval_prompts.jsonl"
JOB_WEIGHTS = {
    "ask": 0.36,
    "text": 0.16,
    "code": 0.15,
    "problem": 0.05,
    "math": 0.06,
    "explain": 0.06,
    "roleplay": 0.07,
    "docs": 0.09,
}


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a jsonl file of {"prompt": ...} lines; ValueError naming the first line that is
    none (a plain text file, another key), where a JSONDecodeError or KeyError said nothing of where."""
    prompts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f'{path}, line {number}: expected a JSON object with a "prompt" string, got {line[:60]!r}')
        prompts.append(record["prompt"])
    return prompts


@dataclass(frozen=True)
class Ask:
    """One chat turn for the target to answer.

    `then` is the user's next message, if the conversation goes on after this answer.
    """

    job: str
    stage: str
    messages: tuple[tuple[str, str], ...]  # (role, content)
    then: str = ""

    @property
    def key(self) -> str:
        return conversation_key(self.messages)

    def chat(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]

    @property
    def user_text(self) -> str:
        return self.messages[-1][1]


def conversation_key(messages: Iterable[tuple[str, str]]) -> str:
    return hashlib.sha1(json.dumps([list(m) for m in messages]).encode()).hexdigest()[:20]


# --- near-duplicates ---------------------------------------------------------


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def shingles(text: str, n: int = 3) -> frozenset[tuple[str, ...]]:
    w = words(text)
    if len(w) < n:
        return frozenset([tuple(w)]) if w else frozenset()
    return frozenset(tuple(w[i : i + n]) for i in range(len(w) - n + 1))


def similarity(a: frozenset, b: frozenset) -> float:
    """Word-trigram overlap: Jaccard, or how much of the shorter one the other contains if larger."""
    if not a or not b:
        return 0.0
    common = len(a & b)
    return max(common / len(a | b), common / min(len(a), len(b)) if min(len(a), len(b)) >= 4 else 0.0)


@dataclass
class HeldOut:
    """The held-out prompts, and whether a text is one of them or close to one."""

    prompts: list[str] = field(default_factory=list)
    threshold: float = 0.5

    def __post_init__(self) -> None:
        self._norm = {" ".join(words(p)) for p in self.prompts}
        self._shingles = [shingles(p) for p in self.prompts]

    @classmethod
    def load(cls, path: Path = EVAL_PROMPTS) -> HeldOut:
        return cls(read_prompts(path) if path.is_file() else [])

    def nearest(self, text: str) -> float:
        s = shingles(text)
        return max((similarity(s, h) for h in self._shingles), default=0.0)

    def excludes(self, text: str) -> bool:
        return " ".join(words(text)) in self._norm or self.nearest(text) >= self.threshold


# --- seeds -> first turns ----------------------------------------------------


@dataclass
class Sources:
    """Everything seeded prompts draw from; `available()` reads what this machine has."""

    topics: list[str]
    personas: list[str]
    functions: list[tuple[str, str]]
    commands: list[tuple[str, str]]

    @classmethod
    def available(cls) -> Sources:
        wordnet = list(seeds.wordnet_topics())
        return cls(
            topics=list(seeds.CORE_TOPICS) + wordnet,
            personas=list(seeds.PERSONAS) + list(seeds.faker_personas()),
            functions=list(seeds.stdlib_functions()),
            commands=list(seeds.man_summaries()),
        )


def _topic(rng: random.Random, src: Sources) -> str:
    # The hand-picked core is small but familiar; keep it a fixed share of the mix.
    if rng.random() < 0.3 or len(src.topics) <= len(seeds.CORE_TOPICS):
        return rng.choice(seeds.CORE_TOPICS)
    return rng.choice(src.topics[len(seeds.CORE_TOPICS) :])


def _arithmetic(rng: random.Random) -> str:
    name, other = rng.sample(seeds.NAMES, 2)
    item = rng.choice(["apples", "pencils", "cookies", "marbles", "stickers", "books", "eggs", "cards", "coins"])
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 12)
    forms = [
        f"{name} has {a} {item}. {other} gives {name} {b} more. How many {item} does {name} have now?",
        f"{name} has {a + b} {item} and gives {b} to {other}. How many are left?",
        f"{name} shares {a * c} {item} equally among {c} friends. How many does each friend get?",
        f"What is {a} times {b}? Explain step by step.",
        f"What is {a * b} divided by {b}? Show your work.",
        f"What is {a}% of {b * 10}?",
        f"A shop sells {item} for {a} cents each. How much do {b} {item} cost in dollars?",
        f"{name} reads {c} pages a day. How many days does a {a * c}-page book take?",
        f"A train travels at {a} km/h for {c} hours. How far does it go?",
        f"Solve for x: {c}x + {a} = {c * b + a}.",
        f"Is {a * b + 1} a prime number? Explain.",
        f"What is the area of a rectangle that is {a} cm by {b} cm?",
        f"{name} saves {a} dollars a week. How long until {name} has {a * (c + 3)} dollars?",
        f"A recipe needs {c} eggs for {b} cookies. How many eggs are needed for {b * 3} cookies?",
    ]
    return rng.choice(forms)


def first_turn(kind: str, rng: random.Random, src: Sources, job: str) -> Ask:
    """The seeded opening turn of a job of this kind."""

    def user(text: str, stage: str = "answer", then: str = "") -> Ask:
        return Ask(job, stage, (("user", text),), then)

    if kind == "ask":
        template = seeds.ASK_KINDS[rng.choice(sorted(seeds.ASK_KINDS))]
        return user(template.format(persona=rng.choice(src.personas), topic=_topic(rng, src)), "questions")
    if kind == "text":
        return user(rng.choice(seeds.TEXT_KINDS).format(topic=_topic(rng, src)), "text")
    if kind == "code":
        lang = rng.choice(seeds.LANGUAGES)
        verb = rng.choice(
            [
                "Write a {lang} function that {f}.",
                "Show me {lang} code that {f}.",
                "How do I write a {lang} function that {f}?",
            ]
        )
        return user(verb.format(lang=lang, f=rng.choice(seeds.FUNCTIONS)), "code")
    if kind == "problem":
        return user(f"Write a short math word problem about {_topic(rng, src)}. Only write the problem.", "problem")
    if kind == "math":
        return user(_arithmetic(rng), then=_maybe_follow_up(rng, 0.2))
    if kind == "explain":
        text = f"Explain {_topic(rng, src)} to {rng.choice(seeds.AUDIENCES)}."
        return user(text, then=_maybe_follow_up(rng, 0.3))
    if kind == "roleplay":
        role = rng.choice(seeds.ROLES)
        question = rng.choice(seeds.ROLE_QUESTIONS)
        then = rng.choice(seeds.ROLE_QUESTIONS + seeds.FOLLOW_UPS) if rng.random() < 0.5 else ""
        return Ask(job, "answer", (("system", f"You are {role}. Stay in character."), ("user", question)), then)
    if kind == "docs":
        if src.commands and (rng.random() < 0.4 or not src.functions):
            cmd, desc = rng.choice(src.commands)
            return user(f"What does the `{cmd}` command do? ({desc}) Give an example of how to use it.")
        if src.functions:
            name, doc = rng.choice(src.functions)
            if rng.random() < 0.5:
                return user(f"Explain what the Python function `{name}` does and show an example.")
            return user(f"Summarize this documentation in plain words: {doc}")
        return user(f"Explain how {rng.choice(seeds.FUNCTIONS)} works in Python.")
    raise ValueError(f"unknown job kind {kind!r}")


def _maybe_follow_up(rng: random.Random, chance: float) -> str:
    return rng.choice(seeds.FOLLOW_UPS) if rng.random() < chance else ""


def jobs(
    seed: int = 0, src: Sources | None = None, starter: list[str] | None = None, held_out: HeldOut | None = None
) -> Iterator[Ask]:
    """The endless, seeded stream of opening turns: the starter prompts first, then seeded jobs.

    Turns that are (near-)duplicates of a held-out prompt are never emitted.
    """
    src = src or Sources.available()
    held_out = held_out if held_out is not None else HeldOut.load()
    for text in starter or []:
        ask = Ask(f"starter-{zlib.crc32(text.encode()):08x}", "answer", (("user", text),))
        if not held_out.excludes(ask.user_text):
            yield ask
    rng = random.Random(seed)
    kinds, weights = zip(*sorted(JOB_WEIGHTS.items()), strict=True)
    n = 0
    while True:
        kind = rng.choices(kinds, weights)[0]
        ask = first_turn(kind, rng, src, f"{seed}-{n}-{kind}")
        n += 1
        if not held_out.excludes(ask.user_text):
            yield ask


# --- answers -> next turns ---------------------------------------------------


_LIST_ITEM = re.compile(r"^\s*(?:\d+[.)]|[-*\u2022])\s+(.+?)\s*$")


def parse_questions(text: str, limit: int = 3) -> list[str]:
    """The list items the target wrote, cleaned: quotes and trailing explanations dropped."""
    out: list[str] = []
    for line in text.splitlines():
        m = _LIST_ITEM.match(line)
        if not m:
            continue
        item = m.group(1).strip().strip('"').strip("*").strip()
        item = re.sub(r'^"|"$', "", item).strip()
        if item.count('"') == 1 and item.endswith('"'):
            item = item[:-1]
        if ":" in item[:40] and not item.endswith("?"):
            item = item.split(":", 1)[1].strip().strip('"')
        n = len(words(item))
        if 4 <= n <= 60 and item not in out:
            out.append(item)
        if len(out) >= limit:
            break
    return out


def parse_code(text: str) -> str:
    """The first fenced code block, if any."""
    m = re.search(r"```[\w+#-]*\n(.+?)```", text, re.S)
    code = m.group(1).strip() if m else ""
    return code if 2 <= code.count("\n") <= 60 else ""


def parse_problem(text: str) -> str:
    para = text.strip().split("\n\n")[0].strip()
    return para if "?" in para and any(c.isdigit() for c in para) and 8 <= len(words(para)) <= 120 else ""


def _rng_for(ask: Ask, seed: int) -> random.Random:
    return random.Random(zlib.crc32(f"{seed}:{ask.key}".encode()))


def next_turns(ask: Ask, answer: str, seed: int = 0, held_out: HeldOut | None = None) -> list[Ask]:
    """What the conversation asks next, given the target's answer; [] when the job is done.

    A pure function of (ask, answer, seed), so a resumed run rebuilds the same turns. Turns
    close to a held-out prompt are dropped, as in `jobs`.
    """
    held_out = held_out if held_out is not None else HeldOut.load()
    return [t for t in _next_turns(ask, answer, _rng_for(ask, seed)) if not held_out.excludes(t.user_text)]


def _next_turns(ask: Ask, answer: str, rng: random.Random) -> list[Ask]:

    def fresh(text: str, then: str = "") -> Ask:
        return Ask(ask.job, "answer", (("user", text),), then)

    if ask.stage == "questions":
        questions = parse_questions(answer)
        out = []
        for i, q in enumerate(questions[:2]):
            if rng.random() < 0.35:
                q = f"{q} {rng.choice(seeds.STYLES)}"
            # The last question continues the first one's conversation: a second turn.
            then = questions[2] if i == 0 and len(questions) > 2 else ""
            out.append(fresh(q, then))
        return out
    if ask.stage == "text":
        body = answer.strip()
        if len(words(body)) < 30:
            return []
        tasks = rng.sample(seeds.TEXT_TASKS, 2)
        return [fresh(f"{task}\n\n{body}", _maybe_follow_up(rng, 0.15)) for task in tasks]
    if ask.stage == "code":
        code = parse_code(answer)
        if not code:
            return []
        lang = re.search(r"(?:a|write a|write) (\S+) function|(\S+) code", ask.user_text)
        lang_name = next((g for g in (lang.groups() if lang else ()) if g), "")
        other = rng.choice([x for x in seeds.LANGUAGES if x != lang_name])
        task = rng.choice(seeds.CODE_TASKS).format(other=other)
        fence = lang_name.lower().replace("c++", "cpp").replace("c#", "csharp")
        return [fresh(f"{task}\n\n```{fence}\n{code}\n```", _maybe_follow_up(rng, 0.15))]
    if ask.stage == "problem":
        problem = parse_problem(answer)
        return [fresh(problem)] if problem else []
    if ask.then:
        history = (*ask.messages, ("assistant", answer.strip()), ("user", ask.then))
        return [Ask(ask.job, "followup", history)]
    return []
