"""A synthetic English → German parallel corpus from a rule-based grammar, then BPE and token ids.

No translation corpus ships in any package and nothing can be downloaded, so the embedded default is
generated: deterministic from `seed`, written as raw text (`{train,valid,test}.{en,de}`, one sentence
per line), then prepared exactly like WMT (`data.translation.prepare_corpus`: a shared sentencepiece BPE
model, token ids in memory-mapped arrays).

The German side follows the grammar a model has to learn, not a word-for-word substitution:
- grammatical gender (der/die/das) and case: nominative subject, accusative object, dative indirect
  object and after prepositions (with the contractions im/am), on articles, ein-words, dieser;
- adjective endings, weak after der/dieser, mixed after ein/kein/mein, strong without an article;
- irregular plurals (Mann → Männer, with the dative-plural -n) and verb conjugation by person
  (ich sehe, du siehst, er sieht, wir/sie sehen);
- verb-second inversion after a fronted adverb or date ("Heute sieht der Mann ..."), and time before
  the object ("Die Frau kauft am dritten Mai ein Auto");
- verb-final subordinate clauses ("..., dass der Mann den Hund sieht") and the modal bracket
  ("Der Mann will ein Auto kaufen", "..., dass er ein Auto kaufen will");
- negation (kein for an indefinite object, nicht after a definite one) and yes/no questions;
- number words with German's units-before-tens ("twenty-three" → "dreiundzwanzig") and ordinal dates.

valid and test hold sentences that never occur in train (checked when writing). A `.complete` marker
makes reruns a no-op. The command line is scripts/prepare_synthetic_translation.py.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path

from data.translation import prepare_corpus

# ---------------------------------------------------------------- lexicon

M, F, N = "m", "f", "n"
NOM, ACC, DAT = 0, 1, 2


@dataclass(frozen=True)
class Noun:
    en: str
    en_pl: str
    gender: str
    de: str
    de_pl: str
    de_dat_pl: str = ""
    """Dative plural when it differs from de_pl (the -n of "den Männern")."""
    animate: bool = False
    place: bool = False


def _n(en: str, en_pl: str, g: str, de: str, de_pl: str, dat: bool = False, animate: bool = False,
       place: bool = False) -> Noun:
    return Noun(en, en_pl, g, de, de_pl, de_pl + "n" if dat else de_pl, animate, place)


NOUNS = [
    _n("man", "men", M, "Mann", "Männer", dat=True, animate=True),
    _n("woman", "women", F, "Frau", "Frauen", animate=True),
    _n("child", "children", N, "Kind", "Kinder", dat=True, animate=True),
    _n("dog", "dogs", M, "Hund", "Hunde", dat=True, animate=True),
    _n("cat", "cats", F, "Katze", "Katzen", animate=True),
    _n("horse", "horses", N, "Pferd", "Pferde", dat=True, animate=True),
    _n("teacher", "teachers", M, "Lehrer", "Lehrer", dat=True, animate=True),
    _n("doctor", "doctors", M, "Arzt", "Ärzte", dat=True, animate=True),
    _n("friend", "friends", M, "Freund", "Freunde", dat=True, animate=True),
    _n("girl", "girls", N, "Mädchen", "Mädchen", animate=True),
    _n("bird", "birds", M, "Vogel", "Vögel", dat=True, animate=True),
    _n("sister", "sisters", F, "Schwester", "Schwestern", animate=True),
    _n("brother", "brothers", M, "Bruder", "Brüder", dat=True, animate=True),
    _n("farmer", "farmers", M, "Bauer", "Bauern", animate=True),
    _n("book", "books", N, "Buch", "Bücher", dat=True),
    _n("letter", "letters", M, "Brief", "Briefe", dat=True),
    _n("car", "cars", N, "Auto", "Autos", place=True),
    _n("house", "houses", N, "Haus", "Häuser", dat=True, place=True),
    _n("table", "tables", M, "Tisch", "Tische", dat=True),
    _n("apple", "apples", M, "Apfel", "Äpfel", dat=True),
    _n("flower", "flowers", F, "Blume", "Blumen"),
    _n("door", "doors", F, "Tür", "Türen"),
    _n("window", "windows", N, "Fenster", "Fenster", dat=True),
    _n("city", "cities", F, "Stadt", "Städte", dat=True, place=True),
    _n("garden", "gardens", M, "Garten", "Gärten", place=True),
    _n("ball", "balls", M, "Ball", "Bälle", dat=True),
    _n("cake", "cakes", M, "Kuchen", "Kuchen"),
    _n("picture", "pictures", N, "Bild", "Bilder", dat=True),
    _n("song", "songs", N, "Lied", "Lieder", dat=True),
    _n("chair", "chairs", M, "Stuhl", "Stühle", dat=True),
    _n("newspaper", "newspapers", F, "Zeitung", "Zeitungen"),
    _n("key", "keys", M, "Schlüssel", "Schlüssel", dat=True),
    _n("cup", "cups", F, "Tasse", "Tassen"),
    _n("bag", "bags", F, "Tasche", "Taschen"),
    _n("bottle", "bottles", F, "Flasche", "Flaschen"),
    _n("river", "rivers", M, "Fluss", "Flüsse", dat=True, place=True),
    _n("mountain", "mountains", M, "Berg", "Berge", dat=True, place=True),
    _n("school", "schools", F, "Schule", "Schulen", place=True),
    _n("bed", "beds", N, "Bett", "Betten"),
    _n("shoe", "shoes", M, "Schuh", "Schuhe", dat=True),
    _n("village", "villages", N, "Dorf", "Dörfer", dat=True, place=True),
    _n("kitchen", "kitchens", F, "Küche", "Küchen", place=True),
]
ANIMATE = [n for n in NOUNS if n.animate]
PLACES = [n for n in NOUNS if n.place]

ADJECTIVES = [("big", "groß"), ("small", "klein"), ("old", "alt"), ("new", "neu"), ("young", "jung"),
              ("red", "rot"), ("green", "grün"), ("blue", "blau"), ("beautiful", "schön"), ("fast", "schnell"),
              ("happy", "glücklich"), ("tired", "müde"), ("hungry", "hungrig"), ("white", "weiß"),
              ("black", "schwarz"), ("cheap", "billig"), ("friendly", "freundlich"), ("strange", "seltsam"),
              ("long", "lang"), ("warm", "warm"), ("quiet", "ruhig"), ("clever", "klug")]


def _regular(stem: str, e: str = "") -> list[str]:
    """Present tense of a regular verb by person: ich, du, er/sie/es, wir, ihr, sie (plural); `e` is the
    linking vowel of stems in -t/-d/-n ("du wartest")."""
    return [stem + "e", stem + e + "st", stem + e + "t", stem + "en", stem + e + "t", stem + "en"]


@dataclass(frozen=True)
class Verb:
    en: str
    en_3sg: str
    de_inf: str
    de: tuple[str, ...]
    particle: str = ""
    """English particle after the verb ("look for")."""


def _v(en: str, en_3sg: str, de_inf: str, forms: list[str], particle: str = "") -> Verb:
    return Verb(en, en_3sg, de_inf, tuple(forms), particle)


TRANSITIVE = [
    _v("see", "sees", "sehen", ["sehe", "siehst", "sieht", "sehen", "seht", "sehen"]),
    _v("find", "finds", "finden", _regular("find", "e")),
    _v("buy", "buys", "kaufen", _regular("kauf")),
    _v("love", "loves", "lieben", _regular("lieb")),
    _v("need", "needs", "brauchen", _regular("brauch")),
    _v("have", "has", "haben", ["habe", "hast", "hat", "haben", "habt", "haben"]),
    _v("carry", "carries", "tragen", ["trage", "trägst", "trägt", "tragen", "tragt", "tragen"]),
    _v("visit", "visits", "besuchen", _regular("besuch")),
    _v("hold", "holds", "halten", ["halte", "hältst", "hält", "halten", "haltet", "halten"]),
    _v("paint", "paints", "malen", _regular("mal")),
    _v("wash", "washes", "waschen", ["wasche", "wäschst", "wäscht", "waschen", "wascht", "waschen"]),
    _v("read", "reads", "lesen", ["lese", "liest", "liest", "lesen", "lest", "lesen"]),
    _v("look", "looks", "suchen", _regular("such"), particle="for"),
    _v("open", "opens", "öffnen", _regular("öffn", "e")),
    _v("sell", "sells", "verkaufen", _regular("verkauf")),
    _v("forget", "forgets", "vergessen", ["vergesse", "vergisst", "vergisst", "vergessen", "vergesst", "vergessen"]),
    _v("take", "takes", "nehmen", ["nehme", "nimmst", "nimmt", "nehmen", "nehmt", "nehmen"]),
    _v("draw", "draws", "zeichnen", _regular("zeichn", "e")),
    _v("clean", "cleans", "putzen", ["putze", "putzt", "putzt", "putzen", "putzt", "putzen"]),
    _v("count", "counts", "zählen", _regular("zähl")),
]
DITRANSITIVE = [
    _v("give", "gives", "geben", ["gebe", "gibst", "gibt", "geben", "gebt", "geben"]),
    _v("show", "shows", "zeigen", _regular("zeig")),
    _v("send", "sends", "schicken", _regular("schick")),
    _v("bring", "brings", "bringen", _regular("bring")),
]
INTRANSITIVE = [
    _v("sleep", "sleeps", "schlafen", ["schlafe", "schläfst", "schläft", "schlafen", "schlaft", "schlafen"]),
    _v("laugh", "laughs", "lachen", _regular("lach")),
    _v("sing", "sings", "singen", _regular("sing")),
    _v("run", "runs", "laufen", ["laufe", "läufst", "läuft", "laufen", "lauft", "laufen"]),
    _v("wait", "waits", "warten", _regular("wart", "e")),
    _v("work", "works", "arbeiten", _regular("arbeit", "e")),
    _v("play", "plays", "spielen", _regular("spiel")),
    _v("dance", "dances", "tanzen", ["tanze", "tanzt", "tanzt", "tanzen", "tanzt", "tanzen"]),
]
SAY_VERBS = [  # verbs that take a dass-clause
    _v("know", "knows", "wissen", ["weiß", "weißt", "weiß", "wissen", "wisst", "wissen"]),
    _v("think", "thinks", "glauben", _regular("glaub")),
    _v("say", "says", "sagen", _regular("sag")),
    _v("hope", "hopes", "hoffen", _regular("hoff")),
]
MODALS = [  # (English 3sg, other persons, negated English, German forms, German forms when negated)
    ("can", "can", "cannot", ["kann", "kannst", "kann", "können", "könnt", "können"], None),
    # "must not" is a prohibition: dürfen ... nicht, not müssen ... nicht ("need not")
    ("must", "must", "must not", ["muss", "musst", "muss", "müssen", "müsst", "müssen"],
     ["darf", "darfst", "darf", "dürfen", "dürft", "dürfen"]),
    ("wants to", "want to", "", ["will", "willst", "will", "wollen", "wollt", "wollen"], None),
]
# (English, German, person index into the verb forms, English verb takes -s)
PRONOUNS = [("I", "ich", 0, False), ("you", "du", 1, False), ("he", "er", 2, True), ("she", "sie", 2, True),
            ("we", "wir", 3, False), ("they", "sie", 5, False)]
ADVERBS = [("today", "heute"), ("tomorrow", "morgen"), ("now", "jetzt"), ("often", "oft"),
           ("sometimes", "manchmal"), ("later", "später")]
PREPOSITIONS = [("in", "in"), ("near", "neben"), ("behind", "hinter")]  # location: dative
CONJUNCTIONS = [("because", "weil"), ("when", "wenn"), ("although", "obwohl")]

ONES_EN = ["", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
           "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
ONES_DE = ["", "eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun", "zehn", "elf", "zwölf",
           "dreizehn", "vierzehn", "fünfzehn", "sechzehn", "siebzehn", "achtzehn", "neunzehn"]
TENS_EN = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
TENS_DE = ["", "", "zwanzig", "dreißig", "vierzig", "fünfzig", "sechzig", "siebzig", "achtzig", "neunzig"]
ORD_EN = ["", "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
          "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth", "seventeenth", "eighteenth",
          "nineteenth"]
MONTHS = [("January", "Januar"), ("February", "Februar"), ("March", "März"), ("April", "April"), ("May", "Mai"),
          ("June", "Juni"), ("July", "Juli"), ("August", "August"), ("September", "September"),
          ("October", "Oktober"), ("November", "November"), ("December", "Dezember")]
DAYS_IN_MONTH = [31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]


def number_en(n: int) -> str:
    if n < 20:
        return ONES_EN[n]
    tens, ones = divmod(n, 10)
    return TENS_EN[tens] + (f"-{ONES_EN[ones]}" if ones else "")


def number_de(n: int) -> str:
    """German cardinal: units before tens ("dreiundzwanzig"), "ein" inside compounds."""
    if n < 20:
        return ONES_DE[n]
    tens, ones = divmod(n, 10)
    unit = "ein" if ones == 1 else ONES_DE[ones]
    return (f"{unit}und" if ones else "") + TENS_DE[tens]


def ordinal_en(n: int) -> str:
    if n < 20:
        return ORD_EN[n]
    tens, ones = divmod(n, 10)
    return f"{TENS_EN[tens]}-{ORD_EN[ones]}" if ones else TENS_EN[tens][:-1] + "ieth"


def ordinal_de_dative(n: int) -> str:
    """The dative ordinal after "am": am ersten, dritten, siebten, zwanzigsten, einunddreißigsten."""
    irregular = {1: "ersten", 3: "dritten", 7: "siebten", 8: "achten"}
    if n in irregular:
        return irregular[n]
    return number_de(n) + ("ten" if n < 20 else "sten")


# ---------------------------------------------------------------- noun phrases

DEFINITE = {M: ["der", "den", "dem"], F: ["die", "die", "der"], N: ["das", "das", "dem"], "pl": ["die", "die", "den"]}
DIESER = {M: ["dieser", "diesen", "diesem"], F: ["diese", "diese", "dieser"], N: ["dieses", "dieses", "diesem"],
          "pl": ["diese", "diese", "diesen"]}
EIN_ENDINGS = {M: ["", "en", "em"], F: ["e", "e", "er"], N: ["", "", "em"], "pl": ["e", "e", "en"]}
WEAK = {M: ["e", "en", "en"], F: ["e", "e", "en"], N: ["e", "e", "en"], "pl": ["en", "en", "en"]}
MIXED = {M: ["er", "en", "en"], F: ["e", "e", "en"], N: ["es", "es", "en"], "pl": ["en", "en", "en"]}
STRONG_PL = ["e", "e", "en"]
POSSESSIVES = [("my", "mein"), ("your", "dein"), ("his", "sein"), ("her", "ihr"), ("our", "unser")]


@dataclass
class NP:
    en: str
    de: list[str]
    """German words by case: nominative, accusative, dative."""
    plural: bool
    indefinite: bool = False
    """Starts with a/an (negated with kein rather than nicht)."""
    de_neg: list[str] | None = None
    """The kein-form by case, for indefinite singulars."""
    counted: bool = False
    """Starts with a number word (not negated: "nicht zwei Hunde" needs a contrast)."""


def noun_phrase(rng: random.Random, pool: list[Noun] | None = None, allow_number: bool = True) -> NP:
    noun = rng.choice(pool or NOUNS)
    adjective = rng.choice(ADJECTIVES) if rng.random() < 0.45 else None
    kind = rng.choices(["the", "a", "this", "poss", "number"], weights=[4, 3, 1, 2, 2 if allow_number else 0])[0]
    plural = kind == "number" or (kind in ("the", "this", "poss") and rng.random() < 0.3)
    g = "pl" if plural else noun.gender
    en_noun = noun.en_pl if plural else noun.en
    de_noun = [noun.de_pl, noun.de_pl, noun.de_dat_pl] if plural else [noun.de] * 3
    en_adj = f"{adjective[0]} " if adjective else ""

    def with_adj(endings: list[str]) -> list[str]:
        if not adjective:
            return de_noun
        stem = adjective[1].removesuffix("e")  # müde + e = müde, not müdee
        return [f"{stem}{endings[c]} {de_noun[c]}" for c in range(3)]

    if kind == "the":
        de = [f"{DEFINITE[g][c]} {w}" for c, w in enumerate(with_adj(WEAK[g]))]
        return NP(f"the {en_adj}{en_noun}", de, plural)
    if kind == "this":
        de = [f"{DIESER[g][c]} {w}" for c, w in enumerate(with_adj(WEAK[g]))]
        return NP(f"{'these' if plural else 'this'} {en_adj}{en_noun}", de, plural)
    if kind == "poss":
        en_p, de_p = rng.choice(POSSESSIVES)
        de = [f"{de_p}{EIN_ENDINGS[g][c]} {w}" for c, w in enumerate(with_adj(MIXED[g]))]
        return NP(f"{en_p} {en_adj}{en_noun}", de, plural)
    if kind == "a":
        article = "an" if (en_adj or en_noun)[0] in "aeiou" else "a"
        words = with_adj(MIXED[g])
        de = [f"ein{EIN_ENDINGS[g][c]} {w}" for c, w in enumerate(words)]
        neg = [f"kein{EIN_ENDINGS[g][c]} {w}" for c, w in enumerate(words)]
        return NP(f"{article} {en_adj}{en_noun}", de, False, indefinite=True, de_neg=neg)
    n = rng.randint(2, 99)
    de = [f"{number_de(n)} {w}" for w in with_adj(STRONG_PL)]
    return NP(f"{number_en(n)} {en_adj}{en_noun}", de, True, counted=True)


def place_phrase(rng: random.Random) -> tuple[str, str]:
    """A dative location: "in the garden" → "im Garten", "near a river" → "neben einem Fluss"."""
    en_p, de_p = rng.choice(PREPOSITIONS)
    np_ = noun_phrase(rng, PLACES, allow_number=False)
    de = np_.de[DAT]
    if de_p == "in" and de.startswith("dem "):
        return f"{en_p} {np_.en}", "im " + de[4:]
    return f"{en_p} {np_.en}", f"{de_p} {de}"


def date_phrase(rng: random.Random) -> tuple[str, str]:
    month = rng.randrange(12)
    en_m, de_m = MONTHS[month]
    day = rng.randint(1, DAYS_IN_MONTH[month])
    return f"on the {ordinal_en(day)} of {en_m}", f"am {ordinal_de_dative(day)} {de_m}"


def subject(rng: random.Random) -> tuple[str, str, int, bool]:
    """(English, German, person index, English 3sg) — a pronoun or an animate noun phrase."""
    if rng.random() < 0.3:
        return rng.choice(PRONOUNS)
    np_ = noun_phrase(rng, ANIMATE)
    return np_.en, np_.de[NOM], 5 if np_.plural else 2, not np_.plural


# ---------------------------------------------------------------- clauses


@dataclass
class Clause:
    """One clause in parts, so that main, inverted and subordinate word orders can be assembled."""

    en_subj: str
    en_pred: str
    """English verb group and everything after it ("sees the dog in the garden")."""
    en_3sg: bool
    de_subj: str
    de_finite: str
    de_middle: list[str]
    """Words between the finite verb and the clause end (time, objects, place) in main-clause order."""
    de_final: str = ""
    """Clause-final verb part (the infinitive after a modal), or ""."""
    en_question: str = ""
    """The English yes/no question without "?" ("Does the man see the dog"); "" = no question form."""
    en_pred_neg: str = ""
    """The negated predicate ("does not see the dog"); "" = no negated form."""
    de_finite_neg: str = ""
    de_middle_neg: list[str] | None = None


def clause(rng: random.Random, with_time: bool = True) -> Clause:
    en_subj, de_subj, person, third = subject(rng)
    kind = rng.choices(["trans", "ditrans", "intrans", "modal"], weights=[5, 2, 2, 2])[0]
    time_en, time_de = "", ""
    if with_time and rng.random() < 0.25:
        time_en, time_de = date_phrase(rng) if rng.random() < 0.5 else rng.choice(ADVERBS)
    tail = f" {time_en}" if time_en else ""
    time_mid = [time_de] if time_de else []  # German: time right after the finite verb, before the objects
    does = "does" if third else "do"

    def finite_en(v: Verb) -> str:
        return (v.en_3sg if third else v.en) + (f" {v.particle}" if v.particle else "")

    def base_en(v: Verb) -> str:
        return v.en + (f" {v.particle}" if v.particle else "")

    if kind == "intrans":
        v = rng.choice(INTRANSITIVE)
        place_en, place_de = place_phrase(rng) if rng.random() < 0.6 else ("", "")
        rest = (f" {place_en}" if place_en else "") + tail
        return Clause(en_subj, finite_en(v) + rest, third, de_subj, v.de[person], time_mid + [place_de],
                      en_question=f"{_cap(does)} {en_subj} {base_en(v)}{rest}")
    if kind == "ditrans":
        v = rng.choice(DITRANSITIVE)
        recipient = noun_phrase(rng, ANIMATE, allow_number=False)
        thing = noun_phrase(rng, [n for n in NOUNS if not n.animate])
        rest = f" {recipient.en} {thing.en}{tail}"
        return Clause(en_subj, finite_en(v) + rest, third, de_subj, v.de[person],
                      time_mid + [recipient.de[DAT], thing.de[ACC]],
                      en_question=f"{_cap(does)} {en_subj} {base_en(v)}{rest}")
    v = rng.choice(TRANSITIVE)
    obj = noun_phrase(rng)
    place_en, place_de = place_phrase(rng) if rng.random() < 0.25 else ("", "")
    rest = f" {obj.en}" + (f" {place_en}" if place_en else "") + tail
    middle = time_mid + [obj.de[ACC], place_de]
    # Negation: "ein" becomes "kein"; any other object takes "nicht" after it. Not offered with a place
    # phrase ("nicht im Garten" negates the place) nor with a number ("nicht zwei Hunde" needs a contrast).
    neg_middle = None
    if obj.indefinite:
        neg_middle = time_mid + [obj.de_neg[ACC], place_de]
    elif not place_de and not obj.counted:
        neg_middle = time_mid + [obj.de[ACC], "nicht"]
    if kind == "modal":
        en_m3, en_m, en_neg, forms, neg_forms = rng.choice(MODALS)
        question = (f"{_cap(does)} {en_subj} want to" if en_m == "want to" else f"{_cap(en_m)} {en_subj}")
        c = Clause(en_subj, f"{en_m3 if third else en_m} {base_en(v)}{rest}", third, de_subj, forms[person], middle,
                   v.de_inf, en_question=f"{question} {base_en(v)}{rest}")
        if neg_middle is not None and not place_de:
            neg = en_neg or f"{does} not want to"
            c.en_pred_neg, c.de_middle_neg = f"{neg} {base_en(v)}{rest}", neg_middle
            c.de_finite_neg = (neg_forms or forms)[person]
        return c
    c = Clause(en_subj, finite_en(v) + rest, third, de_subj, v.de[person], middle,
               en_question=f"{_cap(does)} {en_subj} {base_en(v)}{rest}")
    if neg_middle is not None and not place_de:
        c.en_pred_neg, c.de_middle_neg, c.de_finite_neg = f"{does} not {base_en(v)}{rest}", neg_middle, c.de_finite
    return c


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


def _join(*parts: str | list[str]) -> str:
    words: list[str] = []
    for p in parts:
        words += p if isinstance(p, list) else [p]
    return " ".join(w for w in words if w)


def main_clause_de(c: Clause, negated: bool = False) -> str:
    if negated:
        return _join(c.de_subj, c.de_finite_neg, c.de_middle_neg or [], c.de_final)
    return _join(c.de_subj, c.de_finite, c.de_middle, c.de_final)


def subordinate_de(c: Clause) -> str:
    """Verb-final: "der Mann den Hund sieht", "er ein Auto kaufen will"."""
    return _join(c.de_subj, c.de_middle, c.de_final, c.de_finite)


def sentence(rng: random.Random) -> tuple[str, str]:
    """One (English, German) pair."""
    form = rng.choices(["plain", "fronted", "negated", "question", "dass", "conj"], weights=[5, 3, 2, 2, 3, 2])[0]
    if form == "fronted":  # a fronted adverb or date puts the finite verb second, before the subject
        c = clause(rng, with_time=False)
        time_en, time_de = date_phrase(rng) if rng.random() < 0.5 else rng.choice(ADVERBS)
        return (f"{_cap(time_en)} {c.en_subj} {c.en_pred}.",
                _cap(_join(time_de, c.de_finite, c.de_subj, c.de_middle, c.de_final)) + ".")
    c = clause(rng)
    if form == "negated" and c.en_pred_neg:
        return f"{_cap(c.en_subj)} {c.en_pred_neg}.", _cap(main_clause_de(c, negated=True)) + "."
    if form == "question" and c.en_question:
        return f"{c.en_question}?", _cap(_join(c.de_finite, c.de_subj, c.de_middle, c.de_final)) + "?"
    if form == "dass":
        en_s, de_s, person, third = subject(rng)
        v = rng.choice(SAY_VERBS)
        return (f"{_cap(en_s)} {v.en_3sg if third else v.en} that {c.en_subj} {c.en_pred}.",
                f"{_cap(de_s)} {v.de[person]}, dass {subordinate_de(c)}.")
    if form == "conj":
        main = clause(rng, with_time=False)
        en_c, de_c = rng.choice(CONJUNCTIONS)
        return (f"{_cap(main.en_subj)} {main.en_pred} {en_c} {c.en_subj} {c.en_pred}.",
                f"{_cap(main_clause_de(main))}, {de_c} {subordinate_de(c)}.")
    return f"{_cap(c.en_subj)} {c.en_pred}.", _cap(main_clause_de(c)) + "."


# ---------------------------------------------------------------- corpus


def generate(n_train: int, n_valid: int, n_test: int, seed: int = 0) -> dict[str, list[tuple[str, str]]]:
    """Splits of unique pairs; valid and test are drawn first and no train source equals one of theirs."""
    rng = random.Random(seed)
    seen: set[str] = set()
    splits: dict[str, list[tuple[str, str]]] = {}
    for name, size in (("test", n_test), ("valid", n_valid), ("train", n_train)):
        pairs: list[tuple[str, str]] = []
        attempts = 0
        while len(pairs) < size:
            attempts += 1
            if attempts > 20 * size + 1000:
                raise ValueError(f"the grammar cannot produce {size} new {name} sentences (got {len(pairs)})")
            en, de = sentence(rng)
            if en not in seen:
                seen.add(en)
                pairs.append((en, de))
        splits[name] = pairs
    held_out = {en for name in ("valid", "test") for en, _ in splits[name]}
    if any(en in held_out for en, _ in splits["train"]):  # unreachable by construction; cheap to check
        raise AssertionError("a held-out sentence leaked into train")
    return splits


def write_raw(out: Path, splits: dict[str, list[tuple[str, str]]], src: str = "en", tgt: str = "de") -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, pairs in splits.items():
        (out / f"{name}.{src}").write_text("".join(en + "\n" for en, _ in pairs), encoding="utf-8")
        (out / f"{name}.{tgt}").write_text("".join(de + "\n" for _, de in pairs), encoding="utf-8")


def prepare(out: Path, n_train: int = 20000, n_valid: int = 500, n_test: int = 500, seed: int = 0,
            vocab_size: int = 1000) -> Path:
    """Generate the corpus and its BPE ids into `out` (a no-op when a complete one is there)."""
    marker = out / ".complete"
    stamp = f"train {n_train} valid {n_valid} test {n_test} seed {seed} vocab {vocab_size}\n"
    if marker.exists() and marker.read_text() == stamp:
        return out
    if out.exists():
        shutil.rmtree(out)
    write_raw(out, generate(n_train, n_valid, n_test, seed))
    prepare_corpus(out, "en", "de", vocab_size=vocab_size, splits=("train", "valid", "test"))
    marker.write_text(stamp)
    return out

