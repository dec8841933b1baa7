#!/usr/bin/env python
"""IWSLT-14 German-English data, prepared as fairseq's examples/translation/prepare-iwslt14.sh
does it, then binarized with fairseq-preprocess (the steps: :mod:`iwslt14`).

Layout (the shell script's, under ``--workdir``, default ``data/``)::

    data/orig/de-en.tgz, data/orig/de-en/...          (download)
    data/iwslt14.tokenized.de-en/tmp/...               (intermediate files)
    data/iwslt14.tokenized.de-en/{train,valid,test}.{de,en}, code
    data-bin/iwslt14.tokenized.de-en/                  (binarized)

Usage::

    python scripts/translation/iwslt14_prepare.py                         # download, then all steps
    python scripts/translation/iwslt14_prepare.py --raw-dir path/to/de-en # no network needed
"""

import argparse
import os
import shutil

import iwslt14


def main(argv=None):
    p = argparse.ArgumentParser(description="IWSLT-14 de-en as fairseq's prepare-iwslt14.sh, then fairseq-preprocess.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workdir", default="data", help="holds orig/ and iwslt14.tokenized.de-en/")
    p.add_argument("--raw-dir", help="an extracted de-en folder (train.tags.de-en.*, IWSLT14.TED*.xml): no download")
    p.add_argument("--archive", help="a local de-en.tgz to extract instead of downloading")
    p.add_argument("--url", action="append", help="download URL (repeatable; default: fairseq's mirror, then wit3)")
    p.add_argument("--bpe-tokens", type=int, default=iwslt14.BPE_TOKENS, help="learn_bpe.py -s")
    p.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1), help="tokenizer processes")
    p.add_argument("--destdir", default="data-bin/iwslt14.tokenized.de-en", help="fairseq-preprocess --destdir")
    p.add_argument("--workers", type=int, default=min(20, os.cpu_count() or 1), help="fairseq-preprocess --workers")
    p.add_argument("--separate-dictionaries", action="store_true",
                   help="binarize without --joined-dictionary (fairseq README's variant)")
    p.add_argument("--skip-binarize", action="store_true", help="stop after BPE (no fairseq needed)")
    p.add_argument("--force", action="store_true", help="replace a binarized corpus already in --destdir")
    a = p.parse_args(argv)
    done = [d for d in ("dict.%s.txt" % iwslt14.SRC, "dict.%s.txt" % iwslt14.TGT)
            if os.path.exists(os.path.join(a.destdir, d))]
    if done and not a.skip_binarize and not a.force:  # fairseq-preprocess would refuse it after all the work
        p.error("--destdir %s holds a binarized corpus already (%s): give another --destdir, or --force to "
                "replace it" % (a.destdir, ", ".join(done)))

    orig = os.path.join(a.workdir, "orig")
    if a.raw_dir:
        raw_dir = a.raw_dir
    elif a.archive:
        raw_dir = iwslt14.extract(a.archive, orig)
    else:
        raw_dir = iwslt14.download(orig, a.url or iwslt14.URLS)
    prep = os.path.join(a.workdir, "iwslt14.tokenized.%s" % iwslt14.LANG)
    iwslt14.prepare_text(raw_dir, prep, a.bpe_tokens, a.threads, log=lambda m: print(m, flush=True))
    if not a.skip_binarize:
        if done:  # --force
            shutil.rmtree(a.destdir)
        iwslt14.binarize(prep, a.destdir, workers=a.workers, joined=not a.separate_dictionaries)
        print("binarized data in %s" % a.destdir)


if __name__ == "__main__":
    main()
