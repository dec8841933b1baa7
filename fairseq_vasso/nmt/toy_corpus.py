"""A small, deterministic German-to-English toy translation corpus.

The demo (``scripts/translation/demo.py``), the benchmark and the tests need a parallel corpus that exists
without network access, is the same on every machine, and is rich enough that a
tiny transformer's BLEU rises well above 0 within a few CPU minutes.  This module
generates one from a small grammar of real German and English words:

* gendered articles and case (``der Hund`` / ``den Hund`` / ``dem Hund``),
  adjective endings (``ein großer Hund``, ``der große Hund``), plurals;
* verb agreement (``ich sehe``, ``er sieht``, ``wir sehen``);
* word order that differs from English: verb-second after a fronted adverb
  (``heute sieht der Hund ...`` -> ``today the dog sees ...``), verb-final in
  subordinate clauses (``..., weil die Katze den Ball sieht``) and the perfect
  tense (``der Hund hat den Ball gesehen`` -> ``the dog saw the ball``);
* negation (``nicht``), prepositional phrases with dative (``mit dem Hund``).

Sentences are written as ordinary, cased, untokenized text with punctuation
attached (``Heute sieht der Hund die Katze.``), so the demo runs them through
the same Moses tokenization / lowercasing / BPE steps as the IWSLT-14 pipeline.
The output depends only on ``seed`` (Python's ``random.Random``), never on the
machine.

Usage::

    python -m fairseq_vasso.nmt.toy_corpus OUTDIR [--train 4000 --valid 300 --test 300 --seed 1]

writes ``OUTDIR/{train,valid,test}.{de,en}``. Run again with the same settings, it
says that OUTDIR already holds this corpus and writes nothing; with other settings it
refuses, naming the files, unless ``--force``.
"""

import argparse
import os
import random

# noun: (gender, German singular, German plural, English singular, English plural)
NOUNS = [
    ("m", "Hund", "Hunde", "dog", "dogs"),
    ("f", "Katze", "Katzen", "cat", "cats"),
    ("n", "Kind", "Kinder", "child", "children"),
    ("m", "Mann", "Männer", "man", "men"),
    ("f", "Frau", "Frauen", "woman", "women"),
    ("m", "Lehrer", "Lehrer", "teacher", "teachers"),
    ("f", "Lehrerin", "Lehrerinnen", "teacher", "teachers"),
    ("m", "Vogel", "Vögel", "bird", "birds"),
    ("n", "Pferd", "Pferde", "horse", "horses"),
    ("m", "Arzt", "Ärzte", "doctor", "doctors"),
    ("f", "Maus", "Mäuse", "mouse", "mice"),
    ("m", "Bauer", "Bauern", "farmer", "farmers"),
    ("m", "Student", "Studenten", "student", "students"),
    ("f", "Freundin", "Freundinnen", "friend", "friends"),
    ("m", "Freund", "Freunde", "friend", "friends"),
    ("n", "Mädchen", "Mädchen", "girl", "girls"),
    ("m", "Junge", "Jungen", "boy", "boys"),
    ("m", "König", "Könige", "king", "kings"),
]
THINGS = [
    ("m", "Ball", "Bälle", "ball", "balls"),
    ("n", "Buch", "Bücher", "book", "books"),
    ("m", "Apfel", "Äpfel", "apple", "apples"),
    ("n", "Haus", "Häuser", "house", "houses"),
    ("f", "Blume", "Blumen", "flower", "flowers"),
    ("m", "Brief", "Briefe", "letter", "letters"),
    ("n", "Auto", "Autos", "car", "cars"),
    ("f", "Zeitung", "Zeitungen", "newspaper", "newspapers"),
    ("m", "Tisch", "Tische", "table", "tables"),
    ("n", "Bild", "Bilder", "picture", "pictures"),
    ("f", "Tür", "Türen", "door", "doors"),
    ("m", "Schlüssel", "Schlüssel", "key", "keys"),
    ("n", "Brot", "Brote", "bread", "breads"),
    ("m", "Stein", "Steine", "stone", "stones"),
    ("f", "Uhr", "Uhren", "clock", "clocks"),
    ("n", "Lied", "Lieder", "song", "songs"),
]
# adjective: (German stem, English)
ADJECTIVES = [
    ("groß", "big"), ("klein", "small"), ("alt", "old"), ("jung", "young"),
    ("rot", "red"), ("blau", "blue"), ("schön", "beautiful"), ("neu", "new"),
    ("schnell", "fast"), ("müde", "tired"), ("klug", "clever"), ("laut", "loud"),
    ("grün", "green"), ("kalt", "cold"), ("warm", "warm"), ("arm", "poor"),
]
# transitive verb: German (1sg, 2sg, 3sg, 1pl/3pl, 2pl, participle),
#                  English (base, 3sg, past)
VERBS = [
    (("sehe", "siehst", "sieht", "sehen", "seht", "gesehen"), ("see", "sees", "saw")),
    (("finde", "findest", "findet", "finden", "findet", "gefunden"), ("find", "finds", "found")),
    (("kaufe", "kaufst", "kauft", "kaufen", "kauft", "gekauft"), ("buy", "buys", "bought")),
    (("suche", "suchst", "sucht", "suchen", "sucht", "gesucht"), ("look for", "looks for", "looked for")),
    (("trage", "trägst", "trägt", "tragen", "tragt", "getragen"), ("carry", "carries", "carried")),
    (("male", "malst", "malt", "malen", "malt", "gemalt"), ("paint", "paints", "painted")),
    (("verliere", "verlierst", "verliert", "verlieren", "verliert", "verloren"), ("lose", "loses", "lost")),
    (("brauche", "brauchst", "braucht", "brauchen", "braucht", "gebraucht"), ("need", "needs", "needed")),
    (("hole", "holst", "holt", "holen", "holt", "geholt"), ("fetch", "fetches", "fetched")),
    (("liebe", "liebst", "liebt", "lieben", "liebt", "geliebt"), ("love", "loves", "loved")),
    (("nehme", "nimmst", "nimmt", "nehmen", "nehmt", "genommen"), ("take", "takes", "took")),
    (("baue", "baust", "baut", "bauen", "baut", "gebaut"), ("build", "builds", "built")),
]
HABEN = ("habe", "hast", "hat", "haben", "habt")
# pronoun subjects: German, English, German verb slot, English is-3sg
PRONOUNS = [
    ("ich", "I", 0, False), ("du", "you", 1, False), ("er", "he", 2, True),
    ("sie", "she", 2, True), ("wir", "we", 3, False), ("ihr", "you", 4, False),
]
ADVERBS = [
    ("heute", "today"), ("morgen", "tomorrow"), ("oft", "often"), ("manchmal", "sometimes"),
    ("jetzt", "now"), ("immer", "always"), ("gestern", "yesterday"), ("abends", "in the evening"),
]
PLACES = [
    ("im Garten", "in the garden"), ("in der Stadt", "in the city"), ("im Wald", "in the forest"),
    ("in der Schule", "at school"), ("am Fluss", "by the river"), ("auf dem Markt", "at the market"),
    ("im Park", "in the park"), ("zu Hause", "at home"),
]
CONJUNCTIONS = [("weil", "because"), ("obwohl", "although"), ("wenn", "when"), ("dass", "that")]
MAIN_INTRO = [("Ich glaube", "I think"), ("Sie sagt", "she says"), ("Wir wissen", "we know"),
              ("Er hofft", "he hopes"), ("Man sagt", "people say")]

DEF = {"nom": {"m": "der", "f": "die", "n": "das", "pl": "die"},
       "acc": {"m": "den", "f": "die", "n": "das", "pl": "die"},
       "dat": {"m": "dem", "f": "der", "n": "dem", "pl": "den"}}
INDEF = {"nom": {"m": "ein", "f": "eine", "n": "ein"},
         "acc": {"m": "einen", "f": "eine", "n": "ein"},
         "dat": {"m": "einem", "f": "einer", "n": "einem"}}
# adjective endings after definite / indefinite article (weak / mixed declension)
WEAK = {"nom": {"m": "e", "f": "e", "n": "e", "pl": "en"},
        "acc": {"m": "en", "f": "e", "n": "e", "pl": "en"},
        "dat": {"m": "en", "f": "en", "n": "en", "pl": "en"}}
MIXED = {"nom": {"m": "er", "f": "e", "n": "es"},
         "acc": {"m": "en", "f": "e", "n": "es"},
         "dat": {"m": "en", "f": "en", "n": "en"}}


def _adj(stem, ending):
    # "müde" + "e" -> "müde"; "müde" + "en" -> "müden"
    if stem.endswith("e") and ending.startswith("e"):
        return stem + ending[1:]
    return stem + ending


def noun_phrase(rng, pool, case):
    """Returns (German words, English words, is_plural) for a random noun phrase."""
    gender, sg, pl, en_sg, en_pl = rng.choice(pool)
    plural = rng.random() < 0.25
    definite = plural or rng.random() < 0.6
    adj = rng.choice(ADJECTIVES) if rng.random() < 0.45 else None
    de, en = [], []
    g = "pl" if plural else gender
    if definite:
        de.append(DEF[case][g])
        en.append("the")
    elif not plural:
        de.append(INDEF[case][g])
        en.append("an" if (adj[1] if adj else en_sg)[0] in "aeiou" else "a")
    if adj:
        ending = WEAK[case][g] if definite else MIXED[case][g]
        de.append(_adj(adj[0], ending))
        en.append(adj[1])
    noun = pl if plural else sg
    if plural and case == "dat" and not noun.endswith(("n", "s")):
        noun += "n"  # dative plural -n
    de.append(noun)
    en.append(en_pl if plural else en_sg)
    return de, en, plural


def subject(rng):
    """Returns (German, English, German verb slot, English is-3sg)."""
    if rng.random() < 0.3:
        de, en, slot, third = rng.choice(PRONOUNS)
        return [de], [en], slot, third
    de, en, plural = noun_phrase(rng, NOUNS, "nom")
    return de, en, (3 if plural else 2), not plural


def clause(rng, subordinate=False):
    """One clause: (German words, English words)."""
    s_de, s_en, slot, third = subject(rng)
    verb_de, verb_en = rng.choice(VERBS)
    o_de, o_en, _ = noun_phrase(rng, THINGS + NOUNS[:6], "acc")
    perfect = rng.random() < 0.3
    negate = rng.random() < 0.15
    adverb = rng.choice(ADVERBS) if rng.random() < 0.35 else None
    place = None
    if rng.random() < 0.3:
        if rng.random() < 0.5:
            place = rng.choice(PLACES)
        else:
            p_de, p_en, _ = noun_phrase(rng, NOUNS, "dat")
            place = ("mit " + " ".join(p_de), "with " + " ".join(p_en))
    if perfect and adverb and adverb[0] in ("morgen",):
        adverb = ("gestern", "yesterday")
    if not perfect and adverb and adverb[0] == "gestern":
        perfect = True

    # English: subject (adverb) verb object (place)
    if perfect:
        e_verb = (["did", "not", verb_en[0]] if negate else [verb_en[2]])
    elif negate:
        e_verb = ["does" if third else "do", "not", verb_en[0]]
    else:
        e_verb = [verb_en[1] if third else verb_en[0]]
    en = []
    if adverb and not subordinate and adverb[1] in ("today", "tomorrow", "yesterday", "now"):
        en += adverb[1].split() + s_en + e_verb + o_en
    elif adverb:
        en += s_en + e_verb + o_en + adverb[1].split()
    else:
        en += s_en + e_verb + o_en
    if place:
        en += place[1].split()

    finite = (HABEN if perfect else verb_de)[slot]
    middle = o_de + (["nicht"] if negate else []) + (place[0].split() if place else [])
    nonfinite = [verb_de[5]] if perfect else []
    if subordinate:  # verb-final: subject (adverb) object ... participle finite
        de = s_de + ([adverb[0]] if adverb else []) + middle + nonfinite + [finite]
    elif adverb and rng.random() < 0.6:  # verb second after a fronted adverb
        de = [adverb[0], finite] + s_de + middle + nonfinite
    else:
        de = s_de + [finite] + ([adverb[0]] if adverb else []) + middle + nonfinite
    return de, en


def sentence_pair(rng):
    """Returns one (German, English) pair of untokenized, cased sentences."""
    r = rng.random()
    if r < 0.55:
        de, en = clause(rng)
    elif r < 0.8:
        de1, en1 = clause(rng)
        conj_de, conj_en = rng.choice(CONJUNCTIONS)
        de2, en2 = clause(rng, subordinate=True)
        de, en = de1 + [",", conj_de] + de2, en1 + [conj_en] + en2
    else:
        intro_de, intro_en = rng.choice(MAIN_INTRO)
        de2, en2 = clause(rng, subordinate=True)
        de, en = intro_de.split() + [",", "dass"] + de2, intro_en.split() + ["that"] + en2
    end = "!" if rng.random() < 0.1 else "."
    return _detok(de, end), _detok(en, end)


def _detok(words, end):
    text = " ".join(words).replace(" ,", ",")
    text = text[0].upper() + text[1:]
    return text + end


def generate(n, seed):
    """n distinct sentence pairs, a deterministic function of (n, seed)."""
    rng = random.Random(seed)
    seen, pairs = set(), []
    while len(pairs) < n:
        de, en = sentence_pair(rng)
        if de in seen:
            continue
        seen.add(de)
        pairs.append((de, en))
    return pairs


def corrupt_targets(pairs, fraction, seed):
    """Misaligned training pairs, the translation analogue of label noise.

    Picks ``round(fraction * len(pairs))`` pairs and gives each the target of another
    picked pair (the picked targets rotated by one place in a random order), so a
    corrupted target is a fluent English sentence of the corpus that does not
    translate its source. Sources stay as they are. Returns (new pairs, sorted indices
    of the corrupted pairs); a deterministic function of (pairs, fraction, seed).
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError("fraction must be in [0, 1], got %r" % (fraction,))
    rng = random.Random(seed)
    picked = rng.sample(range(len(pairs)), int(round(fraction * len(pairs))))
    out = list(pairs)
    if len(picked) < 2:  # one pair cannot be misaligned with itself
        return out, []
    for i, j in zip(picked, picked[1:] + picked[:1]):
        out[i] = (pairs[i][0], pairs[j][1])
    return out, sorted(picked)


def corpus_text(n_train=4000, n_valid=300, n_test=300, seed=1, src="de", tgt="en", train_noise=0.0):
    """{file name: its text} of the corpus ``write_corpus`` writes; splits are disjoint.

    ``train_noise``: the fraction of training pairs whose target is misaligned
    (``corrupt_targets``); valid and test stay clean.
    """
    pairs = generate(n_train + n_valid + n_test, seed)
    train = corrupt_targets(pairs[:n_train], train_noise, seed)[0] if train_noise else pairs[:n_train]
    splits = {"train": train, "valid": pairs[n_train:n_train + n_valid],
              "test": pairs[n_train + n_valid:]}
    files = {}
    for split, rows in splits.items():
        files["%s.%s" % (split, src)] = "".join(de + "\n" for de, _ in rows)
        files["%s.%s" % (split, tgt)] = "".join(en + "\n" for _, en in rows)
    return files


def write_corpus(outdir, n_train=4000, n_valid=300, n_test=300, seed=1, src="de", tgt="en", train_noise=0.0):
    """Writes OUTDIR/{train,valid,test}.{src,tgt} (``corpus_text``). Returns the file prefixes."""
    os.makedirs(outdir, exist_ok=True)
    for name, text in corpus_text(n_train, n_valid, n_test, seed, src, tgt, train_noise).items():
        with open(os.path.join(outdir, name), "w", encoding="utf-8") as f:
            f.write(text)
    return {split: os.path.join(outdir, split) for split in ("train", "valid", "test")}


def differing_files(outdir, files):
    """The names of ``files`` ({name: text}) that exist in ``outdir`` with other contents."""
    differ = []
    for name, text in files.items():
        path = os.path.join(outdir, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                if f.read() != text:
                    differ.append(name)
    return differ


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outdir")
    p.add_argument("--train", type=int, default=4000)
    p.add_argument("--valid", type=int, default=300)
    p.add_argument("--test", type=int, default=300)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--train-noise", type=float, default=0.0,
                   help="fraction of training pairs with a misaligned target, in [0, 1]; valid/test stay clean")
    p.add_argument("--force", action="store_true",
                   help="replace a corpus of other settings already in OUTDIR (the same corpus is never rewritten)")
    a = p.parse_args(argv)
    for flag, n in (("--train", a.train), ("--valid", a.valid), ("--test", a.test)):
        if n < 1:
            p.error("argument %s: must be >= 1 sentence pairs, got %d" % (flag, n))
    if not 0.0 <= a.train_noise <= 1.0:
        p.error("--train-noise must be in [0, 1], got %g" % a.train_noise)
    files = corpus_text(a.train, a.valid, a.test, a.seed, train_noise=a.train_noise)
    present = [name for name in files if os.path.exists(os.path.join(a.outdir, name))]
    differ = differing_files(a.outdir, files)
    if present and not differ:
        print("%s already holds this corpus (same settings): nothing written" % a.outdir)
        return 0
    if differ and not a.force:
        p.error("%s already holds a corpus with other settings (%s differ): give another OUTDIR, "
                "or --force to replace it" % (a.outdir, ", ".join(differ)))
    write_corpus(a.outdir, a.train, a.valid, a.test, a.seed, train_noise=a.train_noise)
    print("wrote", a.outdir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
