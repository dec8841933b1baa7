"""scripts/translation/iwslt14_prepare.py (the steps of iwslt14) end to end on small local files in the IWSLT-14 formats
(everything after the download: --raw-dir and --archive), including fairseq-preprocess."""

import os
import tarfile

import pytest

import iwslt14 as prep
from fairseq_vasso.nmt.bleu import dataset_size

GERMAN = ["Das ist {i} ein kleiner Test.", "Wir haben {i} Hunde und Katzen gesehen!",
          "Heute, am {i}. Mai, regnet es (nicht).", "„Warum?“, fragte sie {i} Mal."]
ENGLISH = ["This is {i} a small test.", "We saw {i} dogs and cats!",
           "Today, on May {i}, it doesn't rain.", "\"Why?\", she asked {i} times."]


def _train_tags(lang, talks):
    lines = []
    for t in range(talks):
        lines += ["<url>http://www.ted.com/talks/talk%d.html</url>" % t,
                  "<keywords>talks, tests</keywords>",
                  "<speaker>Speaker %d</speaker>" % t,
                  "<talkid>%d</talkid>" % t,
                  "<title>Title %d</title>" % t,
                  "<description>Talk number %d</description>" % t]
        for i in range(12):
            lines.append((GERMAN if lang == "de" else ENGLISH)[i % 4].format(i=t * 12 + i))
    # a pair that clean-corpus drops for its length ratio (1 token vs 8)
    lines.append("Ja." if lang == "de" else "Yes , yes , yes , yes , yes , yes , yes")
    return lines


def _xml(name, lang, n):
    lines = ['<?xml version="1.0" encoding="UTF-8"?>', "<mteval>",
             '<%s setid="%s" srclang="german">' % ("srcset" if lang == "de" else "refset", name),
             '<doc docid="1" genre="lectures">', "<url>http://x</url>", "<talkid>1</talkid>"]
    for i in range(n):
        text = (GERMAN if lang == "de" else ENGLISH)[i % 4].format(i=i)
        lines.append('<seg id="%d"> %s’s %s </seg>' % (i + 1, name.split(".")[-1], text))
    return lines + ["</doc>", "</srcset>" if lang == "de" else "</refset>", "</mteval>"]


def write_raw_dir(root, talks=5):
    raw = os.path.join(root, "de-en")
    os.makedirs(raw)
    for lang in ("de", "en"):
        prep.write_lines(os.path.join(raw, "train.tags.de-en.%s" % lang), _train_tags(lang, talks))
        for k, name in enumerate(prep.TEST_SETS):
            prep.write_lines(os.path.join(raw, "%s.de-en.%s.xml" % (name, lang)), _xml(name, lang, 3 + k))
    return raw


def test_pipeline_from_raw_dir_to_binarized(tmp_path, script):
    raw = write_raw_dir(str(tmp_path / "orig"))
    work, dest = tmp_path / "data", tmp_path / "data-bin"
    script(os.path.join("translation", "iwslt14_prepare.py"), "--raw-dir", raw, "--workdir", work, "--destdir", dest,
               "--bpe-tokens", 40, "--threads", 2, "--workers", 1)
    prep_dir = work / "iwslt14.tokenized.de-en"
    tmp = prep_dir / "tmp"

    # train: header lines gone except <speaker> (tokenized, escaped), title/description text kept
    tok_de = prep.read_lines(str(tmp / "train.tags.de-en.tok.de"))
    assert len(tok_de) == 5 * (12 + 3) + 1
    assert tok_de[0] == "&lt; speaker &gt; Speaker 0 &lt; / speaker &gt;"
    assert tok_de[1:3] == ["Title 0", "Talk number 0"]
    # clean-corpus drops the 1:8 pair; lowercasing comes after cleaning
    clean_de = prep.read_lines(str(tmp / "train.tags.de-en.de"))
    assert len(clean_de) == 5 * 15
    assert clean_de == [l.lower() for l in prep.read_lines(str(tmp / "train.tags.de-en.clean.de"))]
    assert "heute , am 2. mai , regnet es ( nicht ) ." in clean_de  # German ordinal: no split

    # every 23rd line to valid
    train_de = prep.read_lines(str(tmp / "train.de"))
    valid_de = prep.read_lines(str(tmp / "valid.de"))
    assert valid_de == [clean_de[i] for i in (22, 45, 68)]
    assert len(train_de) == 75 - 3

    # test = dev2010, TEDX dev2012, tst2010, tst2011, tst2012 in this order, ’ -> ', tokenized, lowercased
    test_en = prep.read_lines(str(tmp / "test.en"))
    assert len(test_en) == sum(3 + k for k in range(5))
    assert test_en[0] == "dev2010 &apos;s this is 0 a small test ."
    assert test_en[3].startswith("dev2012 &apos;s") and test_en[-1].startswith("tst2012 &apos;s")

    # joint BPE: code beside the texts; removing it restores the tokenized text
    assert (prep_dir / "code").exists()
    for split in ("train", "valid", "test"):
        for lang in ("de", "en"):
            bpe = prep.read_lines(str(prep_dir / ("%s.%s" % (split, lang))))
            plain = prep.read_lines(str(tmp / ("%s.%s" % (split, lang))))
            assert [(l + " ").replace("@@ ", "").rstrip(" ") for l in bpe] == plain
    assert any("@@" in l for l in prep.read_lines(str(prep_dir / "train.de")))

    # binarized with one joined dictionary
    assert (dest / "dict.de.txt").read_text() == (dest / "dict.en.txt").read_text()
    assert dataset_size(str(dest), "train") == 72
    assert dataset_size(str(dest), "valid") == 3
    assert dataset_size(str(dest), "test") == 25

    # the same command again: refused before any work, naming --destdir and --force
    again = script(os.path.join("translation", "iwslt14_prepare.py"), "--raw-dir", raw, "--workdir", work,
                   "--destdir", dest, "--bpe-tokens", 40, check=False)
    assert again.returncode == 2 and f"--destdir {dest} holds a binarized corpus already" in again.stderr
    assert "--force" in again.stderr and "pre-processing" not in again.stdout


def test_archive_extract_without_binarize(tmp_path, script):
    raw = write_raw_dir(str(tmp_path / "src"), talks=2)
    archive = tmp_path / "de-en.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(raw, arcname="de-en")
    work = tmp_path / "data"
    script(os.path.join("translation", "iwslt14_prepare.py"), "--archive", archive, "--workdir", work, "--bpe-tokens", 20,
               "--threads", 1, "--skip-binarize")
    assert (work / "orig" / "de-en" / "train.tags.de-en.de").exists()
    prep_dir = work / "iwslt14.tokenized.de-en"
    assert len(prep.read_lines(str(prep_dir / "train.en"))) == 2 * 15 - 1
    assert len(prep.read_lines(str(prep_dir / "valid.en"))) == 1
    assert not (tmp_path / "data-bin").exists()


def test_binarize_command_matches_the_readme():
    cmd = prep.binarize_command("data/iwslt14.tokenized.de-en", "data-bin/iwslt14.tokenized.de-en", workers=20)
    assert os.path.basename(cmd[0]) == "fairseq-preprocess"
    assert cmd[1:] == ["--source-lang", "de", "--target-lang", "en",
                       "--trainpref", "data/iwslt14.tokenized.de-en/train",
                       "--validpref", "data/iwslt14.tokenized.de-en/valid",
                       "--testpref", "data/iwslt14.tokenized.de-en/test",
                       "--destdir", "data-bin/iwslt14.tokenized.de-en", "--workers", "20", "--joined-dictionary"]


def test_download_falls_back_to_the_next_url_and_extracts(tmp_path):
    """The download step itself, with file:// URLs (no network here): the first URL fails."""
    raw = write_raw_dir(str(tmp_path / "src"), talks=1)
    archive = tmp_path / "served" / "de-en.tgz"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(raw, arcname="de-en")
    orig = tmp_path / "orig"
    out = prep.download(str(orig), urls=["file://" + str(tmp_path / "missing.tgz"), "file://" + str(archive)])
    assert out == str(orig / "de-en")
    assert (orig / "de-en.tgz").read_bytes() == archive.read_bytes()
    assert sorted(os.listdir(out)) == sorted(os.listdir(raw))


def test_a_failed_download_names_archive_and_raw_dir(tmp_path):
    orig = tmp_path / "orig"
    missing = "file://" + str(tmp_path / "missing.tgz")
    with pytest.raises(SystemExit) as info:
        prep.download(str(orig), urls=[missing])
    message = str(info.value)
    assert f"could not be downloaded into {orig}" in message and missing in message
    assert "--archive path/to/de-en.tgz" in message and "--raw-dir path/to/de-en" in message
    assert os.listdir(orig) == []  # no partial archive left for the next run to take for a whole one
