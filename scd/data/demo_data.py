"""Text for the demo model family, built from what every Python install has.

Three sources, all deterministic given a seed:
- prose: `pydoc_data.topics` (the reference manual's help topics),
- code: the top-level modules of the standard library,
- facts: synthetic documents about fictional people, with extractive questions whose answers are spans of
  the document (the QA specialist's task and its exact F1/EM metric).
Held-out material is disjoint from training material: topics and modules are split by a hash of their name,
facts documents by seed.
"""
from __future__ import annotations

import hashlib
import os
import random
import sysconfig
from dataclasses import dataclass

_FIRST = ["Alba", "Bruno", "Clara", "Dmitri", "Edith", "Felix", "Greta", "Hugo", "Ines", "Jonas", "Kira", "Leon",
          "Mira", "Nils", "Olga", "Pavel", "Rosa", "Sven", "Tilda", "Ugo", "Vera", "Walt", "Yara", "Zeno"]
_LAST = ["Korin", "Marsh", "Oakes", "Petrov", "Quill", "Rowe", "Sato", "Thorne", "Vance", "Wilde", "Brandt",
         "Castell", "Dunn", "Ebert", "Frost", "Gale", "Holt", "Ives", "Jansen", "Lund"]
_CITIES = ["Quenby", "Marlow Heath", "Tessary", "Oldwick", "Brenmoor", "Caltrop Bay", "Ivel", "Saltmere",
           "Dunhollow", "Pellam", "Rookford", "Vask", "Elderpoint", "Ferrow", "Galen Cross", "Hythe"]
_JOBS = ["baker", "clockmaker", "pilot", "gardener", "librarian", "surgeon", "carpenter", "chemist",
         "sailor", "painter", "teacher", "weaver", "miner", "judge", "brewer", "cartographer"]
_COLORS = ["teal", "crimson", "amber", "violet", "olive", "silver", "ochre", "indigo", "scarlet", "ivory"]
_OBJECTS = ["bicycle", "lantern", "violin", "telescope", "kettle", "compass", "typewriter", "canoe",
            "harp", "umbrella", "chess set", "sled"]
_PETS = ["a cat", "a parrot", "two dogs", "a tortoise", "three goats", "a ferret", "an owl", "no pets"]


def _held_out(name: str, fraction: float = 0.15) -> bool:
    """Stable split by name: the same item is held out on every machine and every run."""
    h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
    return h / 2**32 < fraction


def prose_texts(split: str) -> list[str]:
    """Help topics of the reference manual, split by topic name ('train' or 'heldout')."""
    from pydoc_data.topics import topics
    want_held = split == "heldout"
    return [topics[k] for k in sorted(topics) if _held_out(k) == want_held]


def code_texts(split: str, max_chars: int = 1_500_000) -> list[str]:
    """Standard-library module sources, split by module name, capped in total size."""
    root = sysconfig.get_paths()["stdlib"]
    want_held = split == "heldout"
    out, total = [], 0
    for name in sorted(os.listdir(root)):
        if not name.endswith(".py") or _held_out(name) != want_held:
            continue
        with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
            text = f.read()
        out.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return out


@dataclass(frozen=True)
class QAExample:
    document: str          # the shared prefix
    question: str          # suffix "Question: ...?\nAnswer: <restated stem>"; the answer span follows
    answer: str            # gold span, present verbatim in the document


def _names(rng: random.Random, n: int) -> list[str]:
    """n people with distinct first and last names: either name alone identifies a person in a document."""
    return [f"{f} {l}" for f, l in zip(rng.sample(_FIRST, n), rng.sample(_LAST, n))]


def facts_document(rng: random.Random, n_people: int) -> tuple[str, list[tuple[str, str]]]:
    """One synthetic document and its (question, answer) pairs; every answer is a span of the document."""
    sentences, qas = [], []
    for who in _names(rng, n_people):
        city, job = rng.choice(_CITIES), rng.choice(_JOBS)
        year, obj = str(rng.randint(1700, 1999)), f"{rng.choice(_COLORS)} {rng.choice(_OBJECTS)}"
        pet = rng.choice(_PETS)
        # (statement stem, answer, question): the answer line restates the stem, then the span follows
        facts = [
            (f"{who} lives in", city, f"Where does {who} live?"),
            (f"{who} works as a", job, f"What is the job of {who}?"),
            (f"{who} was born in", year, f"When was {who} born?"),
            (f"{who} owns a", obj, f"What does {who} own?"),
            (f"{who} keeps", pet, f"Which pets does {who} keep?"),
        ]
        for stem, a, q in rng.sample(facts, rng.randint(3, 5)):
            sentences.append(f"{stem} {a}.")
            qas.append((f"Question: {q}\nAnswer: {stem}", a))
    rng.shuffle(sentences)
    return "Notes:\n" + " ".join(sentences) + "\n", qas


# The demo family's chat template: its conversations in the plain text its QA specialist was trained on. The
# system turn holds the notes, a user turn is a question and an assistant turn the answer line:
#     <notes>\nQuestion: Where does Alba Korin live?\nAnswer: Alba Korin lives in Quenby\n
# Each turn renders on its own, so a conversation's rendering starts with every shorter one's (the router's
# shared prefix is the conversation before its last user turn).
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ 'Question: ' + m['content'] + '\\n' }}"
    "{% elif m['role'] == 'assistant' %}{{ 'Answer: ' + m['content'] + '\\n' }}"
    "{% else %}{{ m['content'] }}{% if not m['content'].endswith('\\n') %}{{ '\\n' }}{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Answer:' }}{% endif %}")


def instruct_chat(tok) -> bool:
    """Whether `tok`'s family is an instruction-tuned chat family (SmolLM2-Instruct): its template marks turns
    with tokens of its own, and its QA samples and demo prompts are chats. The demo family's template only
    renders the plain QA text it learned, so its samples and prompts stay in that text."""
    template = getattr(tok, "chat_template", None)
    return template is not None and template != CHAT_TEMPLATE


QA_SYSTEM = "Answer the question with words copied from these notes."


def qa_system_prompt(document: str) -> str:
    """The system turn of a chat QA request: the instruction and the notes (the shared prefix)."""
    return f"{QA_SYSTEM}\n\n{document}"


def bare_question(question: str) -> str:
    """'Question: Where does X live?\nAnswer: X lives in' -> 'Where does X live?' (the chat form's user turn)."""
    return question.split("\n", 1)[0].removeprefix("Question: ")


def qa_examples(split: str, n: int, seed: int = 0, people: tuple[int, int] = (2, 4)) -> list[QAExample]:
    """`n` (document, question, answer) triples about `people` (min, max) persons each; held-out documents
    come from a disjoint seed stream."""
    rng = random.Random(f"qa-{split}-{seed}" + ("" if people == (2, 4) else f"-{people}"))
    out = []
    while len(out) < n:
        doc, qas = facts_document(rng, rng.randint(*people))
        q, a = rng.choice(qas)
        out.append(QAExample(doc, q, f" {a}"))
    return out


def qa_conversations(split: str, n: int, seed: int = 0, people: tuple[int, int] = (2, 4),
                     turns: int = 4) -> list[tuple[str, list[tuple[str, str]]]]:
    """`n` (document, [(question, answer), ...]) with up to `turns` distinct questions per document, from a
    stream of their own (the single-question splits of qa_examples are unchanged)."""
    rng = random.Random(f"qa-conv-{split}-{seed}-{people}")
    out = []
    for _ in range(n):
        doc, qas = facts_document(rng, rng.randint(*people))
        out.append((doc, [(q, a.strip()) for q, a in rng.sample(qas, min(turns, len(qas)))]))
    return out


def qa_training_text(rng: random.Random) -> str:
    """A document followed by many of its questions with answers: the QA specialist's fine-tuning text.
    Dense questions give the retrieval skill many supervised answers per document."""
    doc, qas = facts_document(rng, rng.randint(2, 4))
    picked = rng.sample(qas, min(len(qas), 8))
    return doc + "".join(f"{q} {a}\n" for q, a in picked)


def repeat_texts(n: int, seed: int) -> list[str]:
    """Random word sequences shown twice. Copying the second half is only possible by looking back, which
    teaches the base model induction heads early; without them no in-context retrieval (QA) can be learned."""
    rng = random.Random(f"repeat-{seed}")
    words = _FIRST + _LAST + _CITIES + _JOBS + _COLORS + _OBJECTS + [str(y) for y in range(1700, 2000, 7)]
    out = []
    for _ in range(n):
        seq = " ".join(rng.choice(words) for _ in range(rng.randint(8, 30)))
        out.append(f"{seq}\n{seq}\n")
    return out


def facts_texts(n: int, seed: int) -> list[str]:
    """Plain synthetic documents (no questions) for the base model."""
    rng = random.Random(f"facts-{seed}")
    return [facts_document(rng, rng.randint(3, 6))[0] for _ in range(n)]
