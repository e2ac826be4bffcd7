"""The prompt set at scale for draft training (issue 11): 22,152 chat requests (seed 0) in the 12 categories that
chat benchmarks use, built offline from team-written templates and content that ships with midlayer or Python.

Why a recipe and not a list: published drafters train on 68k-500k conversations (EAGLE: ShareGPT 68k);
the 268 hand-written prompts of `midlayer.prompts` are two orders of magnitude short of that. No chat data
can be downloaded here, so requests are generated: each category has a few dozen templates with slots, and
slots are filled from team-written word lists (topics, characters, languages, concepts, tasks), from
numbers drawn by the recipe's RNG (math and reasoning items, computed so every question has an answer), from
passages of the embedded corpus (`midlayer.corpus`), and from the docstrings of Python's standard library
(real technical prose present on every machine that runs Python).

Categories (`CATEGORIES`): writing, roleplay, reasoning, math, coding, extraction, stem, humanities,
translation, summarisation, qa (closed-book questions), reading (answer from a given passage).

Determinism: `build(seed)` draws everything from `random.Random(f"{seed}-{category}")`, so the set depends on
the seed, this file, the corpus and -- for the docstring slots only -- the Python version. The built set is
committed (`prompt_data/scaled_prompts.jsonl.gz`, with a header naming the seed, the recipe's hash and the
Python version), so nobody needs to regenerate it; `python -m midlayer.prompt_recipe --check` regenerates it
and compares.

Deduplication: exact (case- and whitespace-normalised text), then near-duplicates: MinHash signatures of
word 3-gram shingles with LSH banding; a prompt whose estimated Jaccard similarity to an earlier-kept prompt
(ordered by id) is >= `NEAR_DUP_JACCARD` is dropped. Template prompts that differ in one slot word are
*not* near-duplicates at that threshold (their request differs); re-drawn identical combinations are.

Splits: per category, the `HELDOUT_FRACTION` of ids with the smallest sha256 are "heldout"
(`midlayer.prompts.assign_splits`: a function of the ids alone).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import inspect
import json
import random
import re
import sys
import zlib
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .prompts import PROMPT_DATA, Prompt, assign_splits
from .prompts import summary as base_summary

CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
              "translation", "summarisation", "qa", "reading")
PER_CATEGORY = 2000
HELDOUT_FRACTION = 0.05  # ~100 per category: enough to measure held-out loss and to benchmark on
NEAR_DUP_JACCARD = 0.8
SCALED_FILE = PROMPT_DATA / "scaled_prompts.jsonl.gz"
FORMAT = "midlayer-prompts-v1"

# ------------------------------------------------------------------------------------------ word lists
TOPICS = """the ocean at night|a forgotten lighthouse|the first day of school|a city after rain|autumn leaves|a lost
key|friendship between a cat and a dog|a robot learning to paint|the smell of fresh bread|a long train journey|
a grandmother's garden|the last bookstore in town|a thunderstorm in summer|climbing a mountain|an old photograph|
the moon landing|a village market|learning to swim|a broken umbrella|the sound of a violin|a snowy morning|
a letter never sent|a desert at noon|a busy airport|a quiet library|the northern lights|a fisherman's boat|
a child's first bicycle|a haunted house|the end of a long war|a hidden waterfall|a street musician|a time
traveler's regret|the smell of the sea|a midnight kitchen|an abandoned amusement park|a beekeeper|coffee in the
morning|a lost dog finding home|a volcano waking up|the invention of the wheel|a chess game|a spaceship leaving
Earth|a river in spring|a small bakery|a wedding in the rain|the silence after a storm|a marathon runner|
a garden gnome|a dragon who is afraid of fire|a mirror that lies|the last tree on Earth|a music box|
a stray kitten|a sunrise over the city|a farmer in drought|an empty stadium|a paper boat|a mountain village|
a night shift nurse|a message in a bottle|a teacher's last lesson|a clock that runs backwards|a jazz club|
a penguin colony|a pirate ship|an astronaut's dream|the deep forest|a broken promise|a family dinner|a winter
fair|the first snowfall|a tired superhero|a friendly ghost|the hum of a refrigerator|a lighthouse keeper|
a lonely satellite|a kite on a windy day|the smell of old books|a bus stop at dawn|a city of bridges|
a detective's last case|an ant colony|the color blue|a magician's apprentice|a lemonade stand|the history of
tea|a sleepy town|a runaway balloon|a mountain lake|a street food market|a rainy Sunday|a birthday surprise|
moving to a new country|the first phone call|a violin maker|a solar eclipse|a wild horse|an old sailor|
a garden in winter|a cup of hot chocolate|a museum at night|a zoo keeper|a vegetable garden|a city bus driver|
a campfire story|the power going out|a library card|a long-distance friendship|a carnival|a firefly|
a tiny island|an underground train|a secret recipe|the first robot pet|a forgotten song|a grumpy neighbor|
recycling|saving water|a healthy breakfast|the importance of sleep|a weekend hike|working from home|
a job interview|learning a language|a science fair|a school play""".replace("\n", "").split("|")
FORMS = ["short poem", "haiku", "limerick", "short story", "fable", "diary entry", "product description",
         "blog post introduction", "speech opening", "letter to a friend", "news headline and lead paragraph",
         "motivational quote", "song chorus", "movie plot summary", "advertisement", "postcard message",
         "recipe introduction", "travel guide paragraph", "bedtime story", "sonnet", "dialogue between two people",
         "riddle", "book blurb", "thank-you note", "short essay", "social media post", "toast for a party",
         "description of a painting", "opening line of a novel", "apology letter"]
AUDIENCES = ["children", "teenagers", "busy professionals", "retirees", "a history teacher", "beginners",
             "a skeptical reader", "tourists", "scientists", "a five-year-old", "college students", "new parents",
             "gardeners", "sports fans", "a job recruiter"]
STYLES = ["in under 80 words", "using simple words", "with a surprising ending", "in a humorous tone",
          "in a serious tone", "in the second person", "without using the letter z", "in exactly four sentences",
          "with vivid sensory details", "as if it were a fairy tale", "in a hopeful tone", "in a melancholy tone",
          "with a clear moral", "in the present tense", "with a rhyme in every line", "in a formal style"]
CHARACTERS = ["a medieval knight", "a pirate captain", "a tired barista", "a Victorian detective",
              "a friendly librarian", "an alien visiting Earth", "a retired astronaut", "a grumpy wizard",
              "a museum tour guide", "a football coach at half-time", "a chef in a busy kitchen",
              "a ship's navigator in 1700", "a park ranger", "a news anchor", "a travel agent", "a personal trainer",
              "a kindergarten teacher", "a Roman senator", "a helpful robot butler", "a fortune teller",
              "a lighthouse keeper", "a dragon guarding treasure", "a customer service agent", "a mountain guide",
              "an old fisherman", "a time traveler from 2300", "a stand-up comedian", "a ghost in an old castle",
              "a job interviewer", "a flight attendant", "a detective interrogating a suspect", "a pharmacist",
              "a hotel receptionist", "a chess grandmaster", "a tailor", "a car mechanic", "a beekeeper",
              "a medieval innkeeper", "a bookshop owner", "a shy poet", "a spaceship captain", "a museum curator",
              "a zookeeper", "a sports commentator", "a famous painter", "a sailor lost at sea", "a queen",
              "a farmer", "a detective's sidekick", "a tour guide in Rome"]
SITUATIONS = ["A customer asks you for a recommendation.", "Someone asks you for directions to the castle.",
              "A child asks you why the sky is blue.", "You have just lost something important.",
              "A stranger asks what your day was like.", "Someone wants to learn your trade.",
              "You must convince someone to help you.", "A visitor complains about the weather.",
              "You are giving a short welcome speech.", "Someone asks for your best advice.",
              "You are explaining your job to a newcomer.", "A friend asks you to keep a secret.",
              "You are describing your favorite place.", "Someone doubts that you are who you say you are.",
              "You are negotiating a price.", "A journalist interviews you about your life.",
              "You are telling a story from your past.", "You must deliver bad news politely.",
              "Someone asks what you fear most.", "You are planning tomorrow with a partner.",
              "A guest arrives late and apologizes.", "You are teaching a quick lesson.",
              "You have to calm down an angry visitor.", "A young person asks how to become like you."]
LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch", "Swedish", "Polish", "Turkish",
             "Indonesian", "Chinese", "Japanese", "Russian", "Arabic", "Greek", "Czech"]
STEM_CONCEPTS = """photosynthesis|gravity|the water cycle|plate tectonics|DNA replication|natural selection|
electric current|magnetism|the speed of light|black holes|the immune system|vaccines|antibiotics|
the periodic table|chemical bonds|acids and bases|entropy|the greenhouse effect|climate change|ocean tides|
the seasons|the phases of the moon|nuclear fission|nuclear fusion|solar panels|wind turbines|batteries|
semiconductors|transistors|the internet|encryption|machine learning|neural networks|binary numbers|
algorithms|sorting|compilers|operating systems|databases|prime numbers|probability|statistics|
the Pythagorean theorem|calculus|derivatives|integrals|exponential growth|logarithms|vectors|matrices|
Newton's laws of motion|friction|momentum|energy conservation|sound waves|the Doppler effect|rainbows|
lenses|lasers|radio waves|x-rays|the human heart|the nervous system|neurons|sleep|digestion|metabolism|
enzymes|cells|viruses|bacteria|fungi|ecosystems|food chains|biodiversity|erosion|volcanoes|earthquakes|
hurricanes|clouds|weather forecasting|the atmosphere|the ozone layer|stars|galaxies|the Big Bang|
exoplanets|the solar system|comets|satellites|GPS|rockets|airplane lift|bridges|concrete|steel|
recycling plastics|3D printing|robots|electric cars|combustion engines|refrigerators|microwaves|
the speed of sound|temperature|pressure|density|buoyancy|evaporation|osmosis|diffusion|catalysts|
polymers|crystals|magnets in motors|circuits|resistance|capacitors|the scientific method|
hypothesis testing|error bars|significant figures|units of measurement|half-life|radioactivity|
genetics|mutations|stem cells|the kidneys|blood types|hormones|the eye|hearing|muscles|bones""".replace(
    "\n", "").split("|")
HUMANITIES_CONCEPTS = """the Renaissance|the French Revolution|the Industrial Revolution|ancient Egypt|
the Roman Empire|ancient Greek democracy|the Silk Road|the printing press|the Cold War|the fall of the
Berlin Wall|the Magna Carta|the Enlightenment|the Reformation|colonialism|the abolition of slavery|
women's suffrage|the civil rights movement|the Great Depression|World War I|World War II|the United Nations|
the Ottoman Empire|the Mongol Empire|the Maya civilization|the Inca Empire|feudalism|the Black Death|
the Age of Exploration|the American Revolution|the Meiji Restoration|Stoicism|utilitarianism|
Kant's categorical imperative|existentialism|Plato's allegory of the cave|Socratic questioning|free will|
the social contract|human rights|justice|virtue ethics|the trolley problem|Buddhism|Confucianism|
mythology|epic poetry|tragedy in drama|Shakespeare's sonnets|the novel as a form|Romanticism|Realism in
literature|Modernism|Impressionism|Cubism|Baroque music|jazz|opera|folk music|architecture of cathedrals|
the Parthenon|the Great Wall of China|calligraphy|storytelling traditions|oral history|propaganda|
journalism|censorship|the role of museums|languages dying out|how writing systems developed|money and
trade|inflation|supply and demand|globalization|urbanization|migration|nationalism|democracy|
the separation of powers|federalism|public libraries|education reform|the history of medicine|
the history of the calendar|religious tolerance|art patronage|satire|irony|metaphor|the hero's journey|
cultural heritage|translation of literature|the history of chess|the Olympic Games|fashion history|
photography as art|film history|the history of the bicycle|the history of tea|the Hanseatic League|
Viking voyages|the Phoenicians|the Byzantine Empire|the Harlem Renaissance|the Beat Generation""".replace(
    "\n", "").split("|")
CODE_TASKS = """reverses a string|checks whether a number is prime|returns the n-th Fibonacci number|
counts the vowels in a string|removes duplicates from a list while keeping order|merges two sorted lists|
finds the largest element in a list|computes the factorial of n|checks whether a string is a palindrome|
flattens a nested list|counts word frequencies in a text|converts Celsius to Fahrenheit|sorts a list of
dictionaries by a key|finds the second largest number in a list|checks whether two strings are anagrams|
computes the greatest common divisor of two numbers|rotates a list by k positions|returns the sum of the
digits of a number|checks whether a year is a leap year|converts a decimal number to binary|finds all
prime numbers below n|capitalizes the first letter of every word|computes the average of a list of
numbers|finds the longest word in a sentence|validates an email address with a simple rule|transposes a
matrix|chunks a list into pieces of size k|computes the running total of a list|finds the intersection of
two lists|counts the lines in a file|returns the most common element in a list|implements binary search|
implements bubble sort|implements a stack with push and pop|implements a queue|checks balanced
parentheses|converts a Roman numeral to an integer|converts an integer to a Roman numeral|computes the
power set of a list|generates all permutations of a string|finds the median of a list|removes
punctuation from a string|splits a string into words|parses a date string|computes compound interest|
returns the unique characters of a string|zips two lists into a dictionary|inverts a dictionary|
computes the dot product of two vectors|checks whether a list is sorted|counts the set bits of an
integer|computes the Levenshtein distance|finds the missing number in 1..n|shuffles a list with a given
seed|formats a number with thousands separators|truncates a string to n characters with an ellipsis|
groups words by their first letter|converts snake_case to camelCase|reads a CSV file and sums a column|
memoizes a function|retries a function call three times|measures how long a function takes|
computes the area of a circle|generates a random password|checks whether a number is a perfect square|
finds pairs in a list that sum to a target""".replace("\n", "").split("|")
CODE_LANGUAGES = ["Python", "Python", "Python", "JavaScript", "C", "Rust", "Go", "Java", "TypeScript", "Bash"]
COUNTRIES = """France|Germany|Japan|Brazil|Canada|Australia|India|Kenya|Egypt|Mexico|Argentina|Norway|Sweden|
Italy|Spain|Portugal|Greece|Turkey|Poland|Vietnam|Thailand|Indonesia|Nigeria|Ghana|Chile|Peru|Colombia|
Ireland|Scotland|New Zealand|South Korea|China|Russia|Morocco|Ethiopia|Iceland|Finland|Denmark|Austria|
Switzerland|the Netherlands|Belgium|Hungary|Czechia|Romania|Ukraine|Iran|Pakistan|Bangladesh|the Philippines|
Malaysia|Singapore|Cuba|Jamaica|South Africa|Tanzania|Nepal|Mongolia|Saudi Arabia|Israel""".replace(
    "\n", "").split("|")
QA_TEMPLATES = ["What is {c}?", "Why is {c} important?", "Can you explain {c} in simple terms?",
                "What are the main facts about {c}?", "What is a common misconception about {c}?",
                "How would you describe {c} in one paragraph?", "What questions do experts still ask about {c}?",
                "Give three interesting facts about {c}."]
COUNTRY_QA = ["What is the capital of {x}?", "What languages are spoken in {x}?", "What is {x} known for?",
              "Describe the climate of {x}.", "What is a traditional dish from {x}?",
              "What are some famous landmarks in {x}?", "What currency is used in {x}?",
              "Give a short overview of the history of {x}.", "What sports are popular in {x}?",
              "What should a first-time visitor to {x} know?"]
NAMES = ["Alice", "Bob", "Carla", "David", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kira", "Liam",
         "Maya", "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wen", "Yusuf", "Zoe"]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Toronto", "Krakow", "Porto", "Seville", "Hanoi",
          "Denver", "Dublin", "Tallinn", "Quito", "Perth", "Bergen", "Lyon", "Graz", "Cork", "Adelaide"]
ITEMS = ["apples", "notebooks", "pencils", "tickets", "boxes", "cookies", "marbles", "books", "stamps", "cards"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
SENTENCE_SUBJECTS = ["My brother", "The teacher", "Our neighbors", "The little girl", "The old man", "My friend",
                     "The doctor", "The children", "The tourists", "My grandmother", "The cat", "The students"]
SENTENCE_VERBS = ["is reading", "bought", "is cooking", "forgot", "found", "is painting", "wants", "lost",
                  "is looking for", "sold", "is cleaning", "borrowed"]
SENTENCE_OBJECTS = ["a new book", "the red bicycle", "dinner for everyone", "the keys to the house",
                    "a small wooden box", "the kitchen", "a ticket to Paris", "an umbrella", "fresh vegetables",
                    "the old map", "a birthday present", "the train schedule"]
SENTENCE_TAILS = ["this morning.", "before the party.", "at the market.", "after school.", "in the garden.",
                  "last weekend.", "because it was raining.", "for the first time.", "with great care.",
                  "without telling anyone."]


# ---------------------------------------------------------------------------------------- content sources
def _corpus_passages(rng: random.Random, n: int, min_words: int = 50, max_words: int = 140) -> list[str]:
    """n passages of the embedded corpus, each from a speech/stanza start, min..max words (whole lines)."""
    from .corpus import corpus_documents

    docs = corpus_documents()
    out, seen = [], set()
    while len(out) < n:
        name, text = docs[rng.randrange(len(docs))]
        lines = text.split("\n")
        start = rng.randrange(int(0.05 * len(lines)) + 1, int(0.95 * len(lines)))
        while start < len(lines) - 1 and (not lines[start].strip() or lines[start - 1].strip()):
            start += 1
        target, words, end = rng.randint(min_words, max_words), 0, start
        while end < len(lines) and words < target:
            words += len(lines[end].split())
            end += 1
        passage = "\n".join(lines[start:end]).strip()
        if min_words <= len(passage.split()) <= max_words + 30 and (name, start) not in seen:
            seen.add((name, start))
            out.append(passage)
    return out


_DOC_MODULES = ("os", "os.path", "json", "re", "random", "math", "statistics", "collections", "itertools",
                "functools", "string", "textwrap", "datetime", "calendar", "heapq", "bisect", "shutil", "pathlib",
                "csv", "gzip", "zipfile", "tarfile", "hashlib", "base64", "fractions", "decimal", "difflib",
                "argparse", "logging", "threading", "queue", "subprocess", "socket", "urllib.parse", "http.client",
                "email.message", "sqlite3", "unittest", "inspect", "typing", "dataclasses", "enum", "copy",
                "pickle", "struct", "array", "io", "tempfile", "glob", "fnmatch", "time", "uuid", "secrets",
                "operator", "contextlib", "weakref", "abc", "numbers", "cmath", "html", "xml.etree.ElementTree")


def stdlib_docs(min_words: int = 40, max_words: int = 220) -> list[tuple[str, str]]:
    """(qualified name, docstring) of public functions and classes of a fixed list of standard-library
    modules, docstrings of min..max words, in a sorted order (reproducible for a Python version)."""
    import importlib
    import warnings

    out = []
    with warnings.catch_warnings():  # getattr on `typing` warns about its deprecated submodules
        warnings.simplefilter("ignore", DeprecationWarning)
        out = _docs_of(importlib, min_words, max_words)
    seen, uniq = set(), []
    for qn, doc in out:  # re-exported objects appear under several names
        if doc not in seen:
            seen.add(doc)
            uniq.append((qn, doc))
    return uniq


def _docs_of(importlib, min_words: int, max_words: int) -> list[tuple[str, str]]:
    out = []
    for mod_name in _DOC_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except Exception:  # pragma: no cover - a module missing from a stripped-down Python
            continue
        for name in sorted(dir(mod)):
            if name.startswith("_"):
                continue
            obj = getattr(mod, name, None)
            if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            doc = inspect.getdoc(obj) or ""
            doc = re.sub(r"\n{3,}", "\n\n", doc).strip()
            if min_words <= len(doc.split()) <= max_words and ">>>" not in doc:
                out.append((f"{mod_name}.{name}", doc))
    return out


# -------------------------------------------------------------------------------------- the generators
def _writing(rng: random.Random) -> str:
    form, topic = rng.choice(FORMS), rng.choice(TOPICS)
    t = rng.randrange(4)
    if t == 0:
        return f"Write a {form} about {topic}."
    if t == 1:
        return f"Write a {form} about {topic} for {rng.choice(AUDIENCES)}."
    if t == 2:
        return f"Write a {form} about {topic}, {rng.choice(STYLES)}."
    return f"Could you write a {form} about {topic} for {rng.choice(AUDIENCES)}, {rng.choice(STYLES)}?"


def _roleplay(rng: random.Random) -> str:
    c, s = rng.choice(CHARACTERS), rng.choice(SITUATIONS)
    t = rng.randrange(3)
    if t == 0:
        return f"Pretend you are {c}. {s} Stay in character."
    if t == 1:
        return f"Let's role-play: you are {c} and I am a visitor. {s} Answer as {c} would."
    return f"Act as {c}. {s} Reply in two or three sentences, in character, {rng.choice(STYLES[:13])}."


def _reasoning(rng: random.Random) -> str:
    t = rng.randrange(6)
    if t == 0:  # ordering
        a, b, c = rng.sample(NAMES, 3)
        adj, comp = rng.choice([("tall", "taller"), ("old", "older"), ("fast", "faster"), ("heavy", "heavier")])
        return (f"{a} is {comp} than {b}, and {b} is {comp} than {c}. Who is the most {adj}, and who is the "
                "least? Explain your reasoning step by step.")
    if t == 1:  # weekday arithmetic
        d, n = rng.choice(WEEKDAYS), rng.randint(2, 40)
        return f"If today is {d}, what day of the week will it be in {n} days? Show your reasoning."
    if t == 2:  # rate problem
        m, mins, k = rng.randint(2, 9), rng.randint(2, 12), rng.randint(2, 20)
        return (f"If {m} machines make {m} widgets in {mins} minutes, how long would {k * m} machines take to make "
                f"{k * m} widgets? Think it through before answering.")
    if t == 3:  # syllogism
        a, b, c = rng.sample(["cats", "mammals", "animals", "birds", "pets", "dogs", "reptiles", "fish", "poets",
                              "artists", "students", "readers"], 3)
        return (f"All {a} are {b}. Some {b} are {c}. Does it follow that some {a} are {c}? Explain why or why "
                "not.")
    if t == 4:  # counting / pigeonhole
        socks, colors = rng.randint(2, 6) * 2, rng.randint(2, 5)
        return (f"A drawer holds {socks} socks of each of {colors} colors, all mixed up, and the room is dark. How "
                "many socks must you take out to be sure of having a matching pair? Explain.")
    a, b = rng.sample(NAMES, 2)
    x, y = rng.randint(3, 15), rng.randint(3, 15)
    return (f"{a} has {x} {rng.choice(ITEMS)} and gives {b} a third of them, rounded down; then {b} gives back "
            f"{y % 4 + 1}. How many does {a} have now? Reason carefully.")


def _math(rng: random.Random) -> str:
    t = rng.randrange(8)
    if t == 0:
        a, b, c = rng.randint(2, 12), rng.randint(-30, 30), rng.randint(-50, 50)
        return f"Solve for x: {a}x {'+' if b >= 0 else '-'} {abs(b)} = {c}."
    if t == 1:
        p, n = rng.choice([5, 10, 12.5, 15, 20, 25, 30, 40, 75]), rng.randint(20, 900)
        return f"What is {p}% of {n}?"
    if t == 2:
        a, b, c, d = rng.randint(1, 9), rng.randint(2, 12), rng.randint(1, 9), rng.randint(2, 12)
        op = rng.choice(["+", "-", "times", "divided by"])
        return f"Compute {a}/{b} {op} {c}/{d} and simplify the result."
    if t == 3:
        w, h = rng.randint(2, 40), rng.randint(2, 40)
        return f"A rectangle is {w} cm wide and {h} cm long. What are its area and its perimeter?"
    if t == 4:
        a, d = rng.randint(-10, 20), rng.randint(2, 9)
        seq = ", ".join(str(a + d * i) for i in range(5))
        return f"What is the next number in the sequence {seq}? What is the 20th term?"
    if t == 5:
        a, b = rng.randint(12, 400), rng.randint(12, 400)
        return f"Find the greatest common divisor and the least common multiple of {a} and {b}."
    if t == 6:
        s, h = rng.randint(30, 120), rng.randint(2, 9)
        return f"A train travels at {s} km/h for {h} hours and then at {s + 20} km/h for {h - 1} hours. How far does it go in total?"
    a, b = rng.randint(100, 9999), rng.randint(11, 99)
    return f"Calculate {a} x {b} step by step."


def _coding(rng: random.Random) -> str:
    task, lang = rng.choice(CODE_TASKS), rng.choice(CODE_LANGUAGES)
    t = rng.randrange(4)
    if t == 0:
        return f"Write a {lang} function that {task}."
    if t == 1:
        return f"Write a {lang} function that {task}, and explain how it works."
    if t == 2:
        return f"How would you write a function in {lang} that {task}? Include a short test."
    return f"Write a {lang} function that {task}. What is its time complexity?"


def _extraction(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    city, month, day = rng.choice(CITIES), rng.choice(MONTHS), rng.randint(1, 28)
    amount, n = rng.randint(20, 5000), rng.randint(2, 30)
    texts = [f"On {month} {day}, {a} flew from {city} to meet {b}, who had ordered {n} {rng.choice(ITEMS)} for "
             f"{amount} euros. The meeting lasted two hours.",
             f"Invoice: {n} {rng.choice(ITEMS)} delivered to {a} in {city} on {day} {month}; total {amount} dollars; "
             f"contact person {b}.",
             f"{a} ({rng.randint(18, 80)}) moved to {city} in {month}. {b}, a friend, helped with {n} boxes and paid "
             f"{amount} for the van."]
    text = rng.choice(texts)
    ask = rng.choice(["Extract every person, place, date and amount from this text as a JSON object",
                      "List the names, the city and the money mentioned in this text",
                      "From the text below, extract the date and the amount as key: value lines",
                      "Pull out the structured facts (who, where, when, how much) from this text"])
    return f"{ask}:\n\n{text}"


def _stem(rng: random.Random) -> str:
    c = rng.choice(STEM_CONCEPTS)
    t = rng.randrange(6)
    if t == 0:
        return f"Explain {c} to {rng.choice(AUDIENCES)}."
    if t == 1:
        return f"How does {c} work? Give a concrete example."
    if t == 2:
        d = rng.choice(STEM_CONCEPTS)
        return f"What is the difference between {c} and {d}?" if d != c else f"Explain {c} step by step."
    if t == 3:
        return f"What experiment could a student do at home to learn about {c}?"
    if t == 4:
        return f"Summarize what scientists know about {c} in five bullet points."
    return rng.choice(QA_TEMPLATES).format(c=c)


def _humanities(rng: random.Random) -> str:
    c = rng.choice(HUMANITIES_CONCEPTS)
    t = rng.randrange(6)
    if t == 0:
        return f"Explain {c} to {rng.choice(AUDIENCES)}."
    if t == 1:
        return f"What were the causes and consequences of {c}?" if rng.random() < 0.5 else \
            f"Why does {c} still matter today?"
    if t == 2:
        d = rng.choice(HUMANITIES_CONCEPTS)
        return f"Compare {c} with {d}." if d != c else f"Give a short overview of {c}."
    if t == 3:
        return f"Write a short essay outline about {c}."
    if t == 4:
        return f"What would a debate about {c} sound like? Give one argument on each side."
    return rng.choice(QA_TEMPLATES).format(c=c)


def _translation(rng: random.Random, passages: list[str]) -> str:
    lang = rng.choice(LANGUAGES)
    if rng.random() < 0.7:
        s = f"{rng.choice(SENTENCE_SUBJECTS)} {rng.choice(SENTENCE_VERBS)} {rng.choice(SENTENCE_OBJECTS)} " \
            f"{rng.choice(SENTENCE_TAILS)}"
        if rng.random() < 0.5:
            s += f" {rng.choice(SENTENCE_SUBJECTS)} {rng.choice(SENTENCE_VERBS)} {rng.choice(SENTENCE_OBJECTS)} " \
                 f"{rng.choice(SENTENCE_TAILS)}"
    else:
        lines = [ln.strip() for ln in rng.choice(passages).split("\n") if len(ln.split()) >= 4]
        s = lines[0] if lines else "Good morning, my friend."
    return rng.choice([f"Translate into {lang}: {s}", f"How do you say this in {lang}? \"{s}\"",
                       f"Translate the following sentence into {lang} and explain one word choice:\n\n{s}"])


def _summarisation(rng: random.Random, passages: list[str], docs: list[tuple[str, str]]) -> str:
    if docs and rng.random() < 0.5:
        name, doc = rng.choice(docs)
        return rng.choice([f"Summarize this documentation of Python's `{name}` in two sentences:\n\n{doc}",
                           f"Explain in plain words what this text says:\n\n{doc}",
                           f"Give a one-sentence summary of the following:\n\n{doc}"])
    p = rng.choice(passages)
    return rng.choice([f"Summarise this passage in two sentences:\n\n{p}",
                       f"What happens in this passage? Answer briefly.\n\n{p}",
                       f"Rewrite this passage in modern, plain English:\n\n{p}",
                       f"Give a three-bullet summary of this text:\n\n{p}"])


def _qa(rng: random.Random) -> str:
    if rng.random() < 0.4:
        return rng.choice(COUNTRY_QA).format(x=rng.choice(COUNTRIES))
    c = rng.choice(STEM_CONCEPTS + HUMANITIES_CONCEPTS + TOPICS)
    return rng.choice(QA_TEMPLATES + ["Tell me about {c}.", "What should everyone know about {c}?"]).format(c=c)


def _reading(rng: random.Random, passages: list[str], docs: list[tuple[str, str]]) -> str:
    if docs and rng.random() < 0.5:
        name, doc = rng.choice(docs)
        q = rng.choice(["What does this function or class do?", "What arguments does it take?",
                        "What does it return or produce?", "When would you use it?",
                        "What is one limitation or special case mentioned?"])
        return f"Read the documentation of Python's `{name}` below and answer: {q}\n\n{doc}"
    p = rng.choice(passages)
    q = rng.choice(["Who is speaking, and to whom?", "What is the mood of this passage?",
                    "What does the speaker want?", "Which image or metaphor stands out, and what does it mean?",
                    "What happened just before this passage, judging from the text?",
                    "Quote the line that best sums up the passage and explain why."])
    return f"Answer using only the passage below. {q}\n\n{p}"


# ------------------------------------------------------------------------------------------ dedup
def normalise(text: str) -> str:
    """Case- and whitespace-folded text: the key of exact deduplication."""
    return " ".join(text.lower().split())


def _shingles(text: str, n: int = 3) -> set[int]:
    w = re.findall(r"\w+", text.lower())
    if len(w) < n:
        return {zlib.crc32(" ".join(w).encode())}
    return {zlib.crc32(" ".join(w[i:i + n]).encode()) for i in range(len(w) - n + 1)}


def minhash(texts: list[str], num_perm: int = 64, seed: int = 1) -> np.ndarray:
    """[len(texts), num_perm] MinHash signatures of word 3-gram shingles (hashes a*x + b mod 2^61-1)."""
    p = (1 << 61) - 1
    r = np.random.default_rng(seed)
    a = r.integers(1, p, num_perm, dtype=np.uint64)
    b = r.integers(0, p, num_perm, dtype=np.uint64)
    sig = np.empty((len(texts), num_perm), dtype=np.uint64)
    for i, t in enumerate(texts):
        x = np.fromiter(_shingles(t), dtype=np.uint64)
        # a fixed hash family of x (a, b seeded): the uint64 products wrap around (mod 2^64), so this is not
        # exactly (a x + b) mod p, but each of the num_perm functions is deterministic, which is all MinHash needs
        lo, hi = a & ((1 << 30) - 1), a >> 30
        h = ((hi[None, :] * x[:, None] % p) * (1 << 30) % p + lo[None, :] * x[:, None] + b[None, :]) % p
        sig[i] = h.min(0)
    return sig


def near_duplicates(texts: list[str], threshold: float = NEAR_DUP_JACCARD, num_perm: int = 64,
                    bands: int = 16) -> set[int]:
    """Indices to drop: each text whose estimated Jaccard similarity (share of equal MinHash values) to an
    earlier kept text is >= threshold. Candidates come from LSH (bands x rows of the signature)."""
    sig = minhash(texts, num_perm)
    rows = num_perm // bands
    buckets: dict[tuple[int, bytes], list[int]] = {}
    drop: set[int] = set()
    for i in range(len(texts)):
        cands = set()
        keys = [(bnd, sig[i, bnd * rows:(bnd + 1) * rows].tobytes()) for bnd in range(bands)]
        for k in keys:
            cands.update(buckets.get(k, ()))
        if any(float((sig[i] == sig[j]).mean()) >= threshold for j in cands):
            drop.add(i)
            continue
        for k in keys:
            buckets.setdefault(k, []).append(i)
    return drop


# ------------------------------------------------------------------------------------------ the set
def _generators(seed: int) -> dict[str, Callable[[random.Random], str]]:
    prng = random.Random(f"{seed}-passages")
    passages = _corpus_passages(prng, 3000)
    docs = stdlib_docs()
    return {"writing": _writing, "roleplay": _roleplay, "reasoning": _reasoning, "math": _math,
            "coding": _coding, "extraction": _extraction, "stem": _stem, "humanities": _humanities,
            "translation": lambda r: _translation(r, passages),
            "summarisation": lambda r: _summarisation(r, passages, docs),
            "qa": _qa, "reading": lambda r: _reading(r, passages, docs)}


def _draw(gen: Callable[[random.Random], str], rng: random.Random, n: int, taken: set[str]) -> Iterator[str]:
    """Up to n texts of one generator that are new after exact dedup (gives up after 50 n draws)."""
    got = 0
    for _ in range(50 * n):
        if got == n:
            return
        t = gen(rng)
        k = normalise(t)
        if k not in taken:
            taken.add(k)
            got += 1
            yield t


def build(seed: int = 0, per_category: int = PER_CATEGORY, categories: tuple[str, ...] = CATEGORIES,
          progress: bool = False) -> list[Prompt]:
    """The scaled prompt set: per category up to `per_category` exact-unique texts, minus near-duplicates,
    with held-out splits. Deterministic for (seed, this file, the corpus, the Python version)."""
    gens = _generators(seed)
    unknown = [c for c in categories if c not in gens]
    if unknown:
        raise ValueError(f"unknown categories {unknown}; known: {list(gens)}")
    items: list[tuple[str, str, str]] = []
    taken: set[str] = set()
    for cat in categories:
        rng = random.Random(f"{seed}-{cat}")
        texts = list(_draw(gens[cat], rng, per_category, taken))
        items += [(f"{cat}-{hashlib.sha256(t.encode()).hexdigest()[:12]}", cat, t) for t in texts]
        if progress:
            print(f"  {cat}: {len(texts)} drawn", file=sys.stderr)
    items.sort(key=lambda x: x[0])
    drop = near_duplicates([t for _, _, t in items])
    kept = [x for i, x in enumerate(items) if i not in drop]
    return assign_splits(kept, HELDOUT_FRACTION)


def recipe_hash() -> str:
    """sha256 of this file: the recipe version recorded in the committed set's header."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def save(prompts: list[Prompt], path: str | Path, seed: int) -> Path:
    path = Path(path)
    header = {"format": FORMAT, "seed": seed, "recipe": recipe_hash(),
              "python": ".".join(map(str, sys.version_info[:2])), "count": len(prompts)}
    with gzip.open(path, "wt", encoding="utf-8", compresslevel=9) as f:
        f.write(json.dumps(header) + "\n")
        for p in prompts:
            f.write(json.dumps({"id": p.id, "category": p.category, "split": p.split, "text": p.text},
                               ensure_ascii=False) + "\n")
    return path


def load(path: str | Path = SCALED_FILE) -> list[Prompt]:
    """The committed scaled prompt set (or another file written by `save`), checked for its format."""
    path = Path(path)
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            header = json.loads(f.readline())
            if header.get("format") != FORMAT:
                raise ValueError(f"{path}: not a {FORMAT} file (header {header!r})")
            out = []
            for n, line in enumerate(f, 2):
                r = json.loads(line)
                out.append(Prompt(r["id"], r["category"], r["text"], r["split"]))
    except (OSError, EOFError, json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: damaged prompt file ({type(e).__name__}: {e}); regenerate it with "
                         "`python -m midlayer.prompt_recipe --write`") from e
    if len(out) != header.get("count"):
        raise ValueError(f"{path}: header says {header.get('count')} prompts, file has {len(out)} (truncated?)")
    return out


def summary(prompts: list[Prompt]) -> str:
    """Counts per category and split (`prompts.summary` over this set's categories)."""
    return base_summary(prompts, CATEGORIES, name_width=14, count_width=5)


def _main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Build, write or check the scaled prompt set for draft training.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-category", type=int, default=PER_CATEGORY)
    ap.add_argument("--write", action="store_true", help=f"write {SCALED_FILE.name}")
    ap.add_argument("--check", action="store_true", help="regenerate and compare with the committed file")
    args = ap.parse_args(argv)
    prompts = build(args.seed, args.per_category, progress=True)
    print(summary(prompts))
    if args.write:
        print(f"wrote {save(prompts, SCALED_FILE, args.seed)}")
    if args.check:
        same = load() == prompts
        print("committed file matches" if same else "committed file DIFFERS from the recipe's output")
        sys.exit(0 if same else 1)


if __name__ == "__main__":
    _main()


__all__ = ["CATEGORIES", "build", "load", "save", "summary", "near_duplicates", "minhash", "normalise",
           "stdlib_docs", "SCALED_FILE", "HELDOUT_FRACTION"]
