"""The toy corpus's target corruption (the demo's label noise): which pairs, how, and clean valid/test."""

import os

import pytest

from fairseq_vasso.nmt import toy_corpus


def test_corrupt_targets_misaligns_the_chosen_fraction_only():
    pairs = toy_corpus.generate(200, seed=3)
    noisy, idx = toy_corpus.corrupt_targets(pairs, 0.3, seed=5)
    assert len(idx) == 60 and len(set(idx)) == 60 and len(noisy) == 200
    assert [s for s, _ in noisy] == [s for s, _ in pairs]  # sources untouched
    chosen = set(idx)
    assert all(noisy[i] == pairs[i] for i in range(200) if i not in chosen)
    # every corrupted target is another pair's target: the targets were moved, not invented or lost
    assert sorted(noisy[i][1] for i in idx) == sorted(pairs[i][1] for i in idx)
    changed = sum(noisy[i][1] != pairs[i][1] for i in idx)
    assert changed >= 58  # two sentences can share an English side ("du"/"ihr" -> "you")
    # deterministic in the seed, different across seeds
    assert toy_corpus.corrupt_targets(pairs, 0.3, seed=5) == (noisy, idx)
    assert toy_corpus.corrupt_targets(pairs, 0.3, seed=6)[1] != idx
    assert toy_corpus.corrupt_targets(pairs, 0.0, seed=5) == (pairs, [])
    with pytest.raises(ValueError, match="fraction"):
        toy_corpus.corrupt_targets(pairs, 1.5, seed=5)


def test_write_corpus_noise_in_train_only(tmp_path):
    clean, noisy = tmp_path / "clean", tmp_path / "noisy"
    toy_corpus.write_corpus(str(clean), 100, 20, 20, seed=2)
    toy_corpus.write_corpus(str(noisy), 100, 20, 20, seed=2, train_noise=0.25)

    def read(d, name):
        with open(os.path.join(d, name), encoding="utf-8") as f:
            return f.read().splitlines()

    for name in ("valid.de", "valid.en", "test.de", "test.en", "train.de"):
        assert read(clean, name) == read(noisy, name)
    differ = sum(a != b for a, b in zip(read(clean, "train.en"), read(noisy, "train.en")))
    assert 20 <= differ <= 25


def test_cli_writes_once_skips_the_same_corpus_and_refuses_another(tmp_path, capsys):
    out = tmp_path / "raw"
    assert toy_corpus.main([str(out), "--train", "30", "--valid", "5", "--test", "5"]) == 0
    assert "wrote" in capsys.readouterr().out
    written = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(written) == ["test.de", "test.en", "train.de", "train.en", "valid.de", "valid.en"]
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    # the same settings again: said, and nothing rewritten
    assert toy_corpus.main([str(out), "--train", "30", "--valid", "5", "--test", "5"]) == 0
    assert "already holds this corpus" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes
    # other settings: refused before writing, naming the folder and the flag
    with pytest.raises(SystemExit) as exc:
        toy_corpus.main([str(out), "--train", "40", "--valid", "5", "--test", "5"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert str(out) in err and "--force" in err and "train.de" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == written
    # --force replaces it
    assert toy_corpus.main([str(out), "--train", "40", "--valid", "5", "--test", "5", "--force"]) == 0
    assert len((out / "train.de").read_text(encoding="utf-8").splitlines()) == 40
