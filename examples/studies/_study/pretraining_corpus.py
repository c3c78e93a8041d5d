"""A synthetic pre-training corpus: arithmetic task documents mixed with English-like general text.

For the pre-training study of "RL Excursions during Pre-Training" (arXiv 2606.04272): a small causal LM is
pre-trained **from scratch** on a corpus that mixes the domain of a downstream task with general text, and RL / SFT
is then applied to intermediate checkpoints. The corpus here is fully synthetic and deterministic from a seed:

- **Task documents** (:func:`arithmetic_document`): the arithmetic task's plain-text prompt followed by its worked
  answer, ``"What is 13 - 17? Reply with only the number. 13 - 17 = -4"``, i.e. ``arithmetic_question(a, op, b) +
  " " + worked_answer(a, op, b)`` from :mod:`trl_es.tasks.arithmetic`. A model pre-trained on them continues the
  *plain-text* prompt ``arithmetic_question(a, op, b)`` with ``" a op b = result"``, which
  :func:`~trl_es.tasks.arithmetic.arithmetic_reward` grades (first stated result after the restatement). The RL / SFT
  stages that follow must therefore use **standard (non-conversational) prompts**: build their splits with
  ``conversational=False`` (:func:`pretraining_arithmetic_splits` does), so that no chat template is applied; a
  pre-trained-from-scratch model has never seen one.
- **General documents** (:func:`general_document`): a few sentences from a small probabilistic grammar of
  English-like text (about 550 words: names, people, animals, foods, things, places, times, adjectives, adverbs and
  verbs with selectional restrictions, subject-verb agreement, a consistent tense and a protagonist referred to by
  pronoun within a document), so that held-out general text has an LM loss well below that of a random model but
  far from zero, and that loss goes down during pre-training.

Held-out problems: :func:`pretraining_arithmetic_splits` splits the problem grid with
:func:`~trl_es.tasks.arithmetic.make_arithmetic_dataset_dict` (test = the first problems of one seeded permutation of
the grid, validation the next ones, train all the rest); pass its validation and test rows as ``exclude_problems`` of
:func:`make_pretraining_corpus` so that the problems RL / SFT is evaluated on never appear in pre-training. The
corpus lists the problems it does contain in its ``task_problems`` split.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from trl_es.arguments import check_int
from trl_es.tasks.arithmetic import arithmetic_question, check_arithmetic_args, worked_answer

__all__ = [
    "ANSWER_FORMATS",
    "GENERAL_VOCABULARY",
    "arithmetic_document",
    "general_document",
    "make_pretraining_corpus",
    "pretraining_arithmetic_splits",
]

# ----------------------------------------------------------------------------------------------------------------
# The grammar of the general text. Nouns are (singular, plural); verbs are (base, third person singular, past).
# ----------------------------------------------------------------------------------------------------------------

_NAMES = {  # name -> subject pronoun
    "Anna": "she", "Clara": "she", "Emma": "she", "Grace": "she", "Iris": "she", "Lena": "she", "Nora": "she",
    "Paula": "she", "Vera": "she", "Zoe": "she", "Ben": "he", "David": "he", "Felix": "he", "Hugo": "he",
    "Jack": "he", "Max": "he", "Oscar": "he", "Sam": "he", "Tom": "he", "Will": "he",
}
_PEOPLE = [
    ("farmer", "farmers"), ("teacher", "teachers"), ("doctor", "doctors"), ("baker", "bakers"),
    ("sailor", "sailors"), ("student", "students"), ("child", "children"), ("king", "kings"), ("queen", "queens"),
    ("soldier", "soldiers"), ("painter", "painters"), ("writer", "writers"), ("driver", "drivers"),
    ("nurse", "nurses"), ("hunter", "hunters"), ("merchant", "merchants"), ("pilot", "pilots"),
    ("singer", "singers"), ("miner", "miners"), ("fisherman", "fishermen"), ("woman", "women"), ("man", "men"),
    ("girl", "girls"), ("boy", "boys"),
]
_ANIMALS = [
    ("dog", "dogs"), ("cat", "cats"), ("horse", "horses"), ("bird", "birds"), ("fox", "foxes"), ("wolf", "wolves"),
    ("bear", "bears"), ("rabbit", "rabbits"), ("goat", "goats"), ("sheep", "sheep"), ("mouse", "mice"),
    ("owl", "owls"), ("duck", "ducks"), ("cow", "cows"), ("pig", "pigs"), ("frog", "frogs"), ("deer", "deer"),
    ("lion", "lions"), ("tiger", "tigers"), ("donkey", "donkeys"),
]
_FOODS = [
    ("apple", "apples"), ("pear", "pears"), ("plum", "plums"), ("orange", "oranges"), ("egg", "eggs"),
    ("pie", "pies"), ("cake", "cakes"), ("carrot", "carrots"), ("potato", "potatoes"), ("cookie", "cookies"),
    ("loaf of bread", "loaves of bread"), ("piece of cheese", "pieces of cheese"), ("bowl of soup", "bowls of soup"),
    ("fish", "fish"), ("sandwich", "sandwiches"), ("tomato", "tomatoes"), ("onion", "onions"),
    ("cherry", "cherries"), ("lemon", "lemons"), ("melon", "melons"),
]
_THINGS = [
    ("book", "books"), ("letter", "letters"), ("box", "boxes"), ("key", "keys"), ("lamp", "lamps"), ("map", "maps"),
    ("coin", "coins"), ("ring", "rings"), ("cup", "cups"), ("hat", "hats"), ("chair", "chairs"),
    ("table", "tables"), ("boat", "boats"), ("cart", "carts"), ("bell", "bells"), ("rope", "ropes"),
    ("basket", "baskets"), ("stone", "stones"), ("candle", "candles"), ("blanket", "blankets"),
    ("bottle", "bottles"), ("clock", "clocks"), ("coat", "coats"), ("shoe", "shoes"), ("knife", "knives"),
]
_READABLE = ["book", "letter", "map"]
_OPENABLE = ["book", "letter", "box", "basket", "bottle", "door", "window", "gate"]
_PLACES = [
    "garden", "forest", "market", "river", "village", "kitchen", "school", "castle", "harbor", "field", "library",
    "station", "bridge", "hill", "lake", "church", "farm", "bakery", "street", "valley", "meadow", "tower", "barn",
    "cave", "beach", "square", "mill", "shop",
]
_PLACE_PREPOSITIONS = {"river": ("by", "near", "across"), "bridge": ("on", "under", "near"),
                       "hill": ("on", "behind", "near"), "lake": ("by", "near", "across"),
                       "beach": ("on", "near"), "tower": ("in", "near", "behind"), "street": ("on", "down")}
_DEFAULT_PREPOSITIONS = ("in", "near", "behind", "outside")
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_SEASONS = ["spring", "summer", "autumn", "winter"]
_PAST_TIMES = ["yesterday", "last week", "last night", "long ago", "that morning", "one evening", "after dinner",
               "before sunrise", "at noon", "in the end"]
_ANY_TIMES = ["in the morning", "in the evening", "at night", "every day", "after lunch", "at dawn", "at dusk"]
_ADJ_SIZE = ["big", "small", "tiny", "huge", "tall", "short", "long", "round"]
_ADJ_COLOR = ["red", "blue", "green", "yellow", "white", "black", "brown", "gray", "golden", "silver"]
_ADJ_QUALITY = ["old", "new", "young", "happy", "sad", "quiet", "loud", "brave", "kind", "clever", "lazy",
                "hungry", "tired", "warm", "cold", "fresh", "sweet", "heavy", "bright", "dark", "strange", "famous",
                "busy", "gentle", "angry", "proud", "shy", "wild", "clean", "dirty", "broken", "beautiful", "wet"]
_THING_ADJ = ["old", "new", "heavy", "clean", "dirty", "broken", "beautiful", "wet", "strange", "famous",
              "bright", "dark", "warm", "cold", "light", "tiny", "plain", "shiny"]
_ANIMATE_ADJ = ["old", "young", "happy", "sad", "quiet", "loud", "brave", "kind", "clever", "lazy", "hungry",
                "tired", "strange", "famous", "busy", "gentle", "angry", "proud", "shy", "wild", "tall", "small"]
_FOOD_ADJ = ["fresh", "sweet", "warm", "cold", "big", "small", "red", "green", "yellow", "golden", "delicious",
             "sour", "ripe"]
_STATE_ADJ = ["tired", "happy", "hungry", "cold", "warm", "angry", "sad", "proud", "busy", "quiet", "afraid",
              "excited", "calm", "surprised", "worried"]
_WEATHER = ["the sun was shining", "it was raining", "the wind was strong", "the sky was gray", "snow was falling",
            "the air was warm", "a storm was coming", "the moon was bright"]
_ADVERBS = ["quickly", "slowly", "quietly", "happily", "carefully", "loudly", "gently", "suddenly", "sadly",
            "proudly"]
_NUMBER_WORDS = ["two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "twelve"]

# Transitive verbs: (base, 3sg, past) -> object kinds.
_TRANSITIVE = [
    (("eat", "eats", "ate"), "food"), (("cook", "cooks", "cooked"), "food"), (("buy", "buys", "bought"), "food"),
    (("sell", "sells", "sold"), "food"), (("bake", "bakes", "baked"), "food"), (("find", "finds", "found"), "thing"),
    (("lose", "loses", "lost"), "thing"), (("carry", "carries", "carried"), "thing"),
    (("buy", "buys", "bought"), "thing"), (("sell", "sells", "sold"), "thing"),
    (("clean", "cleans", "cleaned"), "thing"),
    (("fix", "fixes", "fixed"), "thing"), (("hide", "hides", "hid"), "thing"), (("drop", "drops", "dropped"), "thing"),
    (("open", "opens", "opened"), "openable"), (("close", "closes", "closed"), "openable"),
    (("read", "reads", "read"), "readable"), (("write", "writes", "wrote"), "readable"),
    (("see", "sees", "saw"), "animate"), (("watch", "watches", "watched"), "animate"),
    (("follow", "follows", "followed"), "animate"), (("meet", "meets", "met"), "person"),
    (("help", "helps", "helped"), "person"), (("call", "calls", "called"), "person"),
    (("feed", "feeds", "fed"), "animal"), (("chase", "chases", "chased"), "animal"),
    (("paint", "paints", "painted"), "animal"), (("visit", "visits", "visited"), "place"),
    (("leave", "leaves", "left"), "place"), (("paint", "paints", "painted"), "thing"),
]
# Verbs an animal can do to an object.
_ANIMAL_TRANSITIVE = [(("eat", "eats", "ate"), "food"), (("find", "finds", "found"), "thing"),
                      (("chase", "chases", "chased"), "animal"), (("see", "sees", "saw"), "animate"),
                      (("follow", "follows", "followed"), "animate"), (("smell", "smells", "smelled"), "food")]
_INTRANSITIVE = [("sleep", "sleeps", "slept"), ("run", "runs", "ran"), ("sing", "sings", "sang"),
                 ("dance", "dances", "danced"), ("swim", "swims", "swam"), ("walk", "walks", "walked"),
                 ("laugh", "laughs", "laughed"), ("wait", "waits", "waited"), ("rest", "rests", "rested"),
                 ("work", "works", "worked"), ("play", "plays", "played"), ("cry", "cries", "cried"),
                 ("sit", "sits", "sat"), ("shout", "shouts", "shouted"), ("smile", "smiles", "smiled")]
_ANIMAL_INTRANSITIVE = [("sleep", "sleeps", "slept"), ("run", "runs", "ran"), ("swim", "swims", "swam"),
                        ("walk", "walks", "walked"), ("wait", "waits", "waited"), ("rest", "rests", "rested"),
                        ("play", "plays", "played"), ("sit", "sits", "sat"), ("hide", "hides", "hid"),
                        ("jump", "jumps", "jumped")]
_SPEECH = [("say", "says", "said"), ("think", "thinks", "thought"), ("know", "knows", "knew"),
           ("hope", "hopes", "hoped")]
_WANT = [("want", "wants", "wanted"), ("try", "tries", "tried"), ("like", "likes", "liked"),
         ("need", "needs", "needed")]


def _collect_vocabulary() -> frozenset[str]:
    words: set[str] = set(_NAMES) | set(_NAMES.values()) | set(_PLACES) | set(_DAYS) | set(_SEASONS)
    for group in (_PEOPLE, _ANIMALS, _FOODS, _THINGS):
        for pair in group:
            for form in pair:
                words.update(form.split())
    for group in (_TRANSITIVE, _ANIMAL_TRANSITIVE):
        for forms, _ in group:
            words.update(forms)
    for group in (_INTRANSITIVE, _ANIMAL_INTRANSITIVE, _SPEECH, _WANT):
        for forms in group:
            words.update(forms)
    for group in (_ADJ_SIZE, _ADJ_COLOR, _ADJ_QUALITY, _THING_ADJ, _ANIMATE_ADJ, _FOOD_ADJ, _STATE_ADJ, _ADVERBS,
                  _NUMBER_WORDS, _PAST_TIMES, _ANY_TIMES, _WEATHER, _OPENABLE, list(_PLACE_PREPOSITIONS.values()),
                  [_DEFAULT_PREPOSITIONS]):
        for item in group:
            words.update(item.split() if isinstance(item, str) else item)
    words.update("the a an and but so because when that to was were is are they he she there too very could not find "
                 "on one give gives gave".split())
    return frozenset(w.lower() for w in words)


#: Every word the general-text grammar can produce (lower-cased), about 550 words.
GENERAL_VOCABULARY = _collect_vocabulary()

def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


class _Writer:
    """Draws the sentences of one document: a tense, a protagonist and a random stream shared by its sentences."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.past = rng.random() < 0.7
        self.name = rng.choice(sorted(_NAMES))
        self.pronoun = _NAMES[self.name]
        self.mentioned = False

    # -- noun phrases --------------------------------------------------------------------------------------------

    def _adjectives(self, pool: Sequence[str], p: float, colors: bool = True) -> list[str]:
        rng, adjectives = self.rng, []
        if rng.random() < p:
            adjectives.append(rng.choice(pool))
            if colors and rng.random() < 0.25:
                color = rng.choice(_ADJ_COLOR)
                if color not in adjectives:
                    adjectives.append(color)
        return adjectives

    def noun_phrase(self, kind: str, definite_only: bool = False) -> tuple[str, bool]:
        """A noun phrase of ``kind`` and whether it is plural."""
        rng = self.rng
        if kind == "animate":
            kind = rng.choice(["person", "animal"])
        if kind == "openable":
            if rng.random() < 0.4:
                return "the " + rng.choice(["door", "window", "gate"]), False
            kind = "thing"
            noun_pool = [p for p in _THINGS if p[0] in _OPENABLE]
        elif kind == "readable":
            noun_pool = [p for p in _THINGS if p[0] in _READABLE]
            kind = "thing"
        else:
            noun_pool = {"person": _PEOPLE, "animal": _ANIMALS, "food": _FOODS, "thing": _THINGS}[kind]
        if kind == "person" and rng.random() < 0.35:
            return rng.choice(sorted(_NAMES)), False
        singular, plural = rng.choice(noun_pool)
        adjective_pool = {"person": _ANIMATE_ADJ, "animal": _ANIMATE_ADJ, "food": _FOOD_ADJ}.get(
            kind, _ADJ_SIZE + _THING_ADJ)
        adjectives = self._adjectives(adjective_pool, 0.45, colors=kind != "person")
        is_plural = rng.random() < 0.3
        noun = plural if is_plural else singular
        words = " ".join(adjectives + [noun])
        if is_plural:
            determiner = "the" if definite_only or rng.random() < 0.6 else rng.choice(_NUMBER_WORDS)
        else:
            determiner = "the" if definite_only or rng.random() < 0.6 else _article(words)
        return f"{determiner} {words}", is_plural

    def place(self) -> str:
        place = self.rng.choice(_PLACES)
        preposition = self.rng.choice(_PLACE_PREPOSITIONS.get(place, _DEFAULT_PREPOSITIONS))
        return f"{preposition} the {place}"

    def time(self) -> str:
        rng = self.rng
        r = rng.random()
        if r < 0.3:
            return "on " + rng.choice(_DAYS)
        if r < 0.45:
            return "in the " + rng.choice(_SEASONS)
        if self.past and r < 0.75:
            return rng.choice(_PAST_TIMES)
        return rng.choice(_ANY_TIMES)

    def subject(self, kind: str = "person") -> tuple[str, bool]:
        """The subject: the protagonist (by name, then by pronoun) half the time for a person, else a new phrase."""
        if kind == "person" and self.rng.random() < 0.5:
            if self.mentioned and self.rng.random() < 0.7:
                return self.pronoun, False
            self.mentioned = True
            return self.name, False
        return self.noun_phrase(kind)

    # -- verbs -----------------------------------------------------------------------------------------------------

    def verb(self, forms: tuple[str, str, str], plural: bool) -> str:
        if self.past:
            return forms[2]
        return forms[0] if plural else forms[1]

    def be(self, plural: bool) -> str:
        if self.past:
            return "were" if plural else "was"
        return "are" if plural else "is"

    # -- sentences -------------------------------------------------------------------------------------------------

    def _object(self, kind: str) -> str:
        if kind == "place":
            return "the " + self.rng.choice(_PLACES)
        return self.noun_phrase(kind)[0]

    def transitive(self) -> str:
        rng = self.rng
        if rng.random() < 0.25:
            subject, plural = self.subject("animal")
            forms, kind = rng.choice(_ANIMAL_TRANSITIVE)
        else:
            subject, plural = self.subject("person")
            forms, kind = rng.choice(_TRANSITIVE)
        parts = [subject, self.verb(forms, plural), self._object(kind)]
        if rng.random() < 0.4:
            parts.append(self.place())
        if rng.random() < 0.3:
            parts.append(self.time())
        return " ".join(parts)

    def intransitive(self, fronted_time: bool = True) -> str:
        rng = self.rng
        if rng.random() < 0.35:
            subject, plural = self.subject("animal")
            forms = rng.choice(_ANIMAL_INTRANSITIVE)
        else:
            subject, plural = self.subject("person")
            forms = rng.choice(_INTRANSITIVE)
        parts = [subject, self.verb(forms, plural)]
        if rng.random() < 0.4:
            parts.append(rng.choice(_ADVERBS))
        parts.append(self.place())
        if rng.random() < 0.4:
            if fronted_time:
                return f"{self.time()}, " + " ".join(parts)
            parts.append(self.time())
        return " ".join(parts)

    def description(self) -> str:
        rng = self.rng
        kind = rng.choice(["person", "animal", "food", "thing"])
        subject, plural = self.noun_phrase(kind, definite_only=True)
        pool = {"person": _ANIMATE_ADJ + _STATE_ADJ, "animal": _ANIMATE_ADJ + _STATE_ADJ, "food": _FOOD_ADJ}.get(
            kind, _ADJ_SIZE + _THING_ADJ + _ADJ_COLOR)
        first = rng.choice(pool)
        text = f"{subject} {self.be(plural)} {rng.choice(['very ', '', '', 'too '])}{first}"
        if rng.random() < 0.4:
            second = rng.choice(pool)
            if second != first:
                text += f" and {second}"
        return text

    def state(self) -> str:
        subject, plural = self.subject("person")
        text = f"{subject} {self.be(plural)} {self.rng.choice(_STATE_ADJ)}"
        if self.rng.random() < 0.5:
            text += " because " + self.transitive()
        return text

    def speech(self) -> str:
        subject, plural = self.subject("person")
        verb = self.verb(self.rng.choice(_SPEECH), plural)
        return f"{subject} {verb} that {self.transitive()}"

    def wish(self) -> str:
        rng = self.rng
        subject, plural = self.subject("person")
        forms, kind = rng.choice([t for t in _TRANSITIVE if t[1] != "place"])
        text = f"{subject} {self.verb(rng.choice(_WANT), plural)} to {forms[0]} {self._object(kind)}"
        ending = rng.random()
        if ending < 0.35:
            pronoun = self.pronoun if subject in (self.name, self.pronoun) else "they"
            text += f", but {pronoun} could not find {self._object(kind)}"
        elif ending < 0.6:
            text += ", so " + self.transitive()
        return text

    def existential(self) -> str:
        rng = self.rng
        kind = rng.choice(["person", "animal", "food", "thing"])
        noun_pool = {"person": _PEOPLE, "animal": _ANIMALS, "food": _FOODS, "thing": _THINGS}[kind]
        singular, plural = rng.choice(noun_pool)
        count = rng.choice(["one"] + _NUMBER_WORDS)
        if count == "one":
            pool = {"person": _ANIMATE_ADJ, "animal": _ANIMATE_ADJ, "food": _FOOD_ADJ}.get(kind, _ADJ_SIZE + _THING_ADJ)
            adjectives = self._adjectives(pool, 0.4, colors=kind != "person")
            phrase = " ".join(adjectives + [singular])
            return f"there {self.be(False)} {_article(phrase)} {phrase} {self.place()}"
        return f"there {self.be(True)} {count} {plural} {self.place()}"

    def weather(self) -> str:
        weather = self.rng.choice(_WEATHER)
        if not self.past:
            weather = weather.replace(" was ", " is ")
        return f"{weather} when {self.intransitive(fronted_time=False)}"

    def gift(self) -> str:
        rng = self.rng
        subject, plural = self.subject("person")
        give = self.verb(("give", "gives", "gave"), plural)
        receiver = rng.choice(["person", "animal"])
        what = "food" if receiver == "animal" else rng.choice(["food", "thing"])
        return f"{subject} {give} {self.noun_phrase(receiver)[0]} {self.noun_phrase(what)[0]}"

    def sentence(self) -> str:
        builders = (self.transitive, self.intransitive, self.description, self.state, self.speech, self.wish,
                    self.existential, self.weather, self.gift)
        weights = (6, 4, 3, 2, 2, 2, 2, 1, 2)
        text = self.rng.choices(builders, weights)[0]()
        return text[0].upper() + text[1:] + "."


def general_document(rng: random.Random, min_sentences: int = 2, max_sentences: int = 5) -> str:
    """One document of English-like general text: ``min_sentences`` to ``max_sentences`` grammatical sentences.

    The sentences of a document share a tense (past 70 %, present 30 %) and a protagonist (a name, then its pronoun),
    so the text has structure beyond single sentences: agreement (``"the dogs run"`` / ``"the dog runs"``),
    selectional restrictions (people cook foods, animals chase animals, ...), adjective order (size or quality before
    colour), and ``a`` / ``an``.

    Args:
        rng (`random.Random`): The random stream; the document is a deterministic function of its state.
        min_sentences (`int`, defaults to 2): Fewest sentences, ``>= 1``.
        max_sentences (`int`, defaults to 5): Most sentences, ``>= min_sentences``.

    Returns:
        `str`: Sentences joined by single spaces, each starting with a capital letter and ending with ``"."``.

    Raises:
        ValueError: If ``min_sentences`` or ``max_sentences`` is out of range (the message names the field).
    """
    _check_sentences(min_sentences, max_sentences)
    writer = _Writer(rng)
    return " ".join(writer.sentence() for _ in range(rng.randint(min_sentences, max_sentences)))


#: Answer formats of :func:`arithmetic_document`.
ANSWER_FORMATS = ("worked", "number")


def arithmetic_document(a: int, op: str, b: int, answer_format: str = "worked") -> str:
    """One task document: the arithmetic question, a space, and its answer.

    ``"worked"``: ``arithmetic_question(a, op, b) + " " + worked_answer(a, op, b)``, e.g. ``"What is 13 - 17? Reply
    with only the number. 13 - 17 = -4"`` (the format of
    :func:`~trl_es.tasks.arithmetic.make_arithmetic_sft_dataset`'s targets); ``"number"``: the result alone, ``"What
    is 13 - 17? Reply with only the number. -4"``. Greedy generation from the plain-text prompt
    ``arithmetic_question(a, op, b)`` of a model trained on such documents continues with ``" 13 - 17 = -4"`` (or
    ``" -4"``); :func:`~trl_es.tasks.arithmetic.arithmetic_reward` grades both (the first stated result, after a
    restatement of the problem).

    Args:
        a (`int`): Left operand.
        op (`str`): One of :data:`~trl_es.tasks.arithmetic.ALLOWED_OPS`.
        b (`int`): Right operand.
        answer_format (`str`, defaults to ``"worked"``): One of :data:`ANSWER_FORMATS`.

    Returns:
        `str`: The document (no end-of-sequence token; the tokenization adds it).

    Raises:
        ValueError: If ``op`` is not an allowed operator or ``answer_format`` is not one of :data:`ANSWER_FORMATS`.
    """
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
    worked = worked_answer(a, op, b)
    answer = worked if answer_format == "worked" else worked.rsplit(" = ", 1)[1]
    return f"{arithmetic_question(a, op, b)} {answer}"


def _check_sentences(min_sentences: int, max_sentences: int) -> None:
    check_int("min_sentences", min_sentences, 1)
    if isinstance(max_sentences, bool) or not isinstance(max_sentences, int) or max_sentences < min_sentences:
        raise ValueError(f"max_sentences must be an integer >= min_sentences ({min_sentences}), got {max_sentences!r}")


def _problem_key(problem) -> tuple[int, str, int]:
    """``(a, op, b)`` of a tuple or of a row with columns ``a``, ``op``, ``b``."""
    if isinstance(problem, dict):
        return int(problem["a"]), str(problem["op"]), int(problem["b"])
    a, op, b = problem
    return int(a), str(op), int(b)


def _problem_set(exclude_problems) -> set[tuple[int, str, int]]:
    """The ``(a, op, b)`` keys of ``exclude_problems`` (see :func:`make_pretraining_corpus`)."""
    from datasets import Dataset, DatasetDict

    if exclude_problems is None:
        return set()
    if isinstance(exclude_problems, Dataset):
        missing = [c for c in ("a", "op", "b") if c not in exclude_problems.column_names]
        if missing:
            raise ValueError(f"exclude_problems must have the columns a, op, b; {missing} missing")
        return {(int(a), str(op), int(b)) for a, op, b in
                zip(exclude_problems["a"], exclude_problems["op"], exclude_problems["b"])}
    if isinstance(exclude_problems, DatasetDict):
        return set().union(*(_problem_set(split) for split in exclude_problems.values()))
    if isinstance(exclude_problems, (str, bytes, dict)):
        raise ValueError(f"exclude_problems must be an iterable of problems or datasets, got {exclude_problems!r}")
    problems: set[tuple[int, str, int]] = set()
    for item in exclude_problems:
        if isinstance(item, (Dataset, DatasetDict)):
            problems |= _problem_set(item)
            continue
        try:
            problems.add(_problem_key(item))
        except (TypeError, ValueError, KeyError) as error:
            raise ValueError(
                "exclude_problems must hold (a, op, b) tuples, rows with the keys a, op, b, or datasets with those "
                f"columns; got {item!r} ({type(error).__name__}: {error})"
            ) from None
    return problems


def pretraining_arithmetic_splits(
    num_validation: int = 100,
    num_test: int = 200,
    seed: int = 0,
    low: int = 0,
    high: int = 20,
    ops: Sequence[str] = ("+", "-"),
):
    """Split the arithmetic problem grid into pre-training (train) and held-out (validation, test) problems.

    :func:`~trl_es.tasks.arithmetic.make_arithmetic_dataset_dict` with ``conversational=False`` (plain-text prompts,
    as a model pre-trained on :func:`arithmetic_document` needs) and **every** problem of the grid: test is the first
    ``num_test`` problems of one permutation drawn from ``random.Random(seed)``, validation the next
    ``num_validation``, train all the rest. Pass ``validation`` and ``test`` as ``exclude_problems`` to
    :func:`make_pretraining_corpus`; RL / SFT can then train on ``train`` (problems seen in pre-training) and report
    ``test`` (never seen). The test split equals ``make_arithmetic_dataset_dict(n, num_validation, num_test, seed,
    low, high, ops, conversational=False)["test"]`` for any ``n``.

    Args:
        num_validation (`int`, defaults to 100): Held-out validation problems, ``>= 0``.
        num_test (`int`, defaults to 200): Held-out test problems, ``>= 0``.
        seed (`int`, defaults to 0): Seed of the permutation.
        low (`int`, defaults to 0): Smallest operand.
        high (`int`, defaults to 20): Largest operand, ``>= low``.
        ops (`Sequence[str]`, defaults to ``("+", "-")``): Operators, a subset of ``("+", "-", "*")``.

    Returns:
        (`datasets.DatasetDict`): ``"train"``, ``"validation"``, ``"test"``; columns ``prompt`` (plain string),
        ``a``, ``b``, ``op``, ``answer``; together exactly the ``len(ops) * (high - low + 1) ** 2`` problems.

    Raises:
        ValueError: If a size is negative, the grid is invalid, or ``num_validation + num_test`` leaves no training
            problem (the message names the field).
    """
    from trl_es.tasks.arithmetic import make_arithmetic_dataset_dict

    check_int("num_validation", num_validation, 0)
    check_int("num_test", num_test, 0)
    ops = check_arithmetic_args(low, high, ops)
    size = len(ops) * (high - low + 1) ** 2
    num_train = size - num_validation - num_test
    if num_train < 1:
        raise ValueError(f"num_validation + num_test = {num_validation + num_test} leaves no training problem in the "
                         f"grid of {size} problems (low={low}, high={high}, ops={ops})")
    return make_arithmetic_dataset_dict(num_train, num_validation, num_test, seed=seed, low=low, high=high, ops=ops,
                                        conversational=False)


def make_pretraining_corpus(
    num_documents: int,
    task_fraction: float = 0.3,
    num_general_eval: int = 200,
    seed: int = 0,
    low: int = 0,
    high: int = 20,
    ops: Sequence[str] = ("+", "-"),
    exclude_problems=None,
    min_sentences: int = 2,
    max_sentences: int = 5,
    answer_format: str = "worked",
):
    """A synthetic pre-training corpus: arithmetic task documents mixed with general text (arXiv 2606.04272).

    ``round(task_fraction * num_documents)`` task documents (:func:`arithmetic_document`, problems drawn uniformly
    **with replacement** from the grid ``ops x [low, high]^2`` minus ``exclude_problems``) and the rest general
    documents (:func:`general_document`), shuffled together. ``general_eval`` is held-out general text drawn from
    another random stream (seeded ``f"{seed}-general-eval"``, train is ``f"{seed}-train"``), and any document that
    also occurs in ``train`` is redrawn, so the two splits share no document. Same arguments, same corpus.

    The fraction counts **documents**: a task document is about 26 tokens of the SmolLM2 tokenizer (digits are single
    tokens), a general document of 2 to 5 sentences about 32 on average (at most about 75), so ``task_fraction=0.3``
    is about 26 % of the tokens.

    Args:
        num_documents (`int`): Documents of the ``train`` split, ``>= 1``.
        task_fraction (`float`, defaults to 0.3): Share of task documents in ``train``, in ``[0, 1]``.
        num_general_eval (`int`, defaults to 200): Documents of the ``general_eval`` split, ``>= 0``.
        seed (`int`, defaults to 0): Seed; same seed, same corpus.
        low (`int`, defaults to 0): Smallest operand.
        high (`int`, defaults to 20): Largest operand, ``>= low``.
        ops (`Sequence[str]`, defaults to ``("+", "-")``): Operators, a subset of ``("+", "-", "*")``.
        exclude_problems (`Iterable | datasets.Dataset | datasets.DatasetDict`, *optional*): Problems that must not
            appear in the corpus: a dataset (or dataset dict) with columns ``a``, ``op``, ``b``, or an iterable of
            ``(a, op, b)`` tuples, rows with keys ``a``, ``op``, ``b`` and such datasets (e.g. ``[splits["validation"],
            splits["test"]]`` of :func:`pretraining_arithmetic_splits`).
        min_sentences (`int`, defaults to 2): Fewest sentences of a general document, ``>= 1``.
        max_sentences (`int`, defaults to 5): Most sentences of a general document, ``>= min_sentences``.
        answer_format (`str`, defaults to ``"worked"``): How task documents answer (:func:`arithmetic_document`).

    Returns:
        (`datasets.DatasetDict`):
            - ``"train"``: ``num_documents`` rows, columns ``text`` (`str`) and ``kind`` (``"task"`` or
              ``"general"``).
            - ``"general_eval"``: ``num_general_eval`` rows, columns ``text`` and ``kind`` (always ``"general"``).
            - ``"task_problems"``: the distinct problems that occur in ``train``, columns ``prompt`` (the plain-text
              question), ``a``, ``b``, ``op``, ``answer`` and ``count`` (occurrences in ``train``), in grid order.

    Raises:
        ValueError: If an argument is out of range, naming the field: ``num_documents`` < 1, ``task_fraction``
            outside ``[0, 1]`` (or not a number), ``num_general_eval`` < 0, a bad grid (``low``, ``high``, ``ops``),
            bad ``min_sentences`` / ``max_sentences``, or ``exclude_problems`` that leave no problem while task
            documents are requested.
    """
    from datasets import Dataset, DatasetDict

    check_int("num_documents", num_documents, 1)
    if isinstance(task_fraction, bool) or not isinstance(task_fraction, (int, float)) or not (
        math.isfinite(task_fraction) and 0.0 <= task_fraction <= 1.0
    ):
        raise ValueError(f"task_fraction must be a number in [0, 1], got {task_fraction!r}")
    check_int("num_general_eval", num_general_eval, 0)
    ops = check_arithmetic_args(low, high, ops)
    _check_sentences(min_sentences, max_sentences)
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
    excluded = _problem_set(exclude_problems)
    pool = [(a, op, b) for op in ops for a in range(low, high + 1) for b in range(low, high + 1)
            if (a, op, b) not in excluded]
    num_task = round(task_fraction * num_documents)
    if num_task and not pool:
        raise ValueError(f"exclude_problems excludes every problem of the grid (low={low}, high={high}, ops={ops}), "
                         f"but task_fraction={task_fraction} asks for {num_task} task documents")

    rng = random.Random(f"{seed}-train")
    kinds = ["task"] * num_task + ["general"] * (num_documents - num_task)
    rng.shuffle(kinds)
    texts, counts = [], {}
    for kind in kinds:
        if kind == "task":
            problem = pool[rng.randrange(len(pool))]
            counts[problem] = counts.get(problem, 0) + 1
            texts.append(arithmetic_document(*problem, answer_format=answer_format))
        else:
            texts.append(general_document(rng, min_sentences, max_sentences))

    seen = set(texts)
    eval_rng = random.Random(f"{seed}-general-eval")
    eval_texts: list[str] = []
    attempts = 0
    while len(eval_texts) < num_general_eval:
        attempts += 1
        if attempts > 100 * max(num_general_eval, 1):
            raise ValueError("could not draw enough general_eval documents that do not occur in train; lower "
                             "num_general_eval or raise max_sentences")
        text = general_document(eval_rng, min_sentences, max_sentences)
        if text not in seen:
            seen.add(text)
            eval_texts.append(text)

    problems = [p for p in pool if p in counts]
    task_rows = [{"prompt": arithmetic_question(a, op, b), "a": a, "b": b, "op": op,
                  "answer": a + b if op == "+" else a - b if op == "-" else a * b, "count": counts[(a, op, b)]}
                 for a, op, b in problems]
    task_features = None
    if not task_rows:  # keep the columns of an empty split
        from datasets import Features, Value

        task_features = Features({"prompt": Value("string"), "a": Value("int64"), "b": Value("int64"),
                                  "op": Value("string"), "answer": Value("int64"), "count": Value("int64")})
    text_features = None
    if not eval_texts:
        from datasets import Features, Value

        text_features = Features({"text": Value("string"), "kind": Value("string")})
    return DatasetDict({
        "train": Dataset.from_dict({"text": texts, "kind": kinds}),
        "general_eval": Dataset.from_dict({"text": eval_texts, "kind": ["general"] * len(eval_texts)},
                                          features=text_features),
        "task_problems": Dataset.from_list(task_rows, features=task_features) if task_rows else
        Dataset.from_dict({k: [] for k in task_features}, features=task_features),
    })
