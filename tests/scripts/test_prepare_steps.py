"""The text steps of iwslt14 (scripts/translation/iwslt14_prepare.py) against what prepare-iwslt14.sh's tools do."""

import iwslt14 as prep


def test_strip_train_tags_as_grep_and_sed():
    lines = [
        "<url>http://www.ted.com/talks/x.html</url>",
        "<keywords>talks, science</keywords>",
        "<speaker>Al Gore</speaker>",
        "<talkid>1</talkid>",
        "<title>Die Rede</title>",
        "<description>Eine <title>Rede</title> hier.</description>",
        "Vielen Dank.",
        "x <url> y",
    ]
    assert prep.strip_train_tags(lines) == [
        "<speaker>Al Gore</speaker>",  # the original keeps it (and tokenizes it)
        "Die Rede",
        "Eine Rede hier.",
        "Vielen Dank.",
    ]


def test_extract_segments_as_grep_and_sed():
    lines = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        '<refset setid="iwslt2014-dev2010" srclang="german" trglang="english">',
        "<doc docid=\"535\" genre=\"lectures\">",
        "<talkid>535</talkid>",
        '<seg id="1"> Das ist’s. </seg>',
        '<seg id="2">\tZwei\t</seg>  ',
        '  <seg id="3">Drei<x></seg>',
        "</doc>",
    ]
    assert prep.extract_segments(lines) == ["Das ist's.", "Zwei", "  Drei<x>"]


def test_tokenize_is_moses_default_with_escaping():
    out = prep.tokenize(['Er sagte: "Das ist z.B. Dr. Müllers Haus & [mehr] | 5,300 Euro..."', "", "   "], "de")
    assert out[0] == ("Er sagte : &quot; Das ist z.B. Dr. Müllers Haus &amp; &#91; mehr &#93; &#124; "
                      "5,300 Euro ... &quot;")
    assert out[1:] == ["", "   "]  # blank lines pass through as in tokenizer.perl
    en = prep.tokenize(["It's the 1990's, isn't it?"], "en")
    assert en == ["It &apos;s the 1990 &apos;s , isn &apos;t it ?"]


def test_tokenize_threads_give_the_same_output():
    lines = ["Satz Nummer %d, mit (Klammern) und 'Zitat'." % i for i in range(50)]
    assert prep.tokenize(lines, "de", threads=2, chunk=7) == prep.tokenize(lines, "de", threads=1)


def test_lowercase_is_perl_lc():
    assert prep.lowercase(["Das IST Groß", "ΟΔΟΣ"]) == ["das ist groß", "οδοσ"]  # no final-sigma rule


def test_clean_corpus_ratio_lengths_whitespace():
    src = [
        "a b c",            # 3 vs 2: ratio 1.5 is kept (> 1.5 is dropped)
        "a b c d",          # 4 vs 2: ratio 2 dropped
        "a  b\t c ",        # whitespace collapsed -> 3 tokens
        "",                 # empty dropped
        " ".join(["w"] * 175),
        " ".join(["w"] * 176),  # > 175 dropped
        "x | y",            # '|' deleted -> "x y"
        "a" * 1001,         # a 1001-character word is dropped
    ]
    tgt = [
        "a b",
        "a b",
        "x y z",
        "e",
        " ".join(["v"] * 175),
        " ".join(["v"] * 176),
        "u v",
        "b",
    ]
    s, t = prep.clean_corpus(src, tgt, 1, 175, ratio=1.5)
    assert s == ["a b c", "a b c", " ".join(["w"] * 175), "x y"]
    assert t == ["a b", "x y z", " ".join(["v"] * 175), "u v"]


def test_clean_corpus_factored_keeps_pipes():
    s, t = prep.clean_corpus(["a|A b|B"], ["c|C"], 1, 175, ratio=9)
    assert s == ["a|A b|B"] and t == ["c|C"]


def test_split_every_23rd_line_to_valid():
    lines = [str(i) for i in range(1, 101)]
    train, valid = prep.split_train_valid(lines)
    assert valid == ["23", "46", "69", "92"]
    assert len(train) == 96 and "23" not in train and train[:3] == ["1", "2", "3"]


def test_read_lines_splits_on_newline_only(tmp_path):
    p = tmp_path / "f"
    p.write_bytes("a\rb\u2028c\nd\n".encode("utf-8"))
    assert prep.read_lines(str(p)) == ["a\rb\u2028c", "d"]


def test_joint_bpe_learn_apply_and_remove(tmp_path):
    de = tmp_path / "train.de"
    en = tmp_path / "train.en"
    de.write_text("der hund sieht die katze .\ndie katze sieht den hund .\n" * 5, encoding="utf-8")
    en.write_text("the dog sees the cat .\nthe cat sees the dog .\n" * 5, encoding="utf-8")
    code = prep.learn_bpe([str(de), str(en)], str(tmp_path / "code"), 10)
    joint = (tmp_path / "code.train").read_text(encoding="utf-8")
    assert joint == de.read_text(encoding="utf-8") + en.read_text(encoding="utf-8")  # train.de then train.en
    merges = [l for l in open(code, encoding="utf-8") if not l.startswith("#version")]
    assert len(merges) == 10
    test = tmp_path / "test.en"
    test.write_text("the doggy sees cats .\n", encoding="utf-8")
    out = prep.apply_bpe(code, str(test), str(tmp_path / "test.bpe.en"))
    text = open(out, encoding="utf-8").read()
    assert "@@ " in text
    assert (text + " ").replace("@@ ", "").rstrip(" ") == test.read_text(encoding="utf-8")  # --remove-bpe
