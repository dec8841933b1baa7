"""IWSLT-14 German-English data, prepared as fairseq's example does it: the steps.

This is fairseq's ``examples/translation/prepare-iwslt14.sh`` step for step, with
the Moses perl scripts replaced by their PyPI ports (``sacremoses`` for
tokenizer.perl, with one rule brought in line with today's tokenizer.perl, see
``moses_tokenizer``; Python for lowercase.perl and clean-corpus-n.perl) and the
subword-nmt git checkout by the ``subword-nmt`` package, then binarized with
``fairseq-preprocess``. The recipe ``scripts/translation/iwslt14_prepare.py`` runs them
all; the demo runs the text steps on its toy corpus. ``tests/scripts/test_moses_parity.py`` runs the original
steps with the perl scripts (where ``MOSES_SCRIPTS`` points at them) on generated
IWSLT-format files full of punctuation, abbreviations, escapes and non-ASCII text,
and requires every intermediate file to be byte-identical.

1. download ``de-en.tgz`` and extract it (``--raw-dir`` skips this and reads an
   already extracted ``de-en`` folder: every later step works on local files);
2. train: drop the lines of ``train.tags.de-en.{de,en}`` that contain ``<url>``,
   ``<talkid>`` or ``<keywords>``, delete the ``<title>``/``<description>`` tags
   (other header lines such as ``<speaker>`` stay, as in the original), Moses
   tokenization (``-l de`` / ``-l en``; the original passes ``-threads 8`` and no
   other option: no punctuation normalization, no aggressive hyphen splitting,
   HTML escaping on), clean-corpus-n (``-ratio 1.5``, lengths 1..175 tokens), then
   lowercasing (after cleaning, as in the original);
3. valid/test sources: the ``<seg id>`` lines of every ``IWSLT14.TED*.{de,en}.xml``,
   tags stripped, ``’`` turned into ``'``, tokenized and lowercased (no length
   filter);
4. split: every 23rd line of the cleaned training data (lines 23, 46, ...) is the
   validation set, the rest is train; test is dev2010 + TEDX dev2012 + tst2010 +
   tst2011 + tst2012, concatenated in that order;
5. joint BPE: ``learn_bpe -s 10000`` on train.de followed by train.en, applied to
   every split (``code`` is written beside the text files);
6. ``fairseq-preprocess --source-lang de --target-lang en --joined-dictionary``
   into ``--destdir`` (``--separate-dictionaries`` gives the two dictionaries
   of fairseq's README instead; the recipe's ``--share-decoder-input-output-embed``
   works with either).

The recipe that runs these steps, its file layout and its usage:
``scripts/translation/iwslt14_prepare.py``.
"""

import multiprocessing
import os
import re
import shutil
import subprocess
import tarfile
import urllib.request

from fairseq_vasso.nmt.recipe import fairseq_bin

# The shell script's URL (wit3.fbk.eu) has been offline for years; fairseq's
# mirror of the same archive is tried first.
URLS = [
    "http://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz",
    "https://wit3.fbk.eu/archive/2014-01/texts/de/en/de-en.tgz",
]
SRC, TGT, LANG = "de", "en", "de-en"
TEST_SETS = [
    "IWSLT14.TED.dev2010",
    "IWSLT14.TEDX.dev2012",
    "IWSLT14.TED.tst2010",
    "IWSLT14.TED.tst2011",
    "IWSLT14.TED.tst2012",
]
BPE_TOKENS = 10000


# ---------------------------------------------------------------- file helpers
def read_lines(path):
    """Lines split on '\\n' only (as perl/sed/awk do), without the newline."""
    with open(path, encoding="utf-8", newline="\n") as f:
        text = f.read()
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def write_lines(path, lines):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for line in lines:
            f.write(line + "\n")


# ---------------------------------------------------------------- download
def download(orig_dir, urls=URLS):
    """Downloads de-en.tgz into orig_dir and extracts it; returns orig_dir/de-en."""
    os.makedirs(orig_dir, exist_ok=True)
    archive = os.path.join(orig_dir, "de-en.tgz")
    if not os.path.exists(archive):
        errors = []
        for url in urls:
            print("Downloading data from %s..." % url, flush=True)
            try:
                with urllib.request.urlopen(url, timeout=60) as r, open(archive + ".part", "wb") as f:
                    shutil.copyfileobj(r, f)
                os.replace(archive + ".part", archive)
                break
            except Exception as e:  # try the next mirror
                errors.append("%s: %s" % (url, e))
                if os.path.exists(archive + ".part"):
                    os.remove(archive + ".part")
        else:
            raise SystemExit(
                "IWSLT-14's de-en.tgz could not be downloaded into %s:\n  %s\n"
                "Fix: get de-en.tgz elsewhere (e.g. %s, on a machine with network) and pass "
                "--archive path/to/de-en.tgz, or pass --raw-dir path/to/de-en (the extracted folder: "
                "train.tags.de-en.*, IWSLT14.TED*.xml); --url tries another mirror."
                % (orig_dir, "\n  ".join(errors), urls[0] if urls else URLS[0]))
    print("Data successfully downloaded.", flush=True)
    return extract(archive, orig_dir)


def extract(archive, orig_dir):
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(orig_dir, filter="data")
        else:  # pragma: no cover - Python < 3.11.4
            tar.extractall(orig_dir)
    return os.path.join(orig_dir, LANG)


# ---------------------------------------------------------------- text steps
_SED_SPACE = "[ \t\n\r\f\v]"  # sed's \s in the C locale


def strip_train_tags(lines):
    """grep -v '<url>' | grep -v '<talkid>' | grep -v '<keywords>' | sed (title/description tags)."""
    out = []
    for line in lines:
        if "<url>" in line or "<talkid>" in line or "<keywords>" in line:
            continue
        for tag in ("<title>", "</title>", "<description>", "</description>"):
            line = line.replace(tag, "")
        out.append(line)
    return out


def extract_segments(lines):
    """grep '<seg id' | sed 's/<seg id="[0-9]*">\\s*//g' | sed 's/\\s*<\\/seg>\\s*//g' | sed "s/’/'/g"."""
    out = []
    for line in lines:
        if "<seg id" not in line:
            continue
        line = re.sub(r'<seg id="[0-9]*">' + _SED_SPACE + "*", "", line)
        line = re.sub(_SED_SPACE + "*</seg>" + _SED_SPACE + "*", "", line)
        out.append(line.replace("\u2019", "'"))
    return out


_TOKENIZERS = {}


def moses_tokenizer(lang):
    """sacremoses' MosesTokenizer, made to follow today's tokenizer.perl (which
    prepare-iwslt14.sh clones) where sacremoses 0.2 differs: tokenizer.perl splits
    the period off the last word of a line unconditionally ("split last words
    independently as they are unlikely to be non-breaking prefixes": ``... Mr.`` ->
    ``... Mr .``, ``am 10.`` -> ``am 10 .``), and it splits words on single spaces,
    so an empty word after a double space is not lowercase."""
    import re as _re

    from sacremoses import MosesTokenizer

    class PerlMosesTokenizer(MosesTokenizer):
        def handles_nonbreaking_prefixes(self, text):
            words = text.split(" ")
            while words and words[-1] == "":  # perl's split drops trailing empty fields
                words.pop()
            n = len(words)
            for i, word in enumerate(words):
                m = _re.search(r"^(\S+)\.$", word)
                if not m:
                    continue
                pre = m.group(1)
                if i == n - 1:
                    words[i] = pre + " ."
                elif (("." in pre and self.isanyalpha(pre))
                      or (pre in self.NONBREAKING_PREFIXES and pre not in self.NUMERIC_ONLY_PREFIXES)
                      or (words[i + 1] and self.islower(words[i + 1][0]))):
                    pass
                elif pre in self.NUMERIC_ONLY_PREFIXES and _re.search(r"^[0-9]+", words[i + 1]):
                    pass
                else:
                    words[i] = pre + " ."
            return " ".join(words)

    return PerlMosesTokenizer(lang=lang)


def _tokenize_chunk(args):
    lang, lines = args
    tok = _TOKENIZERS.get(lang)
    if tok is None:
        tok = _TOKENIZERS[lang] = moses_tokenizer(lang)
    out = []
    for line in lines:
        if line.strip() == "":  # tokenizer.perl prints blank lines unchanged
            out.append(line)
        else:
            out.append(tok.tokenize(line, return_str=True, escape=True, aggressive_dash_splits=False))
    return out


def tokenize(lines, lang, threads=1, chunk=2000):
    """tokenizer.perl -threads N -l LANG (defaults: escaping on, no -a, no -penn)."""
    chunks = [(lang, lines[i:i + chunk]) for i in range(0, len(lines), chunk)]
    if threads > 1 and len(chunks) > 1:
        with multiprocessing.get_context("spawn").Pool(threads) as pool:
            parts = pool.map(_tokenize_chunk, chunks)
    else:
        parts = [_tokenize_chunk(c) for c in chunks]
    return [line for part in parts for line in part]


def lowercase(lines):
    """lowercase.perl: perl's lc(), which (unlike str.lower) has no final-sigma rule."""
    out = []
    for line in lines:
        if "\u03a3" in line:
            out.append("".join(c.lower() for c in line))
        else:
            out.append(line.lower())
    return out


def clean_corpus(src_lines, tgt_lines, min_len=1, max_len=175, ratio=1.5, max_word_length=1000):
    """clean-corpus-n.perl -ratio RATIO corpus l1 l2 out MIN MAX; returns the kept (src, tgt) lines.

    As in the perl script: '|' is deleted (unless the first line pair contains one,
    i.e. the corpus is factored), whitespace is collapsed and trimmed, empty lines,
    lines with fewer than MIN or more than MAX tokens, pairs whose token-count
    ratio exceeds RATIO either way and lines with a token longer than
    MAX_WORD_LENGTH characters are dropped.
    """
    if len(src_lines) != len(tgt_lines):
        raise ValueError("clean_corpus: %d source lines but %d target lines" % (len(src_lines), len(tgt_lines)))
    factored = bool(src_lines) and ("|" in src_lines[0] or "|" in tgt_lines[0])
    long_word = re.compile(r"[^\s|]{%d}" % (max_word_length + 1))
    out_src, out_tgt = [], []
    for f, e in zip(src_lines, tgt_lines):
        cleaned = []
        for s in (f, e):
            if not factored:
                s = s.replace("|", "")
            s = re.sub(r"\s+", " ", s)
            if s.startswith(" "):
                s = s[1:]
            if s.endswith(" "):
                s = s[:-1]
            cleaned.append(s)
        f, e = cleaned
        if f == "" or e == "":
            continue
        fc, ec = len(f.split(" ")), len(e.split(" "))
        if ec > max_len or fc > max_len or ec < min_len or fc < min_len:
            continue
        if ec / fc > ratio or fc / ec > ratio:
            continue
        if long_word.search(e) or long_word.search(f):
            continue
        out_src.append(f)
        out_tgt.append(e)
    return out_src, out_tgt


def split_train_valid(lines, every=23):
    """awk 'NR%23 == 0' -> valid, 'NR%23 != 0' -> train (NR counts from 1)."""
    valid = [l for i, l in enumerate(lines, 1) if i % every == 0]
    train = [l for i, l in enumerate(lines, 1) if i % every != 0]
    return train, valid


def learn_bpe(train_files, code_path, num_symbols=BPE_TOKENS, joint_path=None):
    """cat train.de train.en > train.en-de; learn_bpe.py -s N < train.en-de > code."""
    from subword_nmt.learn_bpe import learn_bpe as _learn

    joint_path = joint_path or code_path + ".train"
    with open(joint_path, "w", encoding="utf-8", newline="\n") as out:
        for path in train_files:
            with open(path, encoding="utf-8", newline="\n") as f:
                shutil.copyfileobj(f, out)
    import subword_nmt.learn_bpe as learn_module

    # subword-nmt draws a tqdm bar over the merges on stderr, which nothing here asks for
    bar = learn_module.tqdm
    learn_module.tqdm = lambda iterable, *args, **kwargs: iterable
    try:
        with open(joint_path, encoding="utf-8") as fin, open(code_path, "w", encoding="utf-8") as fout:
            _learn(fin, fout, num_symbols)  # the CLI's defaults: min frequency 2, one worker
    finally:
        learn_module.tqdm = bar
    return code_path


def apply_bpe(code_path, in_path, out_path):
    """apply_bpe.py -c code < in > out."""
    from subword_nmt.apply_bpe import BPE

    with open(code_path, encoding="utf-8") as codes:
        bpe = BPE(codes)
    with open(in_path, encoding="utf-8", newline="\n") as fin, \
            open(out_path, "w", encoding="utf-8", newline="\n") as fout:
        for line in fin:
            fout.write(bpe.process_line(line))
    return out_path


def binarize_command(text_dir, destdir, src=SRC, tgt=TGT, workers=1, joined=True,
                     splits=("train", "valid", "test")):
    cmd = [fairseq_bin("fairseq-preprocess"), "--source-lang", src, "--target-lang", tgt]
    for split in splits:
        cmd += ["--%spref" % split, os.path.join(text_dir, split)]
    cmd += ["--destdir", destdir, "--workers", str(workers)]
    if joined:
        cmd.append("--joined-dictionary")
    return cmd


def binarize(text_dir, destdir, src=SRC, tgt=TGT, workers=1, joined=True,
             splits=("train", "valid", "test"), log=None):
    cmd = binarize_command(text_dir, destdir, src, tgt, workers, joined, splits)
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT if log else None)
    return destdir


# ---------------------------------------------------------------- the pipeline
def prepare_text(raw_dir, prep_dir, bpe_tokens=BPE_TOKENS, threads=1, log=print):
    """Steps 2-5 on an extracted de-en folder; writes prep_dir/{train,valid,test}.{de,en} and code."""
    tmp = os.path.join(prep_dir, "tmp")
    os.makedirs(tmp, exist_ok=True)

    log("pre-processing train data...")
    tok = {}
    for l in (SRC, TGT):
        lines = strip_train_tags(read_lines(os.path.join(raw_dir, "train.tags.%s.%s" % (LANG, l))))
        tok[l] = tokenize(lines, l, threads)
        write_lines(os.path.join(tmp, "train.tags.%s.tok.%s" % (LANG, l)), tok[l])
    clean_src, clean_tgt = clean_corpus(tok[SRC], tok[TGT], 1, 175, ratio=1.5)
    log("clean-corpus: input sentences: %d  output sentences: %d" % (len(tok[SRC]), len(clean_src)))
    cleaned = {SRC: clean_src, TGT: clean_tgt}
    final = {}
    for l in (SRC, TGT):
        write_lines(os.path.join(tmp, "train.tags.%s.clean.%s" % (LANG, l)), cleaned[l])
        final[l] = lowercase(cleaned[l])
        write_lines(os.path.join(tmp, "train.tags.%s.%s" % (LANG, l)), final[l])

    log("pre-processing valid/test data...")
    for l in (SRC, TGT):
        suffix = ".%s.xml" % l
        for name in sorted(os.listdir(raw_dir)):
            if name.startswith("IWSLT14.TED") and name.endswith(suffix):
                lines = extract_segments(read_lines(os.path.join(raw_dir, name)))
                write_lines(os.path.join(tmp, name[:-len(".xml")]), lowercase(tokenize(lines, l, threads)))

    log("creating train, valid, test...")
    for l in (SRC, TGT):
        train, valid = split_train_valid(final[l])
        write_lines(os.path.join(tmp, "train." + l), train)
        write_lines(os.path.join(tmp, "valid." + l), valid)
        test = []
        for name in TEST_SETS:
            path = os.path.join(tmp, "%s.%s.%s" % (name, LANG, l))
            if not os.path.exists(path):
                raise SystemExit("missing %s.%s.%s.xml in %s" % (name, LANG, l, raw_dir))
            test += read_lines(path)
        write_lines(os.path.join(tmp, "test." + l), test)

    code = os.path.join(prep_dir, "code")
    log("learn_bpe.py on %s..." % os.path.join(tmp, "train.en-de"))
    learn_bpe([os.path.join(tmp, "train." + l) for l in (SRC, TGT)], code, bpe_tokens,
              joint_path=os.path.join(tmp, "train.en-de"))
    for l in (SRC, TGT):
        for split in ("train", "valid", "test"):
            log("apply_bpe.py to %s.%s..." % (split, l))
            apply_bpe(code, os.path.join(tmp, "%s.%s" % (split, l)), os.path.join(prep_dir, "%s.%s" % (split, l)))
    return prep_dir
