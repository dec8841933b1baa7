"""iwslt14 (scripts/translation/iwslt14_prepare.py) against the original: prepare-iwslt14.sh's own steps with the
Moses perl scripts (tokenizer.perl, clean-corpus-n.perl, lowercase.perl), grep, sed and awk,
on generated IWSLT-format files full of the characters tokenizers disagree on. Every
intermediate file must be byte-identical.

Runs where MOSES_SCRIPTS points at a mosesdecoder ``scripts/`` folder and perl is
installed (``git clone https://github.com/moses-smt/mosesdecoder``); skipped otherwise.
The unit tests below it need neither.
"""

import filecmp
import os
import random
import shutil

import process_group
import pytest

import iwslt14 as prep

MOSES = os.environ.get("MOSES_SCRIPTS")

# prepare-iwslt14.sh from "pre-processing train data" to "creating train, valid, test",
# unchanged but for the paths (download and BPE left out)
ORIGINAL_STEPS = r"""
set -e
SCRIPTS=$1; orig=$2; tmp=$3
TOKENIZER=$SCRIPTS/tokenizer/tokenizer.perl
LC=$SCRIPTS/tokenizer/lowercase.perl
CLEAN=$SCRIPTS/training/clean-corpus-n.perl
src=de; tgt=en; lang=de-en
mkdir -p $tmp
for l in $src $tgt; do
    f=train.tags.$lang.$l
    tok=train.tags.$lang.tok.$l
    cat $orig/$f | \
    grep -v '<url>' | \
    grep -v '<talkid>' | \
    grep -v '<keywords>' | \
    sed -e 's/<title>//g' | \
    sed -e 's/<\/title>//g' | \
    sed -e 's/<description>//g' | \
    sed -e 's/<\/description>//g' | \
    perl $TOKENIZER -threads 8 -l $l > $tmp/$tok 2>/dev/null
done
perl $CLEAN -ratio 1.5 $tmp/train.tags.$lang.tok $src $tgt $tmp/train.tags.$lang.clean 1 175 2>/dev/null
for l in $src $tgt; do
    perl $LC < $tmp/train.tags.$lang.clean.$l > $tmp/train.tags.$lang.$l
done
for l in $src $tgt; do
    for o in `ls $orig/IWSLT14.TED*.$l.xml`; do
    fname=${o##*/}
    f=$tmp/${fname%.*}
    grep '<seg id' $o | \
        sed -e 's/<seg id="[0-9]*">\s*//g' | \
        sed -e 's/\s*<\/seg>\s*//g' | \
        sed -e "s/\’/\'/g" | \
    perl $TOKENIZER -threads 8 -l $l 2>/dev/null | \
    perl $LC > $f
    done
done
for l in $src $tgt; do
    awk '{if (NR%23 == 0)  print $0; }' $tmp/train.tags.de-en.$l > $tmp/valid.$l
    awk '{if (NR%23 != 0)  print $0; }' $tmp/train.tags.de-en.$l > $tmp/train.$l
    cat $tmp/IWSLT14.TED.dev2010.de-en.$l \
        $tmp/IWSLT14.TEDX.dev2012.de-en.$l \
        $tmp/IWSLT14.TED.tst2010.de-en.$l \
        $tmp/IWSLT14.TED.tst2011.de-en.$l \
        $tmp/IWSLT14.TED.tst2012.de-en.$l \
        > $tmp/test.$l
done
"""

PIECES = ["Das", "ist", "z.B.", "Dr.", "Müller's", "\"Haus\"", "„Zitat“", "(Klammer)", "[eckig]", "a|b", "&", "<b>",
          "5,300", "3.5", "1990er", "U.S.A.", "usw.", "...", "Nr.", "12.", "Mai", "e-mail", "well-known",
          "www.ted.com/talks", "100%", "$5", "€10", "'s", "l'homme", "--", "—", "ΟΔΟΣ", "İstanbul", "straße", "GROSS",
          "?!", ";", ":", "@user", "#tag", "\t", "  ", "\u00a0", "\u2019", "\u201c", "x\x07y", "C++", "A.", "etc.",
          "vs.", "Mr.", "No.", "1.", "It's", "can't", "I'm", "o'clock", "½", "²", "Ü", "é", "ﬁ", "\u200b", "e.g.",
          "i.e.", "the", "dog", "2."]


def write_hard_raw_dir(root, seed, talks=6, lines_per_talk=50):
    rng = random.Random(seed)

    def sent(n=None):
        s = " ".join(rng.choice(PIECES) for _ in range(n or rng.randint(1, 25)))
        return s + rng.choice([".", "?", "!", "", " .", ".'", "...", ":"])

    raw = os.path.join(root, "de-en")
    os.makedirs(raw)
    for lang in ("de", "en"):
        lines = []
        for t in range(talks):
            lines += ["<url>http://www.ted.com/talks/%d.html</url>" % t, "<keywords>a, b</keywords>",
                      "<speaker>A B</speaker>", "<talkid>%d</talkid>" % t, "<title>Titel: %s</title>" % sent(3),
                      "<description>%s</description>" % sent(6), '<reviewer href="x">R</reviewer>']
            for _ in range(lines_per_talk):
                k = rng.random()
                lines.append("" if k < 0.03 else "   " if k < 0.05 else sent(200) if k < 0.07 else sent())
        prep.write_lines(os.path.join(raw, "train.tags.de-en.%s" % lang), lines)
        for name in prep.TEST_SETS:
            xml = ['<?xml version="1.0" encoding="UTF-8"?>', "<mteval>", '<srcset setid="x">', '<doc docid="1">']
            for i in range(12):
                xml.append('%s<seg id="%d">%s%s%s</seg>%s' % (rng.choice(["", "  ", "\t"]), i + 1,
                                                            rng.choice(["", " ", "  \t"]), sent(),
                                                            rng.choice(["", " ", "\t "]), rng.choice(["", " "])))
            prep.write_lines(os.path.join(raw, "%s.de-en.%s.xml" % (name, lang)), xml + ["</doc>", "</srcset>", "</mteval>"])
    return raw


@pytest.mark.skipif(not (MOSES and os.path.exists(os.path.join(MOSES, "tokenizer", "tokenizer.perl"))
                         and shutil.which("perl")),
                    reason="set MOSES_SCRIPTS to a mosesdecoder scripts/ folder (and have perl) to compare")
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_identical_to_the_perl_pipeline(tmp_path, seed):
    raw = write_hard_raw_dir(str(tmp_path / "orig"), seed)
    script = tmp_path / "original_steps.sh"
    script.write_text(ORIGINAL_STEPS, encoding="utf-8")
    process_group.run(["bash", str(script), MOSES, raw, str(tmp_path / "perl")], check=True)
    prep.prepare_text(raw, str(tmp_path / "ours"), bpe_tokens=20, threads=2, log=lambda m: None)
    names = sorted(os.listdir(tmp_path / "perl"))
    assert len(names) == 2 * 3 + 2 * 2 + 2 * 5 + 2  # tok, clean, lc; train/valid; 5 test sets; test
    different = [n for n in names if not filecmp.cmp(tmp_path / "perl" / n, tmp_path / "ours" / "tmp" / n, shallow=False)]
    assert different == []
    assert len(prep.read_lines(str(tmp_path / "perl" / "train.de"))) > 50


def test_last_word_period_is_split_as_in_tokenizer_perl():
    # expected values: tokenizer.perl (mosesdecoder master) -l de / -l en
    assert prep.tokenize(["Ich traf Dr.", "am 10.", "Dr. Müller kam.", "Er kam am 10. Mai"], "de") == \
        ["Ich traf Dr .", "am 10 .", "Dr. Müller kam .", "Er kam am 10. Mai"]
    assert prep.tokenize(["I met Mr.", "Mr. Smith left.", "see No. 5", "see p. 5"], "en") == \
        ["I met Mr .", "Mr. Smith left .", "see No. 5", "see p . 5"]
